"""The benchmark sections of report.html (harness/report_html.py): what each benchmark's tables compute, as
blocks the page's script draws (harness/page_blocks.py). Every number comes from the functions the Markdown
tables use (harness.paired, harness.report_ruler, harness.report_reuse, harness.stats); a leaderboard row per
(benchmark, run) is collected on the way (`python -m harness.report --format kvpress`).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.page_blocks import (budget_of, chart, interval, method_line, model_of, paired_table, rounded, setting_label,
                                 strata_interval)
from harness.paired import MIN_INTERVAL_ITEMS, longbench_items, method_name, needle_items, pair_runs, task_predictions

PLAN_ROWS = "plan_rows.jsonl"


# ------------------------------------------------------------------------------------------ needle

def _needle_fact(run, question: int) -> tuple[str, str]:
    """(needle text, answer) of the run's question `question` (task.needle/answer, then task.more_needles)."""
    task = run.config.get("task") or {}
    if question == 0:
        return str(task.get("needle") or ""), str(task.get("answer") or "")
    more = task.get("more_needles") or []
    fact = more[question - 1] if question - 1 < len(more) and isinstance(more[question - 1], dict) else {}
    return str(fact.get("needle") or ""), str(fact.get("answer") or "")


def needle_section(runs, run_ids, items, board, *, resamples, seed) -> dict | None:
    from harness.report import _protocol_label
    from harness.page_blocks import item_group
    from harness.report_ruler import removed_fraction

    mine = [r for r in runs if r.task == "needle" and needle_items(r)]
    if not mine:
        return None
    blocks, points_by_model, maps = [], {}, []
    for run in mine:
        scores = needle_items(run)
        values = list(scores.values())
        mean = sum(values) / len(values)
        lo, hi = interval(values, resamples, seed)
        full = method_name(run) == "full"
        points_by_model.setdefault(model_of(run), []).append(
            {"line": method_line(run), "protocol": run.protocol, "x": budget_of(run), "y": rounded(mean), "lo": rounded(lo), "hi": rounded(hi),
             "run": run_ids[run.rel], "full": full})
        board.append({"dataset": "needle", "data_dir": (run.data.get("summary") or {}).get("prompt_style"), "model": model_of(run),
                      "run": run, "compression_ratio": removed_fraction(run), "score": 100 * mean,
                      "ci_low": None if lo is None else 100 * lo, "ci_high": None if hi is None else 100 * hi, "n": len(values)})
        group = item_group(run)
        cells: dict[tuple, dict] = {}
        for rec in run.data.get("rows") or []:
            if not isinstance(rec, dict) or "score" not in rec:
                continue
            length, depth, q = int(rec["length"]), float(rec["depth"]), int(rec.get("question_index") or 0)
            needle, answer = _needle_fact(run, q)
            key = items.add(f"{group}|needle|{length}|{depth:g}|{q}",
                            f"needle · {model_of(run)} · {length} tokens · depth {depth:g}%" + (f" · question {q}" if rec.get("needles") else ""),
                            run_ids[run.rel], rec, response=str(rec.get("response", "")), score=rounded(rec.get("score")),
                            reference=answer, targets=[needle.strip()])
            cell = cells.setdefault((length, depth), {"scores": [], "kept": [], "keys": []})
            cell["scores"].append(float(rec["score"]))
            if rec.get("needle_kept") is not None:
                cell["kept"].append(float(rec["needle_kept"]))
            cell["keys"].append(key)
        maps.append({"run": run_ids[run.rel], "label": setting_label(run), "protocol": _protocol_label(run.protocol), "model": model_of(run),
                     "cells": [{"y": n, "x": d, "score": rounded(sum(c["scores"]) / len(c["scores"]), 3),
                                "kept": rounded(sum(c["kept"]) / len(c["kept"]), 3) if c["kept"] else None, "keys": c["keys"]}
                               for (n, d), c in sorted(cells.items())]})
    for model, points in points_by_model.items():
        blocks.append(chart(f"Needle · {model}: mean score against the budget", "budget (tokens kept per head)",
                             "mean score (keyword recall)", points, logx=True))
    rows, _ = pair_runs(mine, n_resamples=resamples, seed=seed)
    if rows:
        blocks.append(paired_table("Paired difference to the full cache (score units, 95% bootstrap interval)", rows, run_ids, 3))
    blocks.append({"kind": "heatmaps", "title": "Score and needle kept per cell (length × depth): click a cell for its item",
                   "xlabel": "depth %", "ylabel": "prompt tokens", "maps": maps})
    return {"id": "needle", "title": "Needle in a haystack", "blocks": blocks,
            "intro": "Score: keyword recall of the needle's answer (judge-free). Band: 95% bootstrap interval of the mean over "
                     "the run's cells. Needle kept: the fraction of the needle's tokens still cached after compression "
                     "(mean over compressed layers and heads). Solid lines: query-aware; dashed: query-agnostic."}


# ------------------------------------------------------------------------------------------ RULER

def ruler_section(runs, run_ids, items, board, *, resamples, seed) -> dict | None:
    from harness.report import _protocol_label
    from harness.page_blocks import item_group
    from harness.report_ruler import SHORT, TASK_ORDER, _items as ruler_items, ruler_rows

    mine = [r for r in runs if r.task == "ruler" and isinstance((r.data.get("summary") or {}).get("by_length"), dict)]
    if not mine:
        return None
    rows, _ = ruler_rows(mine, resamples, seed)
    by_rel = {r.rel: r for r in mine}
    blocks = []
    keyed: dict[tuple, list] = {}
    for row in rows:
        keyed.setdefault((row["model"], row["length"]), []).append(row)
    for (model, length), group in sorted(keyed.items()):
        tasks = [t for t in TASK_ORDER if any(r.get(t) is not None for r in group)]
        points, variants = [], {t: [] for t in tasks}
        col_items: dict[int, list] = {}
        table = []
        for row in sorted(group, key=lambda r: (r["protocol"], r["method"] != "full", str(r["method"]), r["removed"] or 0)):
            run = by_rel[row["run"]]
            scores = ruler_items(run)
            per_task = {t: [s for (name, n, _), s in scores.items() if name == t and n == length] for t in tasks}
            lo, hi = strata_interval([v for v in per_task.values() if v], resamples, seed)
            full = row["method"] == "full"
            base = {"line": method_line(run), "protocol": run.protocol, "run": run_ids[run.rel], "full": False}
            points.append({**base, "x": 0.0 if full else row["removed"], "y": row["average"], "lo": rounded(lo), "hi": rounded(hi), "full": full})
            for t in tasks:
                tlo, thi = interval(per_task[t], resamples, seed)
                variants[t].append({**base, "x": 0.0 if full else row["removed"], "y": row.get(t), "lo": rounded(tlo), "hi": rounded(thi),
                                    "full": full})
            delta = row["delta_average"]
            table.append({"run": run_ids[run.rel],
                          "cells": [row["setting"], _protocol_label(row["protocol"]), rounded(row["removed"], 3),
                                    *[rounded(row.get(t), 2) for t in tasks], rounded(row["average"], 2),
                                    rounded(delta[0], 2) if delta else None, rounded(delta[1], 2) if delta else None,
                                    rounded(delta[2], 2) if delta else None, delta[3] if delta else None]})
            board.append({"dataset": "ruler", "data_dir": str(length), "model": model, "run": run, "compression_ratio": row["removed"],
                          "score": row["average"], "ci_low": lo, "ci_high": hi, "n": sum(len(v) for v in per_task.values())})
            group_key = item_group(run)
            for rec in run.data.get("rows") or []:
                if not isinstance(rec, dict) or "score" not in rec or int(rec.get("length", -1)) != length:
                    continue
                q = int(rec.get("question_index") or 0)
                refs = rec.get("references") or []
                key = items.add(f"{group_key}|ruler|{rec['task']}|{length}|{rec['index']}|{q}",
                                f"RULER · {model} · {rec['task']} · {length} tokens · sample {rec['index']}" + (f" · key {q}" if q else ""),
                                run_ids[run.rel], rec, response=str(rec.get("response", "")), score=rounded(rec.get("score"), 2),
                                reference=" | ".join(map(str, refs)), targets=[str(x) for x in refs])
                col = 3 + tasks.index(rec["task"]) if rec["task"] in tasks else None
                if col is not None and key not in col_items.setdefault(col, []):
                    col_items[col].append(key)
        variant_charts = {f"{t} ({SHORT.get(t, t)})": chart("", "", "", _with_origin(v)) for t, v in variants.items()}
        figure = chart(f"RULER · {model} · {length} tokens: score against the compression ratio",
                       "compression ratio (fraction of the compressed part's KV removed)", "RULER score (0-100)", _with_origin(points),
                       xmin=0.0, variants={"average": None, **{k: {"series": c["series"], "hlines": c["hlines"]}
                                                               for k, c in variant_charts.items()}})
        blocks.append(figure)
        blocks.append({"kind": "table", "id": f"ruler-{length}", "title": f"RULER per task · {model} · {length} tokens "
                       "(click a task's score for its samples, a setting for all its items)",
                       "columns": [{"name": "Setting"}, {"name": "Protocol"}, {"name": "Removed", "num": True},
                                   *[{"name": SHORT.get(t, t), "num": True, "title": t} for t in tasks],
                                   {"name": "Avg.", "num": True}, {"name": "Δ vs full", "num": True}, {"name": "CI low", "num": True},
                                   {"name": "CI high", "num": True}, {"name": "n", "num": True}],
                       "rows": table, "colItems": {str(k): v for k, v in col_items.items()}})
    return {"id": "ruler", "title": "RULER", "blocks": blocks,
            "intro": "RULER's synthetic tasks, scored by its metrics (0-100); the average is the mean of the task scores. Δ vs full: "
                     "the paired difference of the average on the same samples with its 95% bootstrap interval (samples resampled "
                     f"within each task; none under {MIN_INTERVAL_ITEMS} samples a task). The chart's select shows one task instead "
                     "of the average. Compression ratio: kvpress's, the fraction of the compressed part's KV removed."}


def _with_origin(points: list[dict]) -> list[dict]:
    """Each method line starts at the full cache (x = 0) of its protocol, as the leaderboard draws it."""
    fulls = {p["protocol"]: p for p in points if p["full"]}
    lines = {(p["line"], p["protocol"]) for p in points if not p["full"]}
    extra = [{**fulls[proto], "line": line, "full": False, "x": 0.0} for line, proto in lines if proto in fulls]
    return points + extra


# ------------------------------------------------------------------------------------------ LongBench

def longbench_section(runs, run_ids, items, board, *, resamples, seed) -> dict | None:
    from harness.report import SHORT_NAMES, _protocol_label
    from harness.page_blocks import item_group
    from harness.report_ruler import removed_fraction
    from metrics.longbench_tasks import LONGBENCH_ALL_TASKS, TASK_CATEGORIES

    mine = [r for r in runs if r.task in ("longbench", "longbench_e") and isinstance((r.data.get("summary") or {}).get("scores"), dict)]
    if not mine:
        return None
    tasks = sorted({t for r in mine for t in r.data["summary"]["scores"]},
                   key=lambda t: LONGBENCH_ALL_TASKS.index(t) if t in LONGBENCH_ALL_TASKS else len(LONGBENCH_ALL_TASKS))
    cats = [c for c in TASK_CATEGORIES if any(c in (r.data["summary"].get("categories") or {}) for r in mine)]
    points, table = {}, []
    for run in mine:
        s = run.data["summary"]
        per_item, _ = longbench_items(run)
        lo, hi = strata_interval([list(v.values()) for v in per_item.values()], resamples, seed)
        x = budget_of(run)
        points.setdefault(model_of(run), []).append({"line": method_line(run), "protocol": run.protocol, "x": x, "y": s.get("average"),
                                                   "lo": rounded(lo, 2), "hi": rounded(hi, 2), "run": run_ids[run.rel],
                                                   "full": method_name(run) == "full"})
        table.append({"run": run_ids[run.rel], "cells": [model_of(run), setting_label(run), _protocol_label(run.protocol),
                                                         *[rounded((s.get("categories") or {}).get(c), 2) for c in cats],
                                                         *[rounded(s["scores"].get(t), 2) for t in tasks], rounded(s.get("average"), 2)]})
        board.append({"dataset": run.task, "data_dir": None, "model": model_of(run), "run": run, "compression_ratio": removed_fraction(run),
                      "score": s.get("average"), "ci_low": lo, "ci_high": hi, "n": sum(len(v) for v in per_item.values())})
        group = item_group(run)
        shards = s.get("shards_merged") or 1
        for name, scored in per_item.items():
            n_items = (s.get("items") or {}).get(name)
            for rec in task_predictions(run.path.parent / "pred", name, int(shards), n_items):
                answers = rec.get("answers") or []
                items.add(f"{group}|{run.task}|{name}|{rec.get('index')}|{rec.get('_id')}",
                          f"{run.task} · {model_of(run)} · {name} · item {rec.get('index')}", run_ids[run.rel], rec,
                          response=str(rec.get("pred", "")), score=rounded(scored.get((int(rec["index"]), str(rec.get("_id")))), 2),
                          reference=" | ".join(map(str, answers)), targets=[str(a) for a in answers])
    blocks = [chart(f"LongBench · {model}: average against the budget", "budget (tokens kept per head)", "average (official metrics × 100)",
                     p, logx=True) for model, p in points.items()]
    blocks.append({"kind": "table", "id": "longbench", "title": "LongBench per category and task (click a row for its items)",
                   "columns": [{"name": "Model"}, {"name": "Setting"}, {"name": "Protocol"},
                               *[{"name": c, "num": True} for c in cats], *[{"name": SHORT_NAMES.get(t, t), "num": True, "title": t} for t in tasks],
                               {"name": "Avg.", "num": True}], "rows": table})
    rows, _ = pair_runs(mine, n_resamples=resamples, seed=seed)
    if rows:
        blocks.append(paired_table("Paired difference to the full cache (points, 95% bootstrap interval)", rows, run_ids, 2))
    return {"id": "longbench", "title": "LongBench", "blocks": blocks,
            "intro": "Official metrics × 100; categories: the mean of their tasks present. Band: 95% bootstrap interval of the "
                     "average (items resampled within each task)."}


# ------------------------------------------------------------------------------------------ reuse gap

def reuse_section(runs, run_ids, items, board, *, resamples, seed) -> dict | None:
    from harness.report_reuse import gap_rows

    rows, notes = gap_rows(runs, n_resamples=resamples, seed=seed)
    if not rows:
        return None
    several = len({r.model for r in rows}) > 1  # the model named only where there are several
    blocks = [{"kind": "intervals", "title": "Query-aware minus query-agnostic (95% paired bootstrap interval)",
               "rows": [{"label": (f"{r.model} · " if several else "") + f"{r.method} · {r.task}" + (" · multi-turn" if r.turns == "multi-turn" else ""),
                         "est": rounded(r.delta), "lo": rounded(r.ci_low), "hi": rounded(r.ci_high), "run": run_ids.get(r.agnostic_run)} for r in rows]},
              {"kind": "table", "id": "reuse", "title": "Reuse gap",
               "columns": [{"name": n, "num": n not in ("Model", "Setting", "Task", "Turns")} for n in
                           ("Model", "Setting", "Task", "Turns", "Query-aware", "Query-agnostic", "Δ", "CI low", "CI high", "n")],
               "rows": [{"run": run_ids.get(r.agnostic_run),
                         "cells": [r.model, r.method, r.task, r.turns, rounded(r.aware_score), rounded(r.agnostic_score), rounded(r.delta),
                                   rounded(r.ci_low), rounded(r.ci_high), r.n]} for r in rows]}]
    for b in board:
        task = "average" if b["dataset"].startswith("longbench") else b["dataset"]  # report_reuse's row of the whole benchmark
        gap = next((g for g in rows if g.setting == b["run"].data.get("method_tag") and g.model == b["model"] and g.task == task), None)
        if gap is not None:
            b.update(reuse_gap=gap.delta, reuse_gap_low=gap.ci_low, reuse_gap_high=gap.ci_high)
    return {"id": "reuse", "title": "Reuse gap", "blocks": blocks, "notes": list(dict.fromkeys(notes)),
            "intro": "What asking a compressed context a question it did not see costs: per method setting run under both "
                     "protocols on the same items, the mean of (query-aware − query-agnostic) over the paired (item, question)s."}


# ------------------------------------------------------------------------------------------ plan

def _gpu_gb(folder: Path) -> float | None:
    """task.gpu_memory_gb of the plan run in `folder` (its results.json, else config.yaml)."""
    try:
        data = json.loads((folder / "results.json").read_text(encoding="utf-8"))
        value = ((data.get("config") or {}).get("task") or {}).get("gpu_memory_gb")
        if value is None:
            value = (data.get("summary") or {}).get("gpu_memory_gb")
        return float(value) if value is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    try:
        import yaml

        cfg = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8")) or {}
        value = (cfg.get("task") or {}).get("gpu_memory_gb")
        return float(value) if value is not None else None
    except (OSError, ValueError, TypeError, AttributeError, ImportError):
        return None


def plan_section(folder: Path) -> dict | None:
    """Every plan_rows.jsonl under the folder (the plan task's records: setting, length, batch_size, peak_bytes,
    peak_phase, fits): peak against length, one line per setting and batch, the GPU's memory across."""
    from harness.paired import _complete_lines

    blocks = []
    for path in sorted(Path(folder).rglob(PLAN_ROWS)):
        records = [r for r in _complete_lines(path) if all(k in r for k in ("setting", "length", "peak_bytes"))]
        if not records:
            continue
        gpu = _gpu_gb(path.parent)
        points = [{"line": f"{r['setting']} · batch {r.get('batch_size', 1)}", "protocol": "query_aware", "x": int(r["length"]),
                   "y": round(float(r["peak_bytes"]) / 2**30, 3), "lo": None, "hi": None, "run": None, "full": False} for r in records]
        figure = chart(f"Plan · {path.parent.relative_to(folder) if path.parent != Path(folder) else '.'}: peak memory against length",
                       "prompt tokens", "peak GiB", points, logx=True)
        figure["gpu"] = gpu
        blocks.append(figure)
        blocks.append({"kind": "table", "id": "plan", "title": "Planned peaks",
                       "columns": [{"name": "Setting"}, {"name": "Batch", "num": True}, {"name": "Length", "num": True},
                                   {"name": "Peak GiB", "num": True}, {"name": "Phase"}, {"name": "Fits"}],
                       "rows": [{"cells": [r["setting"], r.get("batch_size"), r["length"], round(float(r["peak_bytes"]) / 2**30, 3),
                                           r.get("peak_phase"), r.get("fits")]} for r in records]})
    if not blocks:
        return None
    return {"id": "plan", "title": "Plan", "blocks": blocks,
            "intro": "Peak live bytes the plan task counted per setting, length and batch (plan_rows.jsonl); the horizontal line "
                     "is the GPU's memory (task.gpu_memory_gb)."}


# ------------------------------------------------------------------------------------------ all

def sections(runs, run_ids, items, folder: Path, *, resamples: int, seed: int, board: list | None = None) -> list[dict]:
    board = [] if board is None else board
    out = [part(runs, run_ids, items, board, resamples=resamples, seed=seed)
           for part in (needle_section, ruler_section, longbench_section, reuse_section)]
    out.append(plan_section(folder))
    return [s for s in out if s]
