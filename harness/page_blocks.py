"""What a benchmark's part of report.html is made of (bottom layer: the benchmarks' report code and the
cross-task page both use it; it imports nothing of the report): the per-item store (`Items`: every setting's
response, score and kept-per-layer of one item, and the prompt around its needle or answers), and the block
builders the page's script draws (harness/report_assets/report.js):

- chart: score against budget or compression ratio; `series` (one per method line and protocol: points x, y
  and the 95% interval lo, hi), `hlines` (the full cache, per protocol), optional `variants` (another y, e.g.
  one RULER task) and `gpu` (a horizontal limit);
- table: sortable columns; a row may name its run (a click lists the run's items) and a column its items;
- heatmaps: per run, score and retention maps over (length, depth); a click on a cell opens its item;
- intervals: estimates with their interval around zero (the reuse gap).
"""

from __future__ import annotations

import hashlib
import json
import re

from harness.paired import MIN_INTERVAL_ITEMS, method_name, pair_key
from harness.stats import bootstrap_mean_ci, stratified_bootstrap_ci

CONTEXT_CHARS = 500     # characters of prompt shown on each side of a needle or answer
TAIL_CHARS = 400        # characters of the prompt's end (the question) shown
MAX_WINDOWS = 4         # windows around answers shown per item


# ------------------------------------------------------------------------------------------ items

def item_group(run) -> str:
    """Runs whose items are the same items (same task, model, task settings; any method or protocol) share
    this prefix of their item keys: the item view lists every setting of an item, both protocols."""
    key = json.loads(pair_key(run))
    key.pop("protocol", None)
    if isinstance(key.get("task_config"), dict):
        key["task_config"].pop("keep_answers", None)
    return hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]


def kept_by_layer(record: dict) -> dict[str, list]:
    """{span: [percent kept per layer, None for layers never compressed]} from a record's diagnostics."""
    out = {}
    for k, v in record.items():
        if k.endswith("_kept_by_layer") and isinstance(v, list):
            out[k[: -len("_kept_by_layer")]] = [None if x is None else round(100 * float(x)) for x in v]
    return out


def excerpt(prompt: str, targets: list[str]) -> list[dict]:
    """Windows of the prompt: around the first occurrence of each target (needle or reference answer), and the
    prompt's end (the question). Each window: {text, marks: [[start, end], ...] of the targets inside it}."""
    if not prompt:
        return []
    spans = []
    for t in targets:
        t = str(t).strip()
        if len(t) >= 2:
            i = prompt.find(t)
            if i >= 0:
                spans.append((i, i + len(t)))
    spans = sorted(set(spans))[:MAX_WINDOWS]
    windows: list[list[int]] = []
    for a, b in spans:
        lo, hi = max(0, a - CONTEXT_CHARS), min(len(prompt), b + CONTEXT_CHARS)
        if windows and lo <= windows[-1][1]:
            windows[-1][1] = max(windows[-1][1], hi)
        else:
            windows.append([lo, hi])
    tail = max(0, len(prompt) - TAIL_CHARS)
    if windows and tail <= windows[-1][1]:
        windows[-1][1] = len(prompt)
    else:
        windows.append([tail, len(prompt)])
    out = []
    for lo, hi in windows:
        marks = [[max(a, lo) - lo, min(b, hi) - lo] for a, b in spans if a < hi and b > lo]
        out.append({"start": lo, "end": hi, "of": len(prompt), "text": prompt[lo:hi], "marks": marks})
    return out


class Items:
    """The per-item view's data: {key: {title, context, question, reference, settings: [...]}}; each setting
    entry names its run (the page's run list) and holds the response, score and kept-per-layer."""

    def __init__(self):
        self.items: dict[str, dict] = {}

    def add(self, key: str, title: str, run_id: int, record: dict, *, response: str, score, reference,
            targets: list[str] = (), extra: dict | None = None) -> str:
        item = self.items.setdefault(key, {"title": title, "reference": reference, "context": [], "settings": []})
        if not item["context"] and isinstance(record.get("prompt"), str):
            item["context"] = excerpt(record["prompt"], list(targets))
        entry = {"run": run_id, "response": response, "score": score, "kept": kept_by_layer(record)}
        if extra:
            entry.update(extra)
        item["settings"].append(entry)
        return key


# ------------------------------------------------------------------------------------------ blocks

def interval(values: list[float], resamples: int, seed: int) -> tuple[float | None, float | None]:
    if len(values) < MIN_INTERVAL_ITEMS:
        return None, None
    ci = bootstrap_mean_ci(values, n_resamples=resamples, seed=seed)
    return ci.low, ci.high


def strata_interval(groups: list[list[float]], resamples: int, seed: int) -> tuple[float | None, float | None]:
    if not groups or any(len(g) < MIN_INTERVAL_ITEMS for g in groups):
        return None, None
    ci = stratified_bootstrap_ci(groups, n_resamples=resamples, seed=seed)
    return ci.low, ci.high


def rounded(v, digits: int = 4):
    return None if v is None else round(float(v), digits)


def setting_label(run) -> str:
    from harness.report import method_setting

    return method_setting(run.data.get("method") or {})[0]


def method_line(run) -> str:
    """The method's line in a chart: its tag without the budget or ratio part (snapkv_c512_w32_... -> snapkv_w32_...):
    one line per method and options."""
    return re.sub(r"_(?:r[0-9.]+|c[0-9]+)(?=_|$)", "", str(run.data.get("method_tag") or method_name(run)))


def budget_of(run):
    b = (run.data.get("method") or {}).get("budget")
    return b if isinstance(b, (int, float)) and not isinstance(b, bool) else None


def model_of(run) -> str:
    return str(run.model.get("name", "?"))


def paired_table(title: str, rows, run_ids: dict, digits: int) -> dict:
    """The paired difference to full (harness.paired rows) as a sortable table; a row click lists its run's items."""
    from harness.report import SHORT_NAMES, _protocol_label, method_setting

    body = []
    for r in rows:
        task = {"average": f"Avg. ({r.tasks_averaged} tasks)", "needle": "needle mean"}.get(r.task, SHORT_NAMES.get(r.task, r.task))
        body.append({"run": run_ids[r.setting], "cells": [r.model, method_setting(r.method)[0], _protocol_label(r.protocol), task,
                                                          rounded(r.delta, digits), rounded(r.ci_low, digits), rounded(r.ci_high, digits), r.n,
                                                          "~ noise" if r.noise else ("" if r.has_interval else f"n < {MIN_INTERVAL_ITEMS}")]})
    return {"kind": "table", "id": "paired", "title": title, "rows": body,
            "columns": [{"name": n, "num": n in ("Δ vs full", "CI low", "CI high", "n")} for n in
                        ("Model", "Setting", "Protocol", "Task", "Δ vs full", "CI low", "CI high", "n", "")]}


def chart(title: str, xlabel: str, ylabel: str, points: list[dict], *, logx: bool = False, xmin=None, variants=None) -> dict:
    """points: {line, protocol, x, y, lo, hi, run, full}: full points become horizontal lines (budgets) or x=0."""
    series: dict[tuple, dict] = {}
    hlines = []
    for p in points:
        if p["full"]:
            hlines.append({"line": "full", "protocol": p["protocol"], "y": p["y"], "lo": p["lo"], "hi": p["hi"], "run": p["run"]})
            continue
        if p["x"] is None or p["y"] is None:
            continue
        s = series.setdefault((p["line"], p["protocol"]), {"line": p["line"], "protocol": p["protocol"], "points": []})
        s["points"].append({k: p[k] for k in ("x", "y", "lo", "hi", "run")})
    for s in series.values():
        s["points"].sort(key=lambda q: q["x"])
    return {"kind": "chart", "title": title, "xlabel": xlabel, "ylabel": ylabel, "logx": logx, "xmin": xmin,
            "series": sorted(series.values(), key=lambda s: (s["line"], s["protocol"])), "hlines": hlines,
            "variants": variants or None}
