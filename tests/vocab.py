"""The real tokenizers of the paper's models, offline, for tests of tokenizer-dependent rules.

`scripts/setup.sh` extracts llama.cpp's vocabulary-only GGUF files (no weights) into
`${KV_HARNESS_CACHE:-~/.cache/kv-harness}/vocab/`. `vocab_tokenizer(name)` loads one of them as a
transformers tokenizer:

- llama-spm: Llama-2 SentencePiece (LWM-Text-Chat-1M, LongChat-7B), 32,000 tokens
- llama-bpe: Llama-3 byte-level BPE, 128,256 tokens
- qwen2: Qwen2 byte-level BPE, 151,936 tokens
- command-r: Command-R byte-level BPE, 256,000 tokens (transformers has no Command-R GGUF config,
  so it is read through its tokenizer class, CohereTokenizer)

Converting a GGUF vocabulary takes up to ~30 s (BPE merges), so the converted tokenizer is saved
once next to the GGUF files (`vocab/hf/<name>-<size>/`, keyed by the GGUF's size) and later test
sessions load that copy in about a second. A missing file is a test failure, not a skip: CI runs
set-up first, so a missing vocabulary means set-up was not run.
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache
from pathlib import Path

import pytest

from harness.models import cache_root

VOCABS: tuple[str, ...] = ("llama-spm", "llama-bpe", "qwen2", "command-r")


def vocab_dir() -> Path:
    return cache_root() / "vocab"


def vocab_file(name: str) -> Path:
    if name not in VOCABS:
        raise ValueError(f"unknown vocabulary {name!r}; expected one of {VOCABS}")
    path = vocab_dir() / f"ggml-vocab-{name}.gguf"
    if not path.is_file() or path.stat().st_size == 0:
        pytest.fail(f"{path} is missing: run `bash scripts/setup.sh` first (it extracts the paper's vocabularies "
                    f"from the llama-cpp-python source distribution)", pytrace=False)
    return path


@lru_cache(maxsize=None)
def vocab_tokenizer(name: str):
    """The tokenizer of vocabulary `name` (one of VOCABS), from the GGUF file set-up extracted."""
    from transformers import AutoTokenizer

    gguf = vocab_file(name)
    derived = vocab_dir() / "hf" / f"{name}-{gguf.stat().st_size}"
    if (derived / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(derived))
    if name == "command-r":
        from transformers import CohereTokenizer

        tok = CohereTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = derived.with_name(derived.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(derived)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
