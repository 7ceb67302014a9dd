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

from pathlib import Path

import pytest

from harness.models import VOCABULARIES, cache_root, vocabulary_file, vocabulary_tokenizer

VOCABS: tuple[str, ...] = VOCABULARIES


def vocab_dir() -> Path:
    return cache_root() / "vocab"


def vocab_file(name: str) -> Path:
    if name not in VOCABS:
        raise ValueError(f"unknown vocabulary {name!r}; expected one of {VOCABS}")
    path = vocabulary_file(name)
    if not path.is_file() or path.stat().st_size == 0:
        pytest.fail(f"{path} is missing: run `bash scripts/setup.sh` first (it extracts the paper's vocabularies "
                    f"from the llama-cpp-python source distribution)", pytrace=False)
    return path


def vocab_tokenizer(name: str):
    """The tokenizer of vocabulary `name` (one of VOCABS), from the GGUF file set-up extracted
    (harness.models.vocabulary_tokenizer, which random-weight models use too)."""
    vocab_file(name)
    return vocabulary_tokenizer(name)
