"""The plan's part of `python -m harness.report`: `plan.md|csv` (every plan run's planned peaks, one row per
setting, attention, batch and length, from its plan_rows.jsonl) and report.html's section (peak against length,
one line per setting and batch, the GPU's memory as a horizontal line). No torch: the rows are read back."""

from __future__ import annotations

import json
from pathlib import Path

from harness.tables import Tables, clean, markdown_table, write_csv
from harness.tasks.plan.tables import GIB, table_rows

PLAN_ROWS = "plan_rows.jsonl"
PLAN_FILES = ("plan.md", "plan.csv")
OUTPUT_FILES = PLAN_FILES
COLUMNS = ["run", "setting", "attn_implementation", "batch_size", "length", "peak_gib", "fits", "peak_phase", "kv_cache_gib", "error"]


def plan_records(run) -> list[dict]:
    """The plan's records of one run (plan_rows.jsonl next to its results.json); a torn last line (a plan still
    running) is skipped."""
    path = Path(run.path).parent / PLAN_ROWS
    records = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and all(k in record for k in ("setting", "length", "peak_bytes")):
                records.append(record)
    return records


def gpu_memory_gb(run) -> float | None:
    """task.gpu_memory_gb of a plan run (its recorded config, else its summary)."""
    value = ((run.config.get("task") or {}).get("gpu_memory_gb"))
    if value is None:
        value = (run.data.get("summary") or {}).get("gpu_memory_gb")
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def tables(runs, out: Path, options) -> Tables:
    out = Path(out)
    clean(out, PLAN_FILES)
    rows = []
    for run in sorted(runs, key=lambda r: r.rel):
        records = plan_records(run)
        if records:
            run.used_in.append("plan")
            rows += [{"run": run.rel, **r} for r in table_rows(records)]
    if not rows:
        return Tables()
    write_csv(out / "plan.csv", rows, COLUMNS)
    md = ("## Memory plans\n\nPeak live bytes counted by `task=plan` (fake tensors, docs/planning.md) per setting, attention, "
          "batch and prompt length; each run's own plan_table.md has every column.\n\n"
          + markdown_table(COLUMNS, [["–" if r.get(c) is None else r.get(c) for c in COLUMNS] for r in rows]) + "\n")
    (out / "plan.md").write_text(md, encoding="utf-8")
    return Tables(sections=[("plan.md", md)], written={"plan": rows})


def html_section(runs, page) -> dict | None:
    """report.html's plan section: per plan run, peak against length (one line per setting and batch) with the
    GPU's memory across, and the planned peaks as a table."""
    from harness.page_blocks import chart

    blocks = []
    for run in sorted(runs, key=lambda r: r.rel):
        records = plan_records(run)
        if not records:
            continue
        points = [{"line": f"{r['setting']} · batch {r.get('batch_size', 1)}", "protocol": "query_aware", "x": int(r["length"]),
                   "y": round(float(r["peak_bytes"]) / GIB, 3), "lo": None, "hi": None, "run": None, "full": False} for r in records]
        figure = chart(f"Plan · {run.rel}: peak memory against length", "prompt tokens", "peak GiB", points, logx=True)
        figure["gpu"] = gpu_memory_gb(run)
        blocks += [figure, {"kind": "table", "id": "memory-plan", "title": "Planned peaks",
                            "columns": [{"name": "Setting"}, {"name": "Batch", "num": True}, {"name": "Length", "num": True},
                                        {"name": "Peak GiB", "num": True}, {"name": "Phase"}, {"name": "Fits"}],
                            "rows": [{"cells": [r["setting"], r.get("batch_size"), r["length"], round(float(r["peak_bytes"]) / GIB, 3),
                                                r.get("peak_phase"), r.get("fits")]} for r in records]}]
    if not blocks:
        return None
    return {"id": "memory-plan", "title": "Plan", "blocks": blocks,
            "intro": "Peak live bytes the plan counted per setting, length and batch (plan_rows.jsonl); the horizontal line "
                     "is the GPU's memory (task.gpu_memory_gb)."}
