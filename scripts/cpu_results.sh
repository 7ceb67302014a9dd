#!/usr/bin/env bash
# Regenerates the committed CPU results (results/cpu/) on a 2-core CPU with SmolLM2-135M-Instruct:
#   1. the needle grid (1K-4K tokens x 5 depths) for every method at one budget (256 tokens per head
#      per layer; method defaults): full, snapkv, streamingllm, h2o, pyramidkv   (~15-20 min idle)
#   2. the efficiency benchmark and maximum-length search (scripts/bench_cpu.sh)   (~15 min idle)
#   3. the tables: python -m harness.report runs/cpu --name cpu  -> results/cpu/
# Runs resume: rerunning after an interruption (or with the runs already present) only redoes what is missing.
#   bash scripts/cpu_results.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
"$py" -m harness -m method=full,snapkv,streamingllm,h2o,pyramidkv progress=false hydra.sweep.dir=runs/cpu/needle
OUT=runs/cpu bash scripts/bench_cpu.sh
"$py" -m harness.report runs/cpu --name cpu
