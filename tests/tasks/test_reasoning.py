"""task=gsm8k / math500 / aime25 (harness/tasks/reasoning): the fixtures in the official formats load and their own
reference solutions score as correct, bad data fails in one line, and a run on the tiny model reports accuracy, length,
decode seconds and peak bytes in both compression modes, the methods list equal to separate runs token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import compose
from harness.errors import HarnessError
from harness.tasks import get_task
from harness.tasks.reasoning.task import DATASETS, load_rows, validate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
METHODS = "methods=[full,{name: snapkv, budget: 40, window_size: 8},{name: snapkv, budget: 40, window_size: 8, decode_interval: 4}]"


def task_cfg(name: str, *more: str):
    return compose(f"task={name}", f"task.data_dir={FIXTURES / name}", *more).task


@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime25"])
def test_fixtures_load_and_their_reference_solutions_score_correct(name):
    assert get_task(name).__name__ == "harness.tasks.reasoning.task"
    cfg = task_cfg(name)
    validate(cfg)
    rows, origin = load_rows(cfg)
    assert origin == "task.data_dir" and len(rows) >= 4
    spec = DATASETS[name]
    for row in rows:
        # what a perfect model would write: GSM8K's worked answer (ends "#### n"), MATH's solution, AIME's boxed integer
        written = {"gsm8k": lambda r: r["answer"], "math500": lambda r: r["solution"],
                   "aime25": lambda r: f"... so the answer is $\\boxed{{{r['answer']}}}$."}[name](row)
        pred, correct, reference = spec.judge(written, row, cfg.scorer)
        assert correct, (name, row, pred)
        assert not spec.judge("I do not know.", row, cfg.scorer)[1]
    assert load_rows(task_cfg(name, "task.limit=2"))[0] == rows[:2]


def test_scorers_are_named_options():
    for scorer in ("openai", "strict", "flexible"):
        validate(task_cfg("gsm8k", f"task.scorer={scorer}"))
    row = load_rows(task_cfg("gsm8k"))[0][0]  # Janet's ducks: 18
    judge = DATASETS["gsm8k"].judge
    assert judge("So she makes \\boxed{18} dollars.", row, "flexible")[1]
    assert not judge("So she makes \\boxed{18} dollars.", row, "openai")[1]  # the official rule needs "#### 18"
    with pytest.raises(HarnessError, match="task.scorer"):
        validate(task_cfg("gsm8k", "task.scorer=hendrycks"))
    aime = load_rows(task_cfg("aime25", "task.scorer=integer"))[0][0]  # 24
    assert DATASETS["aime25"].judge("so \\boxed{024}", aime, "integer")[:2] == (24, True)
    assert not DATASETS["aime25"].judge("so \\boxed{024}", aime, "lm_eval")[1]


def test_bad_data_fails_in_one_line(tmp_path):
    (tmp_path / "test.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    with pytest.raises(HarnessError, match="missing field\\(s\\) id"):
        validate(compose("task=aime25", f"task.data_dir={tmp_path}").task)
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "It is 2."}) + "\n")
    with pytest.raises(HarnessError, match="#### <number>"):
        validate(compose("task=gsm8k", f"task.data_dir={tmp_path}").task)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HarnessError, match="is missing"):
        validate(compose("task=math500", f"task.data_dir={tmp_path / 'empty'}").task)
    with pytest.raises(HarnessError, match="\\{problem\\}"):
        validate(task_cfg("math500", "task.prompt=no placeholder"))


def _run(tmp_path, name: str, methods: str):
    from harness.app import execute

    overrides = [f"task={name}", "model=tiny-random", f"task.data_dir={FIXTURES / name}", "task.limit=2",
                 "task.max_new_tokens=20", methods]
    return execute(compose(*overrides), tmp_path, overrides=overrides)["settings"]


def test_a_run_reports_accuracy_length_time_and_peak_bytes_in_both_modes(tmp_path, tiny_random, one_thread):
    together = _run(tmp_path / "list", "math500", METHODS)
    decode_tag = next(t for t in together if t.endswith("_d4"))
    prefill_tag = next(t for t in together if t.startswith("snapkv") and not t.endswith("_d4"))
    for tag, res in together.items():
        s = res["summary"]
        assert s["items"] == 2 and s["accuracy"] is not None and s["mean_new_tokens"] > 0, tag
        assert s["mean_decode_seconds"] is not None and s["max_peak_cache_bytes"] > 0, tag
        assert {"index", "id", "reference", "pred", "correct", "subject", "level", "peak_cache_bytes"} <= set(res["rows"][0])
    assert set(together[decode_tag]["summary"]["paired_vs_full"]) == {"accuracy", "new_tokens"}
    for row_d, row_p in zip(together[decode_tag]["rows"], together[prefill_tag]["rows"]):
        assert row_d["decode_compressions"] > 0 and "decode_compressions" not in row_p
        if row_d["new_tokens"] > 8:  # decode-time compression bounds what prefill-only lets grow
            assert row_d["peak_cache_bytes"] < row_p["peak_cache_bytes"]
    table = (tmp_path / "list" / "math500_table.md").read_text()
    assert "prefill + decode-time" in table and "prefill only" in table and "none (full cache)" in table
    from harness.report.build import build

    build(tmp_path / "list", tmp_path / "report")  # the cross-run report: the same table per dataset, model, protocol
    report = (tmp_path / "report" / "reasoning.md").read_text()
    assert report.startswith("## MATH500 · tiny-random · query_aware") and decode_tag in report and "prefill only" in report
    # each setting alone writes the same tokens as in the methods list (one prefill, decoded together)
    for tag, method in zip(together, METHODS[len("methods=["):-1].split(",{")):
        alone = _run(tmp_path / tag, "math500", "methods=[" + (method if method == "full" else "{" + method) + "]")
        assert list(alone) == [tag]
        for a, b in zip(alone[tag]["rows"], together[tag]["rows"]):
            assert (a["response"], a["new_tokens"], a["pred"], a.get("decode_events")) == \
                   (b["response"], b["new_tokens"], b["pred"], b.get("decode_events")), tag


def test_hub_files_are_the_official_ones_and_offline_fails_in_one_line(tmp_path, monkeypatch):
    import huggingface_hub
    import pandas as pd

    from harness.tasks import hub_files

    parquet = tmp_path / "test-00000-of-00001.parquet"  # the hub's GSM8K file: the same rows as the authors' jsonl
    pd.read_json(FIXTURES / "gsm8k" / "test.jsonl", lines=True).to_parquet(parquet)
    asked = []

    def download(repo_id, filename, repo_type):
        asked.append((repo_id, filename, repo_type))
        if repo_id != "openai/gsm8k":
            raise OSError("We couldn't connect to 'https://huggingface.co'.\nmore")
        return str(parquet)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    hub_files.hub_file.cache_clear()
    try:
        rows, origin = load_rows(compose("task=gsm8k").task)
        assert origin == "hub:openai/gsm8k/main/test-00000-of-00001.parquet"
        assert rows == load_rows(task_cfg("gsm8k"))[0]
        assert load_rows(compose("task=gsm8k", f"task.data_dir={tmp_path}").task) == (rows, "task.data_dir")  # the download, offline
        for name, repo in (("math500", "HuggingFaceH4/MATH-500"), ("aime25", "math-ai/aime25")):
            with pytest.raises(HarnessError) as err:
                validate(compose(f"task={name}").task)
            assert "\n" not in str(err.value) and repo in str(err.value) and "task.data_dir=" in str(err.value)
        assert asked[1:] == [("HuggingFaceH4/MATH-500", "test.jsonl", "dataset"), ("math-ai/aime25", "test.jsonl", "dataset")]
    finally:
        hub_files.hub_file.cache_clear()
