"""LongBench and LongBench-E in the report: the paper's Table 1 layout, ours minus the paper, the LongBench-E
buckets; and the per-item scores the paired reports pair (PAIRING).

- `longbench.md|csv`: the paper's Table 1 layout (16 task columns in paper order + average), one row per model x
  setting x rules, with the paper's average (results/paper/longbench_table1.csv, matched by model and setting) and the
  difference; `longbench_vs_paper.md|csv`: per-task differences.
- `longbench_e.md|csv`: LongBench-E bucket averages (when any LongBench-E run is found).

Per-item scores (PAIRING): the per-item `score` of each prediction record in `pred/<task>[.shard<k>of<n>].jsonl` (the
official metric of that item, in [0, 1]) when present, else recomputed from `pred` / `answers` / `all_classes` with the
official metric (metrics.longbench, the run's code_sim backend) exactly as the task's scoring does. Either way they must
reproduce the task score recorded in results.json (round(100 * mean, 2)); a task whose items do not is left out, with a
note. Items are matched by (index, _id) within a task; reported x 100, as the tables. Nothing here imports torch.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from harness import REPO_ROOT
from harness.results import Pairing, Run, number as _number, protocol_rank as _protocol_rank
from harness.tables import (Tables, _delta, _fmt, _model_sort, _protocol_label, _setting_sort, flag_duplicates,
                            markdown_table, method_setting, paper_model, row_key, write_csv)
from harness.tasks.longbench.data import SHORT_NAMES
from metrics.longbench_tasks import LONGBENCH_ALL_TASKS, LONGBENCH_EN_TASKS

PAPER_TABLE = REPO_ROOT / "results" / "paper" / "longbench_table1.csv"
OUTPUT_FILES = ("longbench.md", "longbench.csv", "longbench_vs_paper.md", "longbench_vs_paper.csv", "longbench_e.md",
                "longbench_e.csv")
OUTPUT_DIRS = ()
SCORE_TOLERANCE = 0.011  # per-item scores must give the recorded task score (2 decimals) within this


def load_paper_table(path: Path = PAPER_TABLE) -> dict[tuple[str, str], dict[str, float]]:
    """{(paper model, setting): {task: score}} from the paper's Table 1 CSV."""
    if not Path(path).exists():
        return {}
    out = {}
    with open(path, newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            out[(r["model"], r["setting"])] = {t: float(r[t]) for t in LONGBENCH_EN_TASKS if r.get(t) not in (None, "")}
    return out


def paper_average(scores: dict[str, float]) -> float | None:
    """Unweighted mean over the 16 tasks (the paper prints none; this is how papers compare)."""
    if len(scores) != len(LONGBENCH_EN_TASKS):
        return None
    return round(sum(scores.values()) / len(scores), 2)


LB_RULES = ("chat_format", "first_token_guard", "code_sim", "gqa")           # always shown
LB_EXTRA_RULES = ("truncation", "limit", "data", "random_weights")           # shown when they vary


def longbench_row(run: Run, paper: dict) -> dict | None:
    s = run.data.get("summary") or {}
    if s.get("status", "complete") != "complete" or not isinstance(s.get("scores"), dict):
        run.note = f"LongBench run not scored (status {s.get('status', run.data.get('status'))})"
        return None
    method = run.data.get("method") or {}
    rules = s.get("rules") or {}
    label, setting = method_setting(method)
    protocol = run.protocol
    if protocol != "query_aware":
        setting = None  # the paper's numbers are query-aware (the question inside the compressed prompt)
    pmodel = paper_model(run.model, run.config)
    scores = {t: s["scores"].get(t) for t in s["scores"]}
    row = {
        "model": run.model.get("name", "?"),
        "setting": label,
        "protocol": protocol,
        "method_tag": run.data.get("method_tag"),
        "chat_format": rules.get("chat_format", run.model.get("chat_format")),
        "first_token_guard": "all tasks" if rules.get("min_new_tokens_all_tasks") else "samsum only",
        "code_sim": s.get("code_sim_backend"),
        "gqa": method.get("gqa", "-") if method.get("name") != "full" else "-",
        "truncation": (rules.get("truncation") or {}).get("budget_tokens"),
        "limit": s.get("limit"),
        "data": rules.get("data_source"),
        "random_weights": bool(run.model.get("random_weights")),
        "tasks_run": len(scores),
        "items": s.get("total_items"),
        "avg": s.get("average"),
        "all_16": bool(s.get("all_16_en_tasks")),
        "paper_model": pmodel,
        "paper_setting": setting if pmodel else None,
        "paper_avg": None,
        "delta_avg": None,
        "note": "",
        "device": run.device,
        "run": run.rel,
        "_scores": scores,
        "_paper": None,
    }
    for t in LONGBENCH_EN_TASKS:
        row[t] = scores.get(t)
    if not row["all_16"]:
        row["note"] = f"{len(scores)} task(s): Avg. is not the 16-task average"
    if pmodel and setting and (pmodel, setting) in paper:
        pscores = paper[(pmodel, setting)]
        row["_paper"] = pscores
        row["paper_avg"] = paper_average(pscores)
        if row["limit"]:
            row["note"] = (row["note"] + "; " if row["note"] else "") + f"task.limit={row['limit']}: no delta"
        elif row["all_16"] and row["avg"] is not None and row["paper_avg"] is not None:
            row["delta_avg"] = round(row["avg"] - row["paper_avg"], 2)
    return row


LB_KEY = ("model", "protocol", "method_tag", *LB_RULES, *LB_EXTRA_RULES, "tasks_run")


def longbench_tables(runs: list[Run], paper: dict) -> tuple[list[dict], str, str]:
    rows = []
    for run in runs:
        if run.task != "longbench":  # LongBench-E runs have their own table
            continue
        row = longbench_row(run, paper)
        if row is not None:
            rows.append(row)
            run.used_in.append("longbench")
    rows.sort(key=lambda r: (_model_sort(r["model"]), _protocol_rank(r["protocol"]), _setting_sort(r["setting"]),
                             row_key(r, LB_KEY), r["run"]))
    flag_duplicates(rows, LB_KEY)
    if not rows:
        return rows, "", ""
    varying = [f for f in LB_EXTRA_RULES if len({json.dumps(r.get(f), default=str) for r in rows}) > 1]
    constant = [f for f in LB_EXTRA_RULES if f not in varying]
    headers = ["Model", "Setting", "Protocol", "Chat", "1st-token guard", "code_sim", "GQA", *[_rule_header(f) for f in varying],
               *[SHORT_NAMES[t] for t in LONGBENCH_EN_TASKS], "Avg.", "Paper Avg.", "Δ"]
    align = ["l"] * (7 + len(varying)) + ["r"] * (len(LONGBENCH_EN_TASKS) + 3)
    body = []
    for r in rows:
        body.append([r["model"], r["setting"], _protocol_label(r["protocol"]), r["chat_format"], r["first_token_guard"],
                     r["code_sim"], r["gqa"],
                     *[_fmt(r.get(f)) for f in varying], *[_fmt(r.get(t)) for t in LONGBENCH_EN_TASKS],
                     _fmt(r["avg"]), _fmt(r["paper_avg"]), _delta(r["delta_avg"])])
    lines = ["## LongBench (SnapKV Table 1 layout)", "", markdown_table(headers, body, align), ""]
    lines.append("- Scores: LongBench's official metrics x 100; Avg.: unweighted mean of the 16 English tasks "
                 "(the paper prints none; Paper Avg. is the same mean of its Table 1 row, results/paper/longbench_table1.csv).")
    lines.append("- Paper Avg./Δ only where model and setting are exactly the paper's (SnapKV: W=32, k=7, max pooling, "
                 "GQA expand; H2O: budget 4096; real weights; query-aware), the run has all 16 tasks and no task.limit.")
    lines.append("- Protocol: query-aware (the question inside the compressed prompt, as LongBench's prompts and the paper) "
                 "or query-agnostic (the question asked after compression); rows of different protocols never merge.")
    if constant:
        lines.append("- Same for every row: " + "; ".join(f"{_rule_header(f)} = {_fmt(rows[0].get(f))}" for f in constant) + ".")
    notes = [(r["model"], r["setting"], r["run"], r["note"]) for r in rows if r.get("note")]
    for model, setting, run, note in notes:
        lines.append(f"- {model} · {setting} (`{run}`): {note}.")
    md = "\n".join(lines) + "\n"

    matched = [r for r in rows if r["_paper"]]
    vs = ""
    if matched:
        headers = ["Model", "Setting", *[SHORT_NAMES[t] for t in LONGBENCH_EN_TASKS], "Avg."]
        body = []
        for r in matched:
            d = {t: (round(r[t] - r["_paper"][t], 2) if r.get(t) is not None and t in r["_paper"] else None) for t in LONGBENCH_EN_TASKS}
            r["_task_deltas"] = d
            body.append([r["model"], r["setting"], *[_delta(d[t]) for t in LONGBENCH_EN_TASKS], _delta(r["delta_avg"])])
        vs = "\n".join(["## LongBench: ours minus the paper, per task", "",
                        markdown_table(headers, body, ["l", "l"] + ["r"] * (len(LONGBENCH_EN_TASKS) + 1)), "",
                        "- Positive: we score higher than SnapKV's Table 1. Rows as in the LongBench table "
                        "(rules and runs in longbench.csv)."]) + "\n"
    return rows, md, vs


def _rule_header(f: str) -> str:
    return {"truncation": "Trunc.", "limit": "Limit", "data": "Data", "random_weights": "Random weights"}.get(f, f)


def longbench_e_table(runs: list[Run]) -> tuple[list[dict], str]:
    rows = []
    for run in runs:
        if run.task != "longbench_e":
            continue
        s = run.data.get("summary") or {}
        if s.get("status", "complete") != "complete" or "bucket_average" not in s:
            run.note = f"LongBench-E run not scored (status {s.get('status', run.data.get('status'))})"
            continue
        method = run.data.get("method") or {}
        rules = s.get("rules") or {}
        label, _ = method_setting(method)
        b = s.get("bucket_average") or {}
        rows.append({"model": run.model.get("name", "?"), "setting": label, "protocol": run.protocol,
                     "method_tag": run.data.get("method_tag"), "chat_format": rules.get("chat_format"), "first_token_guard": "all tasks" if rules.get("min_new_tokens_all_tasks") else "samsum only",
                     "code_sim": s.get("code_sim_backend"), "gqa": method.get("gqa", "-") if method.get("name") != "full" else "-",
                     "limit": s.get("limit"), "tasks_run": len(s.get("scores") or {}), "0-4k": b.get("0-4k"), "4-8k": b.get("4-8k"),
                     "8k+": b.get("8k+"), "avg": s.get("average"), "device": run.device, "run": run.rel, "note": ""})
        run.used_in.append("longbench_e")
    if not rows:
        return rows, ""
    rows.sort(key=lambda r: (_model_sort(r["model"]), _protocol_rank(r["protocol"]), _setting_sort(r["setting"]), r["run"]))
    flag_duplicates(rows, ("model", "protocol", "method_tag", "chat_format", "first_token_guard", "code_sim", "gqa", "limit",
                           "tasks_run"))
    headers = ["Model", "Setting", "Protocol", "Chat", "1st-token guard", "code_sim", "GQA", "Limit", "Tasks", "0-4k", "4-8k",
               "8k+", "Avg."]
    body = [[r["model"], r["setting"], _protocol_label(r["protocol"]), r["chat_format"], r["first_token_guard"], r["code_sim"],
             r["gqa"], _fmt(r["limit"]), r["tasks_run"], _fmt(r["0-4k"]), _fmt(r["4-8k"]), _fmt(r["8k+"]), _fmt(r["avg"])]
            for r in rows]
    md = "\n".join(["## LongBench-E (average over tasks, per length bucket)", "",
                    markdown_table(headers, body, ["l"] * 9 + ["r"] * 4), ""]) + "\n"
    return rows, md

# ------------------------------------------------------------------------------------------ the section

def tables(runs: list[Run], out: Path, options) -> Tables:
    """longbench.md|csv, longbench_vs_paper.md|csv, longbench_e.md|csv of the LongBench and LongBench-E runs."""
    paper = load_paper_table(options.paper_table or PAPER_TABLE)
    sections = []
    lb_rows, lb_md, vs_md = longbench_tables(runs, paper)
    if lb_rows:
        fields = ["model", "setting", "protocol", "method_tag", *LB_RULES, *LB_EXTRA_RULES, "tasks_run", "items", *LONGBENCH_EN_TASKS, "avg",
                  "all_16", "paper_model", "paper_setting", "paper_avg", "delta_avg", "device", "note", "run"]
        write_csv(out / "longbench.csv", lb_rows, fields)
        (out / "longbench.md").write_text(lb_md, encoding="utf-8")
        sections.append(("longbench.md", lb_md))
        matched = [r for r in lb_rows if r["_paper"]]
        if matched:
            vs_rows = [{"model": r["model"], "setting": r["setting"], "protocol": r["protocol"], "run": r["run"], "delta_avg": r["delta_avg"],
                        **{t: r["_task_deltas"][t] for t in LONGBENCH_EN_TASKS}} for r in matched]
            write_csv(out / "longbench_vs_paper.csv", vs_rows, ["model", "setting", "protocol", *LONGBENCH_EN_TASKS, "delta_avg", "run"])
            (out / "longbench_vs_paper.md").write_text(vs_md, encoding="utf-8")
            sections.append(("longbench_vs_paper.md", vs_md))

    lbe_rows, lbe_md = longbench_e_table(runs)
    if lbe_rows:
        write_csv(out / "longbench_e.csv", lbe_rows, list(lbe_rows[0].keys()))
        (out / "longbench_e.md").write_text(lbe_md, encoding="utf-8")
        sections.append(("longbench_e.md", lbe_md))
    return Tables(sections, {"longbench": lb_rows, "longbench_e": lbe_rows})


# ------------------------------------------------------------------------------------------ per-item scores (PAIRING)

def _complete_lines(path: Path) -> list[dict]:
    """JSON records of a predictions file; a torn last line and unreadable lines are skipped."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    data = data[: data.rfind(b"\n") + 1]
    out = []
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def task_predictions(pred_dir: Path, name: str, shards: int, n_items: int | None) -> list[dict]:
    """The task's prediction records merged in item order, as the task's scoring merges them: item i from
    shard i % shards, first record of an item wins, items at or beyond `n_items` (task.limit) dropped."""
    if shards <= 1:
        files = [(0, pred_dir / f"{name}.jsonl")]
    else:
        files = [(k, pred_dir / f"{name}.shard{k}of{shards}.jsonl") for k in range(shards)]
    found: dict[int, dict] = {}
    for k, path in files:
        for rec in _complete_lines(path):
            i = rec.get("index")
            if not isinstance(i, int) or isinstance(i, bool) or i < 0 or (n_items is not None and i >= n_items):
                continue
            if shards > 1 and i % shards != k:
                continue
            found.setdefault(i, rec)
    return [found[i] for i in sorted(found)]


def recompute_item_scores(name: str, records: list[dict], backend: str) -> list[float]:
    """The official metric of each item in [0, 1], as metrics.longbench.scorer computes them (all_classes of
    the last item, as eval.py keeps the last line's)."""
    from metrics import longbench as lb

    preds = [r["pred"] for r in records]
    answers = [r["answers"] for r in records]
    return [float(x) for x in lb._item_scores(name, preds, answers, records[-1].get("all_classes"), backend)]


def _task_score(raw: list[float]) -> float:
    total = 0.0
    for x in raw:  # sequential sum, as the official scorer
        total += x
    return round(100 * total / len(raw), 2)


def longbench_items(run) -> tuple[dict[str, dict[tuple[int, str], float]], list[str]]:
    """{task: {(index, _id): score x 100}} of a scored LongBench run; and notes on what was left out."""
    s = run.data.get("summary") or {}
    if s.get("status", "complete") != "complete" or not isinstance(s.get("scores"), dict):
        return {}, ["not scored"]
    cfg_task = (run.config.get("task") or {}) if isinstance(run.config, dict) else {}
    shard_cfg = cfg_task.get("shard") if isinstance(cfg_task.get("shard"), dict) else {}
    shards = s.get("shards_merged") or shard_cfg.get("count") or 1
    try:
        shards = max(1, int(shards))
    except (TypeError, ValueError):
        shards = 1
    counts = s.get("items") if isinstance(s.get("items"), dict) else {}
    backend = str(s.get("code_sim_backend") or cfg_task.get("code_sim_backend") or "difflib")
    pred_dir = run.path.parent / "pred"
    tasks = [t for t in (s.get("tasks") or list(s["scores"])) if t in s["scores"]]
    out: dict[str, dict[tuple[int, str], float]] = {}
    notes: list[str] = []
    for name in tasks:
        n_items = counts.get(name)
        n_items = int(n_items) if _number(n_items) else None
        records = task_predictions(pred_dir, name, shards, n_items)
        if not records:
            notes.append(f"{name}: no predictions in pred/")
            continue
        if n_items is not None and len(records) != n_items:
            notes.append(f"{name}: {len(records)} of {n_items} predictions in pred/")
            continue
        recorded = s["scores"].get(name)
        raw = None
        if all(_number(r.get("score")) for r in records):
            stored = [float(r["score"]) for r in records]
            if not _number(recorded) or abs(_task_score(stored) - recorded) <= SCORE_TOLERANCE:
                raw = stored
        if raw is None:
            try:
                raw = recompute_item_scores(name, records, backend)
            except Exception as exc:  # noqa: BLE001 - a bad record must not stop the report
                notes.append(f"{name}: per-item scores not recomputable ({type(exc).__name__}: {exc})")
                continue
            if _number(recorded) and abs(_task_score(raw) - recorded) > SCORE_TOLERANCE:
                notes.append(f"{name}: per-item scores give {_task_score(raw)}, results.json says {recorded}")
                continue
        out[name] = {(int(r["index"]), str(r.get("_id"))): 100.0 * x for r, x in zip(records, raw)}
    return out, notes


def _task_order(name: str) -> tuple:
    return (LONGBENCH_ALL_TASKS.index(name), name) if name in LONGBENCH_ALL_TASKS else (len(LONGBENCH_ALL_TASKS), name)


PAIRING = Pairing(items=longbench_items, order=_task_order, average=True, digits=2,
                  label=lambda t: SHORT_NAMES[t] if t in LONGBENCH_EN_TASKS else t)


# ------------------------------------------------------------------------------------------ report.html

def html_section(runs: list[Run], page) -> dict | None:
    """report.html's LongBench section (harness/page_blocks.py): the average against the budget per model (band: 95%
    bootstrap interval, items resampled within each task), the table per category and task; every item of a task."""
    from harness.page_blocks import budget_of, chart, item_group, method_line, model_of, removed_fraction, rounded, setting_label, strata_interval
    from harness.results import method_name
    from metrics.longbench_tasks import TASK_CATEGORIES

    mine = [r for r in runs if isinstance((r.data.get("summary") or {}).get("scores"), dict)]
    if not mine:
        return None
    tasks = sorted({t for r in mine for t in r.data["summary"]["scores"]}, key=_task_order)
    cats = [c for c in TASK_CATEGORIES if any(c in (r.data["summary"].get("categories") or {}) for r in mine)]
    points, table = {}, []
    for run in mine:
        s = run.data["summary"]
        per_item, _ = longbench_items(run)
        lo, hi = strata_interval([list(v.values()) for v in per_item.values()], page.resamples, page.seed)
        points.setdefault(model_of(run), []).append({"line": method_line(run), "protocol": run.protocol, "x": budget_of(run),
                                                     "y": s.get("average"), "lo": rounded(lo, 2), "hi": rounded(hi, 2),
                                                     "run": page.run_ids[run.rel], "full": method_name(run) == "full"})
        table.append({"run": page.run_ids[run.rel], "cells": [model_of(run), setting_label(run), _protocol_label(run.protocol),
                                                              *[rounded((s.get("categories") or {}).get(c), 2) for c in cats],
                                                              *[rounded(s["scores"].get(t), 2) for t in tasks], rounded(s.get("average"), 2)]})
        group, records = item_group(run), []
        for name, scored in per_item.items():
            for rec in task_predictions(run.path.parent / "pred", name, int(s.get("shards_merged") or 1), (s.get("items") or {}).get(name)):
                records.append(rec)
                answers = rec.get("answers") or []
                page.items.add(f"{group}|{run.task}|{name}|{rec.get('index')}|{rec.get('_id')}", f"{run.task} · {model_of(run)} · {name} · item {rec.get('index')}",
                               page.run_ids[run.rel], rec, response=str(rec.get("pred", "")),
                               score=rounded(scored.get((int(rec["index"]), str(rec.get("_id")))), 2),
                               reference=" | ".join(map(str, answers)), targets=[str(a) for a in answers])
        # the compression ratio from the item records (pred/): results.json's rows are per task, without budgets
        page.board.append({"dataset": run.task, "data_dir": None, "model": model_of(run), "run": run,
                           "compression_ratio": removed_fraction(run, records), "score": s.get("average"), "ci_low": lo, "ci_high": hi,
                           "n": sum(len(v) for v in per_item.values())})
    blocks = [chart(f"LongBench · {model}: average against the budget", "budget (tokens kept per head)", "average (official metrics × 100)",
                    p, logx=True) for model, p in points.items()]
    blocks.append({"kind": "table", "id": "longbench", "title": "LongBench per category and task (click a row for its items)",
                   "columns": [{"name": "Model"}, {"name": "Setting"}, {"name": "Protocol"}, *[{"name": c, "num": True} for c in cats],
                               *[{"name": SHORT_NAMES.get(t, t), "num": True, "title": t} for t in tasks], {"name": "Avg.", "num": True}],
                   "rows": table})
    return {"id": "longbench", "title": "LongBench", "blocks": blocks,
            "intro": "Official metrics × 100; categories: the mean of their tasks present. Band: 95% bootstrap interval of the "
                     "average (items resampled within each task)."}
