"""LongBench-v2 end to end on its fixture (official data.json format): pred.py's prompt, truncation and split,
records scored by the official rules, result.py's table with paired intervals against full, offline refusal."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, compose, run_cli
from harness.app import execute
from harness.errors import HarnessError
from harness.tasks import hub_files
from harness.tasks.longbench_v2 import task as lbv2
from metrics.longbench_v2 import table

FIXTURES = REPO / "tests" / "fixtures" / "longbench_v2"
ROWS = json.loads((FIXTURES / "data.json").read_text(encoding="utf-8"))

pytestmark = pytest.mark.usefixtures("one_thread")


def run(tmp, *overrides, model="tiny-random"):
    args = ["task=longbench_v2", f"model={model}", f"task.data_dir={FIXTURES}", "progress=false", *overrides]
    return execute(compose(*args), tmp, overrides=args)  # as the command line: every setting composed from these


def records(setting_dir):
    return [json.loads(line) for line in (setting_dir / "longbench_v2.jsonl").read_text(encoding="utf-8").splitlines()]


def test_fixture_covers_every_domain_difficulty_and_length():
    assert {r["domain"] for r in ROWS} == set(lbv2.DOMAINS)
    assert {r["difficulty"] for r in ROWS} == {"easy", "hard"} and {r["length"] for r in ROWS} == set(lbv2.LENGTHS)


def test_prompt_is_the_official_template_filled_as_pred_py():
    text = lbv2.fill(lbv2.template(), ROWS[0], ROWS[0]["context"])
    assert text.startswith("Please read the following text and answer the question below.\n\n<text>\n" + ROWS[0]["context"].strip())
    assert f"\n</text>\n\nWhat is the correct answer to this question: {ROWS[0]['question']}\nChoices:\n(A) " in text
    assert text.endswith('Format your response as follows: "The correct answer is (insert answer here)".')


def test_truncation_keeps_both_ends_as_pred_py(tiny_random):
    tok = tiny_random.tokenizer
    prompt = lbv2.fill(lbv2.template(), ROWS[2], ROWS[2]["context"])
    ids = tok.encode(prompt)
    for budget in (64, 65):  # -65//2 == -33: an odd budget keeps 32 + 33
        text, raw, cut = lbv2.truncate(prompt, tok, budget)
        assert cut and raw == len(ids)
        assert text == tok.decode(ids[:budget // 2] + ids[-budget // 2:], skip_special_tokens=True)
    assert lbv2.truncate(prompt, tok, len(ids)) == (prompt, len(ids), False)


def test_methods_run_both_protocols_with_the_split_after_the_document(tmp_path, tiny_random):
    methods = "methods=[full,{name: snapkv, budget: 32, window_size: 4}]"
    run(tmp_path / "aware", methods, "task.limit=3")
    aware = records(tmp_path / "aware" / "full")
    assert [r["index"] for r in aware] == [0, 1, 2] and {r["protocol"] for r in aware} == {"query_aware"}
    agn = run(tmp_path / "agn", methods, "task.query_aware=false", "task.log_prompts=true")
    full_dir = tmp_path / "agn" / "full"
    recs = records(full_dir)
    assert len(recs) == len(ROWS) and {r["protocol"] for r in recs} == {"query_agnostic"}
    assert all(r["question_start"] < r["prompt_tokens"] for r in recs)
    loaded = tiny_random
    task = lbv2.LongBenchV2(compose("task=longbench_v2", "model=tiny-random", f"task.data_dir={FIXTURES}"), loaded)
    built = task.build((1,))
    after = loaded.tokenizer.decode(built.prompt.ids[built.prompt.question_start:])
    assert after.lstrip().startswith("</text>") and ROWS[1]["question"] in after
    assert "For the record" not in after
    for r in recs:
        row = ROWS[r["index"]]
        assert r["_id"] == row["_id"] and r["answer"] == row["answer"] and r["counted"] == (r["response"] != "")
    summary = json.loads((full_dir / "results.json").read_text(encoding="utf-8"))["summary"]
    assert summary["scores"] == table([r for r in recs if r["counted"]])
    assert summary["truncation_budget"] == 7500 and summary["official_truncation_budget"] == 120000
    text = (tmp_path / "agn" / "longbench_v2_table.md").read_text(encoding="utf-8")
    assert "| Setting | Overall | Easy | Hard | Short | Medium | Long |" in text
    assert "Minus `full` on the same items" in text and "snapkv_c32_w4" in text

    from harness.report import build  # the table set: one section per model and protocol, from the collected runs

    build(tmp_path, tmp_path / "tables", resamples=200)
    report = (tmp_path / "tables" / "longbench_v2.md").read_text(encoding="utf-8")
    assert "## LongBench-v2 · tiny-random · query_aware" in report and "## LongBench-v2 · tiny-random · query_agnostic" in report
    overall = " | ".join(f"{summary['scores'][g]:.1f}" for g in ("Overall", "Easy", "Hard", "Short", "Medium", "Long"))
    assert f"| full | {overall} |" in report.split("query_agnostic")[1]


def test_scorer_option_and_lengths_filter(tmp_path):
    cfg = compose("task=longbench_v2", f"task.data_dir={FIXTURES}", "task.lengths=[long]")
    rows, origin = lbv2.load_rows(cfg.task)
    assert origin == "task.data_dir" and [r["length"] for r in rows] == ["long"] * 2
    with pytest.raises(HarnessError, match="task.scorer='lenient' is not one of official, corrected"):
        lbv2.validate(compose("task=longbench_v2", f"task.data_dir={FIXTURES}", "task.scorer=lenient").task)


def test_offline_hub_fails_in_one_line(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nmore")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    hub_files.hub_file.cache_clear()
    with pytest.raises(HarnessError) as err:
        lbv2.validate(compose("task=longbench_v2").task)
    hub_files.hub_file.cache_clear()
    assert "\n" not in str(err.value) and "THUDM/LongBench-v2" in str(err.value) and "task.data_dir=" in str(err.value)


def test_cli_bad_data_is_one_line(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps([{"_id": "x"}]), encoding="utf-8")
    proc = run_cli("task=longbench_v2", f"task.data_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'out'}", timeout=120)
    assert proc.returncode == 2 and "error: " in proc.stderr and "missing field(s) domain" in proc.stderr
    assert "Traceback" not in proc.stderr
