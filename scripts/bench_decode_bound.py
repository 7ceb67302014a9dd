"""Decode steps against the memory bound, on caches filled directly (no prefill): issue 33's targets in minutes.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_decode_bound.py --model smollm2-135m \
        --lengths 1024 8192 --steps 16 --repeats 3

For each dtype (float32, bfloat16) and layout, a cache of every layer is filled with random keys/values of the
given length (decode cost does not depend on their values), then `--steps` single-token forwards are timed.
Layouts: `before` = transformers' concatenating DynamicCache with torch's SDPA (the harness before issue 33),
`after` = in-place cache layers (harness/methods/inplace.py) with the CPU single-query matmul attention
(harness/cpu_attention.py). A compressed cache of C entries at position L decodes like a full cache of C
entries (SnapKV gqa=mean keeps the KV heads): `--compressed 1024` adds that row at the longest length.
Runs are interleaved (repeat-major, layouts and dtypes alternating); the copy bandwidth is measured after each
run. Prints per row: ms/step (median), bound = (weights + cache) / bandwidth, step / bound, and per layout the
cache's marginal cost from the shortest to the longest length against its bound. Loaded machine: ratios
within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from harness.settings import compose_config
from harness.cpu_attention import use_matmul_decode
from harness.decoding import forward_tokens
from harness.methods.inplace import in_place_cache, reserve
from harness.models import load_model
from harness.tasks.bench.worker import copy_bandwidth, weight_bytes


def filled_cache(model, length: int, layout: str):
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = in_place_cache(model) if layout == "after" else DynamicCache(config=cfg)
    gen = torch.Generator().manual_seed(length)
    dtype = next(model.parameters()).dtype
    for i, layer in enumerate(cache.layers):
        k = torch.randn(1, heads, length, dim, generator=gen).to(dtype)
        layer.update(k, k.clone())
    if layout == "after":
        reserve(cache, 64)
    return cache


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.inference_mode()
def run(model, length: int, position: int, layout: str, steps: int) -> tuple[float, int]:
    use_matmul_decode(model, "matmul" if layout == "after" else "sdpa")
    cache = filled_cache(model, length, layout)
    size = cache_bytes(cache)
    tok = torch.tensor([[1]])
    times, cpu = [], []
    for t in range(steps + 1):
        start, cpu_start = time.perf_counter(), time.process_time()
        logits = forward_tokens(model, cache, tok, position + t)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        tok = logits.argmax(-1)[:, None]
    return 1000 * statistics.median(times[1:]), size, 1000 * statistics.median(cpu[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--compressed", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {d: load_model(compose_config([f"model={args.model}", f"model.dtype={d}", "model.device=cpu"]).model).model
              for d in args.dtypes}
    longest = max(args.lengths)
    rows = [(n, n) for n in args.lengths] + ([(args.compressed, longest)] if args.compressed else [])
    results: dict = {}
    for r in range(args.repeats):
        for d in (args.dtypes if r % 2 == 0 else args.dtypes[::-1]):
            for layout in (("before", "after") if r % 2 == 0 else ("after", "before")):
                for n, position in rows:
                    ms, size, cpu = run(models[d], n, position, layout, args.steps)
                    bandwidth = copy_bandwidth("cpu")
                    results.setdefault((d, layout, n, position), []).append((ms, size, bandwidth, cpu))
                    print(f"r{r} {d:8s} {layout:6s} cache {n:5d} at {position:5d}: {ms:7.1f} ms/step, CPU {cpu:7.1f} ms "
                          f"({bandwidth / 1e9:.1f} GB/s)", flush=True)
    print("\n| dtype | layout | cache entries (at position) | cache MB | GB/s | bound ms | ms/step | × bound | CPU ms/step |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for (d, layout, n, position), values in results.items():
        ms = statistics.median(v[0] for v in values)
        size = values[0][1]
        bandwidth = statistics.median(v[2] for v in values)
        bound = 1000 * (weight_bytes(models[d]) + size) / bandwidth
        cpu = statistics.median(v[3] for v in values)
        summary[(d, layout, n, position)] = (ms, size, bandwidth, cpu)
        print(f"| {d} | {layout} | {n} (at {position}) | {size / 2**20:.1f} | {bandwidth / 1e9:.1f} | {bound:.1f} | {ms:.1f} "
              f"| {ms / bound:.2f}x | {cpu:.1f} |")
    shortest = min(args.lengths)
    print()
    for d in args.dtypes:
        for layout in ("before", "after"):
            a, b = summary[(d, layout, shortest, shortest)], summary[(d, layout, longest, longest)]
            bandwidth = statistics.median([a[2], b[2]])
            marginal_bound = 1000 * (b[1] - a[1]) / bandwidth
            line = (f"{d} {layout}: cache marginal cost {shortest}->{longest}: {b[0] - a[0]:.1f} ms for "
                    f"{(b[1] - a[1]) / 2**20:.0f} MB more, bound {marginal_bound:.1f} ms: {(b[0] - a[0]) / marginal_bound:.2f}x "
                    f"(CPU time: {b[3] - a[3]:.1f} ms, {(b[3] - a[3]) / marginal_bound:.2f}x)")
            if args.compressed:
                c = summary[(d, layout, args.compressed, longest)]
                line += (f"; compressed {args.compressed} at {longest} vs full at {shortest}: {c[0] / a[0]:.2f}x "
                         f"(CPU time {c[3] / a[3]:.2f}x)")
            print(line)


if __name__ == "__main__":
    main()
