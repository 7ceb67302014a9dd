"""scripts/reproduce_paper.py and conf/experiment: the plan (every run, counted), resume and conflict
detection, and `--smoke`: the whole plan in miniature on this CPU, end to end, tables included."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import compose
from harness import CONF_DIR
from harness import reproduce as rp
from harness.tasks import TASKS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "reproduce_paper.py"
NEEDLE_DEPTHS = [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]




def run_script(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def total(stdout: str) -> tuple[int, dict[str, int]]:
    m = re.search(r"^Total: (\d+) run\(s\) \(([^)]*)\)", stdout, re.M)
    assert m, stdout[-2000:]
    parts = dict((k, int(v)) for k, v in (p.rsplit(" ", 1) for p in m.group(2).split(", ")))
    return int(m.group(1)), parts


# ------------------------------------------------------------------------------------------ experiments

@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_experiment_composes_with_each_swept_choice(name):
    cfg = compose(f"+experiment={name}")
    assert cfg.task.name in TASKS
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        full = hcompose(config_name="config", overrides=[f"+experiment={name}"], return_hydra_config=True)
    params = {k: rp._sweep_values(k, v) for k, v in full.hydra.sweeper.params.items()}
    assert "model" in params
    for model in params["model"]:
        assert (CONF_DIR / "model" / f"{model}.yaml").exists()
    for method in params.get("method", []):
        assert (CONF_DIR / "method" / f"{method}.yaml").exists()
    # deterministic run directories: no timestamps, no override_dirname
    assert "${now:" not in str(full.hydra.sweep.dir) and "override_dirname" not in str(full.hydra.sweep.subdir)


def test_paper_longbench_is_table_1():
    cfg = compose("+experiment=paper_longbench", "model=mistral-7b-instruct-v0.2", "method=snapkv_longbench_c2048")
    assert cfg.task.name == "longbench" and cfg.task.datasets is None and cfg.task.limit is None
    assert cfg.task.min_new_tokens is True and cfg.task.code_sim_backend == "difflib"
    assert (cfg.method.budget, cfg.method.window_size, cfg.method.kernel_size, cfg.method.pooling, cfg.method.gqa) == (2048, 32, 7, "maxpool", "expand")
    assert cfg.model.chat_format == "none"
    assert compose("+experiment=paper_longbench", "model=lwm-text-chat-1m").model.chat_format == "inst"
    assert compose("+experiment=paper_longbench", "model=longchat-7b-32k").model.chat_format == "vicuna"
    h2o = compose("+experiment=paper_longbench", "method=h2o_longbench_c4096").method
    assert (h2o.name, h2o.budget) == ("h2o", 4096)


def test_paper_needle_grid():
    cfg = compose("+experiment=paper_needle")
    import numpy as np

    assert list(cfg.task.lengths) == np.round(np.linspace(1000, 379538, 45)).astype(int).tolist()
    assert list(cfg.task.depths) == NEEDLE_DEPTHS == np.round(np.linspace(0, 100, 10)).astype(int).tolist()
    assert cfg.model.name == "lwm-text-chat-1m" and cfg.task.prompt_style == "chat"
    assert (cfg.method.budget, cfg.method.window_size, cfg.method.kernel_size, cfg.method.pooling) == (1024, 16, 5, "maxpool")
    assert max(cfg.task.lengths) + cfg.task.max_new_tokens <= cfg.model.max_positions


def test_paper_speed_and_max_length():
    speed = compose("+experiment=paper_speed")
    maxlen = compose("+experiment=paper_maxlen")
    for cfg in (speed, maxlen):
        assert cfg.task.name == "bench" and cfg.model.name == "lwm-text-chat-1m" and cfg.model.random_weights is True
        assert cfg.task.batch_size == 2
        methods = {m.label: m for m in cfg.task.methods}
        assert methods["full"].name == "full"
        assert (methods["snapkv-c2048"].name, methods["snapkv-c2048"].budget) == ("snapkv", 2048)
    assert max(speed.task.context_lengths) == 16384 and speed.task.max_length_search is False
    assert maxlen.task.max_length_search is True and maxlen.task.memory_cap_gb == 80
    assert maxlen.task.search_max <= maxlen.model.max_positions


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "streamingllm", "h2o"])
def test_modern_set_as_pyramidkv_reports_it(method):
    cfg = compose(f"+experiment=modern_{method}", "method.budget=128")
    assert cfg.method.name == method and cfg.method.budget == 128 and cfg.task.min_new_tokens is True
    if method in ("snapkv", "pyramidkv", "h2o"):
        assert cfg.method.window_size == 8
    if method in ("snapkv", "pyramidkv"):
        assert (cfg.method.kernel_size, cfg.method.pooling) == (7, "maxpool")
    if method == "streamingllm":
        assert cfg.method.sink_tokens == 4


# ------------------------------------------------------------------------------------------ the plan

def test_ruler_leaderboard_is_kvpress_setting():
    # kvpress's compression ratios 0.25/0.5/0.75/0.875 are fractions removed: our ratios (kept) 0.75/0.5/0.25/0.125
    cfg = compose("+experiment=ruler_leaderboard")
    assert cfg.task.name == "ruler" and list(cfg.task.lengths) == [4096] and cfg.task.query_aware is False
    assert cfg.task.samples == 500 and len(cfg.task.tasks) == 11
    ratios = {(m["name"], m["ratio"]) for m in cfg.methods if not isinstance(m, str)}
    assert ratios == {(n, r) for n in ("snapkv", "pyramidkv", "streamingllm", "h2o") for r in (0.75, 0.5, 0.25, 0.125)}
    [exp] = rp.plan(rp.PARTS, ["ruler"], Path("/nonexistent/runs"), models=None, extra=[], longbench_data=None)
    assert {j.sweep["model"] for j in exp.jobs} == {"llama-3.1-8b-instruct", "qwen3-8b"} and len(exp.jobs) == 34


def test_field_presets_plan_every_benchmark_both_protocols():
    """conf/experiment/field_*: LongBench-v2, InfiniteBench, LooGLE, ZeroSCROLLS (both protocols) and SCBench (query-agnostic by construction,
    both modes in one job), GPU (two leaderboard models) and CPU (SmolLM2), each benchmark in its own run directories,
    one job per (model, protocol) holding every setting."""
    exps = rp.plan(rp.PARTS, ["field", "field_cpu"], Path("/nonexistent/runs"), models=None, extra=[], longbench_data=None)
    by_name = {e.name: e for e in exps}
    assert set(by_name) == {f"field_{t}{cpu}" for t in ("longbench_v2", "infinitebench", "scbench", "loogle", "zeroscrolls") for cpu in ("", "_cpu")}
    for name, exp in by_name.items():
        task = name.removeprefix("field_").removesuffix("_cpu")
        models = {"smollm2-135m"} if name.endswith("_cpu") else {"llama-3.1-8b-instruct", "qwen3-8b"}
        assert {j.config["task"]["name"] for j in exp.jobs} == {task}
        assert {j.sweep["model"] for j in exp.jobs} == models
        protocols = {"False"} if task == "scbench" else {"True", "False"}
        assert {str(j.config["task"]["query_aware"]) for j in exp.jobs} == protocols
        assert all(f"/{task}/" in str(j.run_dir) for j in exp.jobs)
    assert list(by_name["field_scbench"].jobs[0].config["task"]["modes"]) == ["multi_request", "multi_turn"]
    assert len(by_name["field_longbench_v2"].jobs) == 68 and len(by_name["field_infinitebench_cpu"].jobs) == 10
    assert len(by_name["field_loogle"].jobs) == 68 and len(by_name["field_loogle_cpu"].jobs) == 10
    assert by_name["field_loogle"].jobs[0].config["task"]["repetition_penalty"] == 2.0
    assert len(by_name["field_zeroscrolls"].jobs) == 68 and len(by_name["field_zeroscrolls_cpu"].jobs) == 10
    # the official scorer is the user's copy: the presets read its folder from ZEROSCROLLS_SCORER_DIR (unset here: null)
    assert {j.config["task"]["scorer_dir"] for j in by_name["field_zeroscrolls"].jobs} == {None}


def test_dry_run_counts_every_run(tmp_path):
    proc = run_script("--dry-run", "--out", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    assert total(proc.stdout) == (23, {"longbench": 20, "needle": 1, "speed": 2})
    assert proc.stdout.count("    TODO ") == 23
    assert f"{tmp_path / 'runs' / 'longbench' / 'mixtral-8x7b-instruct' / 'h2o_c4096_w8_expand'}" in proc.stdout
    # Table 1: one job per model, its five settings sharing each item's prefill, each in its own run directory
    assert "overrides: +experiment=paper_longbench model=mistral-7b-instruct-v0.2\n" in proc.stdout
    assert f"{tmp_path / 'runs' / 'longbench' / 'mistral-7b-instruct-v0.2' / 'snapkv_c4096_w32_k7_maxpool_expand'}" in proc.stdout
    assert "hydra/launcher=basic" in proc.stdout
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing

    proc = run_script("--dry-run", "--only", "all", "--launcher", "submitit_slurm", "--out", str(tmp_path / "runs"))
    assert total(proc.stdout) == (579, {"longbench": 20, "needle": 1, "speed": 2, "modern": 18, "observation": 2, "lines": 2,
                                        "ruler": 34, "ruler_cpu": 26, "ruler_gemma_cpu": 8, "ruler_methods_cpu": 92,
                                        "field": 306, "field_cpu": 45, "plan": 23})
    assert "hydra/launcher=submitit_slurm" in proc.stdout
    proc = run_script("--dry-run", "--only", "longbench", "--only", "needle", "--models", "mistral-7b-instruct-v0.2",
                      "--out", str(tmp_path / "runs"))
    assert total(proc.stdout) == (5, {"longbench": 5, "needle": 0})
    assert "model=mistral-7b-instruct-v0.2" in proc.stdout and "skipped, none of --models" in proc.stdout
    proc = run_script("--dry-run", "--smoke", "--out", str(tmp_path / "runs"))
    assert total(proc.stdout) == (7, {"longbench": 3, "needle": 2, "speed": 2})


def test_bad_arguments_fail_in_one_line(tmp_path):
    for args in (["--only", "nope"], ["--models", "gpt-5"], ["--launcher", "slurm"], ["--smoke", "--only", "modern"]):
        proc = run_script("--dry-run", "--out", str(tmp_path), *args)
        assert proc.returncode == 2 and "error:" in proc.stderr, args
    proc = run_script("--dry-run", "--out", str(tmp_path), "--", "task.nonexistent_key=1")
    assert proc.returncode == 2 and proc.stderr.startswith("error: could not compose the plan")


def _fake_results(job, **extra) -> None:
    job.run_dir.mkdir(parents=True, exist_ok=True)
    (job.run_dir / "results.json").write_text(json.dumps({"task": job.config["task"]["name"], "status": "complete", "failures": 0,
                                                          "config": job.config, **extra}))


def test_resume_skips_finished_runs_and_relaunches_only_the_rest(tmp_path):
    out = tmp_path / "runs"
    [exp] = rp.plan(rp.PARTS, ["longbench"], out, models=None, extra=[], longbench_data=None)
    assert len(exp.jobs) == 20 and {j.state for j in exp.jobs} == {"todo"}
    assert rp.launches(exp) == [exp.full_params]
    assert rp.command(exp, exp.full_params, "joblib")[3:] == ["-m", "+experiment=paper_longbench", f"hydra.sweep.dir={out / 'longbench'}",
                                                              "hydra/launcher=joblib"]
    # every run of two models done, one run of a third started (its items are resumed by the harness)
    for job in exp.jobs:
        if job.sweep["model"] in ("lwm-text-chat-1m", "longchat-7b-32k"):
            _fake_results(job)
    started = next(j for j in exp.jobs if j.sweep == {"model": "mixtral-8x7b-instruct"} and j.run_dir.name == "full")
    _fake_results(started, status="items_failed", failures=2)
    [exp] = rp.plan(rp.PARTS, ["longbench"], out, models=None, extra=[], longbench_data=None)
    states = {(j.sweep["model"], j.run_dir.name): j.state for j in exp.jobs}
    assert sum(s == "done" for s in states.values()) == 10
    assert states[("mixtral-8x7b-instruct", "full")] == "resume"
    # one job per model runs its five settings from one prefill per item: the models with anything left
    # are relaunched (their finished settings are then skipped item by item by the harness)
    sweeps = rp.launches(exp)
    assert sweeps == [{"model": ["mistral-7b-instruct-v0.2", "mixtral-8x7b-instruct"]}]
    cmd = rp.command(exp, sweeps[0], "basic")
    assert "model=mistral-7b-instruct-v0.2,mixtral-8x7b-instruct" in cmd

    # a finished run of another config is a conflict: reported, and nothing is launched
    other = next(j for j in exp.jobs if j.state == "todo")
    _fake_results(other, config={**other.config, "task": {**other.config["task"], "limit": 5}})
    proc = run_script("--only", "longbench", "--out", str(out))
    assert proc.returncode == 2 and "CONFLICT" in proc.stdout and "task.limit: 5 -> null" in proc.stdout
    assert "different config" in proc.stderr and "$ python -m harness" not in proc.stdout.split("Total:")[1]


def test_dry_run_loads_no_model(tmp_path):
    code = (f"import sys, runpy; sys.argv = ['reproduce_paper.py', '--dry-run', '--only', 'all', '--out', {str(tmp_path)!r}]\n"
            "try:\n    runpy.run_path(" + repr(str(SCRIPT)) + ", run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code\n"
            "print('TORCH', 'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "TORCH False False" in proc.stdout


# ------------------------------------------------------------------------------------------ --smoke

@pytest.mark.skipif(not {"longbench", "bench", "needle"} <= set(TASKS), reason="LongBench/bench tasks not registered yet")
def test_smoke_runs_the_whole_plan_and_builds_the_tables(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results"
    args = ("--smoke", "--out", str(out), "--results-root", str(results), "--results-name", "smoke")
    planned = run_script("--dry-run", *args)
    run_dirs = re.findall(r"^    TODO     (\S+)$", planned.stdout, re.M)
    assert len(run_dirs) == 7

    started = time.time()
    proc = run_script(*args, timeout=1500)
    elapsed = time.time() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for d in run_dirs:  # every run went where the plan said
        assert (Path(d) / "results.json").exists(), d
    tables = results / "smoke"
    for name in ("README.md", "runs.csv", "longbench.md", "longbench.csv", "needle.md", "needle.csv", "efficiency.md",
                 "efficiency.csv", "max_length.csv", "claims.md", "claims.csv"):
        assert (tables / name).exists(), name
    with open(tables / "longbench.csv", newline="") as f:
        lb = list(csv.DictReader(f))
    assert {r["setting"] for r in lb} == {"All KV", "SnapKV 256", "H2O 256 (W128)"}  # the defaults: W32 k7; H2O's equal split
    assert {r["first_token_guard"] for r in lb} == {"all tasks"} and {r["limit"] for r in lb} == {"1"}
    with open(tables / "needle.csv", newline="") as f:
        needle = list(csv.DictReader(f))
    assert {r["setting"] for r in needle} == {"All KV", "SnapKV 256 (W16 k5 maxpool)"}
    assert len(list((tables / "needle").glob("*__chat.png"))) == 2  # score heatmaps (+ SnapKV's retention picture)
    assert len(list((tables / "needle").glob("*__retention.png"))) == 2  # every setting's, full's included (all ones)
    with open(tables / "efficiency.csv", newline="") as f:
        eff = list(csv.DictReader(f))
    assert {r["method"] for r in eff} == {"full", "snapkv-c128"} and {r["batch"] for r in eff} == {"2"}
    snap = next(r for r in eff if r["method"] == "snapkv-c128" and r["length"] == "1024" and "decode" in r["run"])
    # 1024 / 128 tokens, but gqa=expand stores tiny-random's 4 query heads, the full cache its 2 KV heads
    assert float(snap["kv_full_over_this"]) == pytest.approx(1024 / 128 * 2 / 4, rel=0.01)
    print(f"smoke: {elapsed:.0f} s")

    # the same command again: everything is done, nothing is launched, the tables are rebuilt
    again = run_script(*args, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "$ python -m harness" not in again.stdout and again.stdout.count("    DONE ") == 7
    assert (tables / "longbench.md").exists()
