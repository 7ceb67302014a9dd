"""The run recipe, top to bottom: validate, load, prepare the run directory, run the task, write results.

Everything that can be checked without the model is checked first (task options and data, method
options against the model's config, the run directory: writable, no conflicting earlier run), so a
bad input fails in seconds. User errors (HarnessError) become one line `error: ...` on stderr and exit
status 2, and leave no result file behind (a run directory this run created is removed again).
A run whose items partly failed writes everything it has, records the failures in failures.json and
results.json, and exits with status 3.

Under `--multirun` (any launcher) a job never ends its process: its user error or failed items are
raised as a `JobFailed`, which Hydra reports as `Error executing job with overrides: [...]` followed
by the `error: ...` line, after every job of the sweep has run; the sweep then exits with status 1.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path

from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness.errors import HarnessError
from harness.rundir import RunDir, check_writable
from harness.tasks import get_task

log = logging.getLogger("harness")
EXIT_USER_ERROR = 2
EXIT_ITEM_FAILURES = 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


class JobFailed(CompactHydraException):
    """A multirun job's user error or failed items: Hydra prints the message alone (no traceback)."""


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_dir_path() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def execute(cfg: DictConfig, run_path: Path) -> dict:
    """Run one configured experiment into `run_path`; returns the results dict (also written to disk).

    On a HarnessError nothing this run wrote is left behind unless an item had finished (that work
    is kept for the next run); the error propagates."""
    run_dir = RunDir(run_path)
    try:
        return _execute(cfg, run_dir)
    except HarnessError:
        run_dir.rollback()
        raise


def _execute(cfg: DictConfig, run_dir: RunDir) -> dict:
    task = get_task(cfg.task.name)
    task.validate(cfg.task)
    resume = bool(cfg.resume)
    if hasattr(task, "prepare_and_run"):  # tasks that manage their own models (bench)
        seed_everything(int(cfg.seed))
        return task.prepare_and_run(cfg, run_dir)

    from harness.tasks.common import check_method, load_model_and_method

    run_dir.check(cfg, resume=resume)  # before the model: unwritable folder, conflicting earlier run
    check_method(cfg)  # before the model: bad budgets, windows, kernels
    seed_everything(int(cfg.seed))
    loaded, method = load_model_and_method(cfg)
    run_dir.prepare(cfg, resume=resume, device=str(loaded.device))  # config.yaml, provenance.json
    started = time.time()
    out = task.run(cfg, loaded, method, run_dir, progress=bool(cfg.progress))
    from harness.methods.engine import attention_modules

    num_layers = len(attention_modules(loaded.model))
    failures = out.get("failures") or []
    results = {
        "schema": 1,
        "task": cfg.task.name,
        "status": "items_failed" if failures else out["summary"].get("status", "complete"),
        "model": {"name": loaded.name, **loaded.info, "chat_format": loaded.chat_format, "eos_token_ids": loaded.eos_token_ids},
        "method": method.describe(num_layers),
        "method_tag": cfg.method.tag,
        "summary": out["summary"],
        "failures": len(failures),
        "failed_items": [{k: v for k, v in f.items() if k != "traceback"} for f in failures],
        "rows": out.get("rows", []),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "provenance": {**run_dir.provenance, "wall_seconds": round(time.time() - started, 2)},
    }
    run_dir.write_results(results)
    return results


def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    path = run_dir_path()
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        results = execute(cfg, path)
    except HarnessError as exc:
        if multirun:
            log.error("error: %s", exc)
            raise JobFailed(f"error: {exc}") from None
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        if multirun:
            raise
        print(f"interrupted: finished items are kept in {path}; rerun the same command to resume", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    log.info("results: %s", path / "results.json")
    log.info("summary: %s", _short(results["summary"]))
    failed = int(results.get("failures") or 0)
    if failed:
        records = ", ".join(str(p) for p in sorted(path.glob("failures*.json"))) or str(path / "failures.json")
        message = (f"error: {failed} item(s) failed (recorded in {records} and results.json); "
                   "rerun the same command to retry exactly those items")
        if multirun:
            log.error("%s", message)
            raise JobFailed(message)
        print(message, file=sys.stderr)
        sys.exit(EXIT_ITEM_FAILURES)


class OutputCheck(Callback):
    """Hydra callback (conf/config.yaml, hydra.callbacks): refuse an unwritable output folder with one
    line and exit status 2, before Hydra itself tries to create it (which fails with a traceback)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, "hydra.sweep.dir")

    def _check(self, config: DictConfig, key: str) -> None:
        try:
            folder = Path(str(OmegaConf.select(config, key)))
        except Exception:  # noqa: BLE001  (an interpolation error: Hydra reports it itself)
            return
        try:
            check_writable(folder)  # creates it, as Hydra would next; a run that fails validation removes it
        except HarnessError as exc:
            print(f"error: {str(exc).replace('hydra.run.dir', key)}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)


def _short(summary: dict) -> str:
    keep = {k: v for k, v in summary.items() if not isinstance(v, (dict, list))}
    return ", ".join(f"{k}={v}" for k, v in keep.items())
