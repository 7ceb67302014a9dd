"""The run recipe, top to bottom: validate, load, prepare the run directory, run the task, write results.

User errors (HarnessError) become one line on stderr and exit status 2, before any result file is
written; a run whose items partly failed exits with status 3 after writing everything it has.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from harness.errors import HarnessError
from harness.rundir import RunDir, provenance
from harness.tasks import get_task

log = logging.getLogger("harness")
EXIT_USER_ERROR = 2
EXIT_ITEM_FAILURES = 3


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_dir_path() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def execute(cfg: DictConfig, run_path: Path) -> dict:
    """Run one configured experiment into `run_path`; returns the results dict (also written to disk)."""
    task = get_task(cfg.task.name)
    task.validate(cfg.task)
    seed_everything(int(cfg.seed))
    if hasattr(task, "prepare_and_run"):  # tasks that manage their own models (bench)
        return task.prepare_and_run(cfg, RunDir(run_path))

    from harness.tasks.common import load_model_and_method

    loaded, method = load_model_and_method(cfg)
    run_dir = RunDir(run_path)
    run_dir.prepare(cfg, resume=bool(cfg.resume))
    prov = provenance(int(cfg.seed), str(loaded.device))
    started = time.time()
    out = task.run(cfg, loaded, method, run_dir, progress=bool(cfg.progress))
    num_layers = len(__import__("harness.methods.engine", fromlist=["x"]).attention_modules(loaded.model))
    results = {
        "schema": 1,
        "task": cfg.task.name,
        "model": {"name": loaded.name, **loaded.info, "chat_format": loaded.chat_format, "eos_token_ids": loaded.eos_token_ids},
        "method": method.describe(num_layers),
        "method_tag": cfg.method.tag,
        "summary": out["summary"],
        "failures": len(out.get("failures") or []),
        "rows": out.get("rows", []),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "provenance": {**prov, "wall_seconds": round(time.time() - started, 2)},
    }
    run_dir.write_results(results)
    return results


def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    path = run_dir_path()
    try:
        results = execute(cfg, path)
    except HarnessError as exc:
        _remove_if_empty(path)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    log.info("results: %s", path / "results.json")
    log.info("summary: %s", _short(results["summary"]))
    if results.get("failures"):
        log.error("%d item(s) failed; see %s", results["failures"], path / "failures.json")
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            sys.exit(EXIT_ITEM_FAILURES)


def _short(summary: dict) -> str:
    keep = {k: v for k, v in summary.items() if not isinstance(v, (dict, list))}
    return ", ".join(f"{k}={v}" for k, v in keep.items())


def _remove_if_empty(path: Path) -> None:
    try:
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    except OSError:
        pass
