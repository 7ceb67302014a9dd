"""One efficiency measurement, and the worker process that serves them (`python -m harness.tasks.bench.worker`).

A measurement is one greedy generation of `decode_tokens` tokens (EOS disabled) after a prefill of a
random-token prompt of `length` tokens, batch `batch_size`, under one compression method. It
reports the prefill time, the time spent inside the method's `compress` (summed over layers), the
per-step decode latencies, the KV-cache bytes after prefill (measured from the cache tensors and
the analytic value) and the peak memory of the measurement.

Compression time (`compress_s` = `compress_capture_s` + `compress_select_s`): the observer's capture
during the prompt's attention (the query window; H2O's attention column sums, its main cost) plus the
method's `select`, summed over layers (`CompressTimer`), measured without perturbing the timed
prefill. CPU: `perf_counter` around each call (execution is synchronous). CUDA: a pair of CUDA events
recorded on the current stream of the layer's device around each call, with no host synchronisation
inside the prefill; the events are read after the measurement. (Timing with `torch.cuda.synchronize`
around every call, as before, serialised the host and the device at every layer and lengthened the
very prefill it was part of.)

Peak memory:
- CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, summed over every CUDA
  device the model's weights are on (`device_map=auto` shards it), each synchronised before and after
  the measurement. `peak_bytes` includes the weights; `peak_increase_bytes` is the peak minus what was
  allocated just before the measurement; `peak_bytes_per_device` lists the per-device peaks (their sum
  is an upper bound of the simultaneous total: the devices peak at different layers).
- CPU: the process's resident high-water mark. Before each measurement the worker returns freed
  heap memory to the OS (`malloc_trim(0)`) and resets the high-water mark to the current RSS by
  writing 5 to /proc/self/clear_refs (Linux >= 4.0), so one persistent process yields a
  per-measurement peak: `peak_bytes` = VmHWM after the measurement, `peak_increase_bytes` =
  VmHWM - RSS before it. Where clear_refs is not writable the peak is `ru_maxrss`, which is
  only per-measurement in a fresh process (the bench then starts one process per measurement).
  RSS also counts freed memory that glibc's heap keeps: with glibc's default (dynamic) mmap
  threshold, SmolLM2 at 8K tokens peaked at +616 / +552 / +642 MB (full / SnapKV mean / expand,
  fresh processes), mostly retained heap, and the figures moved by +-150 MB between repeats. So
  during the prefill the worker sets M_MMAP_THRESHOLD to `prefill_mmap_threshold` (1 MiB by
  default): every large tensor is its own mapping, returned when freed, and the peak follows live
  memory (mean +271 MB, expand +364 MB: the 93 MB between them is the expanded cache's extra 90 MB).
  Decode steps run with glibc's steady-state threshold (32 MiB), as in any long-running process.

Protocol (one JSON object per line): the parent writes an init object, the worker loads the model,
warms up, optionally arms a memory cap, and answers {"ready": ...}; then each request line gets one
answer line {"ok": true, "result": {...}} or {"ok": false, "oom": bool, "error": ...}. The worker's
own stdout is redirected to stderr so that nothing but protocol lines reach the parent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import resource
import sys
import time
import traceback

import torch

from harness.decoding import greedy_generate
from harness.errors import is_out_of_memory
from harness.methods import build_method, compression
from harness.methods.engine import attention_modules

# ---------------------------------------------------------------------------------------------- memory

def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    return kb * 1024 if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def vm_size_bytes() -> int | None:
    kb = _status_kb("VmSize")
    return kb * 1024 if kb is not None else None


def reset_peak_rss() -> bool:
    """Reset the resident high-water mark to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    kb = _status_kb("VmHWM")
    return kb * 1024 if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_LIBC = None
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
DECODE_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's own dynamic maximum on 64-bit: its steady state


def _glibc():
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018  (glibc only)
            _LIBC.mallopt  # noqa: B018
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so the next peak counts what it touches."""
    gc.collect()
    if _glibc():
        _glibc().malloc_trim(0)


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc: allocations of at least `nbytes` get their own mmap and leave the resident set when freed."""
    return bool(_glibc()) and bool(_glibc().mallopt(M_MMAP_THRESHOLD, int(nbytes)))


def model_devices(model) -> list[torch.device]:
    """The devices a model's weights are on: every CUDA device of a `device_map` (sorted by index), else
    the one device of its parameters (CPU, or a single GPU)."""
    found: list[torch.device] = []
    for where in (getattr(model, "hf_device_map", None) or {}).values():
        if isinstance(where, int) or (isinstance(where, str) and where.isdigit()):
            found.append(torch.device("cuda", int(where)))
        elif isinstance(where, (str, torch.device)) and str(where).startswith("cuda"):
            d = torch.device(where)
            found.append(torch.device("cuda", d.index if d.index is not None else 0))
    for p in model.parameters():
        if p.device.type == "cuda":
            found.append(torch.device("cuda", p.device.index if p.device.index is not None else 0))
    cuda = sorted(set(found), key=lambda d: d.index)
    return cuda or [next(model.parameters()).device]


def cuda_allocated_bytes(devices: list[torch.device]) -> int:
    return int(sum(torch.cuda.memory_allocated(d) for d in devices))


class PeakMeter:
    """Peak memory of one measurement (see the module docstring): over every CUDA device in `devices`,
    or the process's resident memory on CPU."""

    def __init__(self, devices):
        self.devices = [devices] if isinstance(devices, torch.device) else list(devices)
        self.cuda = self.devices[0].type == "cuda"

    def __enter__(self):
        if self.cuda:
            for d in self.devices:
                torch.cuda.synchronize(d)
                torch.cuda.reset_peak_memory_stats(d)
            self.before = cuda_allocated_bytes(self.devices)
            self.source = "cuda.max_memory_allocated" + (f" (sum of {len(self.devices)} devices)" if len(self.devices) > 1 else "")
        else:
            release_free_memory()
            self.before = rss_bytes()
            self.source = "VmHWM(clear_refs)" if reset_peak_rss() else "ru_maxrss"
        return self

    def __exit__(self, *exc):
        self.per_device = None
        if self.cuda:
            for d in self.devices:
                torch.cuda.synchronize(d)
            self.per_device = [int(torch.cuda.max_memory_allocated(d)) for d in self.devices]
            self.peak = sum(self.per_device)
        else:
            self.peak = peak_rss_bytes() if self.source.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return False

    def record(self) -> dict:
        out = {"peak_bytes": int(self.peak), "mem_before_bytes": int(self.before),
               "peak_increase_bytes": int(max(0, self.peak - self.before)), "peak_source": self.source}
        if self.per_device is not None:
            out["peak_bytes_per_device"] = {str(d): b for d, b in zip(self.devices, self.per_device)}
        return out


def arm_memory_cap(cap_bytes: int, devices) -> dict:
    """Make allocations beyond `cap_bytes` fail in this process.

    CUDA: `set_per_process_memory_fraction(cap / total)` on every device in `devices` (the cap includes
    the weights, as on a smaller card; a model sharded over N GPUs runs as on N cards of `cap_bytes`).
    `disarm_memory_cap` undoes it. CPU: RLIMIT_AS = address space now + (cap - resident memory now), so the process
    can grow its resident memory (weights included) to about the cap; a failed allocation raises
    a RuntimeError/MemoryError that the worker reports as out of memory. Address space is counted
    before pages are touched, so the limit is slightly stricter than an RSS limit; the bench also
    checks the measured peak against the cap.
    """
    devices = [devices] if isinstance(devices, torch.device) else list(devices)
    if devices[0].type == "cuda":
        fractions = {}
        for d in devices:
            fractions[str(d)] = min(1.0, cap_bytes / torch.cuda.get_device_properties(d).total_memory)
            torch.cuda.set_per_process_memory_fraction(fractions[str(d)], d)
        return {"kind": "cuda_memory_fraction", "fraction": min(fractions.values()), "per_device": fractions}
    rss, vm = rss_bytes(), vm_size_bytes()
    if cap_bytes <= rss or vm is None:
        return {"kind": "none", "reason": f"cap {cap_bytes} is below the resident size after load ({rss})" if vm else "no /proc"}
    limit = vm + (cap_bytes - rss)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return {"kind": "rlimit_as", "limit_bytes": limit, "vm_at_arm": vm, "rss_at_arm": rss}


def disarm_memory_cap(devices) -> None:
    """Lift a CUDA cap armed by `arm_memory_cap` (the in-process runner's model outlives its bench)."""
    for d in [devices] if isinstance(devices, torch.device) else list(devices):
        if d.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, d)


# ------------------------------------------------------------------------------------------ measurement

def prompt_ids(seed: int, length: int, batch_size: int, vocab_size: int, device) -> torch.Tensor:
    """Random token ids, the same for every method at a given (seed, length, batch size)."""
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(length))
    return torch.randint(0, int(vocab_size), (int(batch_size), int(length)), generator=gen).to(device)


def model_dims(config) -> dict:
    heads = int(config.num_attention_heads)
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or (["sliding_attention" if window else "full_attention"] * layers)
    return {
        "layers": layers,
        "query_heads": heads,
        "kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        # per layer: the sliding window of a sliding-attention layer (Gemma 3: 5 of every 6), None for full attention
        "sliding_windows": [int(window) if t == "sliding_attention" and window else None for t in types],
    }


def analytic_kv_bytes(dims: dict, method, length: int, batch_size: int, dtype_bytes: int) -> tuple[int, list[int]]:
    """layers x heads x kept x head_dim x 2 (K and V) x dtype bytes (x batch), summed over layers.

    kept = the layer budget when the prompt is at least that long (shorter prompts stay whole, the
    official rule), else the prompt length; heads = query heads for gqa=expand on a compressed
    layer, KV heads otherwise. A sliding-window layer (window W) is never compressed: its own cache
    keeps min(length, W - 1) positions (transformers' DynamicSlidingWindowLayer), KV heads.
    Returns the bytes and the kept tokens per layer.
    """
    n = dims["layers"]
    windows = dims.get("sliding_windows") or [None] * n
    budgets = None
    if method is not None and method.compresses:
        if hasattr(method, "budgets_for_length"):
            budgets = method.budgets_for_length(n, length)
        else:
            budgets = [method.layer_budget(i, n) for i in range(n)]
    total, kept_per_layer = 0, []
    for i in range(n):
        budget = budgets[i] if budgets else None
        if windows[i]:
            kept, heads = min(length, windows[i] - 1), dims["kv_heads"]
        elif budget is None or length < budget:
            kept, heads = length, dims["kv_heads"]
        else:
            kept = int(budget)
            heads = dims["query_heads"] if getattr(method, "gqa", None) == "expand" else dims["kv_heads"]
        kept_per_layer.append(kept)
        total += batch_size * heads * kept * dims["head_dim"] * 2 * dtype_bytes
    return total, kept_per_layer


def measured_kv(cache, appended: int, prompt_length: int | None = None) -> dict:
    """Bytes of the cache tensors at the end, and after prefill: the end minus the `appended` decode positions,
    which decoding appends one per step to every layer and never evicts, except on a sliding-window layer,
    which holds min(positions so far, W - 1): after prefill it held min(prompt_length, what it holds now)."""
    final, after, heads, kept = 0, 0, [], []
    for layer in cache.layers:
        now = int(layer.keys.shape[-2])
        if getattr(layer, "is_sliding", False) and prompt_length is not None:
            at_prefill = min(int(prompt_length), now)
        elif getattr(layer, "_kvharness_ragged", False):  # one flat head: every step appended one entry per head
            at_prefill = now - appended * int(layer._kvharness_heads)
        else:
            at_prefill = now - appended
        for t in (layer.keys, layer.values):
            per_position = t.numel() // t.shape[-2] * t.element_size()
            final += t.numel() * t.element_size()
            after += per_position * at_prefill
        heads.append(int(layer.keys.shape[1]))
        kept.append(at_prefill)
    return {"kv_bytes_final": final, "kv_bytes": after, "cache_heads": heads, "kept_tokens": kept}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class CompressTimer:
    """Time spent compressing: the observer's capture during prompt forwards plus the method's `select`.

    Compression has two parts. The capture runs inside attention, in `Session.on_attention`, on every
    prompt forward: it keeps the last `window` queries and, for H2O, accumulates the attention column
    sums (H2O's main cost: the whole prompt's attention, recomputed block by block). The selection runs
    once per layer, in the method's `select`. Both are wrapped on this measurement's objects only
    (instance attributes): `select` on the method, `on_attention` on the session (calls with a single
    query, decode steps, are passed through untimed). CPU: wall-clock `perf_counter` and process CPU
    time around each call. CUDA: two timing events per call, recorded on the current stream of the
    tensors' device, with no host synchronisation: the timed prefill runs as it would unwrapped.
    `finish()` (after the measurement) waits for the events and sums them; `parts` splits the total.
    """

    def __init__(self, method, device: torch.device):
        self.parts = {"capture": 0.0, "select": 0.0}
        self.seconds, self.cpu_seconds, self.calls, self.capture_calls = 0.0, 0.0, 0, 0
        self.cuda = device.type == "cuda"
        self.device = device
        self.source = "cuda_events" if self.cuda else "perf_counter"
        self._events: list = []
        original = method.select

        def select(*args, **kwargs):
            keys = args[0] if args else kwargs.get("keys")
            self.calls += 1
            return self._timed("select", keys, original, *args, **kwargs)

        method.select = select

    def watch_capture(self, session) -> None:
        """Also time the session's capture (`on_attention` on prompt forwards)."""
        original = session.on_attention

        def on_attention(module, query, *args, **kwargs):
            if query.shape[-2] == 1:  # a decode step: nothing is captured
                return original(module, query, *args, **kwargs)
            self.capture_calls += 1
            return self._timed("capture", query, original, module, query, *args, **kwargs)

        session.on_attention = on_attention

    def _timed(self, part: str, tensor, fn, *args, **kwargs):
        cpu_start = time.process_time()
        if self.cuda:
            stream = torch.cuda.current_stream(tensor.device if isinstance(tensor, torch.Tensor) else self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            out = fn(*args, **kwargs)
            end.record(stream)
            self._events.append((part, start, end))
        else:
            wall_start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.parts[part] += time.perf_counter() - wall_start
        self.cpu_seconds += time.process_time() - cpu_start
        return out

    def finish(self) -> float:
        """Total seconds, capture + select (CUDA: reads the recorded events, waiting for the last one)."""
        for part, start, end in self._events:
            end.synchronize()
            self.parts[part] += start.elapsed_time(end) / 1000.0
        self._events.clear()
        self.seconds = sum(self.parts.values())
        return self.seconds


def _cpu_time_hooks(model, marks: list, after_prefill=None):
    """CPU time (all threads of this process) of every top-level forward: the prefill, then each decode step.

    Wall-clock is what the benchmark reports; on a CPU shared with other work it also counts the
    time this process waited for a core, CPU time does not (a check, not a replacement).
    `after_prefill` runs once, right after the first forward."""

    def pre(module, args, kwargs):
        marks.append(-time.process_time())

    def post(module, args, kwargs, output):
        marks[-1] += time.process_time()
        if len(marks) == 1 and after_prefill is not None:
            after_prefill()

    return [model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post, with_kwargs=True)]


@torch.inference_mode()
def measure(model, method_cfg: dict, length: int, *, batch_size: int, decode_tokens: int, seed: int,
            prefill_mmap_threshold: int | None = None) -> dict:
    """One measurement of `method_cfg` at `length` prompt tokens (see the module docstring).

    `prefill_mmap_threshold` (CPU, glibc): during the prefill, allocations of at least that many bytes
    are mmapped and unmapped when freed, so the peak RSS follows live tensor memory instead of what
    the heap kept of freed tensors; from the first decode step on the threshold is glibc's steady
    state (32 MiB), so decode steps reuse heap memory as in any long-running process."""
    device = next(model.parameters()).device
    devices = model_devices(model)
    method = build_method(method_cfg)
    dims = model_dims(model.config)
    ids = prompt_ids(seed, length, batch_size, model.config.vocab_size, device)
    timer = CompressTimer(method, device) if method.compresses else None
    cpu_marks: list[float] = []
    mmap_regime = None
    if device.type == "cpu" and prefill_mmap_threshold and set_mmap_threshold(prefill_mmap_threshold):
        mmap_regime = int(prefill_mmap_threshold)
    hooks = _cpu_time_hooks(model, cpu_marks, (lambda: set_mmap_threshold(DECODE_MMAP_THRESHOLD)) if mmap_regime else None) \
        if device.type == "cpu" else []
    gc_was_enabled = gc.isenabled()
    with PeakMeter(devices) as meter:
        gc.disable()  # no collector pauses inside timed decode steps
        try:
            with compression(model, method) as session:
                if timer is not None:
                    timer.watch_capture(session)
                gen = greedy_generate(model, ids, max_new_tokens=int(decode_tokens) + 1, ignore_eos=True, keep_cache=True)
        finally:
            for h in hooks:
                h.remove()
            if gc_was_enabled:
                gc.enable()
    steps = list(gen.step_seconds)
    cpu_steps = cpu_marks[1:]
    prefill = gen.prefill_seconds
    kv = measured_kv(gen.cache, len(steps), length)
    dtype_bytes = gen.cache.layers[0].keys.element_size()
    for layer in gen.cache.layers:  # gqa=expand patches `update` per layer (a closure over the layer): break the cycle
        layer.__dict__.pop("update", None)
    gen.cache = None
    del gen
    analytic, kept = analytic_kv_bytes(dims, method, length, batch_size, dtype_bytes)
    decode_total = sum(steps)
    compress_seconds = timer.finish() if timer else 0.0
    step_median = _percentile(steps, 50)
    return {
        "prompt_tokens": int(length),
        "batch_size": int(batch_size),
        "prompt_checksum": int(ids.sum().item()),
        "prefill_s": round(prefill, 5),
        "compress_s": round(compress_seconds, 5),  # capture + select
        "compress_capture_s": round(timer.parts["capture"], 5) if timer else 0.0,
        "compress_select_s": round(timer.parts["select"], 5) if timer else 0.0,
        "compress_calls": timer.calls if timer else 0,
        "capture_calls": timer.capture_calls if timer else 0,
        "compress_timing": timer.source if timer else None,
        "decode_steps": len(steps),
        # decode_*_ms are per decode STEP (one forward of the whole batch: batch_size tokens, one per sequence)
        "decode_median_ms": round(1000 * step_median, 4) if steps else None,
        "decode_ms_per_token": round(1000 * step_median / batch_size, 4) if steps else None,
        "decode_p90_ms": round(1000 * _percentile(steps, 90), 4) if steps else None,
        "decode_mean_ms": round(1000 * decode_total / len(steps), 4) if steps else None,
        "decode_tokens_per_s": round(batch_size * len(steps) / decode_total, 3) if decode_total > 0 else None,
        "step_ms": [round(1000 * s, 3) for s in steps],
        "prefill_cpu_s": round(cpu_marks[0], 5) if cpu_marks else None,
        "compress_cpu_s": round(timer.cpu_seconds if timer else 0.0, 5) if cpu_marks else None,
        "decode_cpu_median_ms": round(1000 * _percentile(cpu_steps, 50), 4) if cpu_steps else None,
        "step_cpu_ms": [round(1000 * s, 3) for s in cpu_steps],
        "threads": torch.get_num_threads(),
        "prefill_mmap_threshold": mmap_regime,
        "kv_bytes": kv["kv_bytes"],
        "kv_bytes_analytic": analytic,
        "kv_bytes_final": kv["kv_bytes_final"],
        "cache_heads": sorted(set(kv["cache_heads"])),
        "kept_tokens": sorted(set(kv["kept_tokens"])),
        "kept_tokens_analytic": sorted(set(kept)),
        **meter.record(),
    }


# ------------------------------------------------------------------------------------------- the worker

class WorkerCore:
    """A loaded model serving measurement requests; used in-process (isolation=none) or by `main` below."""

    def __init__(self, init: dict, loaded=None):
        from omegaconf import OmegaConf

        from harness.seeding import seed_everything
        from harness.models import load_model

        self.init = init
        if init.get("threads"):
            torch.set_num_threads(int(init["threads"]))
        seed_everything(int(init.get("seed", 0)))
        started = time.perf_counter()
        self.loaded = loaded if loaded is not None else load_model(OmegaConf.create(init["model"]))
        self.model = self.loaded.model
        self.device = next(self.model.parameters()).device
        self.devices = model_devices(self.model)  # every GPU of a device_map=auto model
        self.load_seconds = time.perf_counter() - started
        num_layers = len(attention_modules(self.model))
        for cfg in init.get("methods", []):  # bad options fail here, before any measurement
            build_method(cfg).validate(num_layers, self.loaded.max_positions)
        self.warmup_seconds = self._warm_up()
        # Everything alive now (modules, the model) stays: later collections only scan what measurements create.
        gc.collect()
        gc.freeze()
        release_free_memory()
        self.baseline_bytes = cuda_allocated_bytes(self.devices) if self.device.type == "cuda" else rss_bytes()
        self.cap = arm_memory_cap(int(init["memory_cap_bytes"]), self.devices) if init.get("memory_cap_bytes") else None

    def _warm_up(self) -> float:
        """Untimed generations (first-call costs: thread pools, kernel selection, lazy imports)."""
        started = time.perf_counter()
        for _ in range(int(self.init.get("warmup", 0))):
            for cfg in self.init.get("methods", []) or [{"name": "full"}]:
                measure(self.model, cfg, int(self.init["warmup_length"]), batch_size=int(self.init.get("batch_size", 1)),
                        decode_tokens=min(8, int(self.init.get("decode_tokens", 8))), seed=int(self.init.get("seed", 0)) + 1,
                        prefill_mmap_threshold=self.init.get("prefill_mmap_threshold"))
        return time.perf_counter() - started

    def ready(self) -> dict:
        return {"ready": True, "pid": os.getpid(), "device": str(self.device), "devices": [str(d) for d in self.devices],
                "load_s": round(self.load_seconds, 3),
                "warmup_s": round(self.warmup_seconds, 3), "baseline_bytes": int(self.baseline_bytes),
                "threads": torch.get_num_threads(), "memory_cap": self.cap,
                "peak_resettable": self.device.type == "cuda" or reset_peak_rss()}

    def handle(self, request: dict) -> dict:
        try:
            result = measure(self.model, request["method"], int(request["length"]), batch_size=int(request["batch_size"]),
                             decode_tokens=int(request["decode_tokens"]), seed=int(request["seed"]),
                             prefill_mmap_threshold=self.init.get("prefill_mmap_threshold"))
        except Exception as exc:  # noqa: BLE001  (reported to the parent, which decides)
            failure = {"ok": False, "oom": is_out_of_memory(exc), "error": f"{type(exc).__name__}: {str(exc).strip()[:400]}",
                       "traceback": traceback.format_exc(limit=4)[-4000:]}
        else:
            result["baseline_bytes"] = int(self.baseline_bytes)
            result["peak_over_baseline_bytes"] = int(max(0, result["peak_bytes"] - self.baseline_bytes))
            result["worker_pid"] = os.getpid()
            return {"ok": True, "result": result}
        # out of the except block: the traceback's frames (and the tensors they hold) are gone now
        for d in self.devices:
            if d.type == "cuda":
                with torch.cuda.device(d):
                    torch.cuda.empty_cache()
        release_free_memory()
        return failure


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # prints and progress bars of libraries go to stderr, never into the protocol
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        protocol.write(json.dumps(obj, default=str) + "\n")
        protocol.flush()

    line = sys.stdin.readline()
    if not line:
        return 1
    try:
        core = WorkerCore(json.loads(line))
    except Exception as exc:  # noqa: BLE001
        from harness.errors import HarnessError

        send({"ready": False, "user_error": isinstance(exc, HarnessError), "error": str(exc)[:1000],
              "traceback": traceback.format_exc(limit=6)[-4000:]})
        return 2
    send(core.ready())
    for line in sys.stdin:
        if line.strip():
            send(core.handle(json.loads(line)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
