"""RULER's generator against samples made by RULER's own scripts (NVIDIA/RULER, scripts/data/prepare.py;
repository, commit and commands in tests/fixtures/ruler_golden/SOURCE.md): every task at 2048 and 4096
tokens in a vocabulary that adds a BOS (Llama-2 SentencePiece) and one that does not (Qwen2), byte for byte:
the model input, the answer prefix, the references and RULER's own token count. This ties the needle
shuffle, the depths, vt's one-shot example, cwe's lists, fwe's Zipf counts, the qa document top-up and
the haystack fit (counted as RULER counts, no BOS) to RULER's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.tasks.ruler.data import TASKS, TaskGenerator, wonderwords_lists
from test_ruler import _tokenized, essay  # noqa: F401  (the module-scoped essay fixture)

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "ruler_golden"
VOCABS = ("llama-spm", "qwen2")  # adds a BOS / adds none
LENGTHS = (2048, 4096)


def golden(vocab: str, length: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in (GOLDEN / f"{vocab}_{length}.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        out.setdefault(row["task"], []).append(row)
    return out


@pytest.fixture(scope="module")
def words():
    return wonderwords_lists()


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_generator_equals_rulers_own_scripts(vocab, length, essay, words):  # noqa: F811
    t = _tokenized(vocab)
    expected = golden(vocab, length)
    assert sorted(expected) == sorted(TASKS)  # every task, qa included
    for name, rows in expected.items():
        gen = TaskGenerator(name, length, seed=42, measure=t.measure, wrapper=t.wrapper, essay=essay, words=words,
                            qa_data_dir=str(GOLDEN / "qa"))
        got = gen.samples(len(rows))
        for s, row in zip(got, rows):
            where = f"{vocab} {length} {name} #{row['index']}"
            assert s.text == row["input"] + row["answer_prefix"], where
            assert s.answer_prefix == row["answer_prefix"], where
            assert s.references == row["outputs"], where
            assert t.measure(s.text) + s.tokens_to_generate == row["length"], where  # RULER's count: no BOS
