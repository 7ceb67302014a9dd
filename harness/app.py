"""The run recipe, top to bottom: validate, load, prepare the run directories, run the task, write results.

A run has a run directory (`hydra.run.dir`, default `outputs/<task>/<model>`; under `-m` the job's
sweep directory) and one or more method settings: `method=<name>` (one), or `methods=[...]` (several,
the model loaded once; each entry a conf/method name or a mapping `{name: <config>, <option>: <value>}`).
Each setting is written to `<run dir>/<its tag>`, exactly as a separate `method=<entry>` run writes it
(its config is composed the same way, `compose_settings`), so the two ways of running share run
directories and resume each other. `methods.json` in the run directory indexes the settings found
there; `comparison.md` compares those run on the same items and options as the latest run (with cell
counts) and lists the others with what differs. A task module may declare `GRID_KEYS` (its options
that only choose which items run: another grid reuses a run directory's items, harness/rundir.py) and
`PROTOCOL_OPTIONS` (which of `query_aware`, `prefill_chunk_size` it applies; the others are refused).
Tasks that compare methods themselves (`task=bench`: `task.methods`) write into
the run directory itself.

Everything that can be checked without the model is checked first (task options and data, method
options against the model's config, every setting's directory: writable, no conflicting earlier run,
no records of other code), so a bad input fails in seconds. Then every setting's directory is locked
(`RunDir.lock`: two processes never write one run directory at once; the second waits, then resumes).
User errors (HarnessError) become one line `error: ...` on stderr and exit status 2, and leave no
result file behind (a run directory this run created is removed again). A run whose items partly
failed writes everything it has, records the failures in failures.json and results.json, and exits
with status 3.

Under `--multirun` (any launcher) a job never ends its process: its user error or failed items are
raised as a `JobFailed`, which Hydra reports as `Error executing job with overrides: [...]` followed
by the `error: ...` line, after every job of the sweep has run; the sweep then exits with status 1.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness.errors import HarnessError, require
from harness.rundir import RunDir, RunLock, check_writable, remove_if_empty, resume_mode, write_json, write_text
from harness.seeding import seed_everything
from harness.settings import check_method, compose_settings, method_entries  # also registers the kv.* resolvers
from harness.tasks import get_task

log = logging.getLogger("harness")
EXIT_USER_ERROR = 2
EXIT_ITEM_FAILURES = 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
INDEX_FILE = "methods.json"
COMPARISON_FILE = "comparison.md"


class JobFailed(CompactHydraException):
    """A multirun job's user error or failed items: Hydra prints the message alone (no traceback)."""


def run_dir_path() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def writes_run_dir_itself(task) -> bool:
    """Tasks that compare their own methods (bench: task.methods) write into the run directory itself."""
    return hasattr(task, "prepare_and_run")


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def execute(cfg: DictConfig, run_path: Path, overrides: list[str] | None = None, config_name: str = "config") -> dict:
    """Run one configured experiment into the run directory `run_path`; returns the results dict of its
    setting (also written to `<run_path>/<tag>/results.json`) or, with `methods`, a dict with every
    setting's results under "settings". `overrides`: the command line's task overrides (what a
    separate run of each `methods` entry is composed from).

    On a HarnessError nothing this run wrote is left behind unless an item had finished (that work
    is kept for the next run); the error propagates."""
    run_path = Path(run_path)
    dirs: list[RunDir] = []
    try:
        return _execute(cfg, run_path, overrides, config_name, dirs)
    except HarnessError:
        for run_dir in dirs:
            run_dir.rollback()
        remove_if_empty(run_path)
        raise
    finally:
        for run_dir in dirs:
            run_dir.unlock()


def check_protocol(task, cfg: DictConfig) -> None:
    """Refuse, in one line, a protocol option the task does not apply (a task module lists those it
    applies in PROTOCOL_OPTIONS): `model.prefill_chunk_size` and `task.query_aware=false` are never
    silently ignored."""
    applied = getattr(task, "PROTOCOL_OPTIONS", ())
    name = cfg.task.name
    chunk = cfg.model.get("prefill_chunk_size")
    if chunk is not None and "prefill_chunk_size" not in applied:
        raise HarnessError(f"task={name} does not apply model.prefill_chunk_size={chunk} (it prefills in one forward); "
                           "drop it (model.prefill_chunk_size=null)")
    if not bool(cfg.task.get("query_aware", True)) and "query_aware" not in applied:
        raise HarnessError(f"task={name} does not apply task.query_aware=false (it has no question asked after the "
                           "compressed part); drop it")


def _execute(cfg: DictConfig, run_path: Path, overrides, config_name: str, dirs: list[RunDir]) -> dict:
    task = get_task(cfg.task.name)
    task.validate(cfg.task)
    check_protocol(task, cfg)
    resume = resume_mode(cfg.get("resume", True))
    entries = method_entries(cfg, overrides)
    from harness.models import resolve_config_dtype

    resolve_config_dtype(cfg)  # `auto` becomes the dtype that runs before any config is recorded
    if writes_run_dir_itself(task):
        takes_methods = getattr(task, "TAKES_METHODS", False)  # task=plan: the settings it plans
        require(entries is None or takes_methods, f"task={cfg.task.name} compares the methods of task.methods itself; "
                                                  "methods= is for the per-method tasks (needle, longbench, ...)")
        run_dir = RunDir(run_path)
        dirs.append(run_dir)
        check_writable(run_path)
        run_dir.lock()
        seed_everything(int(cfg.seed))
        if takes_methods:
            return task.prepare_and_run(cfg, run_dir, _setting_configs(cfg, entries, overrides, config_name))
        return task.prepare_and_run(cfg, run_dir)

    configs = _setting_configs(cfg, entries, overrides, config_name)
    planned = []
    for tag, scfg in configs:
        run_dir = RunDir(run_path / tag, grid=getattr(task, "GRID_KEYS", ()))
        dirs.append(run_dir)
        run_dir.check(scfg, resume=resume)  # before the model: unwritable folder, conflicting earlier run, other code
        planned.append((tag, scfg, check_method(scfg), run_dir))  # before the model: bad budgets, windows, kernels
    for *_, run_dir in sorted(planned, key=lambda p: str(p[3].path)):  # one order for every process: no deadlock
        run_dir.lock()

    from harness.methods.engine import check_layout
    from harness.models import load_model

    seed_everything(int(cfg.seed))
    loaded = load_model(cfg.model)
    # every decoder layer counts (per-layer budgets); a layout no method here can compress is refused before any work
    num_layers = check_layout(loaded.model, [(tag, method) for tag, _, method, _ in planned])
    settings = []
    for tag, scfg, method, run_dir in planned:
        method.validate(num_layers, loaded.max_positions)
        run_dir.prepare(scfg, resume=resume, device=str(loaded.device))  # config.yaml, provenance.json (re-checked under the lock)
        settings.append(_setting(tag, method, scfg, run_dir))
    started = time.time()
    outs = task.run(cfg, loaded, settings, progress=bool(cfg.progress))  # the task contract (harness/tasks/contract.py)
    wall = round(time.time() - started, 2)
    done = {}
    for s in settings:
        out = outs[s.tag]
        failures = out.get("failures") or []
        results = {
            "schema": 1,
            "task": s.cfg.task.name,
            "status": "items_failed" if failures else out["summary"].get("status", "complete"),
            "model": {"name": loaded.name, **loaded.info, "chat_format": loaded.chat_format, "eos_token_ids": loaded.eos_token_ids},
            "method": s.method.describe(num_layers),
            "method_tag": s.tag,
            "summary": out["summary"],
            "failures": len(failures),
            "failed_items": [{k: v for k, v in f.items() if k != "traceback"} for f in failures],
            "rows": out.get("rows", []),
            "config": OmegaConf.to_container(s.cfg, resolve=True),
            "provenance": {**s.run_dir.provenance, "wall_seconds": wall,
                           **({"settings_in_process": [x.tag for x in settings]} if len(settings) > 1 else {})},
        }
        s.run_dir.write_results(results)
        done[s.tag] = results
    update_index(run_path, done, tuple(getattr(task, "GRID_KEYS", ())))
    if entries is None:
        return done[settings[0].tag]
    return {"settings": done, "summary": {tag: _main_score(r["summary"])[1] for tag, r in done.items()},
            "failures": sum(int(r["failures"]) for r in done.values())}


def _setting_configs(cfg: DictConfig, entries, overrides, config_name: str) -> list[tuple[str, DictConfig]]:
    """(tag, config) of every setting: the run's own config, or one composed per `methods` entry (its dtype
    resolved as the run's)."""
    from harness.models import resolve_config_dtype

    if entries is None:
        return [(str(cfg.method.tag), cfg)]
    configs = compose_settings(entries, overrides, config_name)
    for _, scfg in configs:
        resolve_config_dtype(scfg)
    return configs


def _setting(tag, method, cfg, run_dir):
    try:
        from harness.generation.prompt import Setting
    except ImportError:  # a task side without the multi-setting contract
        from types import SimpleNamespace as Setting
    return Setting(tag=tag, method=method, cfg=cfg, run_dir=run_dir)


# --------------------------------------------------------------------------------------------------
# The run directory's index: methods.json and comparison.md
# --------------------------------------------------------------------------------------------------


def _main_score(summary: dict) -> tuple[str | None, float | None]:
    """(name, value) of a task summary's headline score: `main_score` if the task gives one, else the
    needle's `mean_score` (named by `score_name`), else LongBench's `average`."""
    for key, name in (("main_score", summary.get("score_name") or "main_score"),
                      ("mean_score", summary.get("score_name") or "mean_score"), ("average", "average")):
        value = summary.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return name, value
    return None, None


def _budget_text(method: dict) -> str:
    if method.get("name") == "full":
        return "all"
    if method.get("ratio") is not None:
        return f"ratio {method['ratio']}"
    return str(method.get("budget")) if method.get("budget") is not None else "-"


def _cells(summary: dict) -> int | None:
    """How many items a setting's summary covers: `cells` (needle, lines), LongBench's items per task summed."""
    if isinstance(summary.get("cells"), int):
        return summary["cells"]
    items = summary.get("items")
    if isinstance(items, dict) and all(isinstance(v, int) for v in items.values()):
        return sum(items.values())
    return None


def _compared_config(config: dict) -> dict:
    """What must be equal for two settings' scores to be compared: the resolved config without the method
    keys (`method`, `methods`); result_key_differences then ignores the keys that never change results."""
    return {k: v for k, v in config.items() if k not in ("method", "methods")}


def _setting_config(run_path: Path, tag: str) -> dict | None:
    try:
        data = json.loads((run_path / tag / "results.json").read_text(encoding="utf-8"))
        return data["config"] if isinstance(data.get("config"), dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _grid_text(config: dict, grid: tuple[str, ...]) -> str:
    task = config.get("task") or {}
    return ", ".join(f"{k}={json.dumps(task.get(k), default=str).replace(' ', '')}" for k in grid if k in task)


def update_index(run_path: Path, done: dict[str, dict], grid: tuple[str, ...] = ()) -> None:
    """Add this run's settings to `methods.json` (tag -> sub-directory, method, headline score, cells,
    status) and rewrite `comparison.md` from it. comparison.md compares like with like: the settings whose
    config equals this run's apart from the method (same grid, prompt style, protocol, model options, ...),
    with their cell counts; every other setting in the index is listed below the table with what differs.
    Under a lock: jobs of one sweep share the run directory."""
    from harness.rundir import describe_differences, result_key_differences

    lock = RunLock(run_path, name=".index.lock").acquire(quiet=True)
    try:
        path = run_path / INDEX_FILE
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
            settings = dict(index.get("settings") or {})
        except (OSError, ValueError, AttributeError):
            settings = {}
        for tag, results in done.items():
            name, score = _main_score(results["summary"])
            settings[tag] = {"dir": tag, "method": results["method"].get("name"), "budget": _budget_text(results["method"]),
                             "task": results["task"], "model": results["model"].get("name"), "score_name": name,
                             "score": score, "cells": _cells(results["summary"]), "status": results["status"],
                             "failures": results["failures"], "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        settings = {t: settings[t] for t in sorted(settings, key=lambda t: (settings[t].get("method") != "full", t))}
        write_json(path, {"schema": 1, "settings": settings})

        reference = _compared_config(next(iter(done.values()))["config"])
        compared, left_out = [], []
        for tag in settings:
            config = done[tag]["config"] if tag in done else _setting_config(run_path, tag)
            if config is None:
                left_out.append(f"- {tag}: no results.json with its config")
                continue
            diff = result_key_differences(_compared_config(config), reference)
            if not diff:
                compared.append(tag)
            else:
                cells = settings[tag].get("cells")
                left_out.append(f"- {tag} ({'?' if cells is None else cells} cell{'' if cells == 1 else 's'}): "
                                f"{describe_differences(_compared_config(config), reference, diff, limit=4)}")
        rows = ["| setting | method | budget | cells | score | status |", "|---|---|---|---:|---:|---|"]
        for tag in compared:
            s = settings[tag]
            score = "-" if s.get("score") is None else f"{s['score']:.4f}" if isinstance(s["score"], float) else str(s["score"])
            status = s["status"] + (f" ({s['failures']} failed)" if s.get("failures") else "")
            cells = "-" if s.get("cells") is None else str(s["cells"])
            rows.append(f"| [{tag}]({s['dir']}/results.json) | {s['method']} | {s['budget']} | {cells} | {score} | {status} |")
        names = sorted({settings[t].get("score_name") or "-" for t in compared})
        first = settings[compared[0]]
        task = reference.get("task") or {}
        what = [x for x in (_grid_text(reference, grid), f"prompt_style={task['prompt_style']}" if "prompt_style" in task else "",
                            f"query_aware={json.dumps(task.get('query_aware', True))}",
                            f"prefill_chunk_size={json.dumps((reference.get('model') or {}).get('prefill_chunk_size'))}") if x]
        text = (f"# {first.get('task')} on {first.get('model')}: {', '.join(names)} per setting\n\n"
                f"Settings run on the same items with the same options as the latest run ({'; '.join(what)}); "
                "cells: the items each score averages.\n\n" + "\n".join(rows) + "\n")
        if left_out:
            text += ("\nLeft out (other items or options than the latest run, `old -> latest`; each setting's "
                     "results.json has its own summary; to compare one, run it with the latest options: the cells "
                     "it already holds are reused):\n\n"
                     + "\n".join(left_out) + "\n")
        write_text(run_path / COMPARISON_FILE, text)
    finally:
        lock.release()


# --------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------


def _result_dirs(path: Path, results: dict) -> list[Path]:
    if "settings" in results:
        return [path / tag for tag in results["settings"]]
    tag = results.get("method_tag")
    return [path / str(tag)] if tag is not None and (path / str(tag) / "results.json").exists() else [path]


def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    path = run_dir_path()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    try:
        results = execute(cfg, path, overrides=overrides, config_name=hydra_cfg.job.config_name or "config")
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
    dirs = _result_dirs(path, results)
    for tag, one in (results.get("settings") or {None: results}).items():
        where = path / tag if tag else dirs[0]
        log.info("results: %s", where / "results.json")
        log.info("summary%s: %s", f" ({tag})" if tag else "", _short(one["summary"]))
    if (path / COMPARISON_FILE).exists() and "settings" in results:
        log.info("comparison: %s", path / COMPARISON_FILE)
    failed = int(results.get("failures") or 0)
    if failed:
        found = sorted(p for d in dirs for p in d.glob("failures*.json"))
        records = ", ".join(str(p) for p in found) or str(dirs[0] / "failures.json")
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
