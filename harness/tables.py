"""Table helpers shared by every report section: cells, Markdown tables, CSV files, setting labels.

The bottom of the report layer: the benchmarks' report sections (harness/tasks/<name>/report.py) and the
cross-task report (harness/report/) both import it; it imports nothing from harness, so nothing imports back up.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# Our model names -> the paper's (SnapKV Table 1). Also matched: the basename of the model's hub path.
PAPER_MODELS = {
    "lwm-text-chat-1m": "LWM-Text-Chat-1M",
    "longchat-7b-32k": "LongChat-7b-v1.5-32k",
    "mistral-7b-instruct-v0.2": "Mistral-7B-Instruct-v0.2",
    "mixtral-8x7b-instruct": "Mixtral-8x7B-Instruct-v0.1",
}
# SnapKV's LongBench preset (Table 1): anything else is another setting, never matched to the paper.
PAPER_SNAPKV = {"window_size": 32, "kernel_size": 7, "pooling": "maxpool", "gqa": "expand"}
METHOD_NAMES = {"full": "All KV", "snapkv": "SnapKV", "h2o": "H2O", "pyramidkv": "PyramidKV", "streamingllm": "StreamingLLM"}
SETTING_ORDER = ("All KV", "SnapKV", "PyramidKV", "H2O", "StreamingLLM")


# ------------------------------------------------------------------------------------------ formatting

def _fmt(v, digits: int = 2, none: str = "–") -> str:
    """A table cell: `none` for a missing value, yes/no, a float to `digits` decimals, a range of values joined by –."""
    if v is None or v == "":
        return none
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return none
        return f"{v:.{digits}f}"
    if isinstance(v, (list, tuple)):
        return "–".join(_fmt(x, digits) for x in v)
    return str(v)


def markdown_table(headers: list[str], rows: list[list[Any]], align: list[str] | None = None) -> str:
    align = align or ["l"] * len(headers)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(sep) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |")
    return "\n".join(out)


def write_csv(path: Path, rows: list[dict], fields, lineterminator: str = "\n") -> None:
    """`fields` of every row (missing and None: empty); the report's tables end lines with \n, the run directories'
    per-item tables with csv's default \r\n (lineterminator)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator=lineterminator)
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fields})
    path.write_text(buf.getvalue(), encoding="utf-8")


def _safe(text: str) -> str:
    """A file name from any label."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(text))


def _mean(values) -> float | None:
    """Mean of the values that are not None, 4 decimals; None when there is none."""
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def clean(out: Path, files=(), folders=()) -> None:
    """Remove a section's own files and folders from a table set before it is written again."""
    for name in files:
        if (out / name).is_file():
            (out / name).unlink()
    for name in folders:
        if (out / name).is_dir():
            shutil.rmtree(out / name)


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
    decode = method.get("decode")
    if isinstance(decode, dict):  # decode-time eviction (harness/methods/decode_time.py): never a paper setting
        target = decode.get("budget") if decode.get("budget") is not None else f"ratio {decode.get('ratio')}"
        rerotated = ", rerotated" if decode.get("rerotate") else ""
        return f"{label} + decode every {decode.get('interval')} to {target}{rerotated}", None
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


def row_key(row: dict, fields: tuple[str, ...]) -> tuple:
    return tuple(json.dumps(row.get(f), sort_keys=True, default=str) for f in fields)


def flag_duplicates(rows: list[dict], fields: tuple[str, ...]) -> None:
    seen: dict[tuple, int] = {}
    for r in rows:
        seen[row_key(r, fields)] = seen.get(row_key(r, fields), 0) + 1
    for r in rows:
        if seen[row_key(r, fields)] > 1:
            r["note"] = (r["note"] + "; " if r.get("note") else "") + "same key as another run (see `run`)"


def _protocol_label(protocol: str) -> str:
    return {"query_aware": "query-aware", "query_agnostic": "query-agnostic"}.get(protocol, str(protocol))


def _delta(v) -> str:
    return "–" if v is None else f"{v:+.2f}"


def _ratio(v) -> str:
    return "–" if v is None else f"{v:.2f}x"


# ------------------------------------------------------------------------------------------ a benchmark's section

@dataclass(frozen=True)
class ReportOptions:
    """What `python -m harness.report` passes every benchmark's `tables(runs, out, options)`."""

    resamples: int
    seed: int
    paper_table: Path | None = None  # the paper's LongBench table (None: the committed one)


@dataclass
class Tables:
    """What a benchmark's report section wrote: [(file name, Markdown)] for README.md, its rows for build's caller,
    and `claim(paper claim) -> (ours, run) | None` when its runs measure some of the paper's claims."""

    sections: list[tuple[str, str]] = field(default_factory=list)
    written: dict = field(default_factory=dict)
    claim: Callable[[dict], tuple[str, str] | None] | None = None
