"""Benchmark: a method comparison as separate runs vs one `methods=[...]` run sharing each item's prefill.

Runs, in one invocation and interleaved (A B, then B A for a second repeat, ...), the needle grid with
the given methods (a) as one `python -m harness method=<m>` process per method and (b) as one
`python -m harness 'methods=[...]'` process, each into a fresh folder, and prints the wall-time ratio
(model load and process start included, as a user experiences it), the peak resident memory of each
process, and whether every method's responses and kept-cache sizes are identical both ways.

    python scripts/bench_shared_prefill.py                       # SmolLM2, 2K/4K x 10/50/90, five methods
    python scripts/bench_shared_prefill.py --repeats 2 --out /tmp/shared-bench
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


def run(args: list[str], out: Path) -> tuple[float, float]:
    """One harness process; returns (wall seconds, peak RSS in MiB of that child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "harness", *args, f"hydra.run.dir={out}", "progress=false"],
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 1024


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
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="more harness overrides (e.g. model=..., task.query_aware=false)")
    a = parser.parse_args()
    methods = [m for m in a.methods.split(",") if m]
    base = Path(a.out or tempfile.mkdtemp(prefix="shared-prefill-"))
    common = ["task=needle", f"task.lengths={a.lengths}", f"task.depths={a.depths}", *a.overrides]
    times = {"separate": [], "shared": []}
    peaks = {"separate": [], "shared": []}
    order = []
    for r in range(a.repeats):
        order += [("separate", r), ("shared", r)] if r % 2 == 0 else [("shared", r), ("separate", r)]
    for kind, r in order:
        folder = base / f"{kind}{r}"
        if kind == "separate":
            total, peak = 0.0, 0.0
            for m in methods:
                wall, rss = run([*common, f"method={m}"], folder)
                total, peak = total + wall, max(peak, rss)
                print(f"  separate #{r} method={m}: {wall:.1f} s", flush=True)
        else:
            total, peak = run([*common, f"methods=[{','.join(methods)}]"], folder)
        times[kind].append(total)
        peaks[kind].append(peak)
        print(f"{kind} #{r}: {total:.1f} s wall, peak RSS {peak:.0f} MiB", flush=True)
    sep, shared = cells(base / "separate0"), cells(base / "shared0")
    identical = {tag: sep.get(tag) == shared.get(tag) for tag in sorted(set(sep) | set(shared))}
    ratio = sum(times["shared"]) / sum(times["separate"])
    print(f"\nwall time, {len(methods)} methods: separate {sum(times['separate']):.1f} s, shared prefill "
          f"{sum(times['shared']):.1f} s -> ratio {ratio:.2f}x (target <= 0.55x)")
    print("identical responses and kept-cache sizes per method: "
          + ", ".join(f"{tag} {'yes' if same else 'NO'}" for tag, same in identical.items()))
    print(f"runs in {base}")
    return 0 if identical and all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
