"""bf16 vs fp32 on the CPU, one process, interleaved (issue 33): prefill and decode of a packaged model.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_dtype_cpu.py --model smollm2-135m --length 2048 \
        --decode 24 --repeats 3 [--profile]

Both dtypes are loaded once; each repeat runs fp32 then bf16 (the order alternating per repeat) on the same
random prompt: prefill seconds, median decode ms per step. `--profile` prints the top operators of a bf16 and
an fp32 decode step (torch.profiler), to see where bf16 decode time goes. Ratios only mean something within
one run on a shared machine."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness.settings import compose_config
from harness.decoding import greedy_generate
from harness.models import load_model


def load(name: str, dtype: str):
    cfg = compose_config([f"model={name}", f"model.dtype={dtype}", "model.device=cpu"]).model
    return load_model(cfg).model


def run(model, ids, decode: int) -> tuple[float, float]:
    gen = greedy_generate(model, ids, max_new_tokens=decode + 1, ignore_eos=True)
    return gen.prefill_seconds, 1000 * statistics.median(gen.step_seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {d: load(args.model, d) for d in ("float32", "bfloat16")}
    vocab = models["float32"].config.vocab_size
    ids = torch.randint(0, vocab, (1, args.length), generator=torch.Generator().manual_seed(0))
    for model in models.values():  # warm-up
        run(model, ids[:, :128], 4)
    results = {d: [] for d in models}
    for r in range(args.repeats):
        for d in (list(models) if r % 2 == 0 else list(models)[::-1]):
            results[d].append(run(models[d], ids, args.decode))
            print(f"repeat {r} {d:9s} prefill {results[d][-1][0]:.2f} s  decode {results[d][-1][1]:.1f} ms/step", flush=True)
    med = {d: (statistics.median(p for p, _ in v), statistics.median(s for _, s in v)) for d, v in results.items()}
    print(f"{args.model} {args.length} tokens, {args.threads} thread(s): fp32 prefill {med['float32'][0]:.2f} s, decode "
          f"{med['float32'][1]:.1f} ms; bf16 prefill {med['bfloat16'][0]:.2f} s, decode {med['bfloat16'][1]:.1f} ms; "
          f"bf16 speed-up prefill {med['float32'][0] / med['bfloat16'][0]:.2f}x, decode {med['float32'][1] / med['bfloat16'][1]:.2f}x")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for d, model in models.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(model, ids[:, :512], 8)
            print(f"--- {d}: top operators (prefill 512 + 8 decode steps)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
