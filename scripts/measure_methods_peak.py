"""Peak memory of a methods list against the analytic sum of what must be live (issue: hold only what is live).

One shared prefill for N settings holds, before the first decode: every setting's compressed cache, the
full layer being compressed (or the whole full cache when `full` is listed), and one forward's
activations. This script measures the process's peak resident memory over one item (SmolLM2, a prompt
of --length tokens, CPU, float32) for a plain full-cache prefill and for methods lists, and prints the
measured peak increase next to that analytic sum:

    analytic = sum of the settings' compressed caches (layers x heads x kept x head_dim x 2 x 4 bytes)
             + the full cache if `full` is listed, else one layer's full K/V
             + one forward's activations, taken from the `full` run: its peak minus its full cache

The peak is the process's VmHWM (reset before each run) with glibc's mmap threshold at 1 MiB, so freed
tensors leave the resident set and the peak follows live tensors (harness/tasks/bench/worker.py).

    .venv/bin/python scripts/measure_methods_peak.py --length 8192 --out results/cpu/methods_peak.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.methods import build_method  # noqa: E402
from harness.tasks.bench.worker import (PeakMeter, analytic_kv_bytes, model_dims, release_free_memory,  # noqa: E402
                                        set_mmap_threshold)
from harness.generation.generate import generate_settings  # noqa: E402
from harness.generation.prompt import Prompt

LISTS = {
    "full": ["full"],
    "snapkv c256 + c512 (expand)": [{"name": "snapkv", "budget": 256}, {"name": "snapkv", "budget": 512}],
    "snapkv c256 + c512 (mean)": [{"name": "snapkv", "budget": 256, "gqa": "mean"}, {"name": "snapkv", "budget": 512, "gqa": "mean"}],
    "full + snapkv/streamingllm/h2o/pyramidkv c1024": ["full", {"name": "snapkv"}, {"name": "streamingllm"}, {"name": "h2o"},
                                                       {"name": "pyramidkv"}],
    "adakv r0.25 (ragged)": [{"name": "adakv", "budget": None, "ratio": 0.25}],
}


def compose_method(entry):
    from harness.settings import compose_config

    name = entry if isinstance(entry, str) else entry["name"]
    overrides = [f"method={name}"] + ([] if isinstance(entry, str) else
                                      [f"method.{k}={'null' if v is None else v}" for k, v in entry.items() if k != "name"])
    cfg = compose_config(overrides)
    return str(cfg.method.tag), build_method({k: v for k, v in cfg.method.items() if k != "tag"})


def kept_entry_bytes(kept: dict, dims: dict, length: int) -> int:
    """K and V bytes of the entries a setting kept (per layer and head; -1 pads a shorter head), float32."""
    total = 0
    for idx, positions in kept.items():
        entries = dims["kv_heads"] * length if positions is None else int((positions >= 0).sum())
        total += entries * dims["head_dim"] * 2 * 4
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--lists", nargs="*", default=list(LISTS), help="which lists to run (names of LISTS)")
    args = parser.parse_args()

    from harness.models import load_model
    from harness.settings import compose_config

    loaded = load_model(compose_config().model)
    config = loaded.model.config
    dims = model_dims(config)
    ids = torch.randint(0, config.vocab_size, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = Prompt(ids)
    one_layer = dims["kv_heads"] * args.length * dims["head_dim"] * 2 * 4
    rows, activations = [], None
    set_mmap_threshold(1 << 20)
    # Warm-up outside the meter: the first forward allocates buffers that stay for the process's life
    # (weight layouts, kernel workspaces); they are not part of any item's peak.
    generate_settings(loaded, [compose_method("full")], Prompt(ids[:1024]), max_new_tokens=1)
    for label in args.lists:
        settings = [compose_method(e) for e in LISTS[label]]
        release_free_memory()
        start = time.perf_counter()
        with PeakMeter(torch.device("cpu")) as meter:
            out = generate_settings(loaded, settings, prompt, max_new_tokens=1)
        seconds = time.perf_counter() - start
        errors = {t: str(o.error) for t, o in out.items() if o.error is not None}
        measured_caches = sum(o.diagnostics.get("cache_bytes", 0) for o in out.values())
        compressed = sum(analytic_kv_bytes(dims, m.resolve(args.length), args.length, 1, 4)[0]
                         for _, m in settings if m.compresses)
        ragged = [t for t in out if t.startswith("adakv")]
        kept_bytes = sum(kept_entry_bytes(out[t].kept, dims, args.length) for t, m in settings if m.compresses)
        has_full = any(not m.compresses for _, m in settings)
        full_cache = analytic_kv_bytes(dims, None, args.length, 1, 4)[0]
        peak = meter.record()["peak_increase_bytes"]
        if label == "full":
            activations = peak - full_cache
        analytic = (compressed if not ragged else measured_caches) + (full_cache if has_full else one_layer) + (activations or 0)
        rows.append((label, len(settings), peak, analytic, measured_caches, kept_bytes, seconds, errors))
        del out
    mib = 1 / 2**20
    lines = [f"# Peak memory of a methods list, SmolLM2-135M, {args.length} tokens, CPU float32",
             "",
             f"`{' '.join(['.venv/bin/python', 'scripts/measure_methods_peak.py', '--length', str(args.length)])}`; "
             f"one layer's full K/V = {one_layer * mib:.1f} MiB; one forward's activations (the full run's peak minus its "
             f"full cache, after a warm-up forward outside the meter) = {(activations or 0) * mib:.1f} MiB.",
             "",
             "| methods list | settings | measured peak increase (MiB) | analytic live sum (MiB) | measured / analytic | "
             "caches after prefill (MiB, from the tensors) | kept entries (MiB, from the kept positions) | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, n, peak, analytic, caches, kept, seconds, errors in rows:
        lines.append(f"| {label} | {n} | {peak * mib:.1f} | {analytic * mib:.1f} | {peak / analytic:.2f} | {caches * mib:.1f} | "
                     f"{kept * mib:.1f} | {seconds:.0f} |" + (f" errors: {errors}" if errors else ""))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
