"""Benchmark: one-shot vs exact chunked prefill on one needle prompt, measured in one process.

Builds the needle task's prompt (the task's own prompt code) for one cell, then greedy-generates it
with each method under test, alternating one-shot and chunked prefill (`--repeats` rounds), and prints
the prefill wall times, their ratio, and whether the generated tokens and kept positions are identical.

    python scripts/bench_chunked_prefill.py                                   # gemma3-270m, 16K tokens, full
    python scripts/bench_chunked_prefill.py --length 8192 --chunk 1024 --methods full,snapkv
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--prompt-style", default="completion")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--depth", type=float, default=50)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--methods", default="full", help="comma-separated conf/method names (default budgets)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    a = p.parse_args()

    import torch
    from harness.models import load_model
    from harness.settings import compose_config, method_list
    from harness.generation.generate import generate_settings
    from harness.generation.prompt import Prompt
    from harness.tasks.needle.task import haystack_ids
    from harness.tasks.needle.prompt import build_cell, prompt_parts

    cfg = compose_config([f"model={a.model}", "task=needle", f"task.prompt_style={a.prompt_style}"])
    methods = method_list(a.methods.split(","))
    loaded = load_model(cfg.model)
    parts = prompt_parts(cfg.task, loaded)
    haystack = haystack_ids(cfg.task, loaded.tokenizer)
    haystack = haystack * math.ceil(a.length / len(haystack))
    cell = build_cell(haystack, parts, a.length, a.depth)
    prompt = Prompt(cell.ids, cell.question_start)
    runs = {"one_shot": [], "chunked": []}
    outputs = {}
    for r in range(a.repeats):
        order = [("one_shot", None), ("chunked", a.chunk)] if r % 2 == 0 else [("chunked", a.chunk), ("one_shot", None)]
        for label, chunk in order:
            start = time.perf_counter()
            out = generate_settings(loaded, methods, prompt, chunk_size=chunk, max_new_tokens=a.max_new_tokens,
                                    stop_strings=list(getattr(loaded, "stop_strings", []) or []))
            wall = time.perf_counter() - start
            failed = [t for t, o in out.items() if o.error is not None]
            if failed:
                sys.exit(f"error: {label} failed for {failed}: {out[failed[0]].error}")
            prefill = next(iter(out.values())).diagnostics.get("shared_prefill_seconds")
            runs[label].append({"prefill_seconds": prefill, "wall_seconds": round(wall, 2)})
            outputs[label] = {t: (o.generation.tokens, {i: None if v is None else v.tolist() for i, v in o.kept.items()})
                              for t, o in out.items()}
            print(f"{label:9s} #{r}: prefill {prefill:.1f} s, item wall {wall:.1f} s", flush=True)
    one = sum(x["prefill_seconds"] for x in runs["one_shot"])
    chunked = sum(x["prefill_seconds"] for x in runs["chunked"])
    same = {t: outputs["one_shot"][t] == outputs["chunked"][t] for t in outputs["one_shot"]}
    response = loaded.tokenizer.decode(outputs["chunked"][methods[0][0]][0][0], skip_special_tokens=True)
    print(f"\n{a.model}, {a.length} tokens, chunk {a.chunk}: prefill one-shot {one:.1f} s, chunked {chunked:.1f} s "
          f"-> {chunked / one:.2f}x (target <= 0.6x); identical tokens and kept positions: "
          + ", ".join(f"{t} {'yes' if s else 'NO'}" for t, s in same.items()))
    print(f"response ({methods[0][0]}): {response!r}")
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "length": a.length, "chunk": a.chunk, "runs": runs,
                                      "ratio": round(chunked / one, 3), "identical": same, "torch_threads": torch.get_num_threads()},
                                     indent=2) + "\n", encoding="utf-8")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
