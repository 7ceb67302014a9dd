"""task=ruler task.source=kvpress: kvpress's pre-generated RULER (simonjegou/ruler) read from its files as the hub
stores them (tests/fixtures/ruler_kvpress: <length>/test-00000-of-00001.parquet), its rows run unchanged through
kvpress's split, records and results saying `source: kvpress`, the offline refusal, the hub listing, and the
kvpress leaderboard export (dataset `ruler`, interval, protocol, reuse gap)."""

from __future__ import annotations

import csv
import json

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from conftest import REPO, compose
from harness.app import execute
from harness.errors import HarnessError
from harness.report import build
from harness.report.html import LEADERBOARD
from harness.tasks import hub_files
from harness.tasks.ruler import kvpress_data
from harness.tasks.ruler import task as ruler

FIXTURE = REPO / "tests" / "fixtures" / "ruler_kvpress"
ROWS = pq.read_table(FIXTURE / "4096" / "test-00000-of-00001.parquet").to_pylist()
TASKS = ["niah_single_1", "vt", "qa_1"]
METHODS = "methods=[full,{name: snapkv, budget: 48, window_size: 8}]"

pytestmark = pytest.mark.usefixtures("one_thread")


def first_rows(task: str, n: int) -> list[dict]:
    return [r for r in ROWS if r["task"] == task][:n]


def run(tmp, *overrides):
    args = ["task=ruler", "task.source=kvpress", f"task.data_dir={FIXTURE}", "model=tiny-random", "task.lengths=[4096]",
            "task.samples=2", f"task.tasks=[{','.join(TASKS)}]", "progress=false", *overrides]
    return execute(compose(*args), tmp, overrides=args)


def records(folder):
    return [json.loads(line) for line in (folder / "ruler_samples.jsonl").read_text(encoding="utf-8").splitlines()]


def test_fixture_is_the_hub_format_with_every_task():
    schema = pq.read_schema(FIXTURE / "4096" / "test-00000-of-00001.parquet")
    assert schema.names == list(kvpress_data.COLUMNS) and str(schema.field("answer").type) == "list<element: string>"
    assert {r["task"] for r in ROWS} == set(ruler.ALL_TASKS)


@pytest.mark.parametrize("vocab", ["template", "none"])
def test_rows_become_kvpress_pipeline_inputs(tiny_random, vocab):
    """[chat prefix + context] and [question + chat suffix + answer prefix] tokenized apart (without a chat template:
    BOS text + context, question + "\\n" + answer prefix), written out here from kvpress's pipeline rules."""
    from types import SimpleNamespace

    tok = tiny_random.tokenizer
    if vocab == "template":
        render = lambda m: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)  # noqa: E731
        loaded = SimpleNamespace(tokenizer=tok, chat_format="template", format_chat=render)
    else:
        loaded = SimpleNamespace(tokenizer=tok, chat_format="none", format_chat=lambda m: m[0]["content"])
    t = ruler.Tokenized(loaded, "model", "kvpress")
    for name in ("niah_multikey_2", "cwe", "fwe", "qa_2"):
        row = first_rows(name, 1)[0]
        if vocab == "template":
            marker = "#" * 40
            head, suffix = render([{"role": "user", "content": row["context"] + marker}]).split(marker)
        else:
            head, suffix = (tok.bos_token or "") + row["context"], "\n"
        context_ids = tok.encode(head, add_special_tokens=False)
        expected = context_ids + tok.encode(row["question"] + suffix + row["answer_prefix"], add_special_tokens=False)
        prompt = t.prompt(kvpress_data.sample_from_row(name, 0, row))
        assert prompt.ids == expected and prompt.question_start == len(context_ids), name


def test_both_protocols_run_kvpress_rows_and_export_the_leaderboard(tmp_path, tiny_random):
    run(tmp_path / "runs" / "aware", METHODS)
    run(tmp_path / "runs" / "agn", METHODS, "task.query_aware=false")
    by_protocol = {}
    for protocol, folder in (("query_aware", "aware"), ("query_agnostic", "agn")):
        full = records(tmp_path / "runs" / folder / "full")
        assert {r["source"] for r in full} == {"kvpress"} and {r["protocol"] for r in full} == {protocol}
        for name in TASKS:  # the first two rows of each task, unchanged: references and the row's own budget
            mine = sorted((r for r in full if r["task"] == name), key=lambda r: r["index"])
            rows = first_rows(name, 2)
            assert [r["references"] for r in mine] == [row["answer"] for row in rows]
            assert [r["tokens_to_generate"] for r in mine] == [row["max_new_tokens"] for row in rows]
            assert [r["answer_prefix"] for r in mine] == [row["answer_prefix"] for row in rows]
        data = json.loads((tmp_path / "runs" / folder / "full" / "results.json").read_text())
        summary = data["summary"]
        assert summary["source"] == "kvpress" and summary["split"] == "kvpress" and summary["data_origin"] == "task.data_dir"
        assert data["config"]["task"]["source"] == "kvpress"
        by_protocol[protocol] = {m: records(tmp_path / "runs" / folder / m) for m in ("full", "snapkv_c48_w8_k7_maxpool_expand")}
    out = tmp_path / "tables"
    build(tmp_path / "runs", out, resamples=200, kvpress=True)
    board = list(csv.DictReader((out / LEADERBOARD).open()))
    assert len(board) == 4 and {r["dataset"] for r in board} == {"ruler"} and {r["data_dir"] for r in board} == {"4096"}
    assert list(board[0])[:6] == ["dataset", "data_dir", "model", "method", "compression_ratio", "score"]
    for row in board:
        method = "full" if row["method"] == "no_press" else "snapkv_c48_w8_k7_maxpool_expand"
        aware, agn = by_protocol["query_aware"][method], by_protocol["query_agnostic"][method]
        key = lambda r: (r["task"], r["index"])  # noqa: E731
        diffs = {}
        for a, b in zip(sorted(aware, key=key), sorted(agn, key=key)):
            diffs.setdefault(a["task"], []).append(a["score"] - b["score"])
        expected = sum(sum(d) / len(d) for d in diffs.values()) / len(diffs)  # the mean of the task means
        assert row["reuse_gap"] != "" and float(row["reuse_gap"]) == pytest.approx(expected, abs=1e-3)
        # 2 samples per task: under MIN_INTERVAL_ITEMS (5) a task gets no interval (test_report_html has one with 5)
        assert row["protocol"] in ("query_aware", "query_agnostic") and row["n"] == "6" and row["ci_low"] == row["ci_high"] == ""
    md = (out / "ruler.md").read_text()
    assert "kvpress's RULER data (simonjegou/ruler)" in md


def test_offline_and_bad_folders_refuse_in_one_line(tmp_path, monkeypatch):
    task = OmegaConf.create({"data_dir": str(tmp_path), "hub_repo": "simonjegou/ruler"})
    with pytest.raises(HarnessError, match=r"holds no test-\*\.parquet") as err:
        kvpress_data.read_rows(task, 4096, TASKS, 2)
    assert "\n" not in str(err.value)

    def offline(*a, **k):
        raise OSError("no network\nsecond line")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "list_repo_files", offline)
    with pytest.raises(HarnessError, match="task.data_dir=<the folder holding it>") as err:
        kvpress_data.read_rows(OmegaConf.create({"data_dir": None, "hub_repo": "simonjegou/ruler"}), 4096, TASKS, 2)
    assert "\n" not in str(err.value) and "simonjegou/ruler/tree/main/4096" in str(err.value)
    with pytest.raises(HarnessError, match="fewer rows than task.samples=3"):
        kvpress_data.read_rows(OmegaConf.create({"data_dir": str(FIXTURE)}), 4096, TASKS, 3)


def test_hub_listing_takes_only_the_lengths_test_shards(monkeypatch):
    import huggingface_hub

    listing = ["README.md", "4096/test-00000-of-00001.parquet", "8192/test-00000-of-00002.parquet", "40960/test-00000-of-00001.parquet"]
    fetched = []
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, repo_type=None: listing)

    def download(repo_id, filename, repo_type=None):
        fetched.append((repo_id, filename, repo_type))
        return str(FIXTURE / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    hub_files.hub_file.cache_clear()
    rows, origin = kvpress_data.read_rows(OmegaConf.create({"data_dir": None, "hub_repo": "simonjegou/ruler"}), 4096, TASKS, 2)
    hub_files.hub_file.cache_clear()
    assert fetched == [("simonjegou/ruler", "4096/test-00000-of-00001.parquet", "dataset")] and origin == "hub:simonjegou/ruler/4096"
    assert [r["answer"] for r in rows["vt"]] == [r["answer"] for r in first_rows("vt", 2)]


def test_validate_refuses_what_kvpress_data_cannot_do():
    for bad, match in (("task.split=ruler", "cannot re-cut"), ("task.one_key_at_a_time=true", "generated here"),
                       ("task.source=nvidia", "not one of harness, kvpress")):
        with pytest.raises(HarnessError, match=match):
            ruler.validate(compose("task=ruler", "task.source=kvpress", bad).task if "source=nvidia" not in bad
                           else compose("task=ruler", bad).task)
    ruler.validate(compose("task=ruler", "task.source=kvpress", "task.tasks=[qa_1,qa_2]").task)  # no qa files needed
