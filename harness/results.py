"""Run records read back: what `python -m harness.report` and each benchmark's report section know of a run.

A `Run` is one results.json found under a collected folder (`collect`); `run_protocol` says which protocol it
ran under; `pair_key` says which runs ran the same items under the same rules (the method aside), so their
per-item scores can be paired (`Pairing`: how a benchmark hands its per-item scores to the paired reports).
Bottom layer: imports nothing from harness (no torch, no model).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


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
    def dtype(self) -> str:
        """The dtype the model computed in (`model.dtype: auto` resolved; older records: their config's)."""
        model_cfg = self.config.get("model") if isinstance(self.config.get("model"), dict) else {}
        return str(self.model.get("dtype") or model_cfg.get("dtype") or "?")

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


def protocol_rank(protocol: str) -> int:
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


# Task config keys that never change what an item scores: bookkeeping (as harness/rundir.py NON_RESULT_KEYS),
# the needle memory cap (it decides which cells run out of memory, not what a finished cell scores) and
# query_aware, which is compared as the protocol (absent = true).
IGNORED_TASK_KEYS = ("shard", "log_prompts", "data_dir", "memory_cap_gb", "query_aware",
                     "prompt_style_by_chat_format",  # needle: how the default prompt_style is chosen (it is compared)
                     "batch_size")  # needle cells batched together: the same answers
IGNORED_MODEL_KEYS = ("device_map", "dtype_from")  # dtype_from: `auto` asked for the dtype beside it (that one compares)


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


@dataclass(frozen=True)
class Pairing:
    """How a benchmark's runs give per-item scores to the paired reports (paired deltas against the full cache, the
    reuse gap between the protocols). A benchmark's report module declares one as `PAIRING`; its runs are paired."""

    items: Callable  # run -> ({stratum: {item key: score}}, notes): a stratum is one scored set (a LongBench task)
    order: Callable = str  # sort key of the strata
    average: bool = True  # paired deltas add the mean over strata (stratified bootstrap); False: one stratum alone
    digits: int = 2  # decimals in the tables
    label: Callable = str  # a stratum's name in the paired-deltas table
    unmatched: str = "{stratum}: no item in common"  # the note when a stratum shares no item with the full run


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def finished(runs, task: str) -> list:
    """The runs of `task` that ended (every item done, or some failed): their summaries are final."""
    def ended(run) -> bool:
        s = run.data.get("summary") or {}
        return (s.get("status") or run.data.get("status") or "complete") in ("complete", "items_failed")

    return [run for run in runs if run.task == task and ended(run)]
