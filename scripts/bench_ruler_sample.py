"""What one RULER sample costs with every setting of a grid from one prefill, against the issue's budget:
one prefill plus one decode per setting.

    python scripts/bench_ruler_sample.py [--experiment ruler_cpu] [--tasks niah_single_1,vt,cwe] [--length 4096]
                                         [--query-aware true|false] [--repeats 1] [--threads N] [overrides...]

For each task's first sample (RULER's generator, the `ruler` task's prompt: harness.tasks.ruler.task.RulerTask), in
one process and interleaved:
- full alone: the sample with the full cache only (`generate_settings` with one setting): its prefill time P and
  its decode time per generated token D;
- grid: the sample with every setting of the experiment's `methods` (default: ruler_cpu's 13), one prefill and
  compression for all of them, the settings decoded together (what `python -m harness +experiment=...` runs).
The budget is P + sum over settings of (that setting's generated tokens x D): one full-cache prefill plus one
full-cache decode of each setting's own answer. Prints per task the grid's wall time, the budget and their ratio
(<= 1: within budget), and the grid's prefill against P (what compressing 12 ways at once adds: H2O's column
sums over every query are a second O(L^2) pass). Times are medians over `--repeats` after one warm-up of each (the
full run and the grid: a run's first grid sample also pays the allocator's growth to the grid's memory, once per
process; every later sample of a run costs what is measured here).

`--alone` also runs every compressing setting by itself (one prefill, its compression, its decode: its separate
run) and prints it against its own share of the budget: P + its generated tokens x D. A setting that exceeds that
alone (H2O: its column sums are an O(L^2) pass over every query, part of its definition) cannot fit the budget in
any grid whose other settings do not save the difference in decode steps.
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
    parser.add_argument("--experiment", default="ruler_cpu")
    parser.add_argument("--tasks", default="niah_single_1,vt,cwe")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--query-aware", default="true", choices=("true", "false"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--alone", action="store_true", help="also run each compressing setting by itself")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (e.g. model=...)")
    args = parser.parse_args(argv)

    import torch
    from harness.settings import compose_config, compose_settings, method_entries
    from harness.methods import build_method
    from harness.models import load_model
    from harness.generation.generate import generate_settings
    from harness.tasks.ruler.task import RulerTask

    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.tasks.split(",")
    overrides = [f"+experiment={args.experiment}", f"task.lengths=[{args.length}]", "task.samples=1",
                 f"task.tasks=[{','.join(names)}]", f"task.query_aware={args.query_aware}", *args.overrides]
    cfg = compose_config(overrides)
    settings = [(tag, build_method(scfg.method)) for tag, scfg in compose_settings(method_entries(cfg, overrides), overrides, "config")]
    loaded = load_model(cfg.model)
    task = RulerTask(cfg, loaded)
    full = [(tag, m) for tag, m in settings if tag == "full"]
    if not full:
        print("error: the experiment's methods list has no full setting to measure the budget with", file=sys.stderr)
        return 2
    print(f"model {loaded.name}, RULER {args.length}, {task.protocol}, {len(settings)} settings "
          f"({', '.join(t for t, _ in settings)}), threads {torch.get_num_threads()}")

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out

    rows, lone = [], []
    for name in names:
        built = task.build((name, args.length, 0))
        options = dict(query_aware=task.query_aware, decode_together=True, **built.decode)
        alone = lambda: generate_settings(loaded, full, built.prompt, **options)  # noqa: E731
        grid = lambda: generate_settings(loaded, settings, built.prompt, **options)  # noqa: E731
        timed(alone), timed(grid)  # warm-up of both: the process's allocator grows to the grid's memory once
        prefill, step, walls, grid_prefill = [], [], [], []
        for _ in range(args.repeats):
            _, out = timed(alone)
            gen = out["full"].generation
            prefill.append(gen.prefill_seconds)
            step.append(gen.decode_seconds / max(1, len(gen.tokens[0])))
            wall, out = timed(grid)
            walls.append(wall)
            grid_prefill.append(max(o.generation.prefill_seconds for o in out.values()))
            tokens = {tag: len(o.generation.tokens[0]) for tag, o in out.items()}
        p, d, w = statistics.median(prefill), statistics.median(step), statistics.median(walls)
        budget = p + sum(tokens.values()) * d
        rows.append((name, len(built.prompt.ids), w, budget, p, statistics.median(grid_prefill), d, sum(tokens.values())))
        for tag, method in settings if args.alone else ():
            if tag == "full":
                continue
            wall, out = timed(lambda: generate_settings(loaded, [(tag, method)], built.prompt, **options))
            gen = out[tag].generation
            n = len(gen.tokens[0])
            lone.append((name, tag, n, wall, p + n * d, gen.prefill_seconds, gen.decode_seconds))
    print("| task | prompt tokens | grid wall s | budget s | ratio | full prefill s | grid prefill s | full decode ms/token | tokens (all settings) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, n, w, budget, p, gp, d, tokens in rows:
        print(f"| {name} | {n} | {w:.1f} | {budget:.1f} | {w / budget:.2f}x | {p:.1f} | {gp:.1f} | {d * 1000:.0f} | {tokens} |")
    if lone:
        print("\nEach compressing setting alone (its separate run) against its own share of the budget, P + tokens x D:\n")
        print("| task | setting | tokens | alone wall s | its budget s | ratio | prefill + compression s | decode s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for name, tag, n, wall, budget, pre, dec in lone:
            print(f"| {name} | {tag} | {n} | {wall:.1f} | {budget:.1f} | {wall / budget:.2f}x | {pre:.1f} | {dec:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
