"""Several questions over one compressed context (harness.generation: Prompt.questions, _generate_group).

Rollback equals fresh: under the query-agnostic protocol each of K questions is asked on a rollback copy of
every setting's compressed cache; its answer, and the exact logits and cache layout its decoding starts
from, must equal a run that asks that question alone on the same compressed cache (a fresh prefill and
compression of the context). A copy that leaked the previous question into the cache, or a sliding-window
layer whose counters moved on, changes the first logits. Multi-turn (`keep_answers`) must differ, and
equal the conversation asked as one question. Tiny random models, milliseconds.
"""

from __future__ import annotations

import pytest
import torch

from harness import decoding
from harness.decoding import greedy_generate
from harness.methods import build_method
from harness.models import LoadedModel
from harness.generation.generate import generate_settings
from harness.generation.prompt import Prompt, Question, QuestionOutcomes, question_outcomes
from tiny_models import tiny_model

CONTEXT, QUESTION, NEW, K = 96, 24, 6, 3  # questions and answers longer than Gemma's 16-token window


def settings(gqa: str) -> list[tuple[str, object]]:
    return [
        ("snapkv", build_method({"name": "snapkv", "budget": 40, "window_size": 8, "kernel_size": 5, "pooling": "maxpool", "gqa": gqa})),
        ("h2o", build_method({"name": "h2o", "budget": 40, "window_size": 8, "block_size": 33, "gqa": gqa})),
        ("streamingllm", build_method({"name": "streamingllm", "budget": 40, "sink_tokens": 4, "window_size": 0, "gqa": gqa})),
        ("full", build_method({"name": "full"})),
    ]


def loaded_of(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name="tiny", chat_format="none", eos_token_ids=[], max_positions=4096,
                       prompt_max_length=None, device=torch.device("cpu"))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def many_question_prompt() -> Prompt:
    context = tokens(CONTEXT, 1)
    # questions of different lengths: decoded together, each (setting, question) row sits at its own positions
    questions = [Question(tokens(QUESTION + i, 10 + i), {"question": (CONTEXT, CONTEXT + QUESTION + i)}) for i in range(K)]
    return Prompt(context, spans={"needle": (40, 48)}, questions=questions)


@pytest.fixture
def decode_starts(monkeypatch):
    """What every decoding starts from: its first logits and each cache layer's (length, sliding counter)."""
    seen = []
    original = decoding.greedy_decode

    def spy(model, cache, logits, prompt_length, **kw):
        layout = [(int(layer.keys.shape[-2]) if getattr(layer, "keys", None) is not None else None,
                   getattr(layer, "cumulative_length", None)) for layer in cache.layers]
        seen.append((logits.clone(), layout, prompt_length))
        return original(model, cache, logits, prompt_length, **kw)

    monkeypatch.setattr(decoding, "greedy_decode", spy)
    return seen


@pytest.fixture
def prefill_starts(monkeypatch):
    """The start position and length of every prefill call (context prefills start at 0)."""
    calls = []
    original = decoding.prefill

    def spy(model, cache, ids, *, start=0, **kw):
        calls.append((start, int(ids.shape[1])))
        return original(model, cache, ids, start=start, **kw)

    monkeypatch.setattr(decoding, "prefill", spy)
    return calls


MODELS = {"llama": lambda: tiny_model("llama"), "gemma3": lambda: tiny_model("gemma3")}  # gemma3: 5 sliding : 1 full


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("gqa", ["expand", "mean"])
def test_each_answer_equals_that_question_asked_alone(family, gqa, decode_starts, prefill_starts, one_thread):
    loaded, prompt, methods = loaded_of(MODELS[family]()), many_question_prompt(), settings(gqa)
    # one setting after another (decode_together=false): the spies see each setting's own prefill and decode;
    # the batched default must give the same answers (checked at the end)
    out = generate_settings(loaded, methods, prompt, query_aware=False, max_new_tokens=NEW, decode_together=False)
    assert [start for start, _ in prefill_starts].count(0) == 1, "one context prefill for every setting and question"
    assert sorted(prefill_starts[1:]) == sorted([(CONTEXT, QUESTION + i) for i in range(K)] * len(methods))
    many = {tag: question_outcomes(o, K) for tag, o in out.items()}
    starts_many = {tag: [] for tag, _ in methods}
    for (tag, _), start in zip([(t, i) for i in range(K) for t in ("snapkv", "h2o", "streamingllm", "full")], decode_starts):
        starts_many[tag].append(start)
    assert all(isinstance(o, QuestionOutcomes) and len(o.answers) == K for o in out.values())
    decode_starts.clear()
    for i, alone_prompt in enumerate(prompt.asked()):
        alone = generate_settings(loaded, methods, alone_prompt, query_aware=False, max_new_tokens=NEW, decode_together=False)
        for (tag, _), (logits, layout, position) in zip(methods, decode_starts):
            got = many[tag][i]
            assert got.error is None, (tag, i, got.error)
            assert got.generation.tokens == alone[tag].generation.tokens, (family, gqa, tag, i)
            many_logits, many_layout, many_position = starts_many[tag][i]
            assert torch.equal(many_logits, logits), (family, gqa, tag, i)  # bitwise: the same cache, the same forward
            assert many_layout == layout and many_position == position == CONTEXT + QUESTION + i, (tag, i)
            assert got.diagnostics["question_position"] == CONTEXT
            assert got.diagnostics["shared_with"] == [t for t, _ in methods]
            assert {k: v for k, v in got.diagnostics.items() if k not in ("question_position", "shared_prefill_seconds")} == {
                k: v for k, v in alone[tag].diagnostics.items() if k != "shared_prefill_seconds"}
            for layer, kept in got.kept.items():
                assert (kept is None and alone[tag].kept[layer] is None) or torch.equal(kept, alone[tag].kept[layer])
        decode_starts.clear()
    together = generate_settings(loaded, methods, prompt, query_aware=False, max_new_tokens=NEW)
    # every setting x question in one batch; with sliding-window layers (one window mask per batch) one batch per question
    rows = len(methods) * (K if family == "llama" else 1)
    for tag, outcome in together.items():
        for i, answer in enumerate(question_outcomes(outcome, K)):
            assert answer.diagnostics["decoded_with"] == f"batch of {rows}"
            assert answer.generation.tokens == many[tag][i].generation.tokens, (family, gqa, tag, i)
    if family == "gemma3":  # the sliding layers' counters crossed the window: 96 + 24 tokens, window 16
        sliding = [layer for layer in starts_many["full"][0][1] if layer[1] is not None]
        assert sliding and all(length == 15 and counter == CONTEXT + QUESTION for length, counter in sliding)


def test_query_aware_compresses_each_question_with_the_context(prefill_starts, one_thread):
    loaded, prompt, methods = loaded_of(tiny_model("llama")), many_question_prompt(), settings("expand")
    many = {tag: question_outcomes(o, K) for tag, o in generate_settings(loaded, methods, prompt, max_new_tokens=NEW).items()}
    assert prefill_starts == [(0, CONTEXT + QUESTION + i) for i in range(K)], "K prefills of context + question, shared by every setting"
    for i, alone_prompt in enumerate(prompt.asked()):
        alone = generate_settings(loaded, methods, alone_prompt, max_new_tokens=NEW)
        for tag, _ in methods:
            assert many[tag][i].generation.tokens == alone[tag].generation.tokens, (tag, i)
            assert many[tag][i].diagnostics["question_kept"] == alone[tag].diagnostics["question_kept"]
    snap = [many["snapkv"][i].diagnostics["question_kept"] for i in range(K)]
    assert all(0 < q <= 1 for q in snap)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_keep_answers_continues_the_conversation(family, decode_starts, one_thread):
    """Multi-turn: question i + 1 follows question i and its answer at true positions; the answers equal the
    whole conversation asked as one question on the same compressed cache, and differ from independent questions."""
    loaded, prompt, methods = loaded_of(MODELS[family]()), many_question_prompt(), settings("expand")
    order = [tag for tag, _ in methods]  # the decode order: per question, every setting in turn

    def run(**options):
        decode_starts.clear()
        out = generate_settings(loaded, methods, prompt, query_aware=False, max_new_tokens=NEW, **options)
        firsts = {tag: [decode_starts[i * len(order) + j][0] for i in range(K)] for j, tag in enumerate(order)}
        return {t: question_outcomes(o, K) for t, o in out.items()}, firsts

    independent, independent_logits = run(decode_together=False)  # the spy sees each setting's own decode
    turns, multi_logits = run(keep_answers=True, decode_together=False)
    for tag, method in methods:
        assert turns[tag][0].generation.tokens == independent[tag][0].generation.tokens
        assert torch.equal(multi_logits[tag][0], independent_logits[tag][0])
        assert all(not torch.allclose(multi_logits[tag][i], independent_logits[tag][i]) for i in range(1, K)), tag
        conversation = list(prompt.ids)
        for i, question in enumerate(prompt.questions):
            assert turns[tag][i].diagnostics["question_position"] == len(conversation), (tag, i)
            conversation += question.ids
            answer = turns[tag][i].generation.tokens[0]
            assert turns[tag][i].generation.prompt_length == len(conversation)
            # the conversation so far as ONE question after the same compressed context
            decode_starts.clear()
            alone = generate_settings(loaded, [(tag, method)], Prompt(conversation, CONTEXT), query_aware=False,
                                      max_new_tokens=NEW)[tag]
            assert alone.generation.tokens[0] == answer, (family, tag, i)
            assert torch.allclose(decode_starts[0][0], multi_logits[tag][i], atol=1e-4), (family, tag, i)
            conversation += answer
    if family == "llama":  # full cache: the conversation equals plain greedy decoding of it (an independent reference)
        conversation = list(prompt.ids)
        for i, question in enumerate(prompt.questions):
            conversation += question.ids
            ref = greedy_generate(loaded.model, torch.tensor([conversation]), max_new_tokens=NEW).tokens[0]
            assert turns["full"][i].generation.tokens[0] == ref
            conversation += ref


def test_single_question_prompt_is_unchanged(one_thread):
    """Without `questions` the result is a plain Outcome (today's records), with no multi-question field."""
    loaded, methods = loaded_of(tiny_model("llama")), settings("expand")
    ids = tokens(CONTEXT + QUESTION, 3)
    out = generate_settings(loaded, methods, Prompt(ids, CONTEXT, {"question": (CONTEXT, len(ids))}), query_aware=False,
                            max_new_tokens=NEW)
    for tag, _ in methods:
        assert not isinstance(out[tag], QuestionOutcomes) and "question_position" not in out[tag].diagnostics
        assert question_outcomes(out[tag], 1) == [out[tag]]
    ref = greedy_generate(loaded.model, torch.tensor([ids]), max_new_tokens=NEW).tokens
    assert out["full"].generation.tokens == ref


def test_a_prompt_with_questions_holds_the_context_alone():
    with pytest.raises(ValueError, match="context alone"):
        Prompt([1, 2, 3], 2, questions=[Question([4])])
    p = Prompt([1, 2, 3], spans={"needle": (0, 1)}, questions=[Question([4, 5], {"question": (3, 5)}), Question([6])])
    assert p.question_start == 3
    assert [(q.ids, q.question_start, q.spans) for q in p.asked()] == [
        ([1, 2, 3, 4, 5], 3, {"needle": (0, 1), "question": (3, 5)}), ([1, 2, 3, 6], 3, {"needle": (0, 1)})]


# ------------------------------------------------------------------------------------------ needle, K needles

def needle_cfg(*extra):
    from conftest import compose

    return compose("model=tiny-random", "task=needle", "task.needles=3", "task.query_aware=false", "task.lengths=[400]",
                   "task.depths=[50]", "task.max_new_tokens=3", "method=snapkv", "method.budget=64", "method.window_size=8",
                   "progress=false", *extra)


def small_haystack(folder) -> str:
    """The first essays' opening 20K characters as the haystack (no 150K-token tokenization per run)."""
    from harness.tasks.needle import task as needle

    folder.mkdir()
    text = "".join(p.read_text(encoding="utf-8") for p in needle.haystack_files(needle_cfg().task)[:8])[:20000]
    (folder / "essays.txt").write_text(text, encoding="utf-8")
    return f"task.haystack_dir={folder}"


def test_needle_places_k_facts_asks_each_and_resumes_per_question(tmp_path):
    import json

    from harness.app import execute

    cfg = needle_cfg(small_haystack(tmp_path / "haystack"))
    tmp_path = tmp_path / "run"
    results = execute(cfg, tmp_path)
    rows = results["rows"]
    assert [(r["length"], r["depth"], r["question_index"]) for r in rows] == [(400, 50.0, i) for i in range(K)]
    assert [r["needle_depth"] for r in rows] == [50.0, round(50 + 100 / 3, 4), round((50 + 200 / 3) % 100, 4)]
    assert all(r["protocol"] == "query_agnostic" and r["keep_answers"] is False and r["question_kept"] == 1.0 for r in rows)
    assert max(r["prompt_tokens"] for r in rows) == 400 and len({r["question_start"] for r in rows}) == 1
    assert sorted(r["needle_token_index"] for r in rows) == [r["needle_token_index"] for r in sorted(rows, key=lambda r: r["needle_depth"])]
    for r in rows:  # the retention of every needle, and their mean
        kept = [r[f"needle_{j}_kept"] for j in range(K)]
        assert r["needle_kept"] == round(sum(kept) / K, 4) and "needle_kept_by_layer" not in r
    log = tmp_path / str(cfg.method.tag) / "needle_cells.jsonl"
    lines = log.read_text().splitlines()
    assert len(lines) == K
    # a partly done cell (question 1's record lost) is asked again and only that record is added
    log.write_text(lines[0] + "\n" + lines[2] + "\n")
    again = execute(cfg, tmp_path)
    after = log.read_text().splitlines()
    assert after[:2] == [lines[0], lines[2]] and len(after) == K
    assert json.loads(after[2])["question_index"] == 1 and json.loads(after[2])["response"] == rows[1]["response"]
    assert [r["response"] for r in again["rows"]] == [r["response"] for r in rows]


def test_needle_spans_hold_each_fact(tmp_path):
    """The needle spans of a several-needle cell are exactly the facts' tokens, each question asks its own fact."""
    from conftest import compose
    from harness.models import load_model
    from harness.tasks.needle import task as needle

    cfg = needle_cfg()
    loaded = load_model(compose("model=tiny-random").model)
    facts = needle.fact_parts(cfg.task, loaded, K)
    text = "".join(p.read_text(encoding="utf-8") for p in needle.haystack_files(cfg.task))[:20000]
    haystack = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    cell = needle.build_needles_cell(haystack, facts, 1200, 100)
    assert cell.depths == [100.0, round(100 / 3, 4), round(200 / 3, 4)]
    for (parts, answer), (a, b), suffix in zip(facts, cell.spans, cell.suffixes):
        assert cell.context[a:b] == parts.needle and suffix == parts.suffix
        assert answer.split()[-1] in loaded.tokenizer.decode(parts.needle)
        assert loaded.tokenizer.decode(parts.suffix).count("?") == 1  # its own question, nobody else's
    assert len(cell.context) + max(len(s) for s in cell.suffixes) == 1200
    assert cell.depth_actual[0] == 100.0 and all(abs(x - d) < 5 for x, d in zip(cell.depth_actual[1:], cell.depths[1:]))


@pytest.mark.parametrize("override,message", [
    ("task.needles=7", "task.needles=7: give a whole number from 1 to 6"),
    ("task.needles=0", "task.needles=0"),
    ("task.keep_answers=true task.query_aware=true", "task.keep_answers=true .* applies to task.query_aware=false"),
])
def test_bad_several_needle_settings(override, message):
    from harness.errors import HarnessError
    from harness.tasks.needle import task as needle

    with pytest.raises(HarnessError, match=message):
        needle.validate(needle_cfg(*override.split()).task)
