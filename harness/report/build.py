"""Result tables people can quote, from every run under a folder.

    python -m harness.report <results folder> [--name NAME] [--out results/] [--html] [--format kvpress]

Collects every `results.json` under the folder (recursively) and writes `<out>/<name>/`:

- each benchmark's own tables: its report module (`harness/tasks/<name>/report.py`, found through the task
  registry, harness.tasks.task_reports) gets the runs of its tasks and writes its files (longbench.md|csv,
  needle.md|csv, efficiency.md|csv, observation.md|csv, lines.md|csv, ruler.md|csv, ...);
- `claims.md|csv`: the paper's efficiency and needle claims (results/paper/paper_claims.csv) next to ours.
- `paired_deltas.md|csv`: every compressed setting minus the full cache run on the same items (same model,
  task, protocol and task settings), per LongBench task, on the LongBench average and on the needle mean, with
  a 95% paired bootstrap interval (harness/stats.py; harness/report/paired.py); CSV columns `setting, task, delta, ci_low, ci_high, n`.
- `runs.csv`: every results.json found, which table it went into (or why none), and the code version(s) of its
  records (`code`; README.md names every version and the runs that mix them: harness/report/versions.py).
- `reuse_gap.md|csv`: query-aware minus query-agnostic per setting (harness/report/reuse.py).
- `README.md`: all the Markdown tables in one page (the benchmarks' sections in registry order, then the cross-task ones).
- `--html`: `report.html`, one self-contained page (data and script inline, no network) with charts, sortable tables
  and every item's responses and what each method kept (harness/report/html.py).
- `--format kvpress`: `leaderboard_kvpress.csv`, kvpress's leaderboard columns (dataset, model, method,
  compression_ratio, score) plus protocol, the score's interval and the reuse gap.

Rows never merge runs that differ in a recorded rule (chat formatting, first-token guard, code_sim
backend, GQA handling, truncation budget, item limit, data source, prompt style, device, batch, and the
protocol: query-aware, the question inside the compressed prompt, or query-agnostic, the question after
compression; `summary.protocol`, else `config.task.query_aware`, absent = query-aware): those are columns of
the row key, shown in the tables. Two runs with the same key both appear, flagged.
Nothing here loads a model or imports torch.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from harness import REPO_ROOT
from harness.report.claims import CLAIM_FIELDS, PAPER_CLAIMS, claims_rows, claims_table, load_claims
from harness.report.paired import CSV_FIELDS as PAIRED_FIELDS, pair_runs, paired_table
from harness.report.reuse import reuse_gap_section
from harness.report.versions import code_column, run_versions, versions_paragraph
from harness.results import collect
from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED
from harness.tables import ReportOptions, write_csv
from harness.tasks import task_reports

# Everything `build` writes besides the benchmarks' own files (each report module's OUTPUT_FILES / OUTPUT_DIRS), and
# removes again before writing: never anything else, so a table set can live next to other files (results/paper/ also
# holds the paper's own numbers: longbench_table1.csv, paper_claims.csv, SOURCE.md).
OUTPUT_FILES = ("README.md", "runs.csv", "claims.md", "claims.csv", "paired_deltas.md", "paired_deltas.csv", "report.html",
                "leaderboard_kvpress.csv")
OUTPUT_DIRS = ()


def build(folder: Path, out: Path, *, paper_table: Path | None = None, claims_file: Path = PAPER_CLAIMS,
          resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED, html: bool = False, kvpress: bool = False) -> dict:
    """Collect `folder`, write every table into `out`; returns what was written (for callers and tests)."""
    folder, out = Path(folder), Path(out)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    runs, bad = collect(folder)
    out.mkdir(parents=True, exist_ok=True)
    reports = task_reports()
    dirs = [*OUTPUT_DIRS, *(d for _, m in reports for d in getattr(m, "OUTPUT_DIRS", ()))]
    files = [*OUTPUT_FILES, *(f for _, m in reports for f in getattr(m, "OUTPUT_FILES", ()))]
    for name in dirs:  # a rebuild starts clean: no table or picture of a run that is gone survives
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    for name in files:
        if (out / name).is_file():
            (out / name).unlink()
    options = ReportOptions(resamples=resamples, seed=seed, paper_table=paper_table)
    sections: list[tuple[str, str]] = []
    written: dict[str, Any] = {"runs": len(runs)}
    measures = []
    for names, module in reports:  # each benchmark's own tables, from the runs of its tasks
        tables = module.tables([run for run in runs if run.task in names], out, options)
        sections += tables.sections
        written.update(tables.written)
        if tables.claim is not None:
            measures.append(tables.claim)

    p_rows, p_notes = pair_runs(runs, n_resamples=resamples, seed=seed)
    if p_rows:
        p_md = paired_table(p_rows, p_notes, resamples, seed)
        write_csv(out / "paired_deltas.csv", [r.csv_row() for r in p_rows], PAIRED_FIELDS)
        (out / "paired_deltas.md").write_text(p_md, encoding="utf-8")
        sections.append(("paired_deltas.md", p_md))
        paired_runs = {r.setting for r in p_rows} | {r.full_run for r in p_rows}
        for run in runs:
            if run.rel in paired_runs:
                run.used_in.append("paired_deltas")
    written["paired_deltas"], written["paired_notes"] = p_rows, p_notes

    c_rows = claims_rows(load_claims(claims_file), measures, runs)
    if c_rows:
        c_md = claims_table(c_rows)
        write_csv(out / "claims.csv", c_rows, CLAIM_FIELDS)
        (out / "claims.md").write_text(c_md, encoding="utf-8")
        sections.append(("claims.md", c_md))
    written["claims"] = c_rows
    sections += reuse_gap_section(runs, out, n_resamples=resamples, seed=seed)  # query-aware minus query-agnostic

    versions = {run.rel: run_versions(run) for run in runs}  # the code versions behind the tables
    run_rows = []
    for run in runs:
        if not run.used_in and not run.note:
            run.note = f"task {run.task!r} has no table"
        run_rows.append({"run": run.rel, "task": run.task, "model": run.model.get("name"), "method": run.data.get("method_tag"),
                         "status": run.data.get("status") or (run.data.get("summary") or {}).get("status") or "complete",
                         "failures": run.data.get("failures"), "device": run.device, "dtype": run.dtype,
                         "tables": " ".join(run.used_in),
                         "code": code_column(versions[run.rel]), "note": run.note})
    run_rows += [{"run": rel, "note": why} for rel, why in bad]
    write_csv(out / "runs.csv", run_rows, ["run", "task", "model", "method", "status", "failures", "device", "dtype", "tables", "code",
                                         "note"])
    written["runs_table"] = run_rows

    skipped = [r for r in run_rows if not r.get("tables")]
    head = [f"# Results: {out.name}", "",
            f"Built by `python -m harness.report` from {len(runs)} run(s) under `{folder}`"
            + (f" ({len(skipped)} without a table: see runs.csv)" if skipped else "") + ". "
            "Each table also as CSV next to this file; every row names its run directory (`run` column).", "",
            *versions_paragraph(runs, versions)]
    if not sections:
        head.append("No LongBench, needle or benchmark results were found.")
    (out / "README.md").write_text("\n".join(head) + "\n" + "\n".join(md for _, md in sections), encoding="utf-8")
    written["sections"] = [name for name, _ in sections]
    if html or kvpress:  # the browsable page and the leaderboard export (harness/report/html.py)
        from harness.report.html import write_outputs

        written["sections"] += write_outputs(runs, folder, out, html_page=html, kvpress=kvpress, resamples=resamples, seed=seed)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="folder holding run directories (searched recursively for results.json)")
    parser.add_argument("--name", default=None, help="table set name: writes <out>/<name>/ (default: the folder's name)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results", help="parent folder of the table sets (default: results/)")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES,
                        help=f"paired bootstrap resamples for paired_deltas (default {DEFAULT_RESAMPLES})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"bootstrap seed (default {DEFAULT_SEED})")
    parser.add_argument("--html", action="store_true",
                        help="also write report.html: one self-contained page (charts, tables, items) that opens offline")
    parser.add_argument("--format", choices=("markdown", "kvpress"), default="markdown",
                        help="kvpress: also write leaderboard_kvpress.csv (kvpress's leaderboard columns + protocol, interval, reuse gap)")
    parser.add_argument("--paper-table", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--claims", type=Path, default=PAPER_CLAIMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: {args.folder} is not a folder", file=sys.stderr)
        return 2
    name = args.name or args.folder.resolve().name
    target = args.out / name
    if args.resamples < 1:
        print(f"error: --resamples {args.resamples}: must be a positive number", file=sys.stderr)
        return 2
    written = build(args.folder, target, paper_table=args.paper_table, claims_file=args.claims, resamples=args.resamples,
                    seed=args.seed, html=args.html, kvpress=args.format == "kvpress")
    print(f"report: {written['runs']} run(s) -> {target}/ ({', '.join(written['sections']) or 'no tables'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
