"""One self-contained page per comparison: `python -m harness.report <folder> --html` writes `report.html`.

The page holds its data (one JSON object) and its script and style (harness/report_assets/) inline: it opens
from a file, in any browser, with no network. It draws nothing itself in Python: this module gathers what the
tables already compute (harness.report's collection, harness.paired's paired differences, harness.stats'
intervals, the RULER and reuse-gap sections) into blocks the script renders as inline SVG and HTML:

- overview: the runs, models, protocols, code versions, and which runs can be compared (same task, model,
  task settings and protocol: harness.paired.pair_key) and, for the others, what differs (as comparison.md);
- per benchmark (harness/report_html_parts.py): score against budget or compression ratio, one line per method
  and protocol with its 95% bootstrap band, legend toggles; a sortable table of the paired difference to full;
  needle heatmaps and retention maps; RULER per task; LongBench per task and category; the reuse gap; the plan;
- per item: a click on a heatmap cell or a table row shows the prompt around the needle or answer (when the
  run logged prompts: task.log_prompts=true), and for every setting of that item the response, reference,
  score and what it kept of each span (needle, question) per layer.

Nothing here loads a model or imports torch.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path

from harness.page_blocks import Items
from harness.paired import pair_key
from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED

PAGE = "report.html"


# ------------------------------------------------------------------------------------------ overview

def overview(runs, run_ids: dict[str, int], resamples: int, seed: int) -> dict:
    """Runs, models, protocols, code versions; comparable sets (pair_key) and what separates the others."""
    from harness.report import method_setting
    from harness.report_versions import code_column, run_versions, versions_paragraph
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
                     "code": code_column(versions[run.rel]), "device": run.device})
    return {"runs": rows, "sets": groups, "versions": [v for v in versions_paragraph(runs, versions) if v],
            "models": sorted({r["model"] for r in rows}), "protocols": sorted({r["protocol"] for r in rows}),
            "bootstrap": {"resamples": resamples, "seed": seed}}


# ------------------------------------------------------------------------------------------ page

def asset(name: str) -> str:
    return resources.files("harness").joinpath("report_assets", name).read_text(encoding="utf-8")


def page_data(runs, folder: Path, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
              title: str | None = None) -> tuple[dict, list[dict]]:
    """The page's one JSON object (overview, benchmark sections: blocks the script renders, items); and the
    leaderboard rows gathered on the way (one per benchmark and run: leaderboard_rows)."""
    from harness.report_html_parts import sections

    ordered = sorted(runs, key=lambda r: r.rel)
    run_ids = {run.rel: i for i, run in enumerate(ordered)}
    items, board = Items(), []
    data = {"title": title or f"Results: {Path(folder).resolve().name}", "folder": str(folder),
            "overview": overview(ordered, run_ids, resamples, seed)}
    data["sections"] = sections(ordered, run_ids, items, Path(folder), resamples=resamples, seed=seed, board=board)
    data["items"] = items.items
    return data, board


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
    from harness.report import write_csv

    data, board = page_data(runs, folder, resamples=resamples, seed=seed, title=f"Results: {Path(out).name}")
    written = []
    if html_page:
        (Path(out) / PAGE).write_text(render(data), encoding="utf-8")
        written.append(PAGE)
    if kvpress:
        write_csv(Path(out) / LEADERBOARD, leaderboard_rows(board), LEADERBOARD_FIELDS)
        written.append(LEADERBOARD)
    return written
