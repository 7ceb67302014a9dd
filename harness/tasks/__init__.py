"""Task runners, by `task.name`. A task module has `validate(task_cfg)` (cheap, no model) and
`run(cfg, loaded, method, run_dir, progress)` returning {"summary", "rows", "failures", ...}."""

from importlib import import_module

TASKS = {
    "needle": "harness.tasks.needle",
    "bench": "harness.tasks.bench",
    "longbench": "harness.tasks.longbench",
    "longbench_e": "harness.tasks.longbench",
    "observation": "harness.tasks.observation",
    "lines": "harness.tasks.lines",
}


def get_task(name: str):
    from harness.errors import HarnessError

    if name not in TASKS:
        raise HarnessError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    return import_module(TASKS[name])
