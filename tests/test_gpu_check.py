"""scripts/gpu_check.{sh,py} (issue 22): the GPU readiness check's plan runs on CPU.

The dry run (no torch), the time boxes (under 8 minutes), every harness command composing with the app's own
config, the time box killing a step, a missing asset failing in one line, and each part's table built from
real harness outputs: the plan's own commands, run on CPU with tiny random-weight models instead of the GPU's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import compose

REPO = Path(__file__).resolve().parents[1]
WRAPPER = REPO / "scripts" / "gpu_check.sh"


def wrapper(*args: str, env: dict | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    """`bash scripts/gpu_check.sh <args>` with this interpreter (the wrapper's own choice: $PYTHON)."""
    return subprocess.run(["bash", str(WRAPPER), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu = load_script()


def harness_overrides(step) -> list[str]:
    """The overrides of a `python -m harness` step, without the run directory and progress switches."""
    argv = step.argv
    assert argv[1:3] == ["-m", "harness"], argv
    return [a for a in argv[3:] if not a.startswith(("hydra.", "progress="))]


def substitute(argv: list[str], **values) -> list[str]:
    """argv with `key=...` replaced (dots as __ in the keyword) and keys it lacks appended."""
    values = {k.replace("__", "."): v for k, v in values.items()}
    out = [f"{a.split('=', 1)[0]}={values.pop(a.split('=', 1)[0])}" if "=" in a and a.split("=", 1)[0] in values else a
           for a in argv]
    return out + [f"{k}={v}" for k, v in values.items()]


# ---------------------------------------------------------------------------------------------- the plan

def test_dry_run_plans_every_part_in_under_eight_minutes_without_torch(tmp_path):
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('the dry run imported torch')\n")
    env = {"PYTHONPATH": str(poison.parent)}
    proc = wrapper("--dry-run", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    parts = {p["key"]: p for p in plan["parts"]}
    assert set(parts) == {"setup", "a", "b", "c", "d"}
    check = next(s["timeout_s"] for s in parts["setup"]["steps"] if s["name"] == "s2")
    total = sum(s["timeout_s"] for p in plan["parts"] for s in p["steps"]) + check  # the machine check runs in both calls
    assert plan["total_timeout_s"] == total and total < 8 * 60
    for p in plan["parts"]:
        assert p["tables"] and all(t.startswith("results/gpu/") for t in p["tables"]), p
        for s in p["steps"]:
            assert s["timeout_s"] >= 10, s
            assert s["run_dir"] is None or s["run_dir"].startswith("outputs/gpu_check/"), s
    assert parts["c"]["steps"][0]["timeout_s"] >= 120  # the search gets what is left, enough for the claim's probe

    text = wrapper("--dry-run", env=env)
    assert text.returncode == 0, text.stderr
    for p in plan["parts"]:
        assert f"part {p['key']}:" in text.stdout
        for s in p["steps"]:
            assert f"{s['name']:3} {s['timeout_s']:4d} s" in text.stdout
        for t in p["tables"]:
            assert t in text.stdout


def test_parts_d_brings_part_a_and_unknown_parts_fail_in_one_line():
    proc = wrapper("--dry-run", "--parts", "e")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown part" in proc.stderr
    proc = wrapper("--dry-run", "--parts", "d")
    assert "part a:" in proc.stdout and "part d:" in proc.stdout and "part b:" not in proc.stdout


def test_needle_commands_compose_and_pair_separate_runs_with_the_methods_run():
    from harness.settings import compose_settings, method_entries

    plan = gpu.build_plan()
    shared, eager = gpu.step_of(plan, "a1"), gpu.step_of(plan, "a2")
    cfg = compose(*harness_overrides(shared))
    assert cfg.model.name == "smollm2-135m" and cfg.model.device == "cuda" and list(cfg.task.lengths) == [4096]
    tags = [tag for tag, _ in compose_settings(method_entries(cfg, harness_overrides(shared)), harness_overrides(shared))]
    assert len(tags) == len(gpu.METHODS)
    eager_cfg = compose(*harness_overrides(eager))
    assert eager_cfg.model.attn_implementation == "eager" and cfg.model.attn_implementation == "sdpa"
    assert [t for t, _ in compose_settings(method_entries(eager_cfg, harness_overrides(eager)), harness_overrides(eager))] == tags
    separate = [s for p in plan if p.key == "d" for s in p.steps]
    # each separate run writes <run dir>/<its tag>: the same tags as the methods run, so part d compares like with like
    assert [compose(*harness_overrides(s)).method.tag for s in separate] == tags
    for s in separate:
        assert {k: v for k, v in compose(*harness_overrides(s)).task.items()} == {k: v for k, v in cfg.task.items()}


def test_bench_commands_compose_validate_and_match_the_paper_setting():
    from harness.tasks.bench.task import method_configs, validate

    plan = gpu.build_plan()
    bench, search = gpu.step_of(plan, "b1"), gpu.step_of(plan, "c1")
    for step in (bench, search):
        cfg = compose(*harness_overrides(step))
        validate(cfg.task)  # methods build, lengths, search options: what the bench checks before loading a model
        arch = cfg.model.architecture
        assert (arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers, arch.num_attention_heads) == (4096, 11008, 32, 32)
        assert cfg.model.random_weights is True and cfg.model.dtype == "bfloat16" and cfg.task.batch_size == 1
        snap = next(m for m in method_configs(cfg.task) if m["name"] == "snapkv")
        assert (snap["budget"], snap["window_size"], snap["kernel_size"], snap["pooling"]) == (1024, 32, 7, "maxpool")
    b = compose(*harness_overrides(bench)).task
    assert list(b.context_lengths) == [16384, 32768, 65536] and b.repeats >= 1 and not b.max_length_search
    c = compose(*harness_overrides(search)).task
    assert c.max_length_search and c.memory_cap_gb == 80 and c.repeats == 0
    assert c.search_max == 379538 and c.search_start == c.search_max  # the paper's longest needle prompt is the first probe
    assert [m["name"] for m in method_configs(c)] == ["snapkv", "full"]  # the claim first: it matters most


# ------------------------------------------------------------------------------------------ running a step

def test_time_box_kills_a_step_and_failures_keep_their_error_line(tmp_path):
    env = gpu.step_env(gpu.STAGE)
    slow = gpu.Step("x1", "x", "sleeps", [sys.executable, "-c", "import time; time.sleep(60)"], 2)
    start = time.monotonic()
    out = gpu.run_step(slow, sys.executable, env, tmp_path, time.monotonic() + 100)
    assert out.status == "timed out" and time.monotonic() - start < 30
    bad = gpu.Step("x2", "x", "fails", ["{python}", "-c", "import sys; print('error: no such thing', file=sys.stderr); sys.exit(2)"], 20)
    out = gpu.run_step(bad, sys.executable, env, tmp_path, time.monotonic() + 100)
    assert (out.status, out.rc, out.note) == ("failed", 2, "error: no such thing")
    # the whole run's deadline caps a step's own box
    out = gpu.run_step(slow, sys.executable, env, tmp_path, time.monotonic() + 1)
    assert out.status == "timed out" and "1 s box" in out.note


def test_run_tables_each_part_as_it_ends_keeps_the_other_calls_rows_and_fills_out(tmp_path, monkeypatch):
    """The orchestration with stand-in commands: a part that finishes, a part cut at its box, the summary and $OUT."""
    monkeypatch.setattr(gpu, "ROOT", tmp_path)
    (tmp_path / "stage/llama2-tokenizer").mkdir(parents=True)
    (tmp_path / "stage/llama2-tokenizer/tokenizer.json").write_text("{}")
    (tmp_path / "results/gpu").mkdir(parents=True)
    earlier = {"title": "from the other call", "state": "ok", "wall_s": 50.0, "box_s": 80, "headline": "15/15", "steps": []}
    (tmp_path / "results/gpu/status_a.json").write_text(json.dumps(earlier))  # unpacked from the other call's archive

    def plan(**_):
        setup = gpu.Part("setup", "setup", ("wheels",), [gpu.Step("s1", "setup", "pip", ["{python}", "-m", "pip"], 5),
                                                        gpu.Step("s2", "setup", "check", ["{python}", "-c", "pass"], 20)])
        b = gpu.Part("b", "finishes", ("llama2-tokenizer",), [gpu.Step("b1", "b", "ok", ["{python}", "-c", "print(1)"], 20)])
        c = gpu.Part("c", "cut", ("llama2-tokenizer",), [gpu.Step("c1", "c", "sleeps", ["{python}", "-c", "import time; time.sleep(60)"], 2)])
        return [setup, b, c]

    seen = []

    def builder(key):
        def build(part, done, plan):
            seen.append((key, sorted(done), (tmp_path / "results/gpu/summary.json").exists()))
            (tmp_path / f"results/gpu/{key}.md").write_text(key)
            return f"{key}: {done[part.steps[0].name].status}"
        return build

    monkeypatch.setattr(gpu, "build_plan", plan)
    monkeypatch.setitem(gpu.BUILDERS, "b", builder("b"))
    monkeypatch.setitem(gpu.BUILDERS, "c", builder("c"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    assert gpu.run({"b", "c"}, sequential_override=None, maxlen_upper=1, stage=Path("stage")) == 1
    assert [k for k, *_ in seen] == ["b", "c"] and seen[0][1] == ["b1", "s1", "s2"]  # b tabled before c ran
    summary = json.loads((tmp_path / "results/gpu/summary.json").read_text())
    assert summary["a"] == earlier  # the other call's row stays
    assert summary["setup"]["steps"][0]["status"] == "skipped"  # no wheelhouse: nothing to install
    assert (summary["b"]["state"], summary["b"]["headline"]) == ("ok", "b: ok")
    assert (summary["c"]["state"], summary["c"]["headline"]) == ("incomplete", "c: timed out")
    import tarfile

    with tarfile.open(tmp_path / "out/gpu_results.tar.gz") as tar:
        assert {"results/gpu/b.md", "results/gpu/c.md", "results/gpu/summary.md", "results/gpu/status_b.json"} <= set(tar.getnames())
    with tarfile.open(tmp_path / "out/gpu_runs.tar.gz") as tar:
        assert "outputs/gpu_check/logs/c1.log" in tar.getnames()
    assert "| c | incomplete |" in (tmp_path / "out/summary.md").read_text()


def test_missing_asset_fails_in_one_line(tmp_path):
    proc = wrapper("--parts", "b,c", "--stage", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("gpu_check: error:") and "llama2-tokenizer is missing" in proc.stderr
    assert not (tmp_path / "site").exists()  # nothing ran


def test_smollm2_parts_assemble_and_a_corrupt_part_is_refused(tmp_path, monkeypatch):
    payload = bytes(range(256)) * 1000
    monkeypatch.setattr(gpu, "SMOL_PACKAGE", "gpu_check_test_pkg_absent")
    names = [f"{gpu.SMOL_FILE}.part1", f"{gpu.SMOL_FILE}.part2"]
    manifest = {"file": gpu.SMOL_FILE, "size": len(payload), "sha256": __import__("hashlib").sha256(payload).hexdigest(), "parts": names}
    assert gpu.missing_assets([gpu.Part("a", "", ("smollm2",), [])], tmp_path).startswith("SmolLM2's GGUF is not installed")
    for folder, name, chunk in zip(gpu.smol_parts(tmp_path), names, (payload[:1000], payload[1000:])):
        folder.mkdir()
        (folder / name).write_bytes(chunk)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    (gpu.smol_parts(tmp_path)[1] / "__init__.py").write_text("")
    assert gpu.missing_assets([gpu.Part("a", "", ("smollm2",), [])], tmp_path) is None
    assert gpu.assemble_smollm2(tmp_path) == "assembled from two parts"
    assert (tmp_path / "site" / "gpu_check_test_pkg_absent" / gpu.SMOL_FILE).read_bytes() == payload
    assert gpu.assemble_smollm2(tmp_path) == "installed"
    shutil.rmtree(tmp_path / "site")
    (gpu.smol_parts(tmp_path)[0] / names[0]).write_bytes(b"x" * 1000)
    with pytest.raises(gpu.Fatal, match="SHA-256"):
        gpu.assemble_smollm2(tmp_path)


def test_machine_check_refuses_a_machine_without_cuda_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = wrapper("--machine-check", timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "CUDA is not available" in proc.stderr


# ------------------------------------------------------------------- the tables, from the plan's own commands

CPU_NEEDLE = dict(model="tiny-random", model__device="cpu", task__lengths="[1536]", task__depths="[50]", task__max_new_tokens=4)
TINY_LWM = dict(model__device="cpu", model__architecture__hidden_size=64, model__architecture__intermediate_size=128,
                model__architecture__num_hidden_layers=2, model__architecture__num_attention_heads=4,
                model__architecture__num_key_value_heads=4, task__isolation="none")


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """Parts a (its SDPA methods run), b and c's commands as planned, on CPU with tiny random-weight models (the
    GPU's models swapped out), run at once: {name: run dir}. (Eager vs SDPA decoding itself is held by
    tests/methods/test_engine.py; here the eager side is a copy of the SDPA run, one cell of it altered.)"""
    root = tmp_path_factory.mktemp("gpu_check")
    stage = root / "stage"
    gpu.make_tokenizer(stage / "llama2-tokenizer")
    plan = gpu.build_plan(stage=stage, maxlen_upper=2048)
    dirs = {"a1": root / "outputs/gpu_check/a_sdpa", "bc": root / "outputs/gpu_check/bc"}
    bench = gpu.step_of(plan, "b1").argv
    search = [a for a in gpu.step_of(plan, "c1").argv if a.startswith(("task.max_length_search", "task.memory_cap_gb", "task.search_"))]
    commands = {
        "a1": substitute(gpu.step_of(plan, "a1").argv, **CPU_NEEDLE),
        # part b's command with part c's search options: one process gives both tables their records
        "bc": substitute(bench + search, **TINY_LWM, task__context_lengths="[1536,2048]", task__decode_tokens=4,
                         task__search_resolution=512),
    }
    procs = {}
    for name, argv in commands.items():
        argv = substitute(gpu.expand(argv, sys.executable), hydra__run__dir=str(dirs[name]))
        procs[name] = subprocess.Popen(argv, cwd=REPO, env=gpu.step_env(stage), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {out[-3000:]}"
    return root, plan, dirs


def part(plan, key, **run_dirs):
    """The plan's part with its steps' run directories pointed at the CPU runs."""
    p = next(p for p in plan if p.key == key)
    steps = [gpu.Step(**{**s.__dict__, "run_dir": str(run_dirs.get(s.name, s.run_dir)) if s.run_dir else None}) for s in p.steps]
    return gpu.Part(p.key, p.title, p.needs, steps, p.tables)


def ok(*names, wall=1.0):
    return {n: gpu.Outcome(n, "ok", wall, 0) for n in names}


def test_part_a_table_counts_identical_cells_and_names_a_difference(cpu_runs, monkeypatch, tmp_path):
    root, plan, dirs = cpu_runs
    monkeypatch.setattr(gpu, "ROOT", tmp_path)
    shutil.copytree(dirs["a1"], tmp_path / "eager")
    a = part(plan, "a", a1=dirs["a1"], a2=tmp_path / "eager")
    plan = [a if p.key == "a" else p for p in plan]
    sdpa = gpu.needle_cells(dirs["a1"])
    assert len(sdpa) == len(gpu.METHODS) and all(len(cells) == 1 for cells in sdpa.values())
    compressed = [t for t in sdpa if next(iter(sdpa[t].values())).get("kv_positions_after_prefill")]
    assert len(compressed) == len(gpu.METHODS) - 1  # every method but full kept positions to compare
    headline = gpu.build_a(a, ok("a0", "a1", "a2"), plan)
    assert headline == f"{len(gpu.METHODS)}/{len(gpu.METHODS)} cells identical across {len(gpu.METHODS)} settings"
    table = json.loads((tmp_path / "results/gpu/a_sdpa_vs_eager.json").read_text())
    assert [r[0] for r in table["rows"]] == sorted(sdpa)
    assert (tmp_path / "results/gpu/a_sdpa_vs_eager.md").read_text().count("\n| ") == len(gpu.METHODS) + 1

    # a flipped token in one eager cell, or one layer keeping another number of positions, is found and named
    for tag, change in ((compressed[0], "response"), (compressed[1], "kv_positions_after_prefill")):
        path = tmp_path / "eager" / tag / "needle_cells.jsonl"
        original = path.read_text()
        record = json.loads(original.splitlines()[0])
        if change == "response":
            record["response"] += " flipped"
        else:
            record["kv_positions_after_prefill"][0][1] -= 1
        path.write_text(json.dumps(record) + "\n")
        assert gpu.build_a(a, ok("a0", "a1", "a2"), plan).startswith(f"{len(gpu.METHODS) - 1}/{len(gpu.METHODS)} cells identical")
        row = next(r for r in json.loads((tmp_path / "results/gpu/a_sdpa_vs_eager.json").read_text())["comparison"] if r["tag"] == tag)
        assert row["identical"] == 0 and row["first_difference"]["length"] == 1536
        assert row["first_difference"]["right"].endswith(" flipped") == (change == "response")
        path.write_text(original)


def test_part_d_table_gives_the_ratio_identity_and_the_batched_decode_row(cpu_runs, monkeypatch, tmp_path):
    root, plan, dirs = cpu_runs
    monkeypatch.setattr(gpu, "ROOT", tmp_path)
    shutil.copytree(dirs["a1"], tmp_path / "shared")
    shutil.copytree(dirs["a1"], tmp_path / "separate")  # separate runs write the same <tag>/ layout
    a, d = part(plan, "a", a1=tmp_path / "shared"), part(plan, "d", d1=tmp_path / "separate")
    plan = [a if p.key == "a" else d if p.key == "d" else p for p in plan]
    walls = {"d1": 10.0, "d2": 11.0, "d3": 9.0, "d4": 12.0, "d5": 8.0}
    done = {n: gpu.Outcome(n, "ok", w, 0) for n, w in walls.items()} | {"a1": gpu.Outcome("a1", "ok", 20.0, 0)}
    headline = gpu.build_d(d, done, plan)
    assert headline == f"shared/separate {round(20.0 / 50.0, 3)}x"
    table = json.loads((tmp_path / "results/gpu/d_shared_prefill.json").read_text())
    assert table["shared_over_separate"] == 0.4
    assert all(r["identical"] == r["cells"] == 1 for r in table["identity"])
    has_batched = any("decoded_with" in json.loads(line) for f in (tmp_path / "shared").glob("*/needle_cells.jsonl")
                      for line in f.read_text().splitlines())
    last = table["rows"][-1]
    if has_batched:
        assert "no override known" in last[2]
    else:
        assert last[2] == "not available in this code version"
    # a separate run that ran out of its box leaves the ratio unmeasured rather than wrong
    done["d3"] = gpu.Outcome("d3", "timed out", 14.0, None, "killed at its 14 s box")
    assert gpu.build_d(d, done, plan) == "shared-prefill ratio not measured"


def test_parts_b_and_c_tables_from_the_bench_records_and_a_cut_short_search(cpu_runs, monkeypatch, tmp_path):
    root, plan, dirs = cpu_runs
    monkeypatch.setattr(gpu, "ROOT", tmp_path)
    shutil.copytree(dirs["bc"], tmp_path / "bc")
    b = part(plan, "b", b1=tmp_path / "bc")
    b.steps[0].argv = substitute(b.steps[0].argv, task__context_lengths="[1536,2048]")
    headline = gpu.build_b(b, ok("b1"), plan)
    rows = [json.loads(line) for line in (tmp_path / "bc/bench_rows.jsonl").read_text().splitlines()]
    table = json.loads((tmp_path / "results/gpu/b_bench.json").read_text())
    assert len(table["rows"]) == 4 and "Every step finished." in table["notes"][1]
    for label, length, prefill, per_token, kv_mib, *_ in [r[:2] + [r[2], r[4], r[7]] for r in table["rows"]]:
        row = next(r for r in rows if r["label"] == label and r["length"] == length)
        assert prefill == row["prefill_s"] and kv_mib == round(row["kv_bytes"] / 2**20, 1)
        assert per_token == pytest.approx(row["decode_ms_per_token"], rel=1e-3)
    snap = next(e for e in table["aggregate"] if e["label"] == "snapkv-c1024" and e["length"] == 2048)
    assert snap["kept_tokens"] == [1024] and snap["kv_matches_analytic"]  # SnapKV C1024 really compressed
    assert headline.startswith("at 2048: decode")
    planned = {(r[0], r[1]): r[11] for r in table["rows"]}  # the plan (task=plan) beside each measured peak
    assert all(isinstance(v, float) and v > 12 for v in planned.values()), planned  # LWM's bf16 weights alone: 12.55 GiB
    assert planned[("full", 2048)] > planned[("snapkv-c1024", 2048)]

    c = part(plan, "c", c1=tmp_path / "bc")
    c.steps[0].argv = substitute(c.steps[0].argv, task__search_max=2048)
    assert gpu.build_c(c, ok("c1"), plan) == "SnapKV 2048 tokens (fits at 2048), full 2048"
    table = json.loads((tmp_path / "results/gpu/c_max_length.json").read_text())
    assert table["search_finished"] and [r[1] for r in table["rows"]] == [2048, 2048]

    # cut short: the process was killed after SnapKV's probe, before full's, and wrote no results.json
    (tmp_path / "bc/results.json").unlink()
    log = tmp_path / "bc/bench_search.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines() if json.loads(line)["label"] != "full"))
    killed = {"c1": gpu.Outcome("c1", "timed out", 175.0, None, "killed at its 175 s box")}
    assert gpu.build_c(c, killed, plan) == "SnapKV 2048 tokens (fits at 2048), full –"
    notes = json.loads((tmp_path / "results/gpu/c_max_length.json").read_text())["notes"][1]
    assert "did not finish" in notes and "c1 timed out" in notes
