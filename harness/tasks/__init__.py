"""Task runners, by `task.name`. A task module has `validate(task_cfg)` (cheap, no model) and
`run(cfg, loaded, settings, progress)` returning {tag: {"summary", "rows", "failures", ...}} (one
entry per harness.tasks.common.Setting), or, for tasks that compare methods themselves (listed in
SELF_MANAGED: they write their run directory, not one sub-directory per setting),
`prepare_and_run(cfg, run_dir)`."""

from importlib import import_module

TASKS = {
    "needle": "harness.tasks.needle",
    "bench": "harness.tasks.bench",
    "longbench": "harness.tasks.longbench",
    "longbench_e": "harness.tasks.longbench",
    "observation": "harness.tasks.observation",
    "lines": "harness.tasks.lines",
    "ruler": "harness.tasks.ruler",
    "plan": "harness.tasks.plan",
}

SELF_MANAGED = ("bench", "plan")  # known without importing the module (which loads torch)


def get_task(name: str):
    from harness.errors import HarnessError

    if name not in TASKS:
        raise HarnessError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    return import_module(TASKS[name])
