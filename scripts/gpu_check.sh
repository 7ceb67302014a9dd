#!/usr/bin/env bash
# GPU readiness check (issue 22): SDPA vs eager identity, the bench at 16K-64K, the 80 GB maximum-length search and the
# shared-prefill ratio on one GPU, in time boxes that sum to under 8 minutes; tables in results/gpu/. See docs/gpu_check.md.
#
#   bash scripts/gpu_check.sh --dry-run       # the plan (every command, its time box, its tables); no torch, no GPU
#   bash scripts/gpu_check.sh --prepare       # here, before sending the tree: wheelhouse, tokenizer, SmolLM2 in two parts
#   bash scripts/gpu_check.sh --parts b,c     # on the GPU machine (call 1), then --parts a,d (call 2, right after)
#
# The interpreter: $PYTHON, else the repository's .venv (here), else python3 (the GPU machine's, which has torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONUNBUFFERED=1
exec "$py" scripts/gpu_check.py "$@"
