"""One self-contained page per comparison: `python -m harness.report <folder> --html` writes `report.html`.

The page holds its data (one JSON object) and its script and style (harness/report/assets/) inline: it opens
from a file, in any browser, with no network. It draws nothing itself in Python: it gathers what the tables
already compute into blocks (harness/page_blocks.py) the script renders as inline SVG and HTML:

- overview: the runs, models, protocols, code versions, and which runs can be compared (same task, model,
  task settings and protocol: harness.results.pair_key) and, for the others, what differs (as comparison.md);
- per benchmark: its report module's `html_section(runs, page)` (harness/tasks/<name>/report.py, found through
  the registry: score against budget or compression ratio, one line per method and protocol with its 95%
  bootstrap band, legend toggles; heatmaps, per-task tables, its items), then the sortable table of the paired
  difference to full (harness.report.paired) of its runs;
- the reuse gap (harness.report.reuse); the plan is the plan task's section (harness/tasks/plan/report.py);
- per item: a click on a heatmap cell, a task's score or a table row shows the prompt around the needle or the
  answers (runs with task.log_prompts=true), and for every setting of that item the response, reference, score
  and what it kept of each span (needle, question) per layer.

`--format kvpress` writes the leaderboard rows gathered on the way (leaderboard_rows). Nothing here loads a model.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path

from harness.page_blocks import Page, chart, rounded
from harness.report.paired import AVERAGE, pair_runs
from harness.report.reuse import gap_rows
from harness.report.versions import code_column, run_versions, versions_paragraph
from harness.results import pair_key
from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, MIN_INTERVAL_ITEMS
from harness.tables import _protocol_label, method_setting, write_csv
from harness.tasks import task_reports

PAGE = "report.html"


# ------------------------------------------------------------------------------------------ overview

def overview(runs, run_ids: dict[str, int], resamples: int, seed: int) -> dict:
    """Runs, models, protocols, code versions; comparable sets (pair_key) and what separates the others."""
    from harness.rundir import describe_differences, result_key_differences

    versions = {run.rel: run_versions(run) for run in runs}
    sets: dict[str, list] = {}
    for run in runs:
        sets.setdefault(pair_key(run), []).append(run)
    groups, first_of_task = [], {}
    for n, (key, members) in enumerate(sorted(sets.items(), key=lambda kv: min(r.rel for r in kv[1]))):
        head = members[0]
        config = {k: v for k, v in head.config.items() if k not in ("method", "methods")}
        ref = first_of_task.setdefault(head.task, (n, config))
        differs = ""
        if ref[0] != n:
            diff = result_key_differences(ref[1], config)
            differs = (f"differs from set {ref[0] + 1}: " + describe_differences(ref[1], config, diff, limit=6)) if diff else \
                "same options as set %d but another protocol or model" % (ref[0] + 1)
        groups.append({"set": n + 1, "task": head.task, "model": str(head.model.get("name", "?")), "protocol": head.protocol,
                       "runs": [run_ids[r.rel] for r in members], "differs": differs})
    rows = []
    for run in runs:
        rows.append({"id": run_ids[run.rel], "rel": run.rel, "task": run.task, "model": str(run.model.get("name", "?")),
                     "setting": method_setting(run.data.get("method") or {})[0], "method": (run.data.get("method") or {}).get("name"),
                     "tag": run.data.get("method_tag"), "protocol": run.protocol,
                     "status": run.data.get("status") or (run.data.get("summary") or {}).get("status") or "complete",
                     "code": code_column(versions[run.rel]), "device": run.device, "dtype": run.dtype})
    return {"runs": rows, "sets": groups, "versions": [v for v in versions_paragraph(runs, versions) if v],
            "models": sorted({r["model"] for r in rows}), "protocols": sorted({r["protocol"] for r in rows}),
            "bootstrap": {"resamples": resamples, "seed": seed}}


# ------------------------------------------------------------------------------------------ page

def asset(name: str) -> str:
    return resources.files("harness.report").joinpath("assets", name).read_text(encoding="utf-8")


def page_data(runs, folder: Path, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
              title: str | None = None) -> tuple[dict, list[dict]]:
    """The page's one JSON object (overview, benchmark sections: blocks the script renders, items); and the
    leaderboard rows gathered on the way (one per benchmark and run: leaderboard_rows)."""
    ordered = sorted(runs, key=lambda r: r.rel)
    page = Page(run_ids={run.rel: i for i, run in enumerate(ordered)}, resamples=resamples, seed=seed)
    paired, _ = pair_runs(ordered, n_resamples=resamples, seed=seed)
    sections = []
    for names, module in task_reports():  # each benchmark's part, in registry order, then its paired differences
        part = getattr(module, "html_section", None)
        section = part([run for run in ordered if run.task in names], page) if part else None
        mine = [r for r in paired if r.benchmark in names]
        if section is not None and mine:
            section["blocks"].append(paired_table(mine, page.run_ids))
        if section is not None:
            sections.append(section)
    sections += [s for s in (reuse_section(ordered, page),) if s]
    data = {"title": title or f"Results: {Path(folder).resolve().name}", "folder": str(folder),
            "overview": overview(ordered, page.run_ids, resamples, seed), "sections": sections, "items": page.items.items}
    return data, page.board


def paired_table(rows, run_ids: dict) -> dict:
    """The paired difference to full (harness.report.paired rows) as a sortable table; a row click lists its run's items."""
    body = []
    for r in rows:
        label = f"Avg. ({r.tasks_averaged} tasks)" if r.task == AVERAGE else (r.label or r.task)
        body.append({"run": run_ids[r.setting], "cells": [r.model, method_setting(r.method)[0], _protocol_label(r.protocol), label,
                                                          rounded(r.delta, r.digits), rounded(r.ci_low, r.digits), rounded(r.ci_high, r.digits), r.n,
                                                          "~ noise" if r.noise else ("" if r.has_interval else f"n < {MIN_INTERVAL_ITEMS}")]})
    return {"kind": "table", "id": "paired", "title": "Paired difference to the full cache (95% bootstrap interval)", "rows": body,
            "columns": [{"name": n, "num": n in ("Δ vs full", "CI low", "CI high", "n")} for n in
                        ("Model", "Setting", "Protocol", "Task", "Δ vs full", "CI low", "CI high", "n", "")]}


def reuse_section(runs, page: Page) -> dict | None:
    """The reuse gap (harness.report.reuse) as a forest plot and a table; its whole-benchmark row (the average over
    strata, else the one stratum) joins the leaderboard row of the agnostic and the aware run."""
    rows, notes = gap_rows(runs, n_resamples=page.resamples, seed=page.seed)
    if not rows:
        return None
    several = len({r.model for r in rows}) > 1  # the model named only where there are several
    blocks = [{"kind": "intervals", "title": "Query-aware minus query-agnostic (95% paired bootstrap interval)",
               "rows": [{"label": (f"{r.model} · " if several else "") + f"{r.method} · {r.task}" + (" · multi-turn" if r.turns == "multi-turn" else ""),
                         "est": rounded(r.delta), "lo": rounded(r.ci_low), "hi": rounded(r.ci_high), "run": page.run_ids.get(r.agnostic_run)}
                        for r in rows]},
              {"kind": "table", "id": "reuse", "title": "Reuse gap",
               "columns": [{"name": n, "num": n not in ("Model", "Setting", "Task", "Turns")} for n in
                           ("Model", "Setting", "Task", "Turns", "Query-aware", "Query-agnostic", "Δ", "CI low", "CI high", "n")],
               "rows": [{"run": page.run_ids.get(r.agnostic_run),
                         "cells": [r.model, r.method, r.task, r.turns, rounded(r.aware_score), rounded(r.agnostic_score), rounded(r.delta),
                                   rounded(r.ci_low), rounded(r.ci_high), r.n]} for r in rows]}]
    whole: dict[str, object] = {}
    for r in rows:  # per run pair: the average row wins over a stratum's
        for rel in (r.agnostic_run, r.aware_run):
            if r.turns == "independent" and (rel not in whole or r.task == AVERAGE):
                whole[rel] = r
    for b in page.board:
        gap = whole.get(b["run"].rel)
        if gap is not None:
            b.update(reuse_gap=gap.delta, reuse_gap_low=gap.ci_low, reuse_gap_high=gap.ci_high)
    return {"id": "reuse", "title": "Reuse gap", "blocks": blocks, "notes": list(dict.fromkeys(notes)),
            "intro": "What asking a compressed context a question it did not see costs: per method setting run under both "
                     "protocols on the same items, the mean of (query-aware − query-agnostic) over the paired (item, question)s."}


# ------------------------------------------------------------------------------------------ leaderboard

LEADERBOARD = "leaderboard_kvpress.csv"
# kvpress's leaderboard columns first (dataset, model, method, compression_ratio, score), then what it lacks
LEADERBOARD_FIELDS = ["dataset", "data_dir", "model", "method", "compression_ratio", "score", "protocol", "ci_low", "ci_high", "n",
                      "reuse_gap", "reuse_gap_low", "reuse_gap_high", "method_tag", "run"]
# kvpress's press names where ours differ (its leaderboard script: no_press for the full cache, streaming_llm)
KVPRESS_NAMES = {"full": "no_press", "streamingllm": "streaming_llm"}


def leaderboard_rows(board: list[dict]) -> list[dict]:
    """One row per benchmark and run: score 0-100 (needle: keyword recall x 100), kvpress's compression ratio
    (the fraction of the compressed part's KV removed; 0 for the full cache), the 95% bootstrap interval of
    the score and, where the setting ran under both protocols, the reuse gap (query-aware minus agnostic)."""
    out = []
    for b in board:
        run = b["run"]
        name = str((run.data.get("method") or {}).get("name", "?"))
        row = {k: b.get(k) for k in LEADERBOARD_FIELDS if k in b and k != "run"}
        row.update(method=KVPRESS_NAMES.get(name, name), protocol=run.protocol, method_tag=run.data.get("method_tag"), run=run.rel)
        for k in ("score", "ci_low", "ci_high", "reuse_gap", "reuse_gap_low", "reuse_gap_high", "compression_ratio"):
            if row.get(k) is not None:
                row[k] = round(float(row[k]), 4)
        out.append(row)
    return sorted(out, key=lambda r: (r["dataset"], str(r.get("data_dir")), r["model"], r["protocol"], r["method"],
                                      r.get("compression_ratio") or 0))


def _script_json(data: dict) -> str:
    """JSON safe inside <script>: no `</` can close the element."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=str).replace("</", "<\\/")


def render(data: dict) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(data['title'])}</title><style>{asset('report.css')}</style></head>"
            f"<body><div id=\"app\">Loading…</div><script id=\"data\" type=\"application/json\">{_script_json(data)}</script>"
            f"<script>{asset('report.js')}</script></body></html>\n")


def write_outputs(runs, folder: Path, out: Path, *, html_page: bool, kvpress: bool, resamples: int = DEFAULT_RESAMPLES,
                  seed: int = DEFAULT_SEED) -> list[str]:
    """Write `out/report.html` and/or `out/leaderboard_kvpress.csv` for the collected runs; returns the names written."""
    data, board = page_data(runs, folder, resamples=resamples, seed=seed, title=f"Results: {Path(out).name}")
    written = []
    if html_page:
        (Path(out) / PAGE).write_text(render(data), encoding="utf-8")
        written.append(PAGE)
    if kvpress:
        write_csv(Path(out) / LEADERBOARD, leaderboard_rows(board), LEADERBOARD_FIELDS)
        written.append(LEADERBOARD)
    return written
