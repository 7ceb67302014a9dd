"""Needle placement on the real vocabularies of the paper's models (shared/reference/needle.md).

Llama-2 SentencePiece (LWM-Text-Chat-1M, LongChat), Llama-3, Qwen2, Command-R (llama.cpp's
vocabulary-only GGUF files, tests/vocab.py) and SmolLM2 (the embedded model's tokenizer), on the
real Paul Graham haystack. Expected values come from the rule in needle.md, checked on the text:
the needle starts right after a token that decodes to a sentence-final ".", within a few points of
the requested depth, and no "." lies between it and the requested point.
"""

from __future__ import annotations

import pytest
import torch

from conftest import compose
from harness.errors import HarnessError
from harness.models import LoadedModel, embedded_tokenizer
from harness.tasks.needle import task as needle
from harness.tasks.needle.prompt import PromptParts, build_cell, insert_needle, period_token_ids, prompt_parts
from vocab import vocab_tokenizer

NAMES = ("llama-spm", "llama-bpe", "qwen2", "command-r", "smollm2")
LENGTH = 3000


def tokenizer_of(name: str):
    return embedded_tokenizer() if name == "smollm2" else vocab_tokenizer(name)


def fake_loaded(tok, chat_format: str = "none") -> LoadedModel:
    return LoadedModel(model=None, tokenizer=tok, name="fake", chat_format=chat_format, eos_token_ids=[0],
                       max_positions=0, prompt_max_length=None, device=torch.device("cpu"))


_TEXT: list[str] = []


def haystack_ids(tok) -> list[int]:
    """The first ~40K characters of the real haystack (sorted essays, no separator): > 3,000 tokens."""
    if not _TEXT:
        _TEXT.append("".join(p.read_text(encoding="utf-8", errors="replace") for p in needle.haystack_files(compose().task))[:40000])
    return tok(_TEXT[0], add_special_tokens=False)["input_ids"]


def find(ids: list[int], part: list[int]) -> int:
    hits = [i for i in range(len(ids) - len(part) + 1) if ids[i : i + len(part)] == part]
    assert len(hits) == 1, hits
    return hits[0]


def test_real_vocabularies_load_with_their_known_sizes():
    assert vocab_tokenizer("llama-spm").vocab_size == 32000  # Llama-2 SentencePiece
    assert vocab_tokenizer("llama-bpe").vocab_size == 128256  # Llama-3
    assert max(vocab_tokenizer("command-r").get_vocab().values()) + 1 == 256000  # ids 0..255999
    assert vocab_tokenizer("qwen2").vocab_size >= 151643  # Qwen2: 151,643 regular tokens (+ control tokens)
    assert vocab_tokenizer("llama-spm")("Hi")["input_ids"][0] == 1  # <s>, as pred.py tokenizes for Llama-2


@pytest.mark.parametrize("name", NAMES)
def test_needle_lands_right_after_a_sentence_final_period(name):
    tok = tokenizer_of(name)
    task = compose("task.prompt_style=completion").task
    parts = prompt_parts(task, fake_loaded(tok))
    hay = haystack_ids(tok)
    needle_ids = tok(task.needle, add_special_tokens=False)["input_ids"]
    n_context = LENGTH - len(parts.prefix) - len(parts.suffix) - len(needle_ids)
    for depth in (25, 50, 75):
        cell = build_cell(hay, parts, LENGTH, depth)
        assert len(cell.ids) == LENGTH
        start = find(cell.ids, needle_ids)
        assert (cell.needle_start, cell.needle_end) == (start, start + len(needle_ids))
        at = start - len(parts.prefix)  # the needle's index in the context
        assert cell.ids[len(parts.prefix) : start] == hay[:at] and cell.ids[cell.needle_end : cell.question_start] == hay[at:n_context]
        before = tok.decode(cell.ids[start - 1 : start])
        assert before.rstrip().endswith("."), (depth, before)
        actual = 100 * at / n_context
        assert abs(actual - depth) <= 5 and cell.depth_actual == pytest.approx(actual, abs=1e-3)
        point = int(n_context * depth / 100)
        assert at <= point and not any(tok.decode([t]).strip() == "." for t in hay[at:point]), "walked back past a period"


@pytest.mark.parametrize("name", ["llama-spm", "qwen2"])
def test_needle_placement_in_the_chat_prompt(name):
    tok = tokenizer_of(name)
    task = compose().task
    loaded = fake_loaded(tok, "inst" if name == "llama-spm" else "template")
    parts = prompt_parts(task, loaded)
    cell = build_cell(haystack_ids(tok), parts, LENGTH, 50)
    assert len(cell.ids) == LENGTH and abs(cell.depth_actual - 50) <= 5
    assert tok.decode(cell.ids[cell.needle_start - 1 : cell.needle_start]).rstrip().endswith(".")
    assert tok.decode(cell.ids[cell.needle_start : cell.needle_end]).strip() == task.needle.strip()


def test_the_old_rule_puts_every_llama2_needle_at_position_0():
    """needle.md's trap: tok(".") is "▁." (869) while a period after a word is the bare "." (29889)."""
    tok = vocab_tokenizer("llama-spm")
    assert tok(".", add_special_tokens=False)["input_ids"] == [869]
    assert tok("a sunny day.", add_special_tokens=False)["input_ids"][-1] == 29889
    context, needle_ids = haystack_ids(tok)[:2900], tok("\nThe needle.\n", add_special_tokens=False)["input_ids"]
    old = set(tok(".", add_special_tokens=False)["input_ids"])
    found = period_token_ids(tok, context)
    assert {29889} <= found and all(tok.decode([i]).rstrip().endswith(".") for i in found)
    for depth in (25, 50, 75):
        assert insert_needle(context, needle_ids, depth, old)[1] == 0
        at = insert_needle(context, needle_ids, depth, found)[1]
        assert abs(100 * at / len(context) - depth) <= 5
    # With the old ids the cell fails loudly instead of silently measuring depth 0.
    parts = prompt_parts(compose("task.prompt_style=completion").task, fake_loaded(tok))
    broken = PromptParts(prefix=parts.prefix, suffix=parts.suffix, needle=parts.needle, periods=old)
    with pytest.raises(HarnessError) as err:
        build_cell(haystack_ids(tok), broken, LENGTH, 50)
    message = str(err.value)
    assert "\n" not in message and message.startswith("needle cell length=3000 depth=50: the needle starts at 0.0%")
    assert build_cell(haystack_ids(tok), broken, LENGTH, 0).depth_actual == 0
    assert build_cell(haystack_ids(tok), broken, LENGTH, 100).depth_actual == 100


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2"])
def test_periods_merged_with_newlines_count(name):
    """Llama-3 and Qwen2 merge a paragraph's final period with the newlines after it (".\\n\\n")."""
    tok = tokenizer_of(name)
    ids = tok("It ends here.\n\nNext one.", add_special_tokens=False)["input_ids"]
    merged = [i for i in ids if tok.decode([i]) == ".\n\n"]
    assert merged and set(merged) <= period_token_ids(tok, ids)


@pytest.mark.parametrize("name", ["llama-spm", "qwen2"])
def test_observation_needles_land_at_their_depths(name):
    """task=observation's haystack documents place their needles by needle's rule (place_needles): with Llama-2
    SentencePiece the old `tok(".")` walk-back put the needle asked at depth 25 at token 0 of ~4K."""
    from harness.tasks.observation import task as observation

    tok = tokenizer_of(name)
    task = compose("task=observation", "task.documents_per_length=1").task
    docs = observation.haystack_documents(task, fake_loaded(tok, "inst" if name == "llama-spm" else "none"))
    assert len(docs) == 1
    doc = docs[0]
    needles = [tok(str(nd.text), add_special_tokens=False)["input_ids"] for nd in task.needles]
    starts, actual = doc.meta["needle_token_index"], doc.meta["needle_depth_actual"]
    n_context = len(doc.ids) - sum(map(len, needles))
    assert n_context > 3500 and len(starts) == len(actual) == 3
    for nd, ids, start, got in zip(task.needles, needles, starts, actual):
        assert doc.ids[start:start + len(ids)] == ids
        before = sum(len(other) for other, s in zip(needles, starts) if s < start)  # needles placed earlier in the document
        point = start - before                      # the needle's point in the haystack slice
        requested = int(n_context * float(nd.depth) / 100)
        assert point > 0 and tok.decode(doc.ids[start - 1:start]).rstrip().endswith(".")
        assert got == pytest.approx(100 * point / n_context, abs=1e-3) and abs(got - float(nd.depth)) <= 5
        context = [t for i, t in enumerate(doc.ids) if not any(s <= i < s + len(x) for x, s in zip(needles, starts))]
        assert not any(tok.decode([t]).strip() == "." for t in context[point:requested]), "walked back past a period"
