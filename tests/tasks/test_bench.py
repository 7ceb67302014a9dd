"""task=bench: KV bytes measured vs analytic, the end-to-end run on tiny-random, resume, the maximum-length
search (doubling + bisection on a fake memory model) and the worker process with a memory cap."""

from __future__ import annotations

import json
import time

import pytest
import torch

from conftest import compose

MEAN = {"label": "mean", "name": "snapkv", "budget": 64, "window_size": 8, "kernel_size": 5, "pooling": "maxpool", "gqa": "mean"}
EXPAND = {**MEAN, "label": "expand", "gqa": "expand"}
FULL = {"label": "full", "name": "full"}


def _opts(m):
    return {k: v for k, v in m.items() if k != "label"}


def _methods_override(methods) -> str:
    body = ",".join("{" + ",".join(f"{k}: {v}" for k, v in m.items()) + "}" for m in methods)
    return f"task.methods=[{body}]"


@pytest.fixture
def one_thread():
    """Other work may share this 2-core machine; one thread keeps tiny-model timings from thrashing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------- KV bytes

@pytest.mark.parametrize("method", [FULL, MEAN, EXPAND], ids=lambda m: m["label"])
@pytest.mark.parametrize("batch", [1, 2])
def test_kv_bytes_measured_equal_analytic(tiny_random, one_thread, method, batch):
    from harness.tasks.bench.worker import measure

    r = measure(tiny_random.model, _opts(method), 256, batch_size=batch, decode_tokens=3, seed=0)
    # tiny-random: 2 layers, 4 query heads, 2 KV heads, head_dim 16, float32
    heads = {"full": 2, "mean": 2, "expand": 4}[method["label"]]
    kept = 256 if method["label"] == "full" else 64
    assert r["kv_bytes"] == r["kv_bytes_analytic"] == 2 * batch * heads * kept * 16 * 2 * 4
    assert r["cache_heads"] == [heads] and r["kept_tokens"] == [kept]
    assert r["kv_bytes_final"] == 2 * batch * heads * (kept + 3) * 16 * 2 * 4  # 3 decode steps appended
    assert r["decode_steps"] == 3 and len(r["step_ms"]) == 3
    assert (r["compress_calls"] == 2) == (method["name"] != "full")
    assert r["peak_bytes"] >= r["mem_before_bytes"] > 0


def test_short_prompt_is_not_compressed(tiny_random, one_thread):
    from harness.tasks.bench.worker import measure

    r = measure(tiny_random.model, _opts(EXPAND), 48, batch_size=1, decode_tokens=2, seed=0)
    assert r["kept_tokens"] == [48] and r["cache_heads"] == [2]  # shorter than the budget: kept whole, KV heads
    assert r["kv_bytes"] == r["kv_bytes_analytic"]


def test_analytic_ratios_smollm2_shape():
    """The issue's targets on SmolLM2's shape (30 layers, 9 query / 3 KV heads): full / SnapKV-1024 at 8K = 8 (mean), 8/3 (expand)."""
    from harness.methods import build_method
    from harness.tasks.bench.worker import analytic_kv_bytes

    dims = {"layers": 30, "query_heads": 9, "kv_heads": 3, "head_dim": 64}
    full, _ = analytic_kv_bytes(dims, build_method({"name": "full"}), 8192, 1, 4)
    mean, _ = analytic_kv_bytes(dims, build_method({**_opts(MEAN), "budget": 1024, "window_size": 32}), 8192, 1, 4)
    expand, _ = analytic_kv_bytes(dims, build_method({**_opts(EXPAND), "budget": 1024, "window_size": 32}), 8192, 1, 4)
    assert full == 30 * 3 * 8192 * 64 * 2 * 4
    assert full / mean == 8 and full / expand == pytest.approx(8 / 3)


# ------------------------------------------------------------------------------------------ search

def test_search_doubles_then_bisects_on_a_fake_memory_model():
    from harness.tasks.bench.task import search_max_length

    weights, per_token, cap = 500, 3, 50_000  # fits while weights + per_token * n <= cap: n <= 16500
    out = search_max_length(lambda n: weights + per_token * n <= cap, start=1024, resolution=512, upper=1 << 20)
    assert out["max_length"] <= 16500 < out["first_failure"]
    assert out["first_failure"] - out["max_length"] <= 512
    lengths = [n for n, _ in out["probes"]]
    assert lengths[:6] == [1024, 2048, 4096, 8192, 16384, 32768]  # doubling up to the first failure
    assert len(lengths) == len(set(lengths)) and len(lengths) <= 6 + 5  # then log2(16384 / 512) bisection steps
    assert not out["reached_upper"]


def test_search_edges():
    from harness.tasks.bench.task import search_max_length

    assert search_max_length(lambda n: True, start=1000, resolution=10, upper=5000) == {
        "max_length": 5000, "first_failure": None, "reached_upper": True,
        "probes": [(1000, True), (2000, True), (4000, True), (5000, True)]}
    nothing = search_max_length(lambda n: False, start=1024, resolution=512, upper=8192)
    assert nothing["max_length"] == 0 and nothing["first_failure"] == 512  # bisects below the start
    small = search_max_length(lambda n: n <= 300, start=1024, resolution=16, upper=8192)
    assert 300 - 16 <= small["max_length"] <= 300 < small["first_failure"]


# ------------------------------------------------------------------------------------------ end to end

def _bench_cfg(*extra):
    return compose("task=bench", "model=tiny-random", _methods_override([FULL, MEAN, EXPAND]), "task.context_lengths=[64,256]",
                   "task.decode_tokens=4", "task.repeats=2", "task.warmup=1", "task.isolation=none", "task.threads=1",
                   "progress=false", *extra)


def test_bench_end_to_end_then_resume(tmp_path, monkeypatch):
    from harness.app import execute
    from harness.tasks.bench import worker as bench_worker

    cfg = _bench_cfg()
    results = execute(cfg, tmp_path)
    rows = results["rows"]
    assert len(rows) == 3 * 2 * 2 and results["failures"] == 0
    assert [(r["label"], r["length"], r["repeat"]) for r in rows[:6]] == [
        ("full", 64, 0), ("mean", 64, 0), ("expand", 64, 0), ("full", 256, 0), ("mean", 256, 0), ("expand", 256, 0)]
    checksums = {(r["length"]): set() for r in rows}
    for r in rows:
        checksums[r["length"]].add(r["prompt_checksum"])
    assert all(len(v) == 1 for v in checksums.values())  # the same prompt for every method at a length
    summary = results["summary"]
    assert summary["kv_bytes_match_analytic"] is True
    at256 = summary["by_method"]
    assert at256["mean"]["256"]["kv_full_over_this"] == 4.0 and at256["expand"]["256"]["kv_full_over_this"] == 2.0
    assert at256["full"]["256"]["decode_vs_full"] == 1.0
    for name in ("results.json", "bench_table.md", "bench_decode_latency.png", "bench_peak_memory.png", "bench_rows.jsonl"):
        assert (tmp_path / name).exists(), name
    table = (tmp_path / "bench_table.md").read_text()
    assert "| mean | 256 |" in table and "4.00x" in table and "2.00x" in table
    assert json.loads((tmp_path / "results.json").read_text())["summary"]["measurements"] == 12

    # Resume: drop two finished rows; a rerun measures exactly those two and keeps the others.
    log_path = tmp_path / "bench_rows.jsonl"
    lines = log_path.read_text().splitlines(keepends=True)
    log_path.write_text("".join(lines[:-2]))
    calls = []
    real = bench_worker.WorkerCore.handle

    def counting(self, request):
        calls.append((request["method"]["name"], request["length"]))
        return real(self, request)

    monkeypatch.setattr(bench_worker.WorkerCore, "handle", counting)
    again = execute(cfg, tmp_path)
    assert len(calls) == 2 and len(again["rows"]) == 12
    kept = {(d["label"], d["length"], d["repeat"]): d["finished_at"] for d in map(json.loads, lines[:-2])}
    assert all(r["finished_at"] == kept[(r["label"], r["length"], r["repeat"])] for r in again["rows"]
               if (r["label"], r["length"], r["repeat"]) in kept)
    calls.clear()
    execute(cfg, tmp_path)  # everything done: no model is even loaded
    assert calls == []


def test_bench_search_in_process(tmp_path):
    from harness.app import execute

    cfg = _bench_cfg("task.context_lengths=[64]", "task.repeats=1", "task.warmup=0", "task.max_length_search=true",
                     "task.memory_cap_gb=100", "task.search_start=32", "task.search_resolution=16", "task.search_max=128",
                     "task.search_decode_tokens=2", "task.plots=false", "task.search_by=measure")
    results = execute(cfg, tmp_path)
    search = results["search"]["methods"]
    assert all(s["max_length"] == 128 and s["reached_upper"] for s in search.values())
    assert results["summary"]["max_length_vs_full"] == {"full": 1.0, "mean": 1.0, "expand": 1.0}
    assert "Maximum prompt length" in (tmp_path / "bench_table.md").read_text()
    # A cap below the loaded model's own memory: nothing fits, reported as 0 (ratio undefined), no crash.
    low = execute(_bench_cfg("task.context_lengths=[64]", "task.repeats=1", "task.warmup=0", "task.max_length_search=true",
                             "task.memory_cap_gb=0.01", "task.search_start=32", "task.search_resolution=16", "task.search_max=64",
                             "task.search_decode_tokens=2", "task.plots=false", "task.search_by=measure"), tmp_path / "low")
    assert all(s["max_length"] == 0 for s in low["search"]["methods"].values())


def test_bench_search_finds_the_length_where_the_cap_binds(tmp_path):
    """A cap between the peaks of the shortest and the longest probe: the search must stop strictly between them,
    at a length whose measured peak fits, next to one whose peak does not. The cap comes from a first search under a
    cap that everything fits (its probes record each length's peak): the midpoint of the 64- and 1024-token peaks."""
    from harness.app import execute

    def search(cap_gb, run):
        cfg = _bench_cfg(_methods_override([FULL]), "task.context_lengths=[64]", "task.repeats=0", "task.warmup=0",
                         "task.batch_size=32", "task.max_length_search=true", f"task.memory_cap_gb={cap_gb}", "task.search_start=64",
                         "task.search_resolution=128", "task.search_max=1024", "task.search_decode_tokens=2", "task.plots=false", "task.search_by=measure")
        return execute(cfg, tmp_path / run)["search"]

    free = search(100, "free")
    assert free["methods"]["full"]["max_length"] == 1024
    probes = [json.loads(line) for line in (tmp_path / "free" / "bench_search.jsonl").read_text().splitlines()]
    peak = {p["length"]: p["peak_bytes"] for p in probes}
    assert sorted(peak) == [64, 128, 256, 512, 1024]
    assert peak[1024] - peak[64] > 40 * 2**20, peak  # 32 x 960 more tokens: ~80 MB of activations and cache
    cap = (peak[64] + peak[1024]) / 2
    bound = search(cap / 1024**3, "bound")["methods"]["full"]
    assert 64 <= bound["max_length"] < bound["first_failure"] <= 1024 and not bound["reached_upper"], bound
    assert bound["first_failure"] - bound["max_length"] <= 128
    for p in map(json.loads, (tmp_path / "bound" / "bench_search.jsonl").read_text().splitlines()):
        assert p["fits"] == (p["peak_bytes"] <= int(cap)), p  # a probe fits exactly when its measured peak is under the cap


def test_validate_rejects_bad_task_configs():
    from harness.errors import HarnessError
    from harness.tasks.bench.task import validate

    with pytest.raises(HarnessError, match="unique"):
        validate(compose("task=bench", _methods_override([FULL, FULL])).task)
    with pytest.raises(HarnessError, match="no option"):
        validate(compose("task=bench", _methods_override([{**FULL, "kernel_size": 3}])).task)  # full ignores budget, not this
    with pytest.raises(HarnessError, match="memory_cap_gb"):
        validate(compose("task=bench", "task.max_length_search=true").task)


# ------------------------------------------------------------------------------------------ worker process

def test_worker_process_peak_and_memory_cap(tmp_path):
    """A persistent worker: per-measurement peaks, and under a memory cap an oversized request fails as
    out-of-memory (RLIMIT_AS) while the worker lives on and serves the next request."""
    from omegaconf import OmegaConf

    from harness.tasks.bench.task import PerMethodRunner

    init = {"model": OmegaConf.to_container(compose("model=tiny-random").model, resolve=True), "seed": 0, "threads": 1,
            "warmup": 1, "warmup_length": 32, "decode_tokens": 2, "batch_size": 1, "memory_cap_bytes": int(1.5 * 1024**3)}
    runner = PerMethodRunner(init, {"mean": MEAN}, tmp_path)
    try:
        small = {"method": _opts(MEAN), "length": 128, "batch_size": 1, "decode_tokens": 2, "seed": 0}
        ok = runner.request("mean", small)
        assert ok["ok"], ok
        res = ok["result"]
        import os

        assert res["worker_pid"] != os.getpid() and res["peak_bytes"] >= res["mem_before_bytes"] > 0
        if runner.infos["mean"]["memory_cap"]["kind"] != "rlimit_as":
            pytest.skip("no /proc here: the CPU memory cap (RLIMIT_AS relative to the resident size) is not armed")
        huge = runner.request("mean", {**small, "length": 8192, "batch_size": 4096})  # 8 GB for the embeddings alone
        assert not huge["ok"] and huge["oom"], huge
        again = runner.request("mean", small)
        assert again["ok"] and again["result"]["worker_pid"] == res["worker_pid"]
        assert again["result"]["kv_bytes"] == res["kv_bytes"]
    finally:
        runner.close()


# ------------------------------------------------------------------------------------------ timing and devices

class _FakeCuda:
    """Stands in for torch.cuda on a CPU-only machine: per-device memory counters, events, and a log of
    every host synchronisation."""

    def __init__(self, allocated: dict[int, int], peaks: dict[int, int], total: int = 80 * 1024**3):
        self.allocated, self.peaks, self.total = allocated, peaks, total
        self.syncs: list = []
        self.resets: list = []
        self.fractions: dict = {}
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                import time

                self.t = time.perf_counter()
                self.stream = stream

            def synchronize(self):
                fake.syncs.append(("event", self.stream))

            def elapsed_time(self, end):
                return 1000.0 * (end.t - self.t)  # milliseconds, as CUDA events report

        self.Event = Event

    def install(self, monkeypatch):
        idx = lambda d: torch.device(d).index  # noqa: E731
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", str(device)))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.syncs.append(("device", str(device))))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: self.resets.append(idx(d)))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: self.allocated[idx(d)])
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: self.peaks[idx(d)])
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": self.total})())
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: self.fractions.__setitem__(idx(d), f))
        return self


def test_compress_timer_never_synchronises_inside_the_prefill(monkeypatch):
    """CUDA: two events per selection, recorded on the keys' device's stream; the host waits only in finish()."""
    from harness.tasks.bench.worker import CompressTimer

    fake = _FakeCuda({}, {}).install(monkeypatch)

    class Method:
        def select(self, keys, values, stats):
            return keys, values

    method = Method()
    timer = CompressTimer(method, torch.device("cuda", 0))
    k = torch.zeros(1, 2, 8, 4)
    for _ in range(3):
        assert method.select(k, k, None)[0] is k
    assert fake.syncs == [] and timer.calls == 3 and timer.seconds == 0.0  # nothing read back yet
    total = timer.finish()
    assert timer.source == "cuda_events" and total >= 0 and total == timer.seconds
    assert [kind for kind, _ in fake.syncs] == ["event"] * 3  # only the events, after the measurement

    class Session:  # the capture: events around prompt forwards' calls, none around decode steps
        def on_attention(self, module, query, key, mask):
            return mask

    session = Session()
    timer.watch_capture(session)
    fake.syncs.clear()
    assert session.on_attention(None, torch.zeros(1, 2, 8, 4), k, "mask") == "mask"  # a prompt forward: timed
    assert session.on_attention(None, torch.zeros(1, 2, 1, 4), k, "mask") == "mask"  # a decode step: not timed
    assert fake.syncs == [] and timer.capture_calls == 1
    timer.finish()
    assert [kind for kind, _ in fake.syncs] == ["event"] and timer.seconds == pytest.approx(sum(timer.parts.values()))


def test_compress_time_includes_the_capture_of_h2os_column_sums(tiny_random, one_thread, monkeypatch):
    """H2O's main cost, its attention column sums, is computed in the observer during the prompt's attention, not in
    `select`: compress_s counts it (capture + select). A known delay injected into the column sums must show up there."""
    from harness.methods import attention as h2o
    from harness.tasks.bench.worker import measure

    real, calls, delay = h2o.accumulated_attention, [], 0.05

    def slow(*args, **kwargs):
        calls.append(1)
        time.sleep(delay)
        return real(*args, **kwargs)

    monkeypatch.setattr(h2o, "accumulated_attention", slow)
    r = measure(tiny_random.model, {"name": "h2o", "budget": 64, "window_size": 8}, 256, batch_size=1, decode_tokens=3, seed=0)
    assert len(calls) == 2, "the engine no longer computes H2O's column sums through h2o.accumulated_attention"
    assert r["capture_calls"] == 2 and r["compress_calls"] == 2  # one prompt forward x 2 layers; decode steps untimed
    assert r["compress_capture_s"] >= 2 * delay and r["compress_s"] >= 2 * delay
    assert r["compress_s"] == pytest.approx(r["compress_capture_s"] + r["compress_select_s"], abs=2e-5)
    assert r["compress_select_s"] < r["compress_capture_s"]


def test_compress_timing_on_cpu(tiny_random, one_thread):
    from harness.tasks.bench.worker import measure

    r = measure(tiny_random.model, _opts(MEAN), 256, batch_size=1, decode_tokens=2, seed=0)
    assert r["compress_timing"] == "perf_counter" and r["compress_calls"] == 2 and 0 < r["compress_s"] < r["prefill_s"]
    assert measure(tiny_random.model, _opts(FULL), 64, batch_size=1, decode_tokens=2, seed=0)["compress_timing"] is None


def test_devices_peaks_and_caps_cover_every_gpu_of_a_device_map(monkeypatch):
    from harness.tasks.bench.worker import PeakMeter, arm_memory_cap, disarm_memory_cap, model_devices

    class Sharded(torch.nn.Module):  # what device_map=auto leaves: hf_device_map (parameters here are on CPU)
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)
            self.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cuda:1", "lm_head": 1,
                                  "model.norm": "cpu"}

    devices = model_devices(Sharded())
    assert devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert model_devices(torch.nn.Linear(2, 2)) == [torch.device("cpu")]

    fake = _FakeCuda(allocated={0: 100, 1: 50}, peaks={0: 400, 1: 250}).install(monkeypatch)
    with PeakMeter(devices) as meter:
        pass
    rec = meter.record()
    assert sorted(fake.resets) == [0, 1] and {d for kind, d in fake.syncs} == {"cuda:0", "cuda:1"}
    assert rec["mem_before_bytes"] == 150 and rec["peak_bytes"] == 650 and rec["peak_increase_bytes"] == 500
    assert rec["peak_bytes_per_device"] == {"cuda:0": 400, "cuda:1": 250} and "2 devices" in rec["peak_source"]

    cap = arm_memory_cap(20 * 1024**3, devices)
    assert fake.fractions == {0: 0.25, 1: 0.25} and cap["kind"] == "cuda_memory_fraction"
    disarm_memory_cap(devices)
    assert fake.fractions == {0: 1.0, 1: 1.0}


def test_decode_is_reported_per_step_and_per_token():
    """Batch 2: one decode step yields two tokens; the table says ms/step and ms/token (= ms/step / 2)."""
    from harness.tasks.bench.task import aggregate, markdown, summarize

    def row(label, name, step_ms):
        return {"label": label, "length": 1024, "repeat": 0, "method": {"name": name}, "batch_size": 2, "prefill_s": 1.0,
                "compress_s": 0.0, "decode_median_ms": step_ms, "step_ms": [step_ms] * 4, "kv_bytes": 10, "kv_bytes_analytic": 10,
                "cache_heads": [2], "kept_tokens": [1024], "peak_increase_bytes": 1, "peak_bytes": 2, "peak_source": "x"}

    rows = [row("full", "full", 30.0), row("snap", "snapkv", 20.0)]
    table = aggregate(rows, ["full", "snap"], [1024])
    snap = table[1]
    assert snap["decode_median_ms"] == 20.0 and snap["decode_ms_per_token"] == 10.0
    assert snap["decode_tokens_per_s"] == pytest.approx(100.0)  # 2 tokens per 20 ms step
    cfg = compose("task=bench", "model=tiny-random", "task.batch_size=2")
    text = markdown(table, summarize(table, ["full", "snap"], [1024], "none", rows, None), None, cfg, "none")
    assert "decode ms/step median" in text and "| ms/token |" in text and "ms/tok median" not in text
    assert "| snap | 1024 | 1.00 | 0.000 (0.0%) | +0.0% | 20.0 | 20.0 | 10.0 | 100.0 |" in text


def test_kv_bytes_of_hybrid_sliding_layers(one_thread):
    """Gemma 3's hybrid cache: sliding-window layers keep W - 1 positions and are never compressed."""
    from tiny_models import tiny_model

    from harness.tasks.bench.worker import measure

    model = tiny_model("gemma3")  # 6 layers: 5 sliding (window 16) + 1 full
    for method, heads, kept in ((FULL, [2], [15, 256]), (MEAN, [2], [15, 64]), (EXPAND, [2, 4], [15, 64])):
        r = measure(model, _opts(method), 256, batch_size=1, decode_tokens=3, seed=0)
        assert r["kv_bytes"] == r["kv_bytes_analytic"], method["label"]
        assert r["kept_tokens"] == r["kept_tokens_analytic"] == kept and r["cache_heads"] == heads
    short = measure(model, _opts(FULL), 8, batch_size=1, decode_tokens=12, seed=0)  # 8 + 12 > 15: the window fills while decoding
    assert short["kept_tokens"] == [8] and short["kv_bytes"] == short["kv_bytes_analytic"]
