"""task=plan: the plan is the run. The same code path under fake tensors (no values, no compute) reaches the same
peak of live tensor bytes as the real run, to the byte where no shape depends on values, and never below the real
one where the plan chose a value-dependent split at its largest (`bound`)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.memory_plan import StorageTracker, largest_first
from harness.methods import build_method
from harness.methods.registry import METHODS
from tests.conftest import compose, run_cli

LENGTH, BUDGET, NEW = 512, 128, 2


@pytest.fixture(scope="module")
def twins(one_thread):
    """The tiny random model twice: real weights (a real run) and fake (its plan), from one config."""
    from harness.models import load_model
    from harness.tasks.plan.task import load_fake

    cfg = compose("model=tiny-random").model
    return load_model(cfg), load_fake(cfg, None, "cpu")


def method_of(name: str):
    overrides = [f"method={name}"]
    if "budget" in compose(f"method={name}").method:
        overrides.append(f"method.budget={BUDGET}")
    return build_method(compose(*overrides).method)


def run_and_plan(twins, methods, **options):
    from harness.tasks.plan.trace import trace_generation

    real, (fake, mode) = twins
    measured = trace_generation(real, methods, LENGTH, new_tokens=NEW, target="cpu", **options)
    planned = trace_generation(fake, methods, LENGTH, new_tokens=NEW, mode=mode, target="cpu", **options)
    assert planned["fake"] and not measured["fake"]
    return measured, planned


def check(measured, planned):
    if planned["bound"]:  # a value-dependent split planned at its largest: never below the run, and close to it
        assert planned["bound_reasons"]
        assert measured["peak_bytes"] <= planned["peak_bytes"] <= measured["peak_bytes"] * 1.01
    else:
        assert planned["peak_bytes"] == measured["peak_bytes"]
        assert planned["peak_phase"] == measured["peak_phase"]
        assert planned["kv_cache_bytes"] == measured["kv_cache_bytes"]


@pytest.mark.parametrize("protocol", ["one_shot_query_aware", "chunked_query_agnostic"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_plan_equals_run_for_every_registered_method(twins, name, protocol):
    options = ({"query_aware": True} if protocol.startswith("one_shot") else
               {"query_aware": False, "question_tokens": 16, "chunk_size": 128})
    check(*run_and_plan(twins, [(name, method_of(name))], **options))


@pytest.mark.parametrize("query_aware", [True, False])
def test_plan_equals_run_for_a_methods_list_sharing_one_prefill(twins, query_aware):
    methods = [(n, method_of(n)) for n in ("full", "snapkv", "h2o", "streamingllm")]
    measured, planned = run_and_plan(twins, methods, query_aware=query_aware, question_tokens=16)
    check(measured, planned)


def test_plan_equals_run_at_batch_two(twins):
    check(*run_and_plan(twins, [("snapkv", method_of("snapkv"))], batch_size=2))


def test_tracker_counts_a_storage_once_and_frees_it():
    tracker = StorageTracker()
    with torch.inference_mode(), tracker:
        a = torch.zeros(1000)  # 4000 bytes
        view = a[10:20]  # a view: no new storage
        b = a + 1  # a new storage
        assert tracker.current == 8000
        del b
        assert tracker.current == 4000
        del view, a
    assert tracker.current == 0 and tracker.peak.bytes == 8000


def test_largest_first_split_sums_to_the_total_within_caps():
    assert largest_first(10, 3, 6) == [6, 4, 0]
    assert largest_first(10, 3, 6, floor=2) == [6, 2, 2]
    assert sum(largest_first(1000, 8, 300, floor=5)) == 1000


def test_plan_cli_writes_rows_table_picture_and_longest_prompt(tmp_path):
    out = tmp_path / "plan"
    proc = run_cli("task=plan", "model=tiny-random", "methods=[full,{name: snapkv, budget: 64, window_size: 8}]",
                   "task.lengths=[256,1024]", "task.new_tokens=2", "task.gpu_memory_gb=0.015625", "task.reserve_gb=0",
                   "task.search=true", "task.search_start=256", "task.length_step=256", "task.search_max=8192",
                   f"hydra.run.dir={out}", "progress=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "plan_rows.jsonl").read_text().splitlines()]
    for r in rows:
        assert {"setting", "length", "batch_size", "peak_bytes", "peak_phase", "fits"} <= set(r)
        assert r["fits"] == (r["peak_bytes"] <= 0.015625 * (1 << 30))
    summary = json.loads((out / "plan_summary.json").read_text())
    longest = {s["setting"]: s["max_length"] for s in summary["max_length"]}
    assert longest["full"] < longest["snapkv_c64_w8_k7_maxpool_expand"]
    by_key = {(r["setting"], r["length"]): r for r in rows}
    for setting, n in longest.items():  # the longest that fits fits, one step more does not
        assert by_key[(setting, n)]["fits"] and not by_key[(setting, n + 256)]["fits"]
    assert (out / "plan_table.md").exists() and (out / "plan_table.csv").exists() and (out / "plan_peak.png").exists()


def test_bench_gains_planned_columns_and_plans_its_search_without_a_gpu(tmp_path):
    """task=bench on this CPU: the plan's KV bytes equal the measured ones; the maximum-length search is planned."""
    from harness.app import execute

    cfg = compose("task=bench", "model=tiny-random", "task.methods=[{label: full, name: full},{label: snapkv, name: snapkv, "
                  "budget: 32, window_size: 8}]", "task.context_lengths=[128]", "task.decode_tokens=2", "task.repeats=1",
                  "task.warmup=0", "task.isolation=none", "task.threads=1", "progress=false", "task.plots=false",
                  "task.max_length_search=true", "task.memory_cap_gb=0.015625", "task.plan_reserve_gb=0", "task.search_start=256",
                  "task.search_resolution=256", "task.search_max=4096", "task.search_decode_tokens=1")
    results = execute(cfg, tmp_path)
    for label, entry in results["summary"]["by_method"].items():
        got = entry["128"]
        assert got["kv_bytes_planned"] == got["kv_bytes"], label
        assert got["peak_bytes_planned"] > got["peak_increase_bytes_planned"] > 0
    search = results["search"]
    assert search["planned"] and search["methods"]["full"]["max_length"] < search["methods"]["snapkv"]["max_length"]
    assert "planned (no GPU here" in (tmp_path / "bench_table.md").read_text()
