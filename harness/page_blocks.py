"""What a benchmark's part of report.html is made of (each benchmark's report.py `html_section(runs, page)` and
the cross-task page, harness/report/html.py, both use it; it imports nothing of the report): the page's state
(`Page`: run ids, the per-item store, leaderboard rows, bootstrap options), the per-item store (`Items`: every
setting's response, score and kept-per-layer of one item, and the prompt around its needle or answers), kvpress's
compression ratio of a run, and the block builders the page's script draws (harness/report/assets/report.js):

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
from dataclasses import dataclass, field

from harness.results import method_name, pair_key
from harness.stats import MIN_INTERVAL_ITEMS, bootstrap_mean_ci, stratified_bootstrap_ci
from harness.tables import method_setting

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


@dataclass
class Page:
    """What the benchmarks' html sections fill: `run_ids` (run directory -> its index in the page's run list), the
    items, the leaderboard rows (`board`: one per benchmark and run: dataset, data_dir, model, run, compression_ratio,
    score, ci_low, ci_high, n), and the bootstrap options of every interval."""

    run_ids: dict
    resamples: int
    seed: int
    items: Items = field(default_factory=Items)
    board: list = field(default_factory=list)


def removed_fraction(run, records: list[dict] | None = None) -> float | None:
    """kvpress's compression ratio: the fraction of the compressed part's KV entries removed (0 for full),
    from each item's resolved budget and its compressed length (the whole prompt query-aware, the
    context query-agnostic): the item records given (LongBench keeps them in pred/), else results.json's rows. A method with one budget over every layer and head (KVzip) records no
    per-head budget; its `ratio` is by construction the fraction of all the compressed part's entries
    kept, so 1 - ratio. None when neither says."""
    if method_name(run) == "full":
        return 0.0
    shares = []
    for r in (run.data.get("rows") or []) if records is None else records:
        budget = r.get("budget_tokens")
        end = r.get("prompt_tokens") if run.protocol == "query_aware" else r.get("question_start")
        if isinstance(budget, (int, float)) and end:
            shares.append(min(1.0, budget / end))
    if shares:
        return round(1 - sum(shares) / len(shares), 4)
    from harness.methods import METHODS

    method = run.data.get("method") or {}
    one_budget = getattr(METHODS.get(method.get("name")), "GLOBAL_BUDGET", False)
    if one_budget and isinstance(method.get("ratio"), (int, float)):
        return round(1 - float(method["ratio"]), 4)
    return None


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
