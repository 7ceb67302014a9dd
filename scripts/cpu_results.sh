#!/usr/bin/env bash
# Regenerates the committed CPU results (results/cpu/) on a 2-core CPU with SmolLM2-135M-Instruct:
#   1. needle, 2K/4K tokens x depths 10/50/90: full + snapkv, streamingllm, h2o, pyramidkv at budgets 256/512/1024
#      (method defaults otherwise), one `methods=[...]` run per question placement (one prefill per cell for all
#      13 settings): query-aware (the paper's protocol) and query-agnostic (kvpress's)       (~15-25 min idle)
#   2. the efficiency benchmark (scripts/bench_cpu.sh; SKIP_BENCH=1 skips it)                  (~15 min idle)
#   3. the tables: python -m harness.report runs/cpu --name cpu  -> results/cpu/
# In float32, as the committed tables were made (the packaged models' default is model.dtype=auto: bfloat16 on a
# CPU with native bf16).
# Runs resume: rerunning after an interruption (or with the runs already present) only redoes what is missing.
#   bash scripts/cpu_results.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
settings="full"
for m in snapkv streamingllm h2o pyramidkv; do
  for b in 256 512 1024; do settings="$settings,{name:$m,budget:$b}"; done
done
for aware in true false; do
  protocol=$([ "$aware" = true ] && echo query_aware || echo query_agnostic)
  "$py" -m harness task=needle "methods=[$settings]" "task.lengths=[2048,4096]" "task.depths=[10,50,90]" \
    task.query_aware=$aware model.dtype=float32 progress=false "hydra.run.dir=runs/cpu/needle_$protocol"
done
[ "${SKIP_BENCH:-0}" = 1 ] || OUT=runs/cpu bash scripts/bench_cpu.sh
"$py" -m harness.report runs/cpu --name cpu
