#!/usr/bin/env bash
# Shared-prefill benchmark (issues 13, 22): five needle methods as separate runs vs one `methods=[...]` run
# (sequential decode) vs one methods run whose settings decode together (batched decode; see the .py docstring),
# interleaved in one invocation; prints the wall-time ratios, peak memory and the per-method identity check.
# Extra arguments go to scripts/bench_shared_prefill.py (e.g. --repeats 2, model=..., task.query_aware=false).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/bench_shared_prefill.py "$@"
