"""Result tables people can quote, from every run under a folder.

    python -m harness.report <results folder> [--name NAME] [--out results/] [--html] [--format kvpress]

Collects every `results.json` under the folder (recursively) and writes `<out>/<name>/`:

- `longbench.md|csv`: the paper's Table 1 layout (16 task columns in paper order + average), one row
  per model x setting x rules, with the paper's average (results/paper/longbench_table1.csv, matched by
  model and setting) and the difference; `longbench_vs_paper.md|csv`: per-task differences.
- `longbench_e.md|csv`: LongBench-E bucket averages (when any LongBench-E run is found).
- `needle.md|csv`: mean score per run and prompt-length bucket, strict accuracy, where cells ran out
  of memory; `needle/*.png`: each run's heatmap; `needle_by_length.png`.
- `efficiency.md|csv`: decode latency, prefill, KV bytes, peak memory and the ratios against the full
  cache, per run, method and prompt length; `max_length.csv`: the maximum-length searches; the
  benchmark's plots under `efficiency/`.
- `claims.md|csv`: the paper's efficiency and needle claims (results/paper/paper_claims.csv) next to ours.
- `paired_deltas.md|csv`: every compressed setting minus the full cache run on the same items (same model,
  task, protocol and task settings), per LongBench task, on the LongBench average and on the needle mean, with
  a 95% paired bootstrap interval (harness/stats.py); CSV columns `setting, task, delta, ci_low, ci_high, n`.
- `runs.csv`: every results.json found, which table it went into (or why none), and the code version(s) of its
  records (`code`; README.md names every version and the runs that mix them: harness/report_versions.py).
- `README.md`: all the Markdown tables in one page.
- `--html`: `report.html`, one self-contained page (data and script inline, no network) with charts, sortable tables
  and every item's responses and what each method kept (harness/report_html.py).
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
import csv
import io
import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import REPO_ROOT
from harness.paired import AVERAGE, CSV_FIELDS as PAIRED_FIELDS, MIN_INTERVAL_ITEMS, NEEDLE, PairedRow, pair_runs
from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED
from metrics.longbench_tasks import LONGBENCH_EN_TASKS

PAPER_DIR = REPO_ROOT / "results" / "paper"
PAPER_TABLE = PAPER_DIR / "longbench_table1.csv"
PAPER_CLAIMS = PAPER_DIR / "paper_claims.csv"
# Everything `build` writes (and removes again before writing): never anything else, so a table set can live
# next to other files (results/paper/ also holds the paper's own numbers: longbench_table1.csv, paper_claims.csv,
# SOURCE.md).
OUTPUT_FILES = ("README.md", "runs.csv", "longbench.md", "longbench.csv", "longbench_vs_paper.md", "longbench_vs_paper.csv",
                "longbench_e.md", "longbench_e.csv", "needle.md", "needle.csv", "needle_by_length.png", "efficiency.md",
                "efficiency.csv", "max_length.csv", "claims.md", "claims.csv", "paired_deltas.md", "paired_deltas.csv",
                "report.html", "leaderboard_kvpress.csv")
OUTPUT_DIRS = ("needle", "efficiency")

# Our model names -> the paper's (SnapKV Table 1). Also matched: the basename of the model's hub path.
PAPER_MODELS = {
    "lwm-text-chat-1m": "LWM-Text-Chat-1M",
    "longchat-7b-32k": "LongChat-7b-v1.5-32k",
    "mistral-7b-instruct-v0.2": "Mistral-7B-Instruct-v0.2",
    "mixtral-8x7b-instruct": "Mixtral-8x7B-Instruct-v0.1",
}
# SnapKV's LongBench preset (Table 1): anything else is another setting, never matched to the paper.
PAPER_SNAPKV = {"window_size": 32, "kernel_size": 7, "pooling": "maxpool", "gqa": "expand"}
# SnapKV's needle preset (the needle claims are matched against runs of exactly this method).
PAPER_NEEDLE = {"name": "snapkv", "budget": 1024, "window_size": 16, "kernel_size": 5, "pooling": "maxpool"}
# Column headers of the papers' LongBench tables.
SHORT_NAMES = {
    "narrativeqa": "NrtvQA", "qasper": "Qasper", "multifieldqa_en": "MF-en", "hotpotqa": "HotpotQA",
    "2wikimqa": "2WikiMQA", "musique": "Musique", "gov_report": "GovReport", "qmsum": "QMSum",
    "multi_news": "MultiNews", "trec": "TREC", "triviaqa": "TriviaQA", "samsum": "SAMSum",
    "passage_count": "PCount", "passage_retrieval_en": "PRe", "lcc": "Lcc", "repobench-p": "RB-P",
}
METHOD_NAMES = {"full": "All KV", "snapkv": "SnapKV", "h2o": "H2O", "pyramidkv": "PyramidKV", "streamingllm": "StreamingLLM"}
SETTING_ORDER = ("All KV", "SnapKV", "PyramidKV", "H2O", "StreamingLLM")
MB = 1024 * 1024


# ------------------------------------------------------------------------------------------ collecting

@dataclass
class Run:
    path: Path          # the results.json
    rel: str            # its run directory, relative to the collected folder
    data: dict
    used_in: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def task(self) -> str:
        return str(self.data.get("task", "?"))

    @property
    def model(self) -> dict:
        return self.data.get("model") or {}

    @property
    def config(self) -> dict:
        return self.data.get("config") or {}

    @property
    def device(self) -> str:
        prov = self.data.get("provenance") or {}
        return str(prov.get("cuda") or prov.get("device") or "?")

    @property
    def protocol(self) -> str:
        return run_protocol(self.data)


PROTOCOLS = ("query_aware", "query_agnostic")


def run_protocol(data: dict) -> str:
    """"query_aware" (the question inside the compressed prompt) or "query_agnostic" (asked after compression):
    `summary.protocol` when recorded, else `config.task.query_aware` (false: agnostic); absent means query-aware."""
    summary = data.get("summary") if isinstance(data.get("summary"), dict) else {}
    recorded = summary.get("protocol")
    if recorded in PROTOCOLS:
        return recorded
    task_cfg = ((data.get("config") or {}).get("task") or {}) if isinstance(data.get("config"), dict) else {}
    flag = task_cfg.get("query_aware", True) if isinstance(task_cfg, dict) else True
    return "query_agnostic" if flag is False or str(flag).lower() == "false" else "query_aware"


def _protocol_rank(protocol: str) -> int:
    return PROTOCOLS.index(protocol) if protocol in PROTOCOLS else len(PROTOCOLS)


def collect(folder: Path) -> tuple[list[Run], list[tuple[str, str]]]:
    """Every readable results.json under `folder`, in path order; and (path, reason) for unreadable ones."""
    folder = Path(folder)
    runs, bad = [], []
    for path in sorted(folder.rglob("results.json")):
        rel = str(path.parent.relative_to(folder)) or "."
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            bad.append((rel, f"unreadable: {type(exc).__name__}"))
            continue
        runs.append(Run(path, rel, data))
    return runs, bad


# ------------------------------------------------------------------------------------------ formatting

def _fmt(v, digits: int = 2) -> str:
    if v is None or v == "":
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.{digits}f}"
    return str(v)


def markdown_table(headers: list[str], rows: list[list[Any]], align: list[str] | None = None) -> str:
    align = align or ["l"] * len(headers)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(sep) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |")
    return "\n".join(out)


def write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fields})
    path.write_text(buf.getvalue(), encoding="utf-8")


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(text))


# ------------------------------------------------------------------------------------------ settings

def method_setting(method: dict) -> tuple[str, str | None]:
    """(label shown in the tables, the paper's setting name when this is exactly the paper's setting)."""
    name = str(method.get("name", "?"))
    base = METHOD_NAMES.get(name, name)
    if name == "full":
        return "All KV", "All KV"
    budget = method.get("budget")
    if isinstance(budget, list):
        return f"{base} per-layer", None
    ratio = method.get("ratio")
    if budget is None and ratio is not None:  # a fraction of each prompt (kvpress's convention): never a paper budget
        budget = f"ratio {ratio:g}" if isinstance(ratio, (int, float)) else f"ratio {ratio}"
    details = []
    if name in ("snapkv", "pyramidkv"):
        details = [f"W{method.get('window_size')}", f"k{method.get('kernel_size')}", str(method.get("pooling"))]
        if name == "pyramidkv":
            details.append(f"β{method.get('beta')}")
    elif name == "h2o":  # no window_size: half of each prompt's resolved budget (the tag's `whalf`)
        details = [f"W{method.get('window_size')}" if method.get("window_size") is not None else "W half the budget"]
    elif name == "streamingllm":
        details = [f"sinks {method.get('sink_tokens')}"]
    label = f"{base} {budget}" + (f" ({' '.join(details)})" if details else "")
    paper = None
    if ratio is not None and method.get("budget") is None:
        return label, None
    if name == "snapkv" and all(method.get(k) == v for k, v in PAPER_SNAPKV.items()):
        label, paper = f"SnapKV {budget}", f"SnapKV {budget}"
    elif name == "h2o" and method.get("gqa", "expand") == "expand":
        paper = f"H2O {budget}"  # the paper does not state H2O's recent window; any window matches
    return label, paper


def paper_model(model: dict, config: dict) -> str | None:
    """The paper's name of this model, or None (random-weight models never match)."""
    if model.get("random_weights") or (config.get("model") or {}).get("random_weights"):
        return None
    name = str(model.get("name", ""))
    if name in PAPER_MODELS:
        return PAPER_MODELS[name]
    path = str(model.get("location") or (config.get("model") or {}).get("path") or "")
    base = path.rstrip("/").split("/")[-1].lower()
    for paper in PAPER_MODELS.values():
        if base and base == paper.lower():
            return paper
    return None


def _setting_sort(label: str) -> tuple:
    rank = next((i for i, s in enumerate(SETTING_ORDER) if label.startswith(s)), len(SETTING_ORDER))
    words = label.split(" ")
    budget = next((int(w) for w in words if w.isdigit()), 0)
    return rank, budget, label


def _model_sort(name: str) -> tuple:
    names = list(PAPER_MODELS)
    return (names.index(name), name) if name in names else (len(names), name)


# ------------------------------------------------------------------------------------------ the paper

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


def load_claims(path: Path = PAPER_CLAIMS) -> list[dict]:
    if not Path(path).exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------------ LongBench

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


def row_key(row: dict, fields: tuple[str, ...]) -> tuple:
    return tuple(json.dumps(row.get(f), sort_keys=True, default=str) for f in fields)


def flag_duplicates(rows: list[dict], fields: tuple[str, ...]) -> None:
    seen: dict[tuple, int] = {}
    for r in rows:
        seen[row_key(r, fields)] = seen.get(row_key(r, fields), 0) + 1
    for r in rows:
        if seen[row_key(r, fields)] > 1:
            r["note"] = (r["note"] + "; " if r.get("note") else "") + "same key as another run (see `run`)"


LB_KEY = ("model", "protocol", "method_tag", *LB_RULES, *LB_EXTRA_RULES, "tasks_run")


def longbench_tables(runs: list[Run], paper: dict) -> tuple[list[dict], str, str]:
    rows = []
    for run in runs:
        if run.task != "longbench":
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


def _protocol_label(protocol: str) -> str:
    return {"query_aware": "query-aware", "query_agnostic": "query-agnostic"}.get(protocol, str(protocol))


def _rule_header(f: str) -> str:
    return {"truncation": "Trunc.", "limit": "Limit", "data": "Data", "random_weights": "Random weights"}.get(f, f)


def _delta(v) -> str:
    return "–" if v is None else f"{v:+.2f}"


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


# ------------------------------------------------------------------------------------------ needle

def length_bucket(n: int) -> tuple[int, str]:
    """Doubling buckets of 1K tokens: (upper edge, label): <=1K, 1K-2K, 2K-4K, ..."""
    upper = 1024
    while n > upper:
        upper *= 2
    return upper, ("≤1K" if upper == 1024 else f"{_k(upper // 2)}-{_k(upper)}")


def _k(n: int) -> str:
    return f"{n // 1024}K"


def needle_rows(runs: list[Run]) -> list[dict]:
    rows = []
    for run in runs:
        if run.task != "needle":
            continue
        cells = [r for r in (run.data.get("rows") or []) if "length" in r and "score" in r]
        failed = run.data.get("failed_items") or []
        if not cells and not failed:
            run.note = "needle run without cells"
            continue
        method = run.data.get("method") or {}
        label, _ = method_setting(method)
        task_cfg = run.config.get("task") or {}
        lengths = sorted({int(c["length"]) for c in cells})
        oom = sorted(int(f["key"][0]) for f in failed if f.get("oom") and isinstance(f.get("key"), list) and f["key"])
        fail_lengths = sorted(int(f["key"][0]) for f in failed if isinstance(f.get("key"), list) and f["key"])
        by_bucket: dict[str, list[float]] = {}
        edges: dict[str, int] = {}
        for c in cells:
            edge, name = length_bucket(int(c["length"]))
            by_bucket.setdefault(name, []).append(float(c["score"]))
            edges[name] = edge
        longest_ok = None
        for n in lengths:
            at = [c for c in cells if int(c["length"]) == n]
            if n in fail_lengths or not all(bool(c.get("strict")) for c in at):
                break
            longest_ok = n
        s = run.data.get("summary") or {}
        rows.append({
            "model": run.model.get("name", "?"), "setting": label, "protocol": run.protocol,
            "method_tag": run.data.get("method_tag"), "prompt_style": (run.data.get("summary") or {}).get("prompt_style") or task_cfg.get("prompt_style"),
            "chat_format": run.model.get("chat_format"), "grid": _grid(cells),
            "score_name": s.get("score_name", "score"), "device": run.device,
            "cells": len(cells), "failed_cells": len(failed), "first_failed_length": fail_lengths[0] if fail_lengths else None,
            "first_oom_length": oom[0] if oom else None,
            "max_length_done": max(lengths) if lengths else None,
            "longest_all_strict": longest_ok,
            "mean_score": _mean(float(c["score"]) for c in cells),
            "strict_accuracy": _mean(float(bool(c.get("strict"))) for c in cells),
            "buckets": {k: _mean(v) for k, v in by_bucket.items()}, "_edges": edges,
            "run": run.rel, "note": "", "_cells": cells, "_run": run, "_method": method,
        })
        run.used_in.append("needle")
    rows.sort(key=lambda r: (r["model"], _protocol_rank(r["protocol"]), _setting_sort(r["setting"]), r["run"]))
    flag_duplicates(rows, ("model", "protocol", "method_tag", "prompt_style", "chat_format", "device"))
    return rows


def _grid(cells: list[dict]) -> str:
    """The cells a needle run's mean covers, e.g. `1K-4K x 5` (lengths x depths): means of other grids differ."""
    lengths = sorted({int(c["length"]) for c in cells})
    depths = {c.get("depth") for c in cells}
    if not lengths:
        return "–"
    span = _k_or_n(lengths[0]) if len(lengths) == 1 else f"{_k_or_n(lengths[0])}-{_k_or_n(lengths[-1])} ({len(lengths)})"
    return f"{span} x {len(depths)}"


def _k_or_n(n: int) -> str:
    return f"{n / 1024:g}K" if n % 256 == 0 and n >= 1024 else str(n)


def _mean(values) -> float | None:
    values = list(values)
    return round(sum(values) / len(values), 4) if values else None


def needle_table(rows: list[dict], out: Path) -> str:
    if not rows:
        return ""
    edges: dict[str, int] = {}
    for r in rows:
        edges.update(r["_edges"])
    buckets = sorted(edges, key=lambda b: edges[b])
    for r in rows:
        for b in buckets:
            r[f"bucket {b}"] = r["buckets"].get(b)
    heat_dir = out / "needle"
    heat_dir.mkdir(parents=True, exist_ok=True)
    used_names: set[str] = set()
    for r in rows:
        name = _safe(f"{r['model']}__{r['method_tag']}__{r['prompt_style']}"
                     + ("" if r["protocol"] == "query_aware" else f"__{r['protocol']}"))
        base, i = name, 2
        while name in used_names:
            name, i = f"{base}_{i}", i + 1
        used_names.add(name)
        target = heat_dir / f"{name}.png"
        source = r["_run"].path.parent / "needle_heatmap.png"
        if source.exists():
            shutil.copyfile(source, target)
        elif r["_cells"]:
            from harness.plots import needle_heatmap

            needle_heatmap(r["_cells"], target, title=f"{r['model']} · {r['method_tag']}", score_key="score")
        r["heatmap"] = f"needle/{target.name}" if target.exists() else None
        retention = r["_run"].path.parent / "needle_retention.png"  # the fraction of the needle each method kept
        if retention.exists():
            shutil.copyfile(retention, heat_dir / f"{name}__retention.png")
    styles = {r["prompt_style"] for r in rows}
    series: dict[str, list] = {}
    for r in rows:  # one line per row: a label shared by two rows (other prompt, device, run) gets the run's path
        label = (f"{r['model']} · {r['setting']}" + ("" if r["protocol"] == "query_aware" else f" · {_protocol_label(r['protocol'])}")
                 + (f" · {r['prompt_style']}" if len(styles) > 1 else ""))
        if label in series:
            label = f"{label} ({r['run']})"
        series[label] = sorted(_by_length(r["_cells"]).items())
    if any(series.values()):
        from harness.plots import line_plot

        line_plot(series, out / "needle_by_length.png", title="Needle: mean score per prompt length",
                  xlabel="prompt tokens", ylabel=rows[0]["score_name"], logx=True)
    headers = ["Model", "Setting", "Protocol", "Prompt", "Chat", "Device", "Grid", "Cells", *buckets, "Mean", "Strict acc.",
               "All depths correct up to", "Failed cells (first at)", "Needle kept", "Heatmap"]

    def kept(r):  # mean fraction of the needle's tokens still cached after compression (needle_retention.png)
        value = (r["_run"].data.get("summary") or {}).get("mean_needle_kept")
        return _fmt(value, 3) if value is not None and r["method_tag"] != "full" else "–"

    def pictures(r):
        links = [f"[png]({r['heatmap']})"] if r.get("heatmap") else []
        retention = Path(r["heatmap"] or "").stem + "__retention.png"
        if r.get("heatmap") and (heat_dir / retention).exists():
            links.append(f"[kept]({'needle/' + retention})")
        return " ".join(links) or "–"

    body = [[r["model"], r["setting"], _protocol_label(r["protocol"]), r["prompt_style"], r["chat_format"], r["device"], r["grid"], r["cells"],
             *[_fmt(r["buckets"].get(b), 3) for b in buckets], _fmt(r["mean_score"], 3), _fmt(r["strict_accuracy"], 3),
             _fmt(r["longest_all_strict"]), f"{r['failed_cells']}" + (f" ({r['first_failed_length']}{', OOM' if r['first_oom_length'] else ''})" if r["failed_cells"] else ""),
             kept(r), pictures(r)] for r in rows]
    lines = ["## Needle in a haystack", "", markdown_table(headers, body, ["l"] * 7 + ["r"] * (len(buckets) + 6) + ["l"]), "",
             f"- Score: {rows[0]['score_name']} of the needle's answer in the response (judge-free), mean per prompt-length "
             "bucket (tokens, template included); Strict acc.: share of cells with every key fact of the needle.",
             "- Grid: the prompt lengths (how many) x the depths a run's cells cover. Mean and Strict acc. average a run's "
             "own cells: compare them only between rows of the same grid, prompt and protocol (the length buckets and "
             "paired_deltas.md compare on common cells).",
             "- All depths correct up to: the longest prompt length L such that every cell at every length <= L is strictly "
             "correct. Failed cells: cells with an error (OOM: out of memory), which have no score.",
             "- Needle kept: the mean fraction of the needle's tokens still in the cache after compression (over cells, "
             "compressed layers and heads; `kept` links the per-cell picture): it tells \"the method evicted the needle\" "
             "from \"the model failed with the needle in cache\"."]
    for r in rows:
        if r.get("note"):
            lines.append(f"- {r['model']} · {r['setting']} (`{r['run']}`): {r['note']}.")
    return "\n".join(lines) + "\n"


def _by_length(cells: list[dict]) -> dict[int, float]:
    out: dict[int, list[float]] = {}
    for c in cells:
        out.setdefault(int(c["length"]), []).append(float(c["score"]))
    return {n: sum(v) / len(v) for n, v in out.items()}


# ------------------------------------------------------------------------------------------ efficiency

def efficiency_rows(runs: list[Run]) -> tuple[list[dict], list[dict]]:
    rows, searches = [], []
    for run in runs:
        if run.task != "bench":
            continue
        s = run.data.get("summary") or {}
        task_cfg = run.config.get("task") or {}
        methods = {m.get("label"): m for m in (run.data.get("methods") or []) if isinstance(m, dict)}
        prov = run.data.get("provenance") or {}
        common = {"model": run.model.get("name", "?"), "random_weights": bool(run.model.get("random_weights")),
                  "device": run.device, "batch": task_cfg.get("batch_size"), "isolation": s.get("isolation", prov.get("isolation")),
                  "decode_tokens": task_cfg.get("decode_tokens"), "run": run.rel}
        by_method = s.get("by_method") or {}
        for label, by_length in by_method.items():
            m = methods.get(label, {})
            setting, _ = method_setting(m) if m else (label, None)
            for length, e in sorted(by_length.items(), key=lambda kv: int(kv[0])):
                d = e.get("decode_vs_full")
                rows.append({**common, "method": label, "setting": setting, "budget": m.get("budget"), "length": int(length),
                             "prefill_s": e.get("prefill_s"), "compress_s": e.get("compress_s"),
                             "decode_ms_per_token": e.get("decode_median_ms"), "decode_p90_ms": e.get("decode_p90_ms"),
                             "decode_speedup_vs_full": round(1 / d, 3) if d else None,
                             "kv_mb": round(e["kv_bytes"] / MB, 3) if e.get("kv_bytes") is not None else None,
                             "kv_full_over_this": e.get("kv_full_over_this"),
                             "peak_mb": round(e["peak_increase_bytes"] / MB, 3) if e.get("peak_increase_bytes") is not None else None,
                             "peak_vs_full": e.get("peak_vs_full"), "decode_cpu_ms_per_token": e.get("decode_cpu_median_ms"),
                             "decode_cpu_speedup_vs_full": round(1 / e["decode_cpu_vs_full"], 3) if e.get("decode_cpu_vs_full") else None,
                             "_method": m})
        search = run.data.get("search")
        if isinstance(search, dict):
            for label, r in (search.get("methods") or {}).items():
                m = methods.get(label, {})
                setting, _ = method_setting(m) if m else (label, None)
                searches.append({**common, "method": label, "setting": setting, "budget": m.get("budget"),
                                 "memory_cap_gb": search.get("memory_cap_gb"), "max_length": r.get("max_length"),
                                 "first_failure": r.get("first_failure"), "reached_upper": r.get("reached_upper"),
                                 "upper": search.get("upper"), "max_length_vs_full": r.get("vs_full"), "_method": m})
        if by_method or search:
            run.used_in.append("efficiency")
        else:
            run.note = "bench run without measurements"
    return rows, searches


EFF_FIELDS = ["model", "random_weights", "device", "batch", "isolation", "decode_tokens", "method", "setting", "budget", "length",
              "prefill_s", "compress_s", "decode_ms_per_token", "decode_p90_ms", "decode_speedup_vs_full", "kv_mb", "kv_full_over_this",
              "peak_mb", "peak_vs_full", "decode_cpu_ms_per_token", "decode_cpu_speedup_vs_full", "run"]
MAXLEN_FIELDS = ["model", "random_weights", "device", "batch", "method", "setting", "budget", "memory_cap_gb", "max_length",
                 "first_failure", "reached_upper", "upper", "max_length_vs_full", "run"]


def efficiency_table(rows: list[dict], searches: list[dict], runs: list[Run], out: Path) -> str:
    if not rows and not searches:
        return ""
    lines = ["## Efficiency (decode latency, KV cache, memory)", ""]
    if rows:
        headers = ["Model", "Weights", "Device", "Batch", "Method", "Prompt", "Prefill s", "Decode ms/tok", "Speed-up × full",
                   "KV MB", "KV full ÷ this", "Peak +MB", "Peak ÷ full", "Run"]
        body = [[r["model"], "random" if r["random_weights"] else "real", r["device"], r["batch"], r["method"], r["length"],
                 _fmt(r["prefill_s"], 3), _fmt(r["decode_ms_per_token"], 2), _ratio(r["decode_speedup_vs_full"]),
                 _fmt(r["kv_mb"], 1), _ratio(r["kv_full_over_this"]), _fmt(r["peak_mb"], 1),
                 _ratio(1 / r["peak_vs_full"] if r["peak_vs_full"] else None), f"`{r['run']}`"] for r in rows]
        lines += [markdown_table(headers, body, ["l"] * 5 + ["r"] * 8 + ["l"]), "",
                  "- Decode ms/tok: median over all timed decode steps; Speed-up × full: the full cache's decode latency at the "
                  "same prompt length ÷ this method's; KV MB: the cache after prefill; Peak +MB: memory above the loaded "
                  "model during one measurement; Peak ÷ full: the full cache's peak ÷ this method's.", ""]
    if searches:
        headers = ["Model", "Device", "Batch", "Method", "Memory cap GB", "Max prompt tokens", "× full", "First failure"]
        body = [[r["model"], r["device"], r["batch"], r["method"], _fmt(r["memory_cap_gb"], 0),
                 f"{r['max_length']}{' (search upper bound)' if r['reached_upper'] else ''}", _ratio(r["max_length_vs_full"]),
                 _fmt(r["first_failure"])] for r in searches]
        lines += ["### Maximum prompt length", "", markdown_table(headers, body, ["l"] * 4 + ["r"] * 4), ""]
    plot_dir = out / "efficiency"
    for run in runs:
        if "efficiency" not in run.used_in:
            continue
        for png in sorted(run.path.parent.glob("bench_*.png")):
            plot_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, plot_dir / f"{_safe(run.rel)}__{png.name}")
    if plot_dir.exists():
        lines.append(f"- Plots: `efficiency/` ({len(list(plot_dir.glob('*.png')))} files, one set per benchmark run).")
    return "\n".join(lines) + "\n"


def _ratio(v) -> str:
    return "–" if v is None else f"{v:.2f}x"


# ------------------------------------------------------------------------------------------ claims

def claims_rows(claims: list[dict], eff: list[dict], searches: list[dict], needle: list[dict]) -> list[dict]:
    """The paper's claims (results/paper/paper_claims.csv) next to our matching measurement, or 'not measured'."""
    out = []
    for c in claims:
        ours, where = None, ""
        cid = c.get("id")
        model = c.get("our_model")
        if cid == "decode_speedup_16k":
            hits = [r for r in eff if r["model"] == model and r["batch"] == 2 and r["length"] == 16384
                    and r["_method"].get("name") == "snapkv" and r["budget"] == 2048 and r["decode_speedup_vs_full"]]
            if hits:
                h = hits[-1]
                full_ms = h["decode_ms_per_token"] * h["decode_speedup_vs_full"]
                ours, where = (f"{h['decode_speedup_vs_full']:.2f}x (full {full_ms / 1000:.3f} s/tok, "
                               f"SnapKV {h['decode_ms_per_token'] / 1000:.3f} s/tok)"), h["run"]
        elif cid == "max_length_ratio":
            hits = [r for r in searches if r["model"] == model and r["batch"] == 2 and r["_method"].get("name") == "snapkv"
                    and r["budget"] == 2048 and r["memory_cap_gb"] == 80]
            if hits:
                h = hits[-1]
                full = next((s for s in searches if s["run"] == h["run"] and s["_method"].get("name") == "full"), None)
                ours = (f"{_ratio(h['max_length_vs_full'])} (full {full['max_length'] if full else '?'}, "
                        f"SnapKV {h['max_length']}{' = search upper bound' if h['reached_upper'] else ''} tokens)")
                where = h["run"]
        elif cid in ("needle_max_length", "needle_retrieval"):
            hits = [r for r in needle if r["model"] == model and r["protocol"] == "query_aware"
                    and all(r["_method"].get(k) == v for k, v in PAPER_NEEDLE.items())]
            if hits:
                h = hits[-1]
                ours = (f"longest prompt done {h['max_length_done']} tokens" if cid == "needle_max_length"
                        else f"all depths correct up to {h['longest_all_strict']}; mean {h['score_name']} {h['mean_score']}")
                where = h["run"]
        elif cid == "needle_full_oom":
            hits = [r for r in needle if r["model"] == model and r["setting"] == "All KV" and r["protocol"] == "query_aware"]
            if hits:
                h = hits[-1]
                ours = (f"first out-of-memory cell at {h['first_oom_length']} tokens" if h["first_oom_length"]
                        else f"no out-of-memory cell up to {h['max_length_done']} tokens")
                where = h["run"]
        out.append({**{k: c.get(k) for k in ("id", "claim", "model", "setting", "paper_full", "paper_snapkv", "paper_ratio", "unit", "hardware")},
                    "ours": ours or "not measured", "device": _device_of(where, eff, searches, needle), "run": where})
    return out


def _device_of(run: str, *tables) -> str | None:
    for table in tables:
        for r in table:
            if r.get("run") == run and run:
                return r.get("device")
    return None


CLAIM_FIELDS = ["id", "claim", "model", "setting", "paper_full", "paper_snapkv", "paper_ratio", "unit", "hardware", "ours", "device", "run"]


def claims_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    headers = ["Claim", "Setting", "Paper: full", "Paper: SnapKV", "Paper ratio", "Paper hardware", "Ours", "Our device"]
    body = [[r["claim"], r["setting"], r["paper_full"] or "–", r["paper_snapkv"] or "–", r["paper_ratio"] or "–",
             r["hardware"] or "–", r["ours"], r["device"] or "–"] for r in rows]
    return "\n".join(["## The paper's efficiency and needle claims", "", markdown_table(headers, body), "",
                      "- Paper values: results/paper/paper_claims.csv (SnapKV, arXiv 2404.14469). Ours: the matching run under the "
                      "collected folder (model, batch, budget, length as in the claim), else 'not measured'. Measurements on "
                      "other hardware than the paper's are not the paper's numbers: compare ratios, not seconds."]) + "\n"


# ------------------------------------------------------------------------------------------ paired deltas

def paired_table(rows: list[PairedRow], notes: list[str], n_resamples: int, seed: int) -> str:
    """Markdown: each compressed setting minus its full-cache run, per task, with the bootstrap interval."""
    if not rows:
        return ""
    order = {}
    for r in rows:  # runs grouped by model, protocol, setting; within a run the task order of pair_runs
        order.setdefault(r.setting, (_model_sort(r.model), _protocol_rank(r.protocol), _setting_sort(method_setting(r.method)[0]),
                                     r.setting))
    ranked = sorted(enumerate(rows), key=lambda ir: (order[ir[1].setting], ir[0]))
    headers = ["Model", "Setting", "Protocol", "Task", "Δ vs full", "95% CI", "n", "", "Run", "Full run"]
    body = []
    for _, r in ranked:
        digits = 3 if r.task == NEEDLE else 2
        task = {AVERAGE: f"Avg. ({r.tasks_averaged} task{'s' if r.tasks_averaged != 1 else ''})",
                NEEDLE: "needle mean"}.get(r.task, SHORT_NAMES.get(r.task, r.task))
        body.append([r.model, method_setting(r.method)[0], _protocol_label(r.protocol), task, f"{r.delta:+.{digits}f}",
                     f"[{r.ci_low:+.{digits}f}, {r.ci_high:+.{digits}f}]" if r.has_interval else f"n/a (n < {MIN_INTERVAL_ITEMS})",
                     r.n, "~ noise" if r.noise else "",
                     f"`{r.setting}`", f"`{r.full_run}`"])
    lines = ["## Paired differences to the full cache", "",
             markdown_table(headers, body, ["l"] * 4 + ["r"] * 3 + ["l"] * 3), "",
             "- Δ vs full: mean over the items both runs finished of (setting − full cache), same model, task, protocol and "
             "task settings; LongBench in points (official metric x 100), needle in score units. n: paired items.",
             f"- 95% CI: percentile interval of {n_resamples} paired bootstrap resamples (items with replacement, seed {seed}); "
             "Avg.: the mean of the task means, items resampled within each task. `~ noise`: the interval contains 0. "
             f"Fewer than {MIN_INTERVAL_ITEMS} paired items give no interval (n/a): their bootstrap has too few distinct "
             "resampled means to mean anything.",
             "- Also as paired_deltas.csv (`setting` = the run directory, `task` = a LongBench task, `average` or `needle`)."]
    lines += [f"- {n}." for n in dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ main

def build(folder: Path, out: Path, *, paper_table: Path = PAPER_TABLE, claims_file: Path = PAPER_CLAIMS,
          resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED, html: bool = False, kvpress: bool = False) -> dict:
    """Collect `folder`, write every table into `out`; returns what was written (for callers and tests)."""
    folder, out = Path(folder), Path(out)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    runs, bad = collect(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_DIRS:  # a rebuild starts clean: no table or picture of a run that is gone survives
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    for name in OUTPUT_FILES:
        if (out / name).is_file():
            (out / name).unlink()
    paper = load_paper_table(paper_table)
    sections: list[tuple[str, str]] = []
    written: dict[str, Any] = {"runs": len(runs)}

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
    written["longbench"] = lb_rows

    lbe_rows, lbe_md = longbench_e_table(runs)
    if lbe_rows:
        write_csv(out / "longbench_e.csv", lbe_rows, list(lbe_rows[0].keys()))
        (out / "longbench_e.md").write_text(lbe_md, encoding="utf-8")
        sections.append(("longbench_e.md", lbe_md))
    written["longbench_e"] = lbe_rows

    n_rows = needle_rows(runs)
    if n_rows:
        n_md = needle_table(n_rows, out)
        buckets = [k for k in n_rows[0] if k.startswith("bucket ")]
        fields = ["model", "setting", "protocol", "method_tag", "prompt_style", "chat_format", "score_name", "device", "grid", "cells", *buckets,
                  "mean_score", "strict_accuracy", "longest_all_strict", "max_length_done", "failed_cells", "first_failed_length",
                  "first_oom_length", "heatmap", "note", "run"]
        write_csv(out / "needle.csv", n_rows, fields)
        (out / "needle.md").write_text(n_md, encoding="utf-8")
        sections.append(("needle.md", n_md))
    written["needle"] = n_rows

    eff, searches = efficiency_rows(runs)
    if eff or searches:
        e_md = efficiency_table(eff, searches, runs, out)
        write_csv(out / "efficiency.csv", eff, EFF_FIELDS)
        if searches:
            write_csv(out / "max_length.csv", searches, MAXLEN_FIELDS)
        (out / "efficiency.md").write_text(e_md, encoding="utf-8")
        sections.append(("efficiency.md", e_md))
    written["efficiency"], written["max_length"] = eff, searches

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

    c_rows = claims_rows(load_claims(claims_file), eff, searches, n_rows)
    if c_rows:
        c_md = claims_table(c_rows)
        write_csv(out / "claims.csv", c_rows, CLAIM_FIELDS)
        (out / "claims.md").write_text(c_md, encoding="utf-8")
        sections.append(("claims.md", c_md))
    written["claims"] = c_rows
    from harness.report_figures import report_sections  # observation figures (2-5) and the lines ablation (8)

    sections += report_sections(runs, out)
    from harness.report_reuse import reuse_gap_section  # query-aware minus query-agnostic per (item, question)
    sections += reuse_gap_section(runs, out, n_resamples=resamples, seed=seed)
    from harness.report_ruler import ruler_sections  # RULER: tables per model and length, score vs compression ratio

    sections += ruler_sections(runs, out, resamples=resamples, seed=seed)

    from harness.report_versions import code_column, run_versions, versions_paragraph  # code versions behind the tables

    versions = {run.rel: run_versions(run) for run in runs}
    run_rows = []
    for run in runs:
        if not run.used_in and not run.note:
            run.note = f"task {run.task!r} has no table"
        run_rows.append({"run": run.rel, "task": run.task, "model": run.model.get("name"), "method": run.data.get("method_tag"),
                         "status": run.data.get("status") or (run.data.get("summary") or {}).get("status") or "complete",
                         "failures": run.data.get("failures"), "device": run.device, "tables": " ".join(run.used_in),
                         "code": code_column(versions[run.rel]), "note": run.note})
    run_rows += [{"run": rel, "note": why} for rel, why in bad]
    write_csv(out / "runs.csv", run_rows, ["run", "task", "model", "method", "status", "failures", "device", "tables", "code", "note"])
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
    if html or kvpress:  # the browsable page and the leaderboard export (harness/report_html.py)
        from harness.report_html import write_outputs

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
    parser.add_argument("--paper-table", type=Path, default=PAPER_TABLE, help=argparse.SUPPRESS)
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
