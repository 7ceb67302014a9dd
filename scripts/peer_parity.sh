#!/usr/bin/env bash
# Peer parity as a command: our methods against kvpress 0.5.5 on identical token ids (docs/peer_parity.md).
#
#   bash scripts/peer_parity.sh [options of scripts/peer_parity_ours.py]
#   e.g. bash scripts/peer_parity.sh --methods snapkv streamingllm --lengths 2048 --depths 50 --gemma-cells
#
# 1. the harness venv (.venv, scripts/setup.sh) and a separate kvpress venv (.venv-kvpress: kvpress pins
#    transformers <5.3, ours needs >=5.24): torch 2.13.0 CPU from this machine's local wheels only (never
#    a CUDA build from an index), then kvpress 0.5.5 and transformers 5.2.0 with torch held at 2.13.0;
# 2. our side builds the needle cells' token ids with our prompt code (cells.pt), then runs our methods
#    (ours.pt); the kvpress side (imports nothing from the harness) runs the same ids (theirs.pt); both in
#    parallel, one thread each unless PEER_PARITY_THREADS says otherwise;
# 3. the comparison prints one line per method and writes the report.
#
# Environment: PEER_PARITY_WORK (work folder, default outputs/peer_parity), PEER_PARITY_OUT (report, default
# results/cpu/peer_parity.md), PEER_PARITY_MERGE (more work folders whose runs the report merges),
# PEER_PARITY_THREADS (torch threads per side, default 1), KVPRESS_ARGS (options of peer_parity_kvpress.py,
# e.g. "--hooks-cells" to skip the as-shipped check), PEER_PARITY_SERIAL=1 (one side after the other).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
work="${PEER_PARITY_WORK:-outputs/peer_parity}"
out="${PEER_PARITY_OUT:-results/cpu/peer_parity.md}"
export OMP_NUM_THREADS="${PEER_PARITY_THREADS:-1}"
export HF_HUB_DISABLE_PROGRESS_BARS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
kv=".venv-kvpress"
pins=("kvpress==0.5.5" "transformers==5.2.0")
stamp="$kv/.peer-parity-stamp"
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

bash scripts/setup.sh
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "torch==2.13.0 ${pins[*]}" ]; then
  [ -x "$kv/bin/python" ] || python3 -m venv "$kv"
  pip=("$kv/bin/python" -m pip install --disable-pip-version-check -q)
  if ! "$kv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    # --no-index: only the local wheels (pip's find-links); an index would hand out the CUDA build. --no-deps:
    # torch's own requirements (filelock, sympy, ...) are not among the local wheels; they come with kvpress below
    quiet "${pip[@]}" --no-index --no-deps "torch==2.13.0" || {
      echo "error: no local CPU wheel of torch 2.13.0; install one into $kv first (a CPU build), then rerun" >&2; exit 2; }
  fi
  constraints="$(mktemp)"
  echo "torch==2.13.0" > "$constraints"
  quiet "${pip[@]}" -c "$constraints" "${pins[@]}"
  rm -f "$constraints"
  if "$kv/bin/python" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
    echo "error: $kv holds CUDA packages (nvidia-*); remove $kv and rerun" >&2; exit 2
  fi
  echo "torch==2.13.0 ${pins[*]}" > "$stamp"
fi
"$kv/bin/python" -c "import torch, transformers, kvpress; print('kvpress venv: torch', torch.__version__, 'transformers', transformers.__version__)"

mkdir -p "$work"
.venv/bin/python scripts/peer_parity_ours.py --stage ids --work "$work" "$@"
# shellcheck disable=SC2086
if [ "${PEER_PARITY_SERIAL:-0}" = "1" ]; then
  .venv/bin/python scripts/peer_parity_ours.py --stage run --work "$work" "$@" > "$work/ours.log" 2>&1
  "$kv/bin/python" scripts/peer_parity_kvpress.py --work "$work" ${KVPRESS_ARGS:-} > "$work/kvpress.log" 2>&1
else
  .venv/bin/python scripts/peer_parity_ours.py --stage run --work "$work" "$@" > "$work/ours.log" 2>&1 & ours=$!
  "$kv/bin/python" scripts/peer_parity_kvpress.py --work "$work" ${KVPRESS_ARGS:-} > "$work/kvpress.log" 2>&1 & theirs=$!
  status=0
  wait "$ours" || { status=$?; echo "our side failed (see $work/ours.log)" >&2; }
  wait "$theirs" || { status=$?; echo "kvpress side failed (see $work/kvpress.log)" >&2; }
  [ "$status" = 0 ] || exit "$status"
fi
# shellcheck disable=SC2086
.venv/bin/python scripts/peer_parity_compare.py --work "$work" ${PEER_PARITY_MERGE:-} --out "$out" \
  --command "bash scripts/peer_parity.sh${*:+ $*}"
