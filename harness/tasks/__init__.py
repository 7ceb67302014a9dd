"""The task registry: the one place that names the benchmarks. One folder per benchmark, `harness/tasks/<folder>/`:

- `task.py`: `validate(task_cfg)` (cheap, no model) and `run(cfg, loaded, settings, progress)` returning
  {tag: {"summary", "rows", "failures", ...}} (one entry per harness.generation.prompt.Setting), or, for tasks that
  compare methods themselves (listed in SELF_MANAGED: they write their run directory, not one sub-directory per
  setting), `prepare_and_run(cfg, run_dir)`;
- `report.py` (optional): its tables in a table set, found by `python -m harness.report` through `task_reports()`
  (torch-free; it never imports harness.report: the cross-task report imports it);
- whatever else the benchmark needs (`data.py`, `prompt.py`, a worker).

TASKS maps each `task.name` (conf/task/*.yaml) to its folder's task module; two names may share a folder
(`longbench`, `longbench_e`). Their order is the order of the report's sections."""

from importlib import import_module
from types import ModuleType

TASKS = {
    "longbench": "harness.tasks.longbench.task",
    "longbench_e": "harness.tasks.longbench.task",
    "needle": "harness.tasks.needle.task",
    "bench": "harness.tasks.bench.task",
    "observation": "harness.tasks.observation.task",
    "lines": "harness.tasks.lines.task",
    "ruler": "harness.tasks.ruler.task",
}

SELF_MANAGED = ("bench",)  # known without importing the module (which loads torch)


def get_task(name: str):
    from harness.errors import HarnessError

    if name not in TASKS:
        raise HarnessError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    return import_module(TASKS[name])


def task_reports() -> list[tuple[tuple[str, ...], ModuleType]]:
    """[(task names, the folder's report module)] in registry order, one entry per folder that has a report.py."""
    folders: dict[str, list[str]] = {}
    for name, module in TASKS.items():
        folders.setdefault(module.rsplit(".", 1)[0], []).append(name)
    out = []
    for folder, names in folders.items():
        try:
            out.append((tuple(names), import_module(f"{folder}.report")))
        except ModuleNotFoundError as exc:
            if exc.name != f"{folder}.report":
                raise
    return out
