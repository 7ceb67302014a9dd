"""LongBench data loading, validation and prompt building (no model weights needed).

Fixture rows (tests/fixtures/longbench/) are short hand-written rows in the official format: 3 per
task, the 16 English tasks, multifieldqa_zh and lsht, and the 13 `_e` files, whose `length` field is
set to 2345 / 5678 / 9012 (one row per LongBench-E bucket) although their contexts are short.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from harness.errors import HarnessError
from harness.models import VICUNA_SYSTEM, LoadedModel, embedded_tokenizer
from harness.tasks import longbench_data as lbd
from metrics.longbench_config import load_dataset2maxlen, read_config_text
from metrics.longbench_tasks import LONGBENCH_ALL_TASKS, LONGBENCH_E_TASKS, LONGBENCH_EN_TASKS
from conftest import REPO, compose, run_cli

FIXTURES = REPO / "tests" / "fixtures" / "longbench"
FIXTURE_TASKS = [t for t in LONGBENCH_ALL_TASKS if (FIXTURES / f"{t}.jsonl").exists()]


def rows(stem: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{stem}.jsonl").read_text(encoding="utf-8").splitlines()]


def task_cfg(*overrides: str, name: str = "longbench"):
    return compose(f"task={name}", f"task.data_dir={FIXTURES}", *overrides).task


def fake_loaded(chat_format: str, tokenizer=None) -> LoadedModel:
    return LoadedModel(model=None, tokenizer=tokenizer or embedded_tokenizer(), name="fake", chat_format=chat_format,
                       eos_token_ids=[2], max_positions=8192, prompt_max_length=7500, device=torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# Fixtures and the official templates
# --------------------------------------------------------------------------------------------


def test_fixtures_cover_all_english_tasks_a_chinese_task_and_longbench_e():
    assert set(LONGBENCH_EN_TASKS) <= set(FIXTURE_TASKS)
    assert {"multifieldqa_zh", "lsht"} <= set(FIXTURE_TASKS)
    for name in LONGBENCH_E_TASKS:
        assert (FIXTURES / f"{name}_e.jsonl").exists()
    for path in FIXTURES.glob("*.jsonl"):
        parsed = lbd.parse_rows(path.read_bytes(), str(path))
        assert len(parsed) == 3 and all(set(r) == set(lbd.ROW_FIELDS) for r in parsed)


def test_prompts_are_the_official_templates_byte_for_byte():
    official = json.loads(read_config_text("dataset2prompt.json"))
    for name in FIXTURE_TASKS:
        for row in rows(name):
            assert lbd.official_prompt(name, row) == official[name].format(**row)
    nqa = rows("narrativeqa")[0]
    p = lbd.official_prompt("narrativeqa", nqa)
    assert p.count("asconcisely") == 2  # the typo is kept
    assert p.startswith("You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely")
    assert p.endswith(f"\n\nQuestion: {nqa['input']}\n\nAnswer:")
    hq = rows("hotpotqa")[0]
    assert lbd.official_prompt("hotpotqa", hq) == (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
        f"The following are given passages.\n{hq['context']}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
        f"Question: {hq['input']}\nAnswer:")
    lcc = rows("lcc")[0]
    assert lbd.official_prompt("lcc", lcc) == f"Please complete the code given below. \n{lcc['context']}Next line of code:\n"
    rb = rows("repobench-p")[0]
    assert lbd.official_prompt("repobench-p", rb) == f"Please complete the code given below. \n{rb['context']}{rb['input']}Next line of code:\n"
    assert lbd.official_prompt("passage_count", rows("passage_count")[0]).endswith("such as 1, 2, 3, and so on.\n\nThe final answer is: ")
    assert lbd.official_prompt("passage_retrieval_en", rows("passage_retrieval_en")[0]).endswith('"Paragraph 2", etc.\n\nThe answer is: ')
    assert "summary of all news. \n\nNews:\n" in lbd.official_prompt("multi_news", rows("multi_news")[0])
    trec = rows("trec")[0]
    assert lbd.official_prompt("trec", trec) == (
        f"Please determine the type of the question below. Here are some examples of questions.\n\n{trec['context']}\n{trec['input']}")
    zh = rows("multifieldqa_zh")[0]
    assert lbd.official_prompt("multifieldqa_zh", zh) == f"阅读以下文字并用中文简短回答：\n\n{zh['context']}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{zh['input']}\n回答："


# --------------------------------------------------------------------------------------------
# Middle truncation
# --------------------------------------------------------------------------------------------


class WordTokenizer:
    """One token per space-separated word, BOS (id 0) added like a Llama tokenizer."""

    def __init__(self):
        self.inv = {0: "<s>"}
        self.ids = {}

    def __call__(self, text, truncation=False, add_special_tokens=True):
        out = [self.ids.setdefault(w, len(self.ids) + 1) for w in text.split(" ")]
        for w, i in self.ids.items():
            self.inv[i] = w
        return {"input_ids": ([0] if add_special_tokens else []) + out}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.inv[i] for i in ids if not (skip_special_tokens and i == 0))


def test_middle_truncation_counts_bos_keeps_int_half_each_side_and_joins_text():
    tok = WordTokenizer()
    text = " ".join(f"w{i}" for i in range(1, 31))  # 30 words + BOS = 31 tokens
    assert lbd.truncate_middle(text, tok, 31) == lbd.Prompt(text, 31, False)  # not longer than the budget
    out = lbd.truncate_middle(text, tok, 11)  # int(11/2) = 5 tokens each side; BOS is the first head token
    assert out.truncated and out.raw_tokens == 31
    assert out.text == "w1 w2 w3 w4" + "w26 w27 w28 w29 w30"  # halves decoded separately, joined without a space


def test_middle_truncation_with_the_real_tokenizer():
    tok = embedded_tokenizer()
    row = dict(rows("narrativeqa")[0])
    row["context"] = row["context"] + " MIDDLE-SENTINEL " + row["context"]
    prompt = lbd.official_prompt("narrativeqa", row)
    ids = tok(prompt)["input_ids"]
    budget = 101
    assert len(ids) > budget
    out = lbd.build_prompt("narrativeqa", row, tok, budget)
    assert out.truncated and out.raw_tokens == len(ids)
    head, tail = tok.decode(ids[:50], skip_special_tokens=True), tok.decode(ids[-50:], skip_special_tokens=True)
    assert out.text == head + tail
    assert out.text.startswith("You are given a story") and out.text.endswith(f"Question: {row['input']}\n\nAnswer:")
    assert "MIDDLE-SENTINEL" not in out.text
    assert tok(out.text)["input_ids"][:50] == ids[:50]
    untouched = lbd.build_prompt("narrativeqa", row, tok, len(ids))
    assert untouched == lbd.Prompt(prompt, len(ids), False)


# --------------------------------------------------------------------------------------------
# Chat formatting and generation settings
# --------------------------------------------------------------------------------------------


RAW = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}


@pytest.mark.parametrize("chat_format", ["inst", "vicuna", "none", "template"])
def test_chat_formatting_after_truncation_except_the_six_raw_tasks(chat_format):
    loaded = fake_loaded(chat_format)
    tok = loaded.tokenizer
    assert set(lbd.RAW_TASKS) == RAW
    prompt = "Some prompt.\n\nQuestion: q\nAnswer:"
    for name in LONGBENCH_ALL_TASKS:
        text, ids = lbd.render(name, prompt, loaded)
        if name in RAW:
            assert text == prompt and ids == tok(prompt)["input_ids"]  # raw, tokenized with special tokens as pred.py
            continue
        if chat_format == "inst":
            assert text == f"[INST]{prompt}[/INST]"
        elif chat_format == "vicuna":
            assert text == f"{VICUNA_SYSTEM} USER: {prompt} ASSISTANT:"
        elif chat_format == "none":
            assert text == prompt
        else:
            assert f"<|im_start|>user\n{prompt}<|im_end|>\n" in text and text.endswith("<|im_start|>assistant\n")
            assert ids == tok(text, add_special_tokens=False)["input_ids"]
            continue
        assert ids == tok(text)["input_ids"]


def test_generation_budgets_and_samsum_newline_token():
    official = load_dataset2maxlen()
    assert {n: lbd.max_new_tokens(n) for n in LONGBENCH_ALL_TASKS} == official
    tok = embedded_tokenizer()
    assert lbd.newline_token_id(tok) == tok.encode("\n", add_special_tokens=False)[-1]


# --------------------------------------------------------------------------------------------
# Dataset selection and validation errors
# --------------------------------------------------------------------------------------------


def test_dataset_selection_defaults_and_order():
    assert lbd.selected_datasets(task_cfg()) == list(LONGBENCH_EN_TASKS)
    assert lbd.selected_datasets(task_cfg(name="longbench_e")) == list(LONGBENCH_E_TASKS)
    assert lbd.selected_datasets(task_cfg("task.datasets=[lsht,qasper,narrativeqa]")) == ["narrativeqa", "qasper", "lsht"]
    assert lbd.selected_datasets(task_cfg("task.datasets=[trec_e,qasper]", name="longbench_e")) == ["qasper", "trec"]


@pytest.mark.parametrize("overrides,name,expected", [
    (["task.datasets=[qasper,nosuch]"], "longbench", "unknown longbench dataset 'nosuch'; valid: narrativeqa, qasper"),
    (["task.datasets=[narrativeqa]"], "longbench_e", "unknown longbench_e dataset 'narrativeqa'; valid: qasper, multifieldqa_en"),
    (["task.datasets=[]"], "longbench", "task.datasets is empty"),
    (["task.limit=0"], "longbench", "task.limit=0"),
    (["task.shard.index=2", "task.shard.count=2"], "longbench", "task.shard.index=2 must be in 0..1"),
    (["task.code_sim_backend=fuzzy"], "longbench", "task.code_sim_backend='fuzzy'"),
])
def test_bad_options_are_user_errors(overrides, name, expected):
    from harness.tasks import get_task

    with pytest.raises(HarnessError, match=None) as err:
        get_task(name).validate(task_cfg(*overrides, name=name))
    assert expected in str(err.value)


def copy_fixtures(tmp_path: Path, names=("qasper", "trec")) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for n in names:
        (folder / f"{n}.jsonl").write_bytes((FIXTURES / f"{n}.jsonl").read_bytes())
    return folder


def validate_dir(folder, *datasets):
    from harness.tasks import longbench

    longbench.validate(compose("task=longbench", f"task.data_dir={folder}", f"task.datasets=[{','.join(datasets)}]").task)


def test_missing_file_names_the_file(tmp_path):
    folder = copy_fixtures(tmp_path)
    validate_dir(folder, "qasper", "trec")
    with pytest.raises(HarnessError, match=f"{folder / 'hotpotqa.jsonl'} is missing"):
        validate_dir(folder, "qasper", "hotpotqa")


@pytest.mark.parametrize("line,problem", [
    ('{"input": "q", "context": ', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"input": "q", "context": "c", "answers": ["a"], "length": 3, "dataset": "trec", "language": "en", "_id": "x"}', "missing field(s) all_classes"),
    ('{"input": "q", "context": "c", "answers": "a", "length": 3, "dataset": "trec", "language": "en", "all_classes": null, "_id": "x"}', "'answers' must be a list of strings"),
    ('{"input": "q", "context": "c", "answers": ["a"], "length": "3", "dataset": "trec", "language": "en", "all_classes": null, "_id": "x"}', "'length' must be an integer"),
    ('{"input": "q", "context": "c", "answers": ["a"], "length": 3, "dataset": "trec", "language": "en", "all_classes": "A", "_id": "x"}', "'all_classes' must be a list of strings or null"),
    ('{"input": 5, "context": "c", "answers": ["a"], "length": 3, "dataset": "trec", "language": "en", "all_classes": null, "_id": "x"}', "'input' must be a string"),
])
def test_malformed_row_names_file_and_line(tmp_path, line, problem):
    folder = copy_fixtures(tmp_path)
    path = folder / "trec.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[1] = line
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(HarnessError) as err:
        validate_dir(folder, "qasper", "trec")
    assert str(err.value).startswith(f"{path}:2: ") and problem in str(err.value)


def make_zip(tmp_path: Path) -> Path:
    path = tmp_path / "data.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for f in sorted(FIXTURES.glob("*.jsonl")):
            zf.writestr(f"data/{f.name}", f.read_bytes())
    return path


def test_hub_data_zip_is_downloaded_once_and_read_from_the_zip(tmp_path, monkeypatch):
    import huggingface_hub

    zpath = make_zip(tmp_path)
    calls = []

    def fake_download(**kwargs):
        calls.append(kwargs)
        return str(zpath)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    lbd.hub_zip.cache_clear()
    try:
        cfg = compose("task=longbench_e", "task.hub_repo=someone/LongBenchCopy").task
        from harness.tasks import longbench

        longbench.validate(cfg)
        plan = longbench.make_plan(cfg)
        assert calls == [{"repo_id": "someone/LongBenchCopy", "filename": "data.zip", "repo_type": "dataset"}]
        assert plan.rows["qasper"] == rows("qasper_e") and plan.source == "hub:someone/LongBenchCopy/data.zip"
        # task.data_dir may also point at a data.zip
        assert lbd.load_rows(lbd.data_source(compose("task=longbench", f"task.data_dir={zpath}").task), "lsht") == rows("lsht")
    finally:
        lbd.hub_zip.cache_clear()


def test_bad_row_inside_the_zip_names_member_and_line(tmp_path):
    zpath = tmp_path / "data.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr("data/trec.jsonl", (FIXTURES / "trec.jsonl").read_text(encoding="utf-8") + "{oops\n")
    with pytest.raises(HarnessError, match=r"data\.zip!data/trec\.jsonl:4: not valid JSON"):
        validate_dir(zpath, "trec")


def test_offline_hub_download_says_how_to_provide_data_dir(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nmore detail")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    lbd.hub_zip.cache_clear()
    try:
        with pytest.raises(HarnessError) as err:
            lbd.data_source(compose("task=longbench").task)
    finally:
        lbd.hub_zip.cache_clear()
    message = str(err.value)
    assert "\n" not in message and "THUDM/LongBench" in message and "task.data_dir=" in message


def test_cli_bad_data_fails_before_loading_a_model(tmp_path):
    folder = copy_fixtures(tmp_path)
    (folder / "qasper.jsonl").write_text('{"input": 1}\n', encoding="utf-8")
    out = tmp_path / "run"
    proc = run_cli("task=longbench", f"task.data_dir={folder}", "task.datasets=[qasper]", f"hydra.run.dir={out}", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"error: {folder / 'qasper.jsonl'}:1: missing field(s)" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
