"""Benchmark: the decode step of N settings batched (harness/generation/batch_decode.py) vs one setting's step.

Builds one needle prompt (the task's own prompt code, default 4K tokens on SmolLM2), prefills it once
for every method (the engine compresses for all of them in that prefill, as a methods run does), then
measures, from the same caches each time (restored between rounds), the decode step time of:
  - each setting decoded alone (`greedy_decode` on its own cache: what a methods run does today, one
    setting after another);
  - all settings in one batch (`decode_together`: one forward per step).
Rounds alternate the order; step times are medians over every step of every round. Prints the
ratio of the batched step to one setting's step (the issue's target: <= 2x at 4K) and to the sum of
the separate steps, and whether the batched tokens equal each setting's own.

    python scripts/bench_batch_decode.py                         # SmolLM2, 4K, full/snapkv/streamingllm/h2o/pyramidkv
    python scripts/bench_batch_decode.py --length 2048 --steps 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ["full", "snapkv", "streamingllm", "h2o", "pyramidkv"]


def snapshot(cache):
    """What a cache holds now; cache updates replace tensors (never write into them), so keeping the
    references is enough to restore it."""
    return [(layer.keys, layer.values, getattr(layer, "cumulative_length", None)) for layer in cache.layers]


def restore(cache, snap) -> None:
    for layer, (keys, values, cumulative) in zip(cache.layers, snap):
        layer.keys, layer.values = keys, values
        if cumulative is not None:
            layer.cumulative_length = cumulative


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--depth", type=float, default=50)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated conf/method names (default budgets)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per measurement (EOS ignored)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    a = p.parse_args()

    import torch
    from harness.generation.batch_decode import decode_together
    from harness.generation.generate import shared_prefill
    from harness.decoding import greedy_decode
    from harness.models import load_model
    from harness.settings import compose_config, method_list
    from harness.tasks.needle.task import haystack_ids
    from harness.tasks.needle.prompt import build_cell, prompt_parts

    if a.threads:
        torch.set_num_threads(a.threads)
    names = [m for m in a.methods.split(",") if m]
    cfg = compose_config([f"model={a.model}", "task=needle"])
    methods = method_list(names)
    loaded = load_model(cfg.model)
    model = loaded.model
    parts = prompt_parts(cfg.task, loaded)
    haystack = haystack_ids(cfg.task, loaded.tokenizer)
    cell = build_cell(haystack * math.ceil(a.length / len(haystack)), parts, a.length, a.depth)
    ids = torch.tensor([cell.ids], device=loaded.device)
    length = ids.shape[1]
    start = time.perf_counter()
    with shared_prefill(model, [(tag, m.resolve(length)) for tag, m in methods], ids) as shared:  # as a methods run does it
        caches = {tag: shared.caches[tag] for tag, _ in methods}
    logits = shared.logits
    print(f"{loaded.name}, {length} prompt tokens, shared prefill of {len(methods)} settings: {time.perf_counter() - start:.1f} s",
          flush=True)
    for tag, cache in caches.items():
        layer = cache.layers[0]
        print(f"  {tag:13s} layer 0: {layer.keys.shape[1]} heads x {layer.keys.shape[2]} entries", flush=True)
    snaps = {tag: snapshot(c) for tag, c in caches.items()}
    decode = dict(max_new_tokens=a.steps + 1, ignore_eos=True)
    alone_steps = {tag: [] for tag in caches}
    batched_steps, tokens_alone, tokens_batched = [], {}, {}
    cpu = {tag: [] for tag in [*caches, "batched"]}  # process CPU seconds per forward (robust on a shared machine)
    for r in range(a.rounds):
        for arm in (("alone", "batched") if r % 2 == 0 else ("batched", "alone")):
            for tag, c in caches.items():
                restore(c, snaps[tag])
            if arm == "alone":
                for tag, c in caches.items():
                    clock = time.process_time()
                    toks, steps, _ = greedy_decode(model, c, logits, length, **decode)
                    cpu[tag].append((time.process_time() - clock) / len(steps))
                    alone_steps[tag] += steps
                    tokens_alone[tag] = toks
            else:
                clock = time.process_time()
                out = decode_together(model, list(caches.values()), [logits] * len(caches), length, **decode)
                cpu["batched"].append((time.process_time() - clock) / len(out[0].step_seconds))
                batched_steps += out[0].step_seconds
                tokens_batched = {tag: d.tokens for tag, d in zip(caches, out)}
            print(f"  round {r} {arm} done", flush=True)
    ms = {tag: 1000 * statistics.median(s) for tag, s in alone_steps.items()}
    batched = 1000 * statistics.median(batched_steps)
    cpu_ms = {tag: 1000 * min(v) for tag, v in cpu.items()}
    same = {tag: tokens_alone[tag] == tokens_batched[tag] for tag in caches}
    print(f"\ndecode step, median wall of {a.rounds} x {a.steps} steps; CPU: process CPU time per forward, best round "
          f"({torch.get_num_threads()} threads):")
    for tag, v in ms.items():
        print(f"  {tag:13s} alone      {v:7.1f} ms wall  {cpu_ms[tag]:7.1f} ms CPU")
    print(f"  {len(caches)} settings batched {batched:7.1f} ms wall  {cpu_ms['batched']:7.1f} ms CPU")
    for label, alone, both in (("wall", ms, batched), ("CPU", {t: cpu_ms[t] for t in caches}, cpu_ms["batched"])):
        slowest = max(alone, key=alone.get)
        print(f"{label}: batched / one setting's step {both / alone[slowest]:.2f}x vs {slowest} (the slowest alone), "
              f"{both / statistics.median(alone.values()):.2f}x vs the median setting (target <= 2x); "
              f"batched / sequential ({sum(alone.values()):.1f} ms) {both / sum(alone.values()):.2f}x")
    print("identical tokens batched vs alone: " + ", ".join(f"{t} {'yes' if s else 'NO'}" for t, s in same.items()))
    if a.json:
        a.json.write_text(json.dumps({"model": loaded.name, "prompt_tokens": length, "steps": a.steps, "rounds": a.rounds,
                                      "threads": torch.get_num_threads(), "alone_ms": ms, "batched_ms": batched, "cpu_ms": cpu_ms,
                                      "identical": same}, indent=2) + "\n", encoding="utf-8")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
