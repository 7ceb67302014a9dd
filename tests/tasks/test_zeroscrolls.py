"""ZeroSCROLLS end to end on its fixture (the hub's <task>.zip layout, all 10 tasks): run_hf_model.py's truncation
and the split at query_start_index, per-task generation budgets, references grouped by id, both protocols, the run's
table with paired intervals, and the official-scorer mechanics: scoring goes through a scorer loaded from
task.scorer_dir (here a small scorer written by this test in the official script's shape: a datasets.Metric subclass
with relative imports), refused in one line without it. The official scorer's own goldens are
tests/metrics/test_zeroscrolls_golden.py (skipped where no copy of it exists)."""

from __future__ import annotations

import json
import sys
import textwrap
import zipfile

import pytest
from omegaconf import OmegaConf

from conftest import REPO, compose
from harness.app import execute
from harness.errors import HarnessError
from harness.tasks.zeroscrolls import scorer as official
from harness.tasks.zeroscrolls import task as zs

FIXTURES = REPO / "tests" / "fixtures" / "zeroscrolls"

pytestmark = pytest.mark.usefixtures("one_thread")

# A scorer in the official script's shape (metrics/zero_scrolls.py + a helper module beside it, imported relatively):
# here a task's score is 100 x the share of predictions holding one of their references, lowercased.
MAIN = '''
import datasets
from .contains import compute_contains

TASKS = ["gov_report", "summ_screen_fd", "qmsum", "squality", "qasper", "narrative_qa", "quality", "musique",
         "space_digest", "book_sum_sort"]


@datasets.utils.file_utils.add_start_docstrings("test scorer", "")
class ZeroScrolls(datasets.Metric):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config_name not in TASKS:
            raise KeyError(f"You should supply a configuration name selected in {TASKS}")

    def _info(self):
        return datasets.MetricInfo(description="", citation="", inputs_description="",
                                   features=datasets.Features({"predictions": datasets.Value("string"),
                                                               "references": datasets.Sequence(datasets.Value("string"))}))

    def _compute(self, predictions, references):
        score = compute_contains(predictions, references)
        return {"contains": round(score, 4), "num_predicted": len(predictions), "zero_scrolls_score": round(score, 4)}
'''
HELPER = '''
def compute_contains(predictions, references):
    hits = [max(float(r.lower() in p.lower()) for r in refs) for p, refs in zip(predictions, references)]
    return 100.0 * sum(hits) / len(hits)
'''


@pytest.fixture
def scorer_dir(tmp_path):
    folder = tmp_path / "zero_scrolls_copy" / "metrics"
    folder.mkdir(parents=True)
    (folder / "zero_scrolls.py").write_text(textwrap.dedent(MAIN), encoding="utf-8")
    (folder / "contains.py").write_text(textwrap.dedent(HELPER), encoding="utf-8")
    return folder.parent


def run(tmp, scorer, *overrides, model="tiny-random"):
    args = ["task=zeroscrolls", f"model={model}", f"task.data_dir={FIXTURES}", f"task.scorer_dir={scorer}", "progress=false",
            "task.max_new_tokens=4", *overrides]
    return execute(compose(*args), tmp, overrides=args)


def records(folder):
    return [json.loads(line) for line in (folder / "zeroscrolls.jsonl").read_text(encoding="utf-8").splitlines()]


def fixture_rows(task):
    with zipfile.ZipFile(FIXTURES / f"{task}.zip") as z:
        return [json.loads(line) for line in z.read(f"{task}/validation.jsonl").decode().splitlines()]


def test_fixture_has_every_task_in_the_official_row_format():
    for task in zs.TASKS:
        rows = fixture_rows(task)
        for r in rows:
            assert set(r) == {"id", "pid", "input", "output", "document_start_index", "document_end_index", "query_start_index",
                              "query_end_index", "truncation_seperator"}
            assert r["document_start_index"] <= r["document_end_index"] <= r["query_start_index"] <= r["query_end_index"] <= len(r["input"])
    items, origin = zs.load_items(OmegaConf.create({"data_dir": str(FIXTURES), "split": "validation"}), "squality")
    assert origin == "task.data_dir" and [len(i["references"]) for i in items] == [2, 1]  # rows sharing an id: one item


def test_truncation_is_run_hf_models(tiny_random):
    """Over the budget: the text before query_start_index cut to budget - len(separator + query), then those tokens."""
    tok = tiny_random.tokenizer
    row = fixture_rows("qasper")[0]
    q = row["query_start_index"]
    full = tok(row["input"])["input_ids"]
    ids, split, raw, truncated = zs.model_input(tok, row, len(full))
    assert (ids, raw, truncated) == (full, len(full), False)
    # the split: the first token holding text from query_start_index ("\n\nQuestion:..."; a "\n" may share a token)
    assert tok.decode(ids[split:]).strip().startswith("Question:") and tok.decode(ids[:split]).rstrip().endswith("Baltic languages.")
    budget = 120
    ids, split, raw, truncated = zs.model_input(tok, row, budget)
    tail = tok(row["truncation_seperator"] + row["input"][q:], add_special_tokens=False)["input_ids"]
    head = tok(row["input"][:q])["input_ids"][: budget - len(tail)]
    assert truncated and raw == len(full) and ids == head + tail and split == len(head) and len(ids) == budget
    assert tok.decode(ids[split:]).startswith("... [The rest of the article is omitted]")


def test_both_protocols_score_through_the_scorer_dir(tmp_path, tiny_random, scorer_dir):
    methods = "methods=[full,{name: snapkv, budget: 32, window_size: 4}]"
    run(tmp_path / "aware", scorer_dir, methods)
    out = run(tmp_path / "agn", scorer_dir, methods, "task.query_aware=false", "task.tasks=[qasper,narrative_qa,book_sum_sort]")
    aware = records(tmp_path / "aware" / "full")
    assert [r["task"] for r in aware] == [t for t in zs.TASKS for _ in range(2)] and {r["protocol"] for r in aware} == {"query_aware"}
    for r in aware:
        assert r["max_new_tokens"] == min(4, zs.MAX_NEW_TOKENS[r["task"]])
        expected = max(float(ref.lower() in r["prediction"].lower()) for ref in r["references"])
        assert r["score"] == expected  # the item's own score: the scorer on that one item, / 100
    agn = records(tmp_path / "agn" / "full")
    assert {r["protocol"] for r in agn} == {"query_agnostic"} and all(0 < r["question_start"] < r["prompt_tokens"] for r in agn)
    summary = json.loads((tmp_path / "agn" / "full" / "results.json").read_text())["summary"]
    for task in ("qasper", "narrative_qa", "book_sum_sort"):
        mine = [r for r in agn if r["task"] == task]
        assert summary["scores"][task] == round(100 * sum(r["score"] for r in mine) / len(mine), 4)
        assert summary["official"][task]["num_predicted"] == len(mine)
    assert summary["scorer"].endswith("metrics/zero_scrolls.py") and summary["split"] == "validation"
    table = (tmp_path / "agn" / "zeroscrolls_table.md").read_text()
    assert "| Qspr | Nrtv | BkSS | Avg. |" in table and "Minus `full` on the same items" in table
    from harness.report import build

    build(tmp_path, tmp_path / "tables", resamples=200)  # the table set: zeroscrolls.md, and the paired rows (PAIRING)
    assert "## ZeroSCROLLS · tiny-random · query_agnostic" in (tmp_path / "tables" / "zeroscrolls.md").read_text()
    paired = (tmp_path / "tables" / "paired_deltas.csv").read_text()
    assert paired.count("agn/snapkv_c32_w4_k7_maxpool_expand,") == 4  # qasper, narrative_qa, book_sum_sort, average
    assert not out["failures"] and (tmp_path / "agn" / "snapkv_c32_w4_k7_maxpool_expand" / "zeroscrolls.jsonl").is_file()
    assert "datasets" not in sys.modules or hasattr(sys.modules["datasets"], "load_dataset")  # the real one put back


def test_without_a_scorer_it_is_refused_in_one_line(tmp_path):
    for bad, match in ((None, "not part of this repository"), (tmp_path, "no metrics/zero_scrolls.py there")):
        with pytest.raises(HarnessError, match=match) as err:
            zs.validate(compose("task=zeroscrolls", f"task.data_dir={FIXTURES}", f"task.scorer_dir={bad}" if bad else "task.limit=1").task)
        assert "\n" not in str(err.value) and "huggingface-cli download tau/zero_scrolls" in str(err.value)


def test_a_scorer_with_missing_imports_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "copy" / "metrics"
    folder.mkdir(parents=True)
    (folder / "zero_scrolls.py").write_text("import datasets\nfrom .rouge import compute_rouge\n", encoding="utf-8")
    (folder / "rouge.py").write_text("from rouge_score_not_installed_here import rouge_scorer\n", encoding="utf-8")
    with pytest.raises(HarnessError, match="imports 'rouge_score_not_installed_here', which is not installed") as err:
        official.OfficialScorer(folder.parent)
    assert "\n" not in str(err.value)


def test_test_split_without_outputs_needs_no_scorer(tmp_path):
    """The leaderboard's split has no outputs: predictions only, no scorer asked for."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [{**r, "output": None} for r in fixture_rows("quality")]
    with zipfile.ZipFile(data / "quality.zip", "w") as z:
        z.writestr("quality/test.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    zs.validate(compose("task=zeroscrolls", f"task.data_dir={data}", "task.split=test", "task.tasks=[quality]").task)
    items, _ = zs.load_items(OmegaConf.create({"data_dir": str(data), "split": "test"}), "quality")
    assert [i["references"] for i in items] == [[], []]
