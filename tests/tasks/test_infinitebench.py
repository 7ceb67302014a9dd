"""InfiniteBench end to end on its fixture (the hub's jsonl format, every task): the authors' open-model prompts,
truncation, split after {context}, per-task new tokens, official scores in the records, the README-layout table
with paired intervals against full."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, compose
from harness.app import execute
from harness.errors import HarnessError
from harness.tasks.infinitebench import task as ib
from metrics.infinitebench import README_ORDER, get_answer, score_one

FIXTURES = REPO / "tests" / "fixtures" / "infinitebench"

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(task):
    return [json.loads(line) for line in (FIXTURES / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_prompts_are_the_authors_open_model_prompts():
    code = rows("code_run")[0]
    values = ib.fields(code, "code_run")
    assert values["func_call"] == "func_3(-4)" and values["func"] == "func_3"
    text = ib.templates()["code_run"].format(**values)
    assert text.startswith("There is a function called func_3 in the following Python code.\n\n")
    assert text.endswith("Please compute the exact value of func_3(-4). The value of func_3(-4) is")
    find = ib.fields(rows("math_find")[0], "math_find")
    assert find["prefix"] == "What is the largest number in the following list?"
    choice = ib.templates()["longbook_choice_eng"].format(**ib.fields(rows("longbook_choice_eng")[0], "longbook_choice_eng"))
    assert "\nA. The Heron\nB. The Gull\nC. The Swan\nD. The Crow\n\nThe letter of the correct answer is" in choice


def test_truncation_as_truncate_by_tokens(tiny_random):
    tok = tiny_random.tokenizer
    text = ib.templates()["passkey"].format(**ib.fields(rows("passkey")[0], "passkey"))
    ids = tok.encode(text)
    for budget in (64, 65):  # split = L // 2 on both sides: an odd budget keeps L - 1 tokens
        out, raw, cut = ib.truncate(text, tok, budget)
        assert cut and raw == len(ids) and out == tok.decode(ids[:budget // 2] + ids[-(budget // 2):], skip_special_tokens=True)


def test_all_tasks_run_with_methods_and_the_table(tmp_path, tiny_random):
    args = ["task=infinitebench", "model=tiny-random", f"task.data_dir={FIXTURES}", "progress=false",
            "task.max_new_tokens=4", "task.query_aware=false", "methods=[full,{name: snapkv, budget: 32, window_size: 4}]"]
    execute(compose(*args), tmp_path, overrides=args)
    recs = [json.loads(line) for line in (tmp_path / "full" / "infinitebench.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {r["task"] for r in recs} == set(README_ORDER)
    for r in recs:
        row = rows(r["task"])[r["index"]]
        assert r["ground_truth"] == get_answer(row, r["task"]) and r["score"] == score_one(r["task"], r["prediction"], r["ground_truth"])
        assert r["question_start"] <= r["prompt_tokens"] and r["protocol"] == "query_agnostic" and r["new_tokens"] <= 4
    summary = json.loads((tmp_path / "full" / "results.json").read_text(encoding="utf-8"))["summary"]
    assert list(summary["scores"]) == list(README_ORDER) and summary["max_new_tokens_cap"] == 4
    table = (tmp_path / "infinitebench_table.md").read_text(encoding="utf-8")
    assert "| Setting | Retrieve.PassKey | Retrieve.Number | Retrieve.KV | En.Sum |" in table and "Minus `full`" in table
    task = ib.InfiniteBench(compose("task=infinitebench", "model=tiny-random", f"task.data_dir={FIXTURES}"), tiny_random)
    built = task.build(("longbook_choice_eng", 0))
    after = tiny_random.tokenizer.decode(built.prompt.ids[built.prompt.question_start:])
    assert after.lstrip().startswith("Question: What was the name of the ship?") and "Mara walked" not in after
    assert built.decode == {"max_new_tokens": 40} and task.new_tokens("math_calc") == 30000


def test_official_scorer_raise_leaves_the_task_without_a_score(tiny_random):
    task = ib.InfiniteBench(compose("task=infinitebench", "model=tiny-random", f"task.data_dir={FIXTURES}", "task.tasks=[math_find]"), tiny_random)
    base = {"question_start": 0, "prompt_tokens": 1}
    good = task.record(("math_find", 1), task.build(("math_find", 1)), 0, "-3", None)
    bad = task.record(("math_find", 0), task.build(("math_find", 0)), 0, "97.5", None)
    assert bad["score"] is None and "int('97.5')" in bad["score_error"] and good["score_error"] is None
    assert task.summarize([{**good, **base}, {**bad, **base}])["scores"]["math_find"] is None


def test_bad_options_fail_in_one_line():
    with pytest.raises(HarnessError, match="unknown InfiniteBench task 'passkeys'"):
        ib.validate(compose("task=infinitebench", f"task.data_dir={FIXTURES}", "task.tasks=[passkeys]").task)
    with pytest.raises(HarnessError, match="is missing; task.data_dir must hold InfiniteBench"):
        ib.validate(compose("task=infinitebench", f"task.data_dir={REPO / 'tests' / 'fixtures' / 'longbench_v2'}").task)
