"""Needle in a haystack: insertion rule on real text, exact lengths, the question split, prompt styles, one
tokenization, outputs, resume, real retrieval. Placement on the paper's vocabularies: test_vocabularies.py."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import REPO, compose
from harness.app import execute
from harness.errors import HarnessError
from harness.tasks import contract
from harness.tasks.needle import prompt as needle_prompt, task as needle



@pytest.fixture(scope="module")
def smol():
    """SmolLM2's tokenizer (the tiny-random model's) and the real haystack in its tokens."""
    from harness.models import embedded_tokenizer

    tok = embedded_tokenizer()
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in needle.haystack_files(compose().task))[:60000]
    return tok, tok(text, add_special_tokens=False)["input_ids"]


def test_insertion_walks_back_to_the_previous_period(smol):
    tok, _ = smol
    ctx = tok("Alpha beta. Gamma delta epsilon. Zeta theta.", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ctx) == ["Alpha", "Ġbeta", ".", "ĠGamma", "Ġdelta", "Ġepsilon", ".", "ĠZ", "eta", "Ġtheta", "."]
    periods = needle_prompt.PeriodRule(tok)
    nd = [900, 901]
    # depth 50: point int(11 * 0.5) = 5; tokens 4, 3 are words, token 2 is "." -> the needle goes in at 3
    out, at = needle.insert_needle(ctx, nd, 50, periods)
    assert at == 3 and out == ctx[:3] + nd + ctx[3:]
    assert needle.insert_needle(ctx, nd, 0, periods) == (nd + ctx, 0)
    assert needle.insert_needle(ctx, nd, 100, periods) == (ctx + nd, len(ctx))  # 100 appends, no walk-back
    assert needle.insert_needle(ctx, nd, 90, periods)[1] == 7  # point 9: back over "eta", "ĠZ" to just after token 6
    assert needle.insert_needle(ctx, nd, 64, periods)[1] == 7  # point 7: token 6 is a period, stay at the point
    words = tok("Alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    assert needle.insert_needle(words, nd, 75, periods)[1] == 0  # no period before the point


def test_several_needles_are_placed_on_the_original_context():
    """place_needles (needle, observation, RULER): each point from the ORIGINAL context, walked back to a period;
    the needles go in together, the starts point at each needle in the new ids, in the order given."""
    periods = {7, 8}
    context = [1, 2, 7, 3, 4, 5, 8, 6, 1, 2]        # periods end tokens 2 and 6
    a, b, c, d = [90], [91, 92], [93], [94]
    placed = needle_prompt.place_needles(context, [(a, 50), (b, 90), (c, 0), (d, 100)], periods)
    # points: a int(10 * .5) = 5 -> back to 3 (after token 2); b 9 -> 7 (after token 6); c 0; d appended at 10
    assert placed.points == [3, 7, 0, 10] and placed.depth_actual == [30.0, 70.0, 0.0, 100.0]
    assert placed.ids == c + [1, 2, 7] + a + [3, 4, 5, 8] + b + [6, 1, 2] + d
    for needle_ids, start in zip((a, b, c, d), placed.starts):
        assert placed.ids[start:start + len(needle_ids)] == needle_ids
    tie = needle_prompt.place_needles(context, [(b, 40), (a, 30)], periods)  # both walk back to 3: the order given
    assert tie.ids == [1, 2, 7] + b + a + [3, 4, 5, 8, 6, 1, 2] and tie.starts == [3, 5]
    assert needle_prompt.insert_needle(context, a, 50, periods) == (context[:3] + a + context[3:], 3)


def test_a_needle_far_from_its_depth_fails_naming_the_needle():
    words = list(range(1000, 1600))                 # 600 tokens, no period: every walk-back reaches 0
    near = needle_prompt.place_needles(words, [([1], 10)], {7})   # 60 tokens back: within one sentence, accepted
    assert near.points == [0]
    with pytest.raises(HarnessError) as err:
        needle_prompt.place_needles(words, [([1], 10), ([2], 75)], {7}, where="observation document length=700 copy=0")
    message = str(err.value)
    assert "\n" not in message and message.startswith("observation document length=700 copy=0 needle 1 (depth 75): "
                                                      "the needle starts at 0.0% of the 600-token context (token 0, "
                                                      "the requested point is token 450)")
    assert needle_prompt.place_needles(words, [([2], 75)], {7}, check=False).points == [0]
    assert needle_prompt.place_needles(words, [([2], 75)], {7}, tolerance=80).depth_actual == [0.0]


@pytest.mark.parametrize("text,is_period", [
    (".", True), (" .", True), ("\u2581.", True), (".\n\n", True), (").", True), ("%.", True), ('").', True), ("...", True),
    ("Mr.", False), ("3.", False), ("etc.", False), ('."', False), (",", False), ("a", False), ("", False), ("</s>", False),
])
def test_period_rule_on_decoded_token_text(text, is_period):
    assert needle_prompt.is_period_text(text) is is_period


def test_cells_have_exactly_the_requested_length(tiny_random, smol):
    _, haystack = smol
    task = compose("model=tiny-random").task
    tok = tiny_random.tokenizer
    parts = needle.prompt_parts(task, tiny_random)
    needle_ids = tok(task.needle, add_special_tokens=False)["input_ids"]
    for length in (300, 1000, 4096):
        for depth in (0, 33, 100):
            cell = needle.build_cell(haystack, parts, length, depth)
            assert isinstance(cell, needle.NeedleCell) and len(cell.ids) == length
            assert cell.ids[cell.needle_start : cell.needle_end] == needle_ids
            context = length - len(parts.prefix) - len(parts.suffix) - len(needle_ids)
            assert cell.depth_actual == pytest.approx(100 * (cell.needle_start - len(parts.prefix)) / context, abs=1e-3)
            assert {0: 0.0, 100: 100.0}.get(depth, cell.depth_actual) == cell.depth_actual
            assert cell.needle_end <= cell.question_start == length - len(parts.suffix)
    with pytest.raises(HarnessError, match="cannot hold the prompt template"):
        needle.build_cell(haystack, parts, 20, 50)


def test_a_haystack_without_periods_fails_the_cell_in_one_line(tiny_random, smol):
    tok, _ = smol
    text = "".join(p.read_text(encoding="utf-8") for p in needle.haystack_files(compose().task))[:30000].replace(".", ";")
    haystack = tok(text, add_special_tokens=False)["input_ids"]
    parts = needle.prompt_parts(compose("model=tiny-random").task, tiny_random)
    with pytest.raises(HarnessError) as err:
        needle.build_cell(haystack, parts, 3000, 50)
    message = str(err.value)
    assert "\n" not in message and message.startswith("needle cell length=3000 depth=50: the needle starts at 0.0% of the")
    assert "task.depth_tolerance" in message
    # Short contexts snap to a sentence: a walk-back of under 256 tokens is accepted at any depth.
    assert needle.build_cell(haystack, parts, 300, 50).depth_actual < 45


QUESTION = "What is the best thing to do in San Francisco?"


@pytest.mark.parametrize("style", ["chat", "storybook", "completion"])
def test_question_start_splits_context_from_question(tiny_random, smol, style):
    tok, haystack = smol
    task = compose("model=tiny-random", f"task.prompt_style={style}").task
    cell = needle.build_cell(haystack, needle.prompt_parts(task, tiny_random), 1000, 50)
    after, before = tok.decode(cell.ids[cell.question_start :]), tok.decode(cell.ids[: cell.question_start])
    assert QUESTION in after and QUESTION not in before
    assert "Dolores Park" in before and "Dolores Park" not in after  # the needle is in the context


def test_storybook_and_completion_prompts(tiny_random, smol):
    tok, haystack = smol
    for style, head, tail in [
        ("storybook", "<|im_start|> This is a very long story book: <book> ",
         " </book>.\n Based on the content of the book, Question: What is the best thing to do in San Francisco?\nAnswer:"),
        ("completion", "You are a helpful AI bot that answers questions for a user. Keep your response short and direct\n\nDocument:\n",
         "\n\nQuestion: What is the best thing to do in San Francisco?\nAnswer:"),
    ]:
        task = compose("model=tiny-random", f"task.prompt_style={style}").task
        cell = needle.build_cell(haystack, needle.prompt_parts(task, tiny_random), 500, 100)
        text = tok.decode(cell.ids)
        assert text.startswith(head) and text.endswith(task.needle + tail), style
        assert tok.decode(cell.ids[cell.question_start :]) == tail
    custom = compose("model=tiny-random", "task.prompt_style=completion", "task.system_prompt=Read this.").task
    assert tok.decode(needle.prompt_parts(custom, tiny_random).prefix) == "Read this.\n\nDocument:\n"


def test_run_outputs_resume_and_single_tokenization(tmp_path, monkeypatch):
    cfg = compose("model=tiny-random", "task.lengths=[200,400]", "task.depths=[0,100]", "task.max_new_tokens=4", "progress=false")
    calls = []
    from harness.models import LoadedModel

    original = needle.run

    def spy_run(cfg, loaded: LoadedModel, settings, progress=True):
        tok = loaded.tokenizer
        real_call = type(tok).__call__

        def counting(self, text, *a, **k):
            if isinstance(text, str) and len(text) > 100_000:
                calls.append(len(text))
            return real_call(self, text, *a, **k)

        monkeypatch.setattr(type(tok), "__call__", counting)
        return original(cfg, loaded, settings, progress)

    monkeypatch.setattr(needle, "run", spy_run)
    results = execute(cfg, tmp_path)
    assert len(calls) == 1, "the haystack must be tokenized once per run, not per cell"
    assert results["summary"]["cells"] == 4 and len(results["rows"]) == 4
    assert {(r["length"], r["depth"]) for r in results["rows"]} == {(200, 0.0), (200, 100.0), (400, 0.0), (400, 100.0)}
    assert all(r["prompt_tokens"] == r["length"] for r in results["rows"])
    assert [r["needle_depth_actual"] for r in results["rows"]] == [{0.0: 0.0, 100.0: 100.0}[r["depth"]] for r in results["rows"]]
    out = tmp_path / str(cfg.method.tag)  # the run directory's setting folder
    for name in ("results.json", "config.yaml", "needle_cells.jsonl", "needle_cells.csv", "needle_heatmap.png"):
        assert (out / name).exists(), name
    saved = json.loads((out / "results.json").read_text())
    commit = saved["provenance"]["git"]["commit"]  # a commit of this repository's history (HEAD may move meanwhile)
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    assert subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO).returncode == 0
    assert {"torch", "transformers", "python", "seed", "device"} <= set(saved["provenance"])
    before = (out / "needle_cells.jsonl").read_text()
    # Rerun: every cell is skipped, nothing is appended.
    again = execute(cfg, tmp_path)
    assert (out / "needle_cells.jsonl").read_text() == before
    assert [r["response"] for r in again["rows"]] == [r["response"] for r in results["rows"]]


@pytest.mark.parametrize(
    "override,message",
    [
        ("task.depths=[-5]", "outside \\[0, 100\\]"),
        ("task.depths=[101]", "outside \\[0, 100\\]"),
        ("task.lengths=[]", "task.lengths is empty"),
        ("task.prompt_style=poem", "not one of chat, storybook, completion"),
    ],
)
def test_bad_task_settings(override, message):
    with pytest.raises(HarnessError, match=message):
        needle.validate(compose(override).task)


def test_empty_haystack_folder(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(HarnessError, match="has no non-empty .txt files"):
        needle.validate(compose(f"task.haystack_dir={tmp_path}").task)


def test_smollm2_retrieves_the_needle_with_full_cache(tmp_path):
    cfg = compose("task.lengths=[1024]", "task.depths=[0,50,100]", "progress=false")
    results = execute(cfg, tmp_path)
    assert results["summary"]["mean_score"] == 1.0, [r["response"] for r in results["rows"]]
    assert all(r["strict"] for r in results["rows"])


def test_a_base_model_gets_the_completion_prompt_and_full_writes_its_retention_picture(tmp_path, monkeypatch):
    """model.chat_format=none (a base model such as gemma3-270m): the completion prompt by default, recorded in the
    config, every record and the summary; every setting, full included, writes needle_retention.png."""
    seen = []
    real = contract.generate_settings

    def spy(loaded, methods, prompt, **kw):
        seen.append(loaded.tokenizer.decode(prompt.ids))
        return real(loaded, methods, prompt, **kw)

    monkeypatch.setattr(contract, "generate_settings", spy)
    args = ["model=tiny-random", "model.chat_format=none", "task.lengths=[200]", "task.depths=[50]", "task.max_new_tokens=2",
            "progress=false", "methods=[full,{name: snapkv, budget: 64}]"]
    cfg = compose(*args)
    assert cfg.task.prompt_style == "completion"
    out = execute(cfg, tmp_path, overrides=args)
    assert seen and seen[0].startswith("You are a helpful AI bot") and "\n\nDocument:\n" in seen[0]
    assert seen[0].endswith("Question: What is the best thing to do in San Francisco?\nAnswer:")
    for tag, results in out["settings"].items():
        assert results["config"]["task"]["prompt_style"] == "completion" and results["summary"]["prompt_style"] == "completion"
        assert all(r["prompt_style"] == "completion" for r in results["rows"])
        assert (tmp_path / tag / "needle_retention.png").exists(), tag
    assert out["settings"]["full"]["rows"][0]["needle_kept"] == 1.0
