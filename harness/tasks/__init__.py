"""The task registry: the one place the benchmarks are found. One folder per benchmark, `harness/tasks/<folder>/`:

- `__init__.py`: `TASK_NAMES`, the `task.name` values it runs (conf/task/*.yaml; `longbench` and `longbench_e` share
  a folder), and `SELF_MANAGED = True` for a task that compares methods itself; light (no torch): read here;
- `task.py`: `validate(task_cfg)` (cheap, no model) and `run(cfg, loaded, settings, progress)` returning
  {tag: {"summary", "rows", "failures", ...}} (one entry per harness.generation.prompt.Setting), or, for a
  self-managed task (it writes its run directory, not one sub-directory per setting), `prepare_and_run(cfg, run_dir)`;
- `report.py` (optional): its tables in a table set, found by `python -m harness.report` through `task_reports()`
  (torch-free; it never imports harness.report: the cross-task report imports it);
- whatever else the benchmark needs (`data.py`, `prompt.py`, a worker).

A folder holding a `task.py` is registered: adding a benchmark edits nothing here. TASKS maps each task name to its
folder's task module, folders in name order (the order of the report's sections)."""

from importlib import import_module
from pathlib import Path
from types import ModuleType


def _folders() -> list[ModuleType]:
    here = Path(__file__).resolve().parent
    return [import_module(f"{__name__}.{p.name}") for p in sorted(here.iterdir()) if (p / "task.py").is_file()]


TASKS = {name: f"{folder.__name__}.task" for folder in _folders() for name in folder.TASK_NAMES}
SELF_MANAGED = tuple(name for folder in _folders() if getattr(folder, "SELF_MANAGED", False) for name in folder.TASK_NAMES)


def get_task(name: str):
    from harness.errors import HarnessError

    if name not in TASKS:
        raise HarnessError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    return import_module(TASKS[name])


def task_reports() -> list[tuple[tuple[str, ...], ModuleType]]:
    """[(task names, the folder's report module)] in registry order, one entry per folder that has a report.py."""
    out = []
    for folder in _folders():
        if (Path(folder.__file__).parent / "report.py").is_file():
            out.append((tuple(folder.TASK_NAMES), import_module(f"{folder.__name__}.report")))
    return out
