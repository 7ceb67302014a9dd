#!/usr/bin/env python3
"""The plan is the run, on a real model: SmolLM2-135M on this CPU, the peak of live tensor bytes measured during real
generations beside the plan of the same generations (its fake twin), per method and prompt length.

    python scripts/plan_vs_run.py [--lengths 1024,4096,8192] [--out results/cpu/plan_vs_run]

Writes plan_vs_run.md and .json: for each (setting, length): measured peak, planned peak, their difference in bytes,
the phase of each, and whether the plan is a bound (a value-dependent split planned at its largest).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = {  # tag: method options (budgets for prompts of 1K-8K tokens)
    "full": {"name": "full"},
    "snapkv_c512": {"name": "snapkv", "budget": 512, "window_size": 32, "kernel_size": 7},
    "streamingllm_c512": {"name": "streamingllm", "budget": 512},
    "adakv_c512": {"name": "adakv", "budget": 512},
}
# (settings run together, query_aware, prefill chunk): one-shot query-aware runs alone, and the methods list sharing one
# chunked query-agnostic prefill (the whole test matrix over every method is tests/tasks/test_plan.py, on tiny models)
CASES = [(["full"], True, None), (["snapkv_c512"], True, None), (["adakv_c512"], True, None),
         (["full", "snapkv_c512", "streamingllm_c512"], False, 1024)]


def main() -> int:
    import torch

    from harness.methods import build_method
    from harness.models import load_model
    from harness.tasks.plan.task import fake_twin
    from harness.tasks.plan.trace import trace_generation
    from tests.conftest import compose

    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--out", default=str(REPO / "results" / "cpu" / "plan_vs_run"))
    p.add_argument("--new-tokens", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    real = load_model(compose("model=smollm2-135m").model)
    fake, mode = fake_twin(real, "cpu")
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        for tags, query_aware, chunk in CASES:
            group = [(tag, build_method(SETTINGS[tag])) for tag in tags]
            if True:
                options = dict(query_aware=query_aware, question_tokens=32, new_tokens=args.new_tokens, chunk_size=chunk, target="cpu")
                t0 = time.perf_counter()
                measured = trace_generation(real, group, n, **options)
                t1 = time.perf_counter()
                planned = trace_generation(fake, group, n, mode=mode, **options)
                t2 = time.perf_counter()
                row = {"setting": "+".join(t for t, _ in group), "length": n, "protocol": "query_aware" if query_aware else "query_agnostic",
                       "prefill_chunk_size": chunk, "measured_peak_bytes": measured["peak_bytes"], "planned_peak_bytes": planned["peak_bytes"],
                       "difference_bytes": planned["peak_bytes"] - measured["peak_bytes"], "measured_phase": measured["peak_phase"],
                       "planned_phase": planned["peak_phase"], "bound": planned["bound"], "run_seconds": round(t1 - t0, 2),
                       "plan_seconds": round(t2 - t1, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_vs_run.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    lines = ["# The plan is the run: SmolLM2-135M on this CPU", "",
             f"`python scripts/plan_vs_run.py --lengths {args.lengths}` ({args.new_tokens} new tokens; the methods list shares one "
             "query-agnostic prefill in chunks of 1,024 tokens and asks a 32-token question on top, decoded together). Measured: the live-storage tracker around the real "
             "generation; planned: the same code on the fake twin (docs/planning.md). Bound: a value-dependent split (per-layer or "
             "per-head budgets) planned at its largest. Run/plan seconds on a machine shared with other work.", "",
             "| setting | length | protocol | measured peak | planned peak | planned - measured | phase (measured / planned) | bound | run s | plan s |",
             "|---|---:|---|---:|---:|---:|---|---|---:|---:|"]
    for r in rows:
        phase = r["measured_phase"] if r["measured_phase"] == r["planned_phase"] else f"{r['measured_phase']} / {r['planned_phase']}"
        lines.append(f"| {r['setting']} | {r['length']:,} | {r['protocol']} | {r['measured_peak_bytes']:,} | {r['planned_peak_bytes']:,} | "
                     f"{r['difference_bytes']:+,} | {phase} | {'yes' if r['bound'] else ''} | {r['run_seconds']} | {r['plan_seconds']} |")
    exact = sum(1 for r in rows if r["difference_bytes"] == 0)
    lines += ["", f"{exact} of {len(rows)} points equal to the byte; the others are bounds "
                  f"(largest over-estimate {max((r['difference_bytes'] for r in rows), default=0):,} bytes)."]
    (out / "plan_vs_run.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
