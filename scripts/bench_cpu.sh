#!/usr/bin/env bash
# The efficiency benchmark's CPU targets with SmolLM2-135M-Instruct (conf/task/bench.yaml defaults):
# full vs SnapKV budget 1024 (gqa=mean and gqa=expand) at 1K/2K/4K/8K prompt tokens, 32 decode steps,
# 3 interleaved repeats, one worker process per method. ~10 min on an idle 2-core machine (the 8K
# prefill alone is ~28 s per measurement). Then a maximum-length search under a memory cap.
#
#   bash scripts/bench_cpu.sh                     # both steps
#   SEARCH=0 bash scripts/bench_cpu.sh            # the benchmark only
#   THREADS=1 bash scripts/bench_cpu.sh           # torch threads per worker (default: torch's own, 2 here)
#   OUT=outputs/my_bench bash scripts/bench_cpu.sh
#   bash scripts/bench_cpu.sh model.dtype=float32  # extra arguments go to both harness runs (the packaged models'
#                                                 # dtype is auto: bfloat16 on a CPU with native bf16, else float32)
#
# Reruns resume: finished (method, length, repeat) rows are not measured again; resume=false starts afresh.
# Timings are only meaningful on a quiet machine: every row records the 1-minute load average, and the
# table reports the highest one seen.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
out="${OUT:-outputs/bench_cpu}"
threads=()
[ -n "${THREADS:-}" ] && threads=("task.threads=$THREADS")

echo "== benchmark -> $out/bench (load average now: $(cut -d' ' -f1-3 /proc/loadavg))"
"$py" -m harness task=bench model=smollm2-135m progress=false "hydra.run.dir=$out/bench" ${threads[@]+"${threads[@]}"} "$@"

"$py" - "$out/bench/results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
m = r["summary"]["by_method"]
def get(label, n, key):
    return m.get(label, {}).get(str(n), {}).get(key)
def fmt(v, f="{:.3f}"):
    return "n/a" if v is None else f.format(v)
batch = r["rows"][0]["batch_size"] if r["rows"] else "?"
print(f"\nCPU targets (SmolLM2-135M, batch {batch}; wall-clock, then process CPU time in brackets):")
for label in ("snapkv-c1024-mean", "snapkv-c1024-expand"):
    if get(label, 8192, "decode_median_ms") is None or get("full", 1024, "decode_median_ms") is None:
        print(f"  {label}: not measured at 8192 (or full at 1024)")
        continue
    print(f"  {label} at 8192 tokens:")
    for view, key in (("wall", "decode_median_ms"), ("cpu", "decode_cpu_median_ms")):
        d8, f1, f8 = get(label, 8192, key), get("full", 1024, key), get("full", 8192, key)
        if None in (d8, f1, f8):
            continue
        print(f"    decode [{view}] {d8:.1f} ms/tok = {d8 / f1:.3f}x full@1024 ({f1:.1f} ms; target <= 1.10 for mean), "
              f"{f8 / d8:.2f}x faster than full@8192 ({f8:.1f} ms; target >= 2 for mean)")
    print(f"    compression overhead {fmt(get(label, 8192, 'compress_s'))} s = {fmt(get(label, 8192, 'compress_pct_of_full_prefill'), '{:.2f}')}% "
          f"of full prefill [cpu {fmt(get(label, 8192, 'compress_cpu_pct_of_full_prefill'), '{:.2f}')}%] (target <= 5%); "
          f"paired prefill difference {fmt(get(label, 8192, 'prefill_overhead_pct'), '{:+.2f}')}% [cpu {fmt(get(label, 8192, 'prefill_cpu_overhead_pct'), '{:+.2f}')}%]")
    print(f"    KV bytes full / this = {fmt(get(label, 8192, 'kv_full_over_this'))}x (8 for mean, 8/3 = 2.667 for expand); "
          f"peak memory x full = {fmt(get(label, 8192, 'peak_vs_full'))}")
print(f"  KV measured == analytic everywhere: {r['summary']['kv_bytes_match_analytic']}; "
      f"highest 1-min load average before a measurement: {r['summary'].get('loadavg_1m_max')} (2 CPUs)")
PY

if [ "${SEARCH:-1}" = "1" ]; then
  # Maximum prompt length per method within a memory cap that includes the weights and the libraries
  # (a SmolLM2 worker is ~0.9 GB resident after load). CPU: RLIMIT_AS in each worker plus a peak-RSS check;
  # doubling from 1024, bisection to 512 tokens. ~20 min with one thread (SnapKV reaches ~16K tokens).
  cap="${CAP_GB:-1.5}"
  echo "== maximum-length search, cap ${cap} GB -> $out/search"
  "$py" -m harness task=bench model=smollm2-135m progress=false "hydra.run.dir=$out/search" ${threads[@]+"${threads[@]}"} \
    task.repeats=0 task.max_length_search=true task.search_by=measure "task.memory_cap_gb=$cap" task.search_start=1024 task.search_resolution=512 \
    task.search_max=65536 "$@"
  sed -n '/Maximum prompt length/,$p' "$out/search/bench_table.md"
fi
