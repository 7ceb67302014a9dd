"""Scale-out through Hydra's own launcher plugins: real multiruns through joblib and submitit (local),
and the example launcher configs in conf/hydra/launcher."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from conftest import CONF_DIR, run_cli
from test_robustness import ENV, small_haystack

LAUNCHER_DIR = CONF_DIR / "hydra" / "launcher"


def _grid(tmp_path: Path, depths: str = "[0,100]") -> tuple[str, ...]:
    return ("model=tiny-random", "progress=false", "task.lengths=[256]", f"task.depths={depths}", "task.max_new_tokens=4",
            f"task.haystack_dir={small_haystack(tmp_path / 'haystack')}", f"hydra.sweep.dir={tmp_path / 'sweep'}")


def _job_results(sweep: Path) -> dict[str, dict]:
    """results.json of every setting under the sweep folder, by method tag."""
    found = {}
    for path in sweep.rglob("results.json"):
        results = json.loads(path.read_text())
        found[results["method_tag"]] = results
        assert path.parent.name == results["method_tag"]  # <job dir>/<method tag>
        assert (path.parent / "config.yaml").exists() and (path.parent / "provenance.json").exists()
    return found


def _check_jobs(proc, sweep: Path, tags: set[str], cells: int = 2) -> dict[str, dict]:
    shown = f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}\nstdout:\n{proc.stdout[-3000:]}"
    assert proc.returncode == 0, shown
    assert "Traceback" not in proc.stderr, shown
    found = _job_results(sweep)
    assert set(found) == tags, shown
    for results in found.values():
        assert results["status"] == "complete" and results["summary"]["cells"] == cells and results["failures"] == 0
    return found


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None,
                    reason="hydra-joblib-launcher is not installed (pip install -e .[joblib])")
def test_joblib_budget_sweep_with_full(tmp_path):
    """`-m method=full,streamingllm method.budget=64,128` through joblib, two jobs at a time (issue 11 item 4): the
    shared override starts every job; the two `full` jobs (full's tag has no budget) resolve to one run directory,
    and, running at the same time, the lock makes the second wait and then resume: its cell is computed once."""
    grid = _grid(tmp_path, depths="[50]")
    proc = run_cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "method=full,streamingllm", "method.budget=64,128",
                   *grid, env=ENV, timeout=300)
    found = _check_jobs(proc, tmp_path / "sweep", {"full", "streamingllm_c64_s4_mean", "streamingllm_c128_s4_mean"}, cells=1)
    assert sorted(r["method"]["budget"] for r in found.values() if r["method"]["name"] == "streamingllm") == [64, 128]
    # One job directory for the whole sweep (the method keys are not in hydra.sweep.subdir), a sub-directory per tag.
    job = tmp_path / "sweep" / "model=tiny-random,task.depths=[50],task.lengths=[256],task.max_new_tokens=4"
    assert sorted(p.parent.name for p in (tmp_path / "sweep").rglob("results.json")) == sorted(found)
    assert all((job / tag / "results.json").exists() for tag in found)
    assert len((job / "full" / "needle_cells.jsonl").read_text().splitlines()) == 1  # computed once
    assert proc.stdout.count("1 of 1 item records already done") == 1, proc.stdout[-3000:]  # the second full job resumed
    assert found["full"]["method"]["budget"] in (64, 128)  # recorded, a no-op
    index = json.loads((job / "methods.json").read_text())
    assert set(index["settings"]) == set(found) and "| [full](full/results.json) | full | all |" in (job / "comparison.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                    reason="hydra-submitit-launcher is not installed (pip install -e .[slurm])")
def test_submitit_local_multirun(tmp_path):
    proc = run_cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", "method=snapkv",
                   "method.budget=64,128", *_grid(tmp_path), env=ENV, timeout=300)
    found = _check_jobs(proc, tmp_path / "sweep", {"snapkv_c64_w32_k7_maxpool_expand", "snapkv_c128_w32_k7_maxpool_expand"})
    assert sorted(r["method"]["budget"] for r in found.values()) == [64, 128]
    assert list((tmp_path / "sweep" / ".submitit").rglob("*_log.out")), "submitit keeps a log per job"


def _compose_with_hydra(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("name,plugin", [("local_parallel", "hydra_joblib_launcher"), ("submitit_local_gpu", "hydra_submitit_launcher"),
                                         ("slurm_gpu", "hydra_submitit_launcher"), ("ray_gpu", "hydra_ray_launcher")])
def test_example_launcher_configs(name, plugin):
    raw = yaml.safe_load((LAUNCHER_DIR / f"{name}.yaml").read_text())
    if name == "ray_gpu":
        assert raw["defaults"] == ["ray"] and raw["ray"]["remote"]["num_gpus"] == 1
    if importlib.util.find_spec(f"hydra_plugins.{plugin}") is None:
        pytest.skip(f"{plugin} is not installed")
    launcher = _compose_with_hydra(f"hydra/launcher={name}", "hydra.launcher.partition=gpu" if name == "slurm_gpu" else "seed=0").hydra.launcher
    if name == "local_parallel":
        assert launcher._target_.endswith("JoblibLauncher") and launcher.n_jobs == 2
    elif name == "submitit_local_gpu":
        assert launcher._target_.endswith("submitit_launcher.LocalLauncher") and launcher.gpus_per_node == 1
    elif name == "slurm_gpu":
        assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
        assert launcher.gpus_per_node == 1 and launcher.partition == "gpu" and launcher.mem_gb and launcher.cpus_per_task
        assert launcher.timeout_min > 0 and launcher.max_num_timeout > 0
    else:
        assert launcher.ray.remote.num_gpus == 1
