"""What K questions over one compressed context cost, against K separate query-agnostic runs.

    python scripts/bench_many_questions.py [--length 2048] [--needles 3] [--methods full,snapkv,streamingllm]
                                           [--max-new-tokens 48] [--repeats 3] [--threads N] [overrides...]

One needle cell of `--length` tokens with K needles (the needle task's prompt, `task.needles=K`), under every
method of `--methods` at its configured defaults (Hydra overrides after the options, e.g. model=... or
method options are not taken: each method is composed as `method=<name>`):

- shared: ONE prefill and compression of the context for every method, then each question prefilled on a
  rollback copy of each method's compressed cache, and every (method, question) decoded in one batch
  (`generate_settings` on the K-question prompt);
- separate: K runs of one question each, each with its own context prefill (`generate_settings` on each
  question's own prompt: what K query-agnostic items cost today).

Both sides decode the same tokens (checked: the answers must be equal, or the script fails). Prints the wall
time of each side (median over `--repeats` after one warm-up) and their ratio. The shared side saves K - 1
context prefills and decodes K times as many rows per step (cheap on a GPU; about linear in rows on this CPU),
so the ratio falls with the context prefill's share: a long context and short answers gain most.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--needles", type=int, default=3)
    parser.add_argument("--depth", type=float, default=50.0)
    parser.add_argument("--methods", default="full,snapkv,streamingllm")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the needle task's max_new_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the model/task (e.g. model=smollm2-135m)")
    args = parser.parse_args(argv)

    import torch
    from harness.models import load_model
    from harness.settings import compose_config, method_list
    from harness.tasks.needle import task as needle
    from harness.generation.generate import generate_settings
    from harness.generation.prompt import Prompt, Question, question_outcomes

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose_config(["task=needle", f"task.needles={args.needles}", "task.query_aware=false", *args.overrides])
    methods = method_list(args.methods.split(","))
    loaded = load_model(cfg.model)
    task = cfg.task
    facts = needle.fact_parts(task, loaded, args.needles)
    haystack = needle.haystack_ids(task, loaded.tokenizer)
    cell = needle.build_needles_cell(haystack, facts, args.length, args.depth)
    start = len(cell.context)
    prompt = Prompt(cell.context, questions=[Question(s, {"question": (start, start + len(s))}) for s in cell.suffixes])
    decode = dict(max_new_tokens=int(args.max_new_tokens or task.max_new_tokens), min_new_tokens=int(task.min_new_tokens),
                  stop_strings=list(getattr(loaded, "stop_strings", None) or []))

    def shared():
        out = generate_settings(loaded, methods, prompt, query_aware=False, **decode)
        return {tag: [a.generation.tokens for a in question_outcomes(o, args.needles)] for tag, o in out.items()}

    def separate():
        answers = {tag: [] for tag, _ in methods}
        for asked in prompt.asked():
            for tag, o in generate_settings(loaded, methods, asked, query_aware=False, **decode).items():
                answers[tag].append(o.generation.tokens)
        return answers

    def timed(fn):
        t, c = time.perf_counter(), time.process_time()
        result = fn()
        return time.perf_counter() - t, time.process_time() - c, result

    timed(shared)  # warm-up (allocator, kernels)
    times = {"shared": [], "separate": []}
    cpu = {"shared": [], "separate": []}
    for _ in range(args.repeats):
        for name, fn in (("shared", shared), ("separate", separate)):
            seconds, cpu_seconds, answers = timed(fn)
            times[name].append(seconds)
            cpu[name].append(cpu_seconds)
            if name == "shared":
                first = answers
            elif answers != first:
                print("error: the shared run's answers differ from the separate runs'", file=sys.stderr)
                return 1
    new_tokens = {tag: [len(a[0]) for a in first[tag]] for tag in first}
    shared_s, separate_s = statistics.median(times["shared"]), statistics.median(times["separate"])
    print(f"model {loaded.name}, {args.length}-token prompt (context {start} tokens), {args.needles} questions, "
          f"methods {args.methods}, threads {torch.get_num_threads()}, max_new_tokens {decode['max_new_tokens']}")
    print(f"answer tokens per method and question: {new_tokens}")
    print(f"shared: one context prefill + {args.needles} questions: {shared_s:.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times['shared'])})")
    print(f"separate: {args.needles} query-agnostic runs:             {separate_s:.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times['separate'])})")
    print(f"ratio shared / separate: {shared_s / separate_s:.3f}x wall  (answers identical)")
    # CPU time of this process: the work itself, what a busy shared machine's wall clock does not show
    cpu_shared, cpu_separate = statistics.median(cpu["shared"]), statistics.median(cpu["separate"])
    print(f"cpu time: shared {cpu_shared:.2f} s, separate {cpu_separate:.2f} s, ratio {cpu_shared / cpu_separate:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
