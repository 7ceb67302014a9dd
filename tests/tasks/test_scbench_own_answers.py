"""SCBench multi-turn with the model's own answers (`task.keep_answers=true`, the authors' --disable_golden_context;
microsoft/MInference fb56c917 scbench/eval_utils.py create_multiturn_prompt and GreedySearch.test/_decode/_process_texts).

Their rules, written out here by hand for SmolLM2's chat template (the tiny random model's tokenizer):
- turn 1 is the golden mode's: `[user: <multiturn template with the context and query 1>]` with the generation prompt;
- turn i > 1 is `[user: <follow-up template with query i>]` with the generation prompt, `.replace`d by the empty system
  message rendered WITHOUT the generation prompt (`<|im_start|>system\\n<|im_end|>\\n`), which SmolLM2's rendering does not
  contain: its default system message stays;
- `_decode` never feeds the token it generates last (an end token breaks the loop before it is fed; the budget's last
  token is appended to the output only), and `_process_texts` puts `tokenizer.eos_token_id` before the next turn exactly
  when the answer did not end with an end token.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, compose
from harness.app import execute
from harness.decoding import greedy_generate
from harness.generation.generate import generate_settings
from harness.methods import build_method
from harness.tasks import contract
from harness.tasks.scbench import task as sc

FIXTURES = REPO / "tests" / "fixtures" / "scbench"
QA = json.loads((FIXTURES / "scbench_qa_eng.jsonl").read_text(encoding="utf-8").splitlines()[0])
SMOLLM_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
FIRST = (SMOLLM_SYSTEM + "<|im_start|>user\nRead the book and answer the question. Be very concise in your answer.\n\n"
         + QA["context"] + "\n\nQuestion: Who rowed out to save the crew?\nAnswer:<|im_end|>\n<|im_start|>assistant\n")
SECOND = SMOLLM_SYSTEM + "<|im_start|>user\nQuestion: Who kept the lamp?\nAnswer:<|im_end|>\n<|im_start|>assistant\n"
EOS = 2  # SmolLM2's <|im_end|>: tokenizer.eos_token_id

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def prefills(monkeypatch):
    """(start, ids) of every prefill on top of a cache (the context's own starts at 0)."""
    from harness import decoding

    calls, original = [], decoding.prefill

    def spy(model, cache, ids, *, start=0, **kw):
        calls.append((start, ids[0].tolist()))
        return original(model, cache, ids, start=start, **kw)

    monkeypatch.setattr(decoding, "prefill", spy)
    return calls


def conversation(loaded, prefills):
    """Run scbench_qa_eng item 0, multi-turn with own answers, under `full` (one decode after another): its two answers."""
    task = sc.SCBench(compose("task=scbench", "model=tiny-random", f"task.data_dir={FIXTURES}", "task.tasks=[scbench_qa_eng]",
                              "task.modes=[multi_turn]", "task.keep_answers=true"), loaded)
    built = task.build(("scbench_qa_eng", 0, "multi_turn"))
    assert built.decode == {"max_new_tokens": 40, "keep_answers": True}
    out = generate_settings(loaded, [("full", build_method({"name": "full"}))], built.prompt, query_aware=False,
                            decode_together=False, **{**task.decode, **built.decode})["full"]
    return [a.generation.tokens[0] for a in out.answers], built, task


@pytest.mark.parametrize("stops", ["by_budget", "at_an_end_token"])
def test_turn_two_follows_the_authors_rendering_of_own_answer_one(tiny_random, prefills, monkeypatch, stops):
    tok = tiny_random.tokenizer
    first_ids = tok.encode(FIRST)
    if stops == "at_an_end_token":  # declare a token answer 1 produces an end token: answer 1 stops on it
        (a1, _), _, _ = conversation(tiny_random, prefills)
        k = next(k for k in range(len(a1)) if a1[k] not in a1[:k])  # the random model may repeat one token: k = 0
        monkeypatch.setattr(tiny_random, "eos_token_ids", [EOS, a1[k]])
        prefills.clear()
    (a1, a2), built, task = conversation(tiny_random, prefills)
    ended = a1[-1] in tiny_random.eos_token_ids
    assert ended == (stops == "at_an_end_token") and (ended or len(a1) == 40)
    # the prompt as the authors tokenize it: turn 1 whole (encode, special tokens added), turn 2 without special tokens
    assert built.prompt.ids + built.prompt.questions[0].ids == first_ids
    turn2 = tok.encode(SECOND, add_special_tokens=False)
    assert built.prompt.questions[1].ids == turn2
    # what turn 2 feeds on top of the cache, and where: answer 1 but its last token sits in the cache already
    expected = ([] if ended else [EOS]) + turn2
    assert prefills[-1] == (len(first_ids) + len(a1) - 1, expected)
    # the whole conversation: full-cache answer 2 equals plain greedy decoding of the authors' token sequence
    authors = first_ids + a1[:-1] + expected
    reference = greedy_generate(tiny_random.model, torch.tensor([authors]), max_new_tokens=40,
                                eos_token_ids=tiny_random.eos_token_ids).tokens[0]
    assert a2 == reference
    record = task.record(("scbench_qa_eng", 0, "multi_turn"), built, 1, "", type("A", (), {"generation": type("G", (), {"tokens": [a2]})()})())
    assert record["history"] == "own_answers" and record["prediction"] == tok.decode(a2)


def test_after_own_answer_rule():
    assert sc.after_own_answer((2, 7), 2, [5, 6, 7]) == []  # stopped at an end token: nothing, the token never fed
    assert sc.after_own_answer((2, 7), 2, [5, 6, 8]) == [2]  # cut by the budget: the tokenizer's EOS
    assert sc.after_own_answer((2, 7), 2, [2]) == []


def test_golden_rendering_unchanged_under_the_switch(tiny_random):
    """keep_answers=false keeps the golden follow-ups (gold answer in an assistant message) and no keep_answers decode."""
    golden = sc.SCBench(compose("task=scbench", "model=tiny-random", f"task.data_dir={FIXTURES}"), tiny_random)
    built = golden.build(("scbench_qa_eng", 0, "multi_turn"))
    second = tiny_random.tokenizer.decode(built.prompt.questions[1].ids)
    assert "keep_answers" not in built.decode and "Mara<|im_end|>\n<|im_start|>user\nQuestion: Who kept the lamp?" in second
    assert all(q.after_answer is None and q.max_new_tokens is None for q in built.prompt.questions)


def test_methods_list_equals_separate_runs_with_own_answers(tmp_path, monkeypatch):
    """Every setting from one prefill per item, each conversation on its own cache: token for token each method's own run.
    A mixed task's turn decodes with its subtask's budget; multi-request items never keep answers."""
    calls = []
    real = contract.generate_settings

    def spy(loaded, methods, prompt, **kw):  # budgets / 20 (repoqa 51, kv 4, qa 2): short, still distinct
        calls.append((kw.get("keep_answers", False), [q.max_new_tokens for q in prompt.questions]))
        for q in prompt.questions:
            q.max_new_tokens = None if q.max_new_tokens is None else q.max_new_tokens // 20
        return real(loaded, methods, prompt, **{**kw, "max_new_tokens": kw["max_new_tokens"] // 20})

    monkeypatch.setattr(contract, "generate_settings", spy)
    base = ["task=scbench", "model=tiny-random", f"task.data_dir={FIXTURES}", "progress=false", "task.keep_answers=true",
            "task.tasks=[scbench_qa_eng,scbench_repoqa_and_kv]"]
    methods = {"full": "full", "snapkv": "{name: snapkv, budget: 32, window_size: 4}",
               "streamingllm": "{name: streamingllm, budget: 32, sink_tokens: 4, window_size: 0}"}
    together = [*base, f"methods=[{','.join(methods.values())}]"]
    execute(compose(*together), tmp_path / "together", overrides=together)
    assert calls == [(False, [None, None])] * 2 + [(True, [None, None]), (True, [1024, 80])]  # requests, then turns
    for name, entry in methods.items():
        alone = [*base, f"methods=[{entry}]"]
        execute(compose(*alone), tmp_path / name, overrides=alone)
        tag = next(d.name for d in (tmp_path / name).iterdir() if d.is_dir())  # the setting's own folder (its full tag)

        def records(folder):
            return [json.loads(line) for line in (folder / tag / "scbench.jsonl").read_text(encoding="utf-8").splitlines()]

        got, own = records(tmp_path / "together"), records(tmp_path / name)
        keep = ("task", "index", "mode", "turn_idx", "prediction", "new_tokens", "stopped_by", "score", "history")
        assert len(got) == 8 and [{k: r.get(k) for k in keep} for r in got] == [{k: r.get(k) for k in keep} for r in own], tag
        turns = [r for r in got if r["mode"] == "multi_turn"]
        assert all(r["history"] == "own_answers" for r in turns) and all("history" not in r for r in got if r["mode"] == "multi_request")
        kv = next(r for r in turns if r.get("subtask") == "scbench_kv")
        assert kv["new_tokens"] <= 4 and (kv["new_tokens"] == 4 or kv["stopped_by"] == "eos")
    summary = json.loads((tmp_path / "together" / "full" / "results.json").read_text(encoding="utf-8"))["summary"]
    assert summary["multi_turn_history"] == "own_answers"
    assert "multi-turn: the model's own answers kept" in (tmp_path / "together" / "scbench_table.md").read_text(encoding="utf-8")
