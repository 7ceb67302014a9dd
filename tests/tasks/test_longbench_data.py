"""LongBench data loading, validation and prompt building (no model weights needed).

Fixture rows (tests/fixtures/longbench/) are short hand-written rows in the official format: 3 per
task, the 16 English tasks, multifieldqa_zh and lsht, and the 13 `_e` files, whose `length` field is
set to 2345 / 5678 / 9012 (one row per LongBench-E bucket) although their contexts are short.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch

from harness.errors import HarnessError
from harness.models import VICUNA_SYSTEM, LoadedModel, embedded_tokenizer
from harness.tasks.longbench import data as lbd
from metrics.longbench import scorer, scorer_e
from metrics.longbench_config import load_dataset2prompt, read_config_text
from metrics.longbench_tasks import LONGBENCH_ALL_TASKS, LONGBENCH_E_TASKS, LONGBENCH_EN_TASKS
from conftest import REPO, compose, run_cli
from vocab import vocab_tokenizer

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
        parsed = lbd.parse_rows(path.read_bytes(), str(path), path.stem)  # each file with its dataset's checks
        assert len(parsed) == 3 and all(set(r) == set(lbd.ROW_FIELDS) for r in parsed)


# SHA-256 of THUDM/LongBench LongBench/config/dataset2prompt.json (the official file, byte for byte).
OFFICIAL_DATASET2PROMPT_SHA256 = "56d22ad4f382169c2b8a11ff4c982a4a1bea096c8152b0f0b85b64686b157c30"


def test_prompts_are_the_official_templates_byte_for_byte():
    shipped = read_config_text("dataset2prompt.json").encode("utf-8")
    assert hashlib.sha256(shipped).hexdigest() == OFFICIAL_DATASET2PROMPT_SHA256
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


def test_middle_truncation_on_the_llama2_vocabulary():
    """longbench.md step 2 on LWM / LongChat's real vocabulary: tokens of the raw prompt with BOS, keep the
    first and last int(max_length/2), decode each half without special tokens, join the text."""
    tok = vocab_tokenizer("llama-spm")
    row = dict(rows("narrativeqa")[0])
    row["context"] = row["context"] + " MIDDLE-SENTINEL " + row["context"]
    prompt = lbd.official_prompt("narrativeqa", row)
    ids = tok(prompt)["input_ids"]
    assert ids[0] == 1  # <s> is counted, as pred.py tokenizes the prompt with special tokens
    budget = 301
    assert len(ids) > 3 * budget
    head = tok.decode(ids[:150], skip_special_tokens=True)  # int(301 / 2) = 150
    tail = tok.decode(ids[-150:], skip_special_tokens=True)
    out = lbd.build_prompt("narrativeqa", row, tok, budget)
    assert out == lbd.Prompt(head + tail, len(ids), True)
    assert out.text.startswith("You are given a story") and out.text.endswith(f"Question: {row['input']}\n\nAnswer:")
    assert "MIDDLE-SENTINEL" not in out.text and "<s>" not in out.text
    assert abs(len(tok(out.text)["input_ids"]) - budget) <= 2  # re-tokenized: about the budget again
    # Then the chat format (LWM / Llama-2: [INST]...[/INST], no spaces) on the truncated text, tokenized once.
    text, final = lbd.render("narrativeqa", out.text, fake_loaded("inst", tok))
    assert text == f"[INST]{head}{tail}[/INST]" and final[0] == 1 and final.count(1) == 1
    assert tok.decode(final, skip_special_tokens=True) == text
    assert lbd.build_prompt("narrativeqa", row, tok, len(ids)) == lbd.Prompt(prompt, len(ids), False)  # fits: untouched


# --------------------------------------------------------------------------------------------
# Chat formatting and generation settings
# --------------------------------------------------------------------------------------------


RAW = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}


QWEN2_TEMPLATE = ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
                  "<|im_start|>assistant\n")  # the Qwen2 vocabulary file's chat template, rendered by hand


@pytest.mark.parametrize("chat_format", ["inst", "vicuna", "none", "template"])
def test_chat_formatting_after_truncation_except_the_six_raw_tasks(chat_format):
    """Llama-2's vocabulary for the three text formats (pred.py adds <s>), Qwen2's for a real chat template."""
    tok = vocab_tokenizer("qwen2" if chat_format == "template" else "llama-spm")
    loaded = fake_loaded(chat_format, tok)
    assert set(lbd.RAW_TASKS) == RAW
    prompt = "Some prompt.\n\nQuestion: q\nAnswer:"
    for name in LONGBENCH_ALL_TASKS:
        text, ids = lbd.render(name, prompt, loaded)
        expected = prompt if name in RAW else {
            "inst": f"[INST]{prompt}[/INST]",
            "vicuna": f"{VICUNA_SYSTEM} USER: {prompt} ASSISTANT:",
            "none": prompt,
            "template": QWEN2_TEMPLATE.format(prompt=prompt),
        }[chat_format]
        assert text == expected, name
        if chat_format == "template" and name not in RAW:
            assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # the template's own start, nothing added
            assert tok.decode(ids) == text
        elif chat_format == "template":
            assert tok.decode(ids) == prompt  # Qwen2 adds no BOS to raw text
        else:
            assert ids[0] == 1 and ids.count(1) == 1 and tok.decode(ids[1:]) == text  # one <s>, then the text


def test_generation_budgets_and_samsum_newline_token():
    assert {n: lbd.max_new_tokens(n) for n in LONGBENCH_ALL_TASKS} == {  # longbench.md, step 4
        "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32, "2wikimqa": 32,
        "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512, "trec": 64,
        "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32,
        "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64}
    # pred.py's samsum stop: encode("\n")[-1]; for Llama-2 that is <0x0A> (13), not the "▁" before it.
    assert lbd.newline_token_id(vocab_tokenizer("llama-spm")) == 13
    for tok in (embedded_tokenizer(), vocab_tokenizer("llama-bpe"), vocab_tokenizer("qwen2"), vocab_tokenizer("command-r")):
        assert tok.decode([lbd.newline_token_id(tok)]) == "\n"


# --------------------------------------------------------------------------------------------
# The question's position (query-agnostic evaluation)
# --------------------------------------------------------------------------------------------

# Text of each template after {context} that holds no row field (hand-copied from the templates).
AFTER_CONTEXT = {
    "narrativeqa": "Now, answer the question based on the story asconcisely as you can",
    "hotpotqa": "\n\nQuestion: ",
    "trec": None,
    "lcc": "Next line of code:",
    "passage_retrieval_en": "Please enter the number of the paragraph that the abstract is from.",
    "multifieldqa_zh": "现在请基于上面的文章回答下面的问题",
}


def _squash(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("vocab,chat_format", [("llama-spm", "inst"), ("qwen2", "template"), ("command-r", "template")])
@pytest.mark.parametrize("dataset", list(AFTER_CONTEXT))
def test_question_start_splits_context_from_question(vocab, chat_format, dataset):
    tok = vocab_tokenizer(vocab)
    loaded = fake_loaded(chat_format, tok)
    row = dict(rows(dataset)[0])
    row["context"] = (row["context"].rstrip("\n") + "\n") * 6
    context_end = row["context"].strip()[-25:]
    for budget in (100_000, 400):  # whole, and middle-truncated (the tail half keeps the suffix)
        prompt = lbd.build_prompt(dataset, row, tok, budget)
        assert prompt.truncated == (budget == 400)
        _, ids = lbd.render(dataset, prompt.text, loaded)
        rendered = list(ids)
        q = lbd.question_start(dataset, row, ids, tok)
        assert ids == rendered and 0 < q < len(ids)
        after, before = tok.decode(ids[q:]), tok.decode(ids[:q])
        if row["input"]:
            assert row["input"].strip() in after and row["input"].strip() not in before
        fixed = AFTER_CONTEXT[dataset]
        if fixed:
            assert _squash(fixed) in _squash(after) and _squash(fixed) not in _squash(before)
        assert context_end in before and context_end not in after
        # Tight: past the suffix's leading blank tokens ("\n\n"), dropping one more token loses suffix text.
        first = q
        while not tok.decode(ids[first : first + 1]).strip():
            first += 1
        assert first - q <= 2
        assert _squash(lbd.template_suffix(dataset, row)) not in _squash(tok.decode(ids[first + 1 :]))


def test_question_start_when_truncation_cut_into_the_question():
    """A repobench-p input longer than the tail half: what survives of it starts the question part."""
    tok = vocab_tokenizer("llama-spm")
    row = rows("repobench-p")[0]
    prompt = lbd.build_prompt("repobench-p", row, tok, 60)
    _, ids = lbd.render("repobench-p", prompt.text, fake_loaded("inst", tok))  # a raw task: no chat format
    q = lbd.question_start("repobench-p", row, ids, tok)
    suffix = _squash(row["input"] + "Next line of code:\n")
    after = _squash(tok.decode(ids[q:], skip_special_tokens=True))
    assert suffix.endswith(after) and len(after) > 20
    assert not suffix.endswith(_squash(tok.decode(ids[q - 1 :], skip_special_tokens=True)))
    assert tok.decode(ids[:q], skip_special_tokens=True).startswith("Please complete the code given below.")


def test_templates_with_nothing_after_the_context():
    official = load_dataset2prompt()
    # Every official template has text after {context}; five have no question ({input}) at all.
    assert lbd.NOTHING_AFTER_CONTEXT == () and all(t.split("{context}")[1].strip() for t in official.values())
    assert set(lbd.NO_QUESTION_TASKS) == {n for n, t in official.items() if "{input}" not in t}
    assert set(lbd.NO_QUESTION_TASKS) == {"gov_report", "multi_news", "vcsum", "passage_count", "lcc"}
    tok = vocab_tokenizer("llama-spm")
    row = rows("qasper")[0]
    ids = tok(f"Read this: {row['context']}")["input_ids"]
    assert lbd.question_start("qasper", row, ids, tok, templates={"qasper": "Read this: {context}"}) == len(ids)


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
    from harness.tasks.longbench import task as longbench

    longbench.validate(compose("task=longbench", f"task.data_dir={folder}", f"task.datasets=[{','.join(datasets)}]").task)


def test_missing_file_names_the_file(tmp_path):
    folder = copy_fixtures(tmp_path)
    validate_dir(folder, "qasper", "trec")
    with pytest.raises(HarnessError, match=f"{folder / 'hotpotqa.jsonl'} is missing"):
        validate_dir(folder, "qasper", "hotpotqa")


DROP = object()  # a field deleted from the row

# Rows the official pipeline scores (pred.py formats the template with the row and copies answers /
# all_classes / length; eval.py runs the task's metric on every answer): accepted, whatever their types.
# Each entry: file stem, changes to a valid fixture row (None: delete the field), why eval.py scores it.
SCOREABLE = [
    ("passage_count", {"answers": [3]}, "count_score compares str(number) == str(ground_truth)"),
    ("gov_report", {"answers": [None, 5]}, "rouge_score's bare except scores a failure 0.0"),
    ("lcc", {"answers": [None]}, "fuzz.ratio(line, None) is 0"),
    ("hotpotqa", {"answers": []}, "no answers: the item scores 0"),
    ("narrativeqa", {"answers": "eleven"}, "a string is iterated: each character is an answer"),
    ("trec", {"answers": [["Individual"]]}, "classification_score only tests `class in ground_truth`"),
    ("narrativeqa", {"length": "long"}, "length is read only by the LongBench-E buckets"),
    ("narrativeqa", {"input": 42}, "str.format takes any value"),
    ("hotpotqa", {"all_classes": "not a list"}, "all_classes is read only by classification_score"),
    ("qasper", {"dataset": DROP, "language": DROP}, "neither script reads dataset or language"),
    ("lcc", {"input": DROP}, "lcc's template has no {input}"),
    ("qasper_e", {"length": 4000.5}, "a float compares with 4000 and 8000"),
]

# Rows it cannot score: rejected with one line naming file:line and the reason.
UNSCOREABLE = [
    ("narrativeqa", {"answers": 5}, "field 'answers' is a number; eval.py iterates over it"),
    ("narrativeqa", {"answers": ["eleven", 11]}, "answers[1] is a number, but narrativeqa's metric needs a string"),
    ("multifieldqa_zh", {"answers": [7]}, "answers[0] is a number, but multifieldqa_zh's metric needs a string"),
    ("passage_retrieval_en", {"answers": ["the third"]}, "answers[0] 'the third' holds no 'Paragraph <n>' id"),
    ("trec", {"all_classes": None}, "field 'all_classes' must be the list of class names (strings) that trec's"),
    ("trec", {"answers": [5]}, "answers[0] is a number, but trec's classification_score needs a string"),
    ("lcc", {"answers": [5]}, "answers[0] is a number, but lcc's code_sim_score needs a string"),
    ("qasper_e", {"length": "2345"}, "field 'length' is a string; LongBench-E buckets items by it"),
    ("qasper", {"all_classes": DROP, "length": DROP}, "missing field(s) all_classes, length"),  # pred.py copies both
    ("repobench-p", {"input": DROP}, "missing field(s) input"),  # its template names {input}
    ("qasper", {"_id": DROP}, "missing field(s) _id"),  # the harness keys resumed predictions by it
]


def changed_row(stem: str, changes: dict) -> dict:
    row = dict(rows(stem)[1])
    for key, value in changes.items():
        if value is DROP:
            del row[key]
        else:
            row[key] = value
    return row


def parse_with(stem: str, row: dict) -> list[dict]:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows(stem)]
    lines[1] = json.dumps(row, ensure_ascii=False)
    return lbd.parse_rows("\n".join(lines).encode("utf-8"), f"data/{stem}.jsonl", stem)


def official_score(stem: str, prediction: str, row: dict) -> None:
    """The item through the official-semantics scorer (metrics.longbench, eval.py's rules)."""
    dataset = stem[:-2] if stem.endswith("_e") else stem
    if stem.endswith("_e"):
        scorer_e(dataset, [prediction], [row["answers"]], [row["length"]], row["all_classes"])
    else:
        scorer(dataset, [prediction], [row["answers"]], row["all_classes"])


PREDICTIONS = ["", "Paragraph 3", "Individual 3", "eleven\nx = 1"]


@pytest.mark.parametrize("stem,changes,why", SCOREABLE, ids=[f"{c[0]}-{'-'.join(c[1])}" for c in SCOREABLE])
def test_rows_the_official_scorer_accepts_are_accepted(stem, changes, why):
    row = changed_row(stem, changes)
    assert parse_with(stem, row)[1] == row
    for prediction in PREDICTIONS:
        official_score(stem, prediction, row)  # and they do score


@pytest.mark.parametrize("stem,changes,problem", UNSCOREABLE, ids=[f"{c[0]}-{'-'.join(c[1])}" for c in UNSCOREABLE])
def test_rows_it_cannot_score_are_rejected_in_one_line(stem, changes, problem):
    row = changed_row(stem, changes)
    with pytest.raises(HarnessError) as err:
        parse_with(stem, row)
    message = str(err.value)
    assert message.startswith(f"data/{stem}.jsonl:2: ") and "\n" not in message and message.endswith("; fix or remove that line")
    assert problem in message
    if not message.split(": ", 1)[1].startswith("missing field"):  # the scorer itself fails on them
        failures = 0
        for prediction in PREDICTIONS:
            try:
                official_score(stem, prediction, row)
            except Exception:
                failures += 1
        assert failures > 0


@pytest.mark.parametrize("line,problem", [
    ('{"input": "q", "context": ', "not valid JSON"),
    ('[1, 2]', "expected a JSON object, got a list"),
    ('{"input": "q", "context": "c", "answers": ["a"], "length": 3, "dataset": "trec", "language": "en", "_id": "x"}',
     "missing field(s) all_classes"),
    ('{"input": "q", "context": "c", "answers": ["a"], "length": 3, "all_classes": [1, 2], "_id": "x"}',
     "field 'all_classes' must be the list of class names (strings) that trec's classification_score looks for, got [1, 2]"),
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
        from harness.tasks.longbench import task as longbench

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
