"""Benchmark: a method comparison as separate runs vs one `methods=[...]` run (sequential decode) vs one
methods run whose settings decode together (batched decode).

Runs, in one invocation and interleaved (the arms' order rotates from one repeat to the next), the needle
grid with the given methods (a) as one `python -m harness method=<m>` process per method, (b) as one
`python -m harness 'methods=[...]'` process (one prefill per item, then the settings decode one after
another), and (c) as that same methods run with the settings of each item decoded together
(harness/generation/batch_decode.py: one forward per step for every setting's cache), each into a fresh folder.
It prints the wall-time ratios (model load and process start included, as a user experiences it), the
peak resident memory of each process, and whether every method's responses and kept-cache sizes are
identical in all three.

Arms (b) and (c) are the same command but for `decode_together=false` / `true` (the runner's default):
the records say how each item was decoded (`decoded_with`).

    python scripts/bench_shared_prefill.py                       # SmolLM2, 2K/4K x 10/50/90, five methods
    python scripts/bench_shared_prefill.py --repeats 2 --out /tmp/shared-bench
    python scripts/bench_shared_prefill.py --arms shared,batched --lengths [2048] task.query_aware=false
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["full", "snapkv", "streamingllm", "h2o", "pyramidkv"]
ARMS = ("separate", "shared", "batched")
CPU_SECONDS: dict[str, float] = {}  # arm -> CPU seconds of its child processes (user + system)
LABELS = {"separate": "separate runs (one per method)", "shared": "one methods run (sequential decode)",
          "batched": "one methods run (batched decode)"}


def run(args: list[str], out: Path, batched: bool = False) -> tuple[float, float]:
    """One harness process (batched: arm (c)'s); returns (wall seconds, peak RSS in MiB of that child)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, cpu_before = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    together = [] if any(a.startswith("method=") for a in args) else [f"decode_together={str(batched).lower()}"]
    proc = subprocess.run([sys.executable, "-m", "harness", *args, *together, f"hydra.run.dir={out}", "progress=false"],
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    arm = "batched" if batched else ("separate" if any(a.startswith("method=") for a in args) else "shared")
    CPU_SECONDS[arm] = CPU_SECONDS.get(arm, 0.0) + usage.ru_utime + usage.ru_stime - cpu_before
    return wall, max(usage.ru_maxrss, before) / 1024


def cells(folder: Path) -> dict:
    """{tag: {(length, depth): (response, kv sizes)}} from every needle_cells.jsonl below a folder."""
    found = {}
    for path in sorted(folder.rglob("needle_cells.jsonl")):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        found[path.parent.name] = {(r["length"], r["depth"]): (r["response"], r.get("kv_positions_after_prefill")) for r in rows}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--lengths", default="[2048,4096]")
    parser.add_argument("--depths", default="[10,50,90]")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which of {', '.join(ARMS)} to run")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="more harness overrides (e.g. model=..., task.query_aware=false)")
    a = parser.parse_args()
    methods = [m for m in a.methods.split(",") if m]
    arms = [arm for arm in ARMS if arm in a.arms.split(",")]
    base = Path(a.out or tempfile.mkdtemp(prefix="shared-prefill-"))
    common = ["task=needle", f"task.lengths={a.lengths}", f"task.depths={a.depths}", *a.overrides]
    times = {arm: [] for arm in arms}
    peaks = {arm: [] for arm in arms}
    order = []
    for r in range(a.repeats):
        shift = r % len(arms)
        order += [(arm, r) for arm in arms[shift:] + arms[:shift]]
    for kind, r in order:
        folder = base / f"{kind}{r}"
        if kind == "separate":
            total, peak = 0.0, 0.0
            for m in methods:
                wall, rss = run([*common, f"method={m}"], folder)
                total, peak = total + wall, max(peak, rss)
                print(f"  separate #{r} method={m}: {wall:.1f} s", flush=True)
        else:
            total, peak = run([*common, f"methods=[{','.join(methods)}]"], folder, batched=kind == "batched")
        times[kind].append(total)
        peaks[kind].append(peak)
        print(f"{LABELS[kind]} #{r}: {total:.1f} s wall, peak RSS {peak:.0f} MiB", flush=True)
    found = {arm: cells(base / f"{arm}0") for arm in arms}
    tags = sorted(set().union(*found.values()))
    identical = {tag: all(found[arm].get(tag) == found[arms[0]].get(tag) for arm in arms) for tag in tags}
    print(f"\nwall time, {len(methods)} methods, model load included ({a.repeats} repeat(s)):")
    reference = sum(times[arms[0]])
    for arm in arms:
        print(f"  {LABELS[arm]:38s} {sum(times[arm]):7.1f} s  {sum(times[arm]) / reference:.2f}x  peak RSS {max(peaks[arm]):.0f} MiB"
              f"  CPU {CPU_SECONDS.get(arm, 0.0):7.1f} s  {CPU_SECONDS.get(arm, 0.0) / max(CPU_SECONDS.get(arms[0], 0.0), 1e-9):.2f}x")
    if "separate" in arms:
        targets = {"shared": "target <= 0.55x", "batched": "target <= 0.30x (0.35x on 2K only)"}
        for arm in arms[1:]:
            print(f"  {arm} / separate: {sum(times[arm]) / sum(times['separate']):.2f}x ({targets[arm]})")
    print(f"identical responses and kept-cache sizes per method ({', '.join(arms)}): "
          + ", ".join(f"{tag} {'yes' if same else 'NO'}" for tag, same in identical.items()))
    print(f"runs in {base}")
    return 0 if identical and all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
