"""Paired differences between each compressed setting and the full cache run on the same items.

Used by `python -m harness.report` (paired_deltas.md|csv). A compressed run is paired with a `full` run
when both ran the same items under the same rules: same task, same protocol (query-aware or
query-agnostic, never merged), the same model config and the same task config (grid, lengths, depths,
datasets, prompt style, limit, chat and decoding rules...), ignoring only keys that never change an
item's score (IGNORED_TASK_KEYS, IGNORED_MODEL_KEYS). Items are matched by identity: needle cells by
(length, depth), LongBench items by (task, index, _id); only items present in both runs are paired.

Per-item scores:
- needle: the `score` of each cell in results.json `rows`;
- LongBench / LongBench-E: the per-item `score` of each prediction record in `pred/<task>[.shard<k>of<n>].jsonl`
  (the official metric of that item, in [0, 1]) when present, else recomputed from `pred` / `answers` /
  `all_classes` with the official metric (metrics.longbench, the run's code_sim backend) exactly as the
  task's scoring does. Either way they must reproduce the task score recorded in results.json
  (round(100 * mean, 2)); a task whose items do not is left out, with a note. Reported x 100, as the tables.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, Interval, bootstrap_mean_ci, stratified_bootstrap_ci
from metrics.longbench_tasks import LONGBENCH_ALL_TASKS

LONGBENCH_TASKS = ("longbench", "longbench_e")
PAIRED_TASKS = (*LONGBENCH_TASKS, "needle")
# Task config keys that never change what an item scores: bookkeeping (as harness/rundir.py NON_RESULT_KEYS),
# the needle memory cap (it decides which cells run out of memory, not what a finished cell scores) and
# query_aware, which is compared as the protocol (absent = true).
IGNORED_TASK_KEYS = ("shard", "log_prompts", "data_dir", "memory_cap_gb", "query_aware",
                     "prompt_style_by_chat_format",  # needle: how the default prompt_style is chosen (it is compared)
                     "batch_size")  # needle cells batched together: the same answers
IGNORED_MODEL_KEYS = ("device_map",)
AVERAGE = "average"  # the `task` of the LongBench average row
NEEDLE = "needle"    # the `task` of the needle mean row
SCORE_TOLERANCE = 0.011  # per-item scores must give the recorded task score (2 decimals) within this
# Fewest paired items for which an interval is reported: with n items the bootstrap's resampled means take at
# most C(2n-1, n) values (n = 1: one, the estimate itself; n = 4: 35), too coarse for a 95% percentile interval.
# Below it the row shows the mean difference and n, and no interval (CSV: empty ci_low, ci_high).
MIN_INTERVAL_ITEMS = 5


# ------------------------------------------------------------------------------------------ pairing key

def method_name(run) -> str | None:
    method = run.data.get("method")
    return str(method.get("name")) if isinstance(method, dict) and method.get("name") is not None else None


def pair_key(run) -> str:
    """Runs with equal keys ran the same items under the same rules (the method aside)."""
    cfg = run.config if isinstance(run.config, dict) else {}
    task_cfg = cfg.get("task") if isinstance(cfg.get("task"), dict) else {}
    model_cfg = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    model = run.model if isinstance(run.model, dict) else {}
    key = {
        "task": run.task,
        "protocol": run.protocol,
        "model_name": model.get("name"),
        "random_weights": bool(model.get("random_weights") or model_cfg.get("random_weights")),
        # an option absent from an older run's config and null in a newer one mean the same (a new option's default)
        "model": {k: v for k, v in model_cfg.items() if k not in IGNORED_MODEL_KEYS and v is not None},
        "task_config": {k: v for k, v in task_cfg.items() if k not in IGNORED_TASK_KEYS and v is not None},
        "seed": cfg.get("seed"),
    }
    return json.dumps(key, sort_keys=True, default=str)


# ------------------------------------------------------------------------------------------ per-item scores

def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def needle_items(run) -> dict[tuple[int, float, int], float]:
    """{(length, depth, question): score} of the run's finished cells, one per question of a cell with
    several needles (question 0 for one-needle records); the first record of a (cell, question) wins."""
    out: dict[tuple[int, float, int], float] = {}
    for r in run.data.get("rows") or []:
        if isinstance(r, dict) and "length" in r and "depth" in r and _number(r.get("score")):
            try:
                out.setdefault((int(r["length"]), float(r["depth"]), int(r.get("question_index") or 0)), float(r["score"]))
            except (TypeError, ValueError):
                continue
    return out


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


# ------------------------------------------------------------------------------------------ pairing

@dataclass
class PairedRow:
    setting: str        # the compressed run's directory, relative to the collected folder
    task: str           # a LongBench task, AVERAGE, or NEEDLE
    delta: float        # mean of (setting - full) over the paired items
    ci_low: float | None   # None: fewer than MIN_INTERVAL_ITEMS paired items, no interval
    ci_high: float | None
    n: int
    benchmark: str      # the run's task: longbench, longbench_e, needle
    model: str = ""
    method: dict = field(default_factory=dict)
    method_tag: str = ""
    protocol: str = ""
    full_run: str = ""
    tasks_averaged: int = 0

    @property
    def has_interval(self) -> bool:
        return self.ci_low is not None and self.ci_high is not None

    @property
    def noise(self) -> bool:
        return self.has_interval and self.ci_low <= 0.0 <= self.ci_high

    def csv_row(self) -> dict:
        def rounded(v):
            return "" if v is None else round(v, 6)

        return {"setting": self.setting, "task": self.task, "delta": round(self.delta, 6), "ci_low": rounded(self.ci_low),
                "ci_high": rounded(self.ci_high), "n": self.n}


CSV_FIELDS = ["setting", "task", "delta", "ci_low", "ci_high", "n"]


def _task_order(name: str) -> tuple:
    return (LONGBENCH_ALL_TASKS.index(name), name) if name in LONGBENCH_ALL_TASKS else (len(LONGBENCH_ALL_TASKS), name)


def _common(a: dict, b: dict) -> list:
    return sorted(k for k in a if k in b)


def pair_runs(runs: list, *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> tuple[list[PairedRow], list[str]]:
    """Paired rows for every compressed run with a full run on the same items; and notes (unpaired runs, items
    left out). Runs: harness.report.Run (rel, path, data, task, model, config, protocol)."""
    groups: dict[str, list] = {}
    for run in runs:
        if run.task not in PAIRED_TASKS or method_name(run) is None:
            continue
        groups.setdefault(pair_key(run), []).append(run)
    items_cache: dict[str, tuple[Any, list[str]]] = {}

    def items(run):
        if run.rel not in items_cache:
            items_cache[run.rel] = longbench_items(run) if run.task in LONGBENCH_TASKS else (needle_items(run), [])
        return items_cache[run.rel]

    rows: list[PairedRow] = []
    notes: list[str] = []
    for key in sorted(groups, key=lambda k: min(r.rel for r in groups[k])):
        group = sorted(groups[key], key=lambda r: r.rel)
        fulls = [r for r in group if method_name(r) == "full"]
        others = [r for r in group if method_name(r) != "full"]
        if not others:
            continue
        if not fulls:
            notes.extend(f"`{r.rel}`: no full-cache run of the same model, task, protocol and task settings" for r in others)
            continue
        for run in others:
            mine, my_notes = items(run)
            if not mine:  # not scored, or no finished cell: said in its own table and runs.csv
                continue
            parent = Path(run.rel).parent
            # a sibling first (the settings of one methods run), then in path order; one with scores
            ranked = sorted(fulls, key=lambda f: (Path(f.rel).parent != parent, f.rel))
            full = next((f for f in ranked if items(f)[0]), None)
            if full is None:
                names = ", ".join(f"`{f.rel}`" for f in fulls)
                notes.append(f"`{run.rel}`: no scores in its full-cache run{'s' if len(fulls) > 1 else ''} ({names})")
                continue
            if len(fulls) > 1:
                notes.append(f"`{run.rel}`: {len(fulls)} full-cache runs match; paired with `{full.rel}`")
            common = dict(setting=run.rel, benchmark=run.task, model=str(run.model.get("name", "?")), method=run.data.get("method") or {},
                          method_tag=str(run.data.get("method_tag") or ""), protocol=run.protocol, full_run=full.rel)
            theirs, their_notes = items(full)
            notes.extend(f"`{run.rel}`: {n}" for n in my_notes)
            notes.extend(f"`{full.rel}` (full): {n}" for n in their_notes)
            if run.task == "needle":
                keys = _common(mine, theirs)
                if not keys:
                    notes.append(f"`{run.rel}`: no needle cell in common with `{full.rel}`")
                    continue
                ci = bootstrap_mean_ci([mine[k] - theirs[k] for k in keys], n_resamples=n_resamples, seed=seed)
                rows.append(_row(ci, NEEDLE, **common))
                continue
            per_task = []
            for name in sorted(set(mine) & set(theirs), key=_task_order):
                keys = _common(mine[name], theirs[name])
                if not keys:
                    notes.append(f"`{run.rel}`: {name}: no item in common with `{full.rel}`")
                    continue
                diffs = [mine[name][k] - theirs[name][k] for k in keys]
                per_task.append(diffs)
                rows.append(_row(bootstrap_mean_ci(diffs, n_resamples=n_resamples, seed=seed), name, **common))
            if per_task:
                ci = stratified_bootstrap_ci(per_task, n_resamples=n_resamples, seed=seed)
                rows.append(_row(ci, AVERAGE, tasks_averaged=len(per_task), **common))
    return rows, notes


def _row(ci: Interval, task: str, **kw) -> PairedRow:
    enough = ci.n >= MIN_INTERVAL_ITEMS
    return PairedRow(task=task, delta=ci.estimate, ci_low=ci.low if enough else None, ci_high=ci.high if enough else None,
                     n=ci.n, **kw)
