"""LongBench metrics: golden values from shared/reference/longbench.md plus hand-computed cases."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import math
import random
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import metrics
from metrics import longbench as lb
from metrics.longbench import (
    CODE_SIM_BACKENDS,
    classification_score,
    code_sim_score,
    count_score,
    dataset2metric,
    fuzz_ratio,
    normalize_answer,
    normalize_zh_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
    scorer,
    scorer_e,
)
from metrics.longbench_config import (
    LONGBENCH_CONFIG_FILES,
    load_dataset2maxlen,
    load_dataset2prompt,
    load_model2maxlen,
    read_config_text,
)
from metrics.longbench_tasks import (
    FIRST_LINE_TASKS,
    LONGBENCH_ALL_TASKS,
    LONGBENCH_E_TASKS,
    LONGBENCH_EN_TASKS,
    LONGBENCH_ZH_TASKS,
    TASK_CATEGORIES,
    average_scores,
    task_category,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_DIR = REPO_ROOT.parent / "shared" / "reference"
PERFECT_ROUGE = 0.999999995  # 2 * (1 * 1) / (1 + 1 + 1e-8)
HAS_LEVENSHTEIN = importlib.util.find_spec("Levenshtein") is not None


# ---------------------------------------------------------------------------------------------
# normalisation and QA F1
# ---------------------------------------------------------------------------------------------


def test_normalize_answer():
    assert normalize_answer("The  Quick, brown FOX!") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theory anthem") == "theory anthem"  # whole words only
    assert normalize_answer("well-known") == "wellknown"  # punctuation deleted, not split
    assert normalize_answer("“Paris”") == "“paris”"  # ASCII punctuation only


def test_normalize_zh_answer():
    assert normalize_zh_answer("你好，世界！ Hello World.") == "你好世界helloworld"
    assert normalize_zh_answer("“北京”…") == "北京"
    assert normalize_zh_answer("《书》") == "《书"  # the official set has 》 but not 《
    assert normalize_zh_answer(" a\tb\nc ") == "abc"  # ALL whitespace deleted


def test_qa_f1_golden():
    score = qa_f1_score("“Paris”", "Paris")
    assert score == 0 and type(score) is int  # int 0 when nothing overlaps
    assert qa_f1_score("The Eiffel Tower.", "eiffel tower") == 1.0


def test_qa_f1_hand_computed():
    assert qa_f1_score("Paris France", "Paris") == pytest.approx(2 * 0.5 * 1 / 1.5)
    # multiset overlap: x x y vs x y y -> 2 common, p = r = 2/3
    assert qa_f1_score("x x y", "x y y") == pytest.approx(2 / 3)
    assert qa_f1_score("An apple", "apple") == 1.0
    assert qa_f1_score("Paris，France", "Paris France") == 0  # full-width comma survives
    assert qa_f1_score("well-known", "well known") == 0
    assert qa_f1_score("", "Paris") == 0
    assert qa_f1_score("the", "a") == 0  # both normalise to nothing


def test_qa_f1_zh():
    assert qa_f1_zh_score("北京", "北京") == 1.0
    assert qa_f1_zh_score("北京。", "北京") == 1.0  # punctuation token dropped
    # jieba: ["北京", " ", "上海"] -> the blank token normalises to "" and is dropped
    assert qa_f1_zh_score("北京 上海", "北京") == pytest.approx(2 / 3)
    assert qa_f1_zh_score("上海", "北京") == 0


# ---------------------------------------------------------------------------------------------
# ROUGE-L (rouge 1.0.1)
# ---------------------------------------------------------------------------------------------


def test_rouge_perfect_and_empty():
    assert rouge_score("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(
        PERFECT_ROUGE, abs=1e-12
    )
    for empty in ("", ".", "   ", "...", " . "):
        assert rouge_score(empty, "the cat sat") == 0.0
    assert rouge_score("the cat", "") == 0.0


def test_rouge_quirks_hand_computed():
    # case-sensitive: only "cat" is common; r = p = 1/2
    assert rouge_score("The cat", "the cat") == pytest.approx(2 * 0.25 / (1 + 1e-8), abs=1e-12)
    # unique-word sets: repetition is not penalised
    assert rouge_score("cat cat cat", "cat") == pytest.approx(PERFECT_ROUGE, abs=1e-12)
    # sentences split on "." and the union LCS recovers all three words
    assert rouge_score("x y. z", "x y z") == pytest.approx(PERFECT_ROUGE, abs=1e-12)
    # one sentence, reversed: LCS 1, r = p = 1/3
    assert rouge_score("z y x", "x y z") == pytest.approx(2 * (1 / 9) / (2 / 3 + 1e-8), abs=1e-12)
    # r = 1, p = 1/2
    assert rouge_score("a b c d", "a b") == pytest.approx(2 * 0.5 / (1.5 + 1e-8), abs=1e-12)
    assert rouge_score("gamma", "alpha beta") == 0.0


def test_rouge_recursion_limit_scores_zero():
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(300)]
    prediction = " ".join(rng.choice(vocab) for _ in range(560))
    reference = " ".join(rng.choice(vocab) for _ in range(560))
    limit = sys.getrecursionlimit()
    assert rouge_score(prediction, reference) == 0.0
    assert sys.getrecursionlimit() == limit
    # shorter pairs of the same kind score normally
    assert rouge_score(" ".join(prediction.split()[:200]), " ".join(reference.split()[:200])) > 0.1


def _chain(n: int) -> tuple[str, str]:
    # The package's LCS reconstruction recurses n + 1 deep here, with a 2 x n table (cheap).
    return " ".join(f"x{i}" for i in range(n)), "x0"


_OFFICIAL_SHAPED_CUTOFF = textwrap.dedent(
    """
    from rouge import Rouge
    def rouge_score(prediction, ground_truth):
        try:
            return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
        except Exception:
            return 0.0
    def scorer(prediction, ground_truth):
        return rouge_score(prediction, ground_truth)
    lo, hi = 10, 5000  # first n whose chain scores 0.0 (eval.py's stack shape)
    while lo < hi:
        mid = (lo + hi) // 2
        words = " ".join("x%d" % i for i in range(mid))
        if scorer(words, "x0") == 0.0:
            hi = mid
        else:
            lo = mid + 1
    print(lo)
    """
)


def test_rouge_recursion_cutoff_is_official_and_independent_of_caller_depth():
    out = subprocess.run(
        [sys.executable, "-c", _OFFICIAL_SHAPED_CUTOFF],
        capture_output=True, text=True, check=True, timeout=60,
    )
    cutoff = int(out.stdout.strip())
    assert 10 < cutoff < 5000
    below, at = _chain(cutoff - 1), _chain(cutoff)

    def nested(depth, fn):
        return fn() if depth == 0 else nested(depth - 1, fn)

    for depth in (0, 300):
        assert nested(depth, lambda: rouge_score(*below)) == pytest.approx(2 / cutoff, rel=1e-6)
        assert nested(depth, lambda: rouge_score(*at)) == 0.0


def test_rouge_zh():
    assert rouge_zh_score("我爱北京天安门", "我爱北京天安门") == pytest.approx(PERFECT_ROUGE, abs=1e-12)
    # 我/爱/北京 vs 我/爱/北京/天安门: r = 3/4, p = 1
    assert rouge_zh_score("我爱北京", "我爱北京天安门") == pytest.approx(
        2 * 0.75 / (1.75 + 1e-8), abs=1e-12
    )
    assert rouge_zh_score("", "我爱北京") == 0.0


# ---------------------------------------------------------------------------------------------
# classification, retrieval, count
# ---------------------------------------------------------------------------------------------


def test_classification_golden_skip_quirk():
    classes = ["Food", "Foo", "Food manufacture"]
    assert classification_score("Food Foo Food manufacture", "Food manufacture", all_classes=classes) == 0.5


def test_classification_hand_traced():
    # matches [Food, Food manufacture]; "Food" removed, nothing skipped that matters -> 1.0
    classes = ["Food", "Other", "Food manufacture"]
    assert classification_score("Food manufacture", "Food manufacture", all_classes=classes) == 1.0
    assert classification_score("Food Sports", "Food", all_classes=["Food", "Sports"]) == 0.5
    assert classification_score("Sports", "Food", all_classes=["Food", "Sports"]) == 0.0
    assert classification_score("food", "Food", all_classes=["Food"]) == 0.0  # case-sensitive
    assert classification_score("nothing here", "Food", all_classes=["Food"]) == 0.0  # no fallback
    assert classification_score("It is LOC", "LOC", all_classes=["LOC", "LOC"]) == 0.5  # dupes count
    with pytest.raises(KeyError):
        classification_score("Food", "Food")


def test_retrieval_and_count():
    assert retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert retrieval_score("Paragraph 3 or Paragraph 13", "Paragraph 3") == 0.5
    assert retrieval_score("Paragraph 3, not 30, so 3", "Paragraph 3") == pytest.approx(2 / 3)
    assert retrieval_score("I do not know", "Paragraph 3") == 0.0
    assert retrieval_score("12", "Paragraph 12 of 30") == 1.0  # first id of the answer
    assert retrieval_zh_score("答案是段落5", "段落5") == 1.0
    assert retrieval_zh_score("段落5和段落6", "段落5") == 0.5
    with pytest.raises(ValueError):
        retrieval_zh_score("5", "Paragraph 5")

    assert count_score("There are 7 unique paragraphs: 7", "7") == 1.0
    assert count_score("7 or 8", "7") == 0.5
    assert count_score("17", "7") == 0.0
    assert count_score("seven", "7") == 0.0
    assert count_score("7", 7) == 1.0  # compared as strings
    assert type(count_score("7", "7")) is float


# ---------------------------------------------------------------------------------------------
# code similarity
# ---------------------------------------------------------------------------------------------


def test_code_sim_first_line_rule():
    prediction = "\n\n# comment\n// note\n```python\nx = 1\ny = 2"
    assert code_sim_score(prediction, "x = 1") == 1.0
    assert code_sim_score('a = "#"\nx = 1', "x = 1") == 1.0  # '#' anywhere skips the line
    assert code_sim_score("a = b / c", "a = b / c") == 1.0  # a single '/' is fine
    # a whitespace-only line qualifies: difflib matches 2 spaces of 3 + 5 chars -> 50
    assert code_sim_score("# c\n   \nx = 1", "x = 1") == 0.5
    # only leading newlines are stripped: " " is the line, 2 * 1 / 6 -> 33
    assert code_sim_score(" \nx = 1", "x = 1") == 0.33
    assert code_sim_score("# a\n`b`\n// c", "x = 1") == 0.0  # no line qualifies -> ""
    assert code_sim_score("", "x = 1") == 0.0
    # fuzzywuzzy checks equality before emptiness: "" vs "" is 100
    assert code_sim_score("# only a comment", "") == 1.0


def test_fuzz_ratio_semantics():
    assert fuzz_ratio("abc", "abc") == 100
    assert fuzz_ratio("", "") == 100
    assert fuzz_ratio("", "a") == 0 and fuzz_ratio("a", "") == 0
    assert fuzz_ratio(None, "a") == 0
    assert fuzz_ratio("ABC", "abc") == 0  # no case folding
    rng = random.Random(7)
    for _ in range(200):
        a = "".join(rng.choice("ab (){}=;x\t") for _ in range(rng.randint(1, 300)))
        b = "".join(rng.choice("ab (){}=;x\t") for _ in range(rng.randint(1, 300)))
        expected = 100 if a == b else int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))
        assert fuzz_ratio(a, b) == expected


def test_code_sim_backends():
    assert CODE_SIM_BACKENDS == ("difflib", "levenshtein")
    # difflib's greedy block matching finds 1 match, the LCS is 2 ("cb")
    assert code_sim_score("bcab", "cb") == 0.33
    assert code_sim_score("bcab", "cb", backend="difflib") == 0.33
    with pytest.raises(ValueError):
        code_sim_score("a", "a", backend="rapidfuzz")
    with pytest.raises(ValueError):
        scorer("lcc", ["a"], [["a"]], None, code_sim_backend="Levenshtein")


def test_code_sim_levenshtein_backend():
    # python-Levenshtein is in the test extra (scripts/setup.sh installs it): this runs, never skips
    assert HAS_LEVENSHTEIN, "python-Levenshtein is missing: run bash scripts/setup.sh"
    assert code_sim_score("bcab", "cb", backend="levenshtein") == 0.67
    assert scorer("lcc", ["bcab"], [["cb"]], None, code_sim_backend="levenshtein") == 67.0


def test_levenshtein_missing_raises_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "Levenshtein", None)  # import fails
    lb._levenshtein_ratio.cache_clear()
    try:
        with pytest.raises(ImportError, match="pip install python-Levenshtein"):
            code_sim_score("bcab", "cb", backend="levenshtein")
    finally:
        lb._levenshtein_ratio.cache_clear()


def test_backends_agree_with_fuzzywuzzy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    backend = "difflib" if fuzz.SequenceMatcher is difflib.SequenceMatcher else "levenshtein"
    rng = random.Random(11)
    alphabet = "abcxyz (){}=;.\n\té中"
    for _ in range(300):
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert fuzz_ratio(a, b, backend=backend) == fuzz.ratio(a, b), (a, b)


# ---------------------------------------------------------------------------------------------
# dataset scorers
# ---------------------------------------------------------------------------------------------


def test_dataset2metric():
    assert set(dataset2metric) == set(LONGBENCH_ALL_TASKS) and len(dataset2metric) == 21
    expected = {
        "qa_f1_score": ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"],
        "qa_f1_zh_score": ["multifieldqa_zh"],
        "rouge_score": ["gov_report", "qmsum", "multi_news", "samsum"],
        "rouge_zh_score": ["dureader", "vcsum"],
        "classification_score": ["trec", "lsht"],
        "retrieval_score": ["passage_retrieval_en"],
        "retrieval_zh_score": ["passage_retrieval_zh"],
        "count_score": ["passage_count"],
        "code_sim_score": ["lcc", "repobench-p"],
    }
    for name, tasks in expected.items():
        for task in tasks:
            assert dataset2metric[task].__name__ == name, task


def test_scorer_first_line_rule():
    classes = ["Location", "Human"]
    assert scorer("trec", ["\n\nLocation\nHuman"], [["Location"]], classes) == 100.0
    assert scorer("lsht", ["\nLocation\nHuman"], [["Location"]], classes) == 100.0
    assert scorer("triviaqa", ["\nParis\nLondon"], [["Paris"]], None) == 100.0
    assert scorer("triviaqa", [" \nParis"], [["Paris"]], None) == 0.0  # spaces are not stripped
    assert scorer("samsum", ["\nthe cat sat\nextra words"], [["the cat sat"]], None) == pytest.approx(
        100 * PERFECT_ROUGE, abs=0.005
    )
    # other tasks keep every line
    assert scorer("qasper", ["\nParis\nFrance"], [["Paris France"]], None) == 100.0


def test_scorer_max_over_answers_and_rounding_once():
    assert scorer("triviaqa", ["Paris"], [["London", "Paris"]], None) == 100.0
    # item scores 1/3, 1/3, 1 -> 100 * (5/3) / 3 = 55.555... -> 55.56
    # (rounding each item first would give 55.55)
    preds = ["7 1 2", "7 1 2", "7"]
    result = scorer("passage_count", preds, [["7"]] * 3, None)
    assert result == 55.56 and type(result) is float
    assert scorer("qasper", ["Paris France", "London"], [["Paris"], ["Paris"]], None) == 33.33
    assert scorer("qasper_e", ["Paris"], [["Paris"]], None) == 100.0  # LongBench-E name
    with pytest.raises(KeyError):
        scorer("unknown", ["a"], [["a"]], None)
    with pytest.raises(ValueError):
        scorer("qasper", ["a", "b"], [["a"]], None)
    with pytest.raises(ValueError):
        scorer("qasper", [], [], None)


def test_scorer_code_sim_backend_default_difflib():
    assert scorer("lcc", ["bcab"], [["cb"]], None) == 33.0
    assert scorer("repobench-p", ["# c\nx = 1"], [["x = 1"]], None) == 100.0


def test_scorer_e_buckets():
    lengths = [100, 3999, 4000, 7999, 8000, 20000]
    preds = ["Paris", "x", "Paris", "Paris", "x", "x"]
    answers = [["Paris"]] * 6
    assert scorer_e("triviaqa", preds, answers, lengths, None) == {"0-4k": 50.0, "4-8k": 100.0, "8k+": 0.0}
    result = scorer_e("passage_count", ["7 1 2", "7 1 2", "7"], [["7"]] * 3, [10, 20, 30], None)
    assert result["0-4k"] == 55.56 and type(result["0-4k"]) is float
    assert math.isnan(result["4-8k"]) and math.isnan(result["8k+"])
    with pytest.raises(ValueError):
        scorer_e("qasper", ["a"], [["a"]], [1, 2], None)


# ---------------------------------------------------------------------------------------------
# task metadata and averages
# ---------------------------------------------------------------------------------------------


def test_task_lists():
    assert LONGBENCH_EN_TASKS == (
        "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
        "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
        "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
    )
    assert LONGBENCH_ZH_TASKS == ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
    assert len(LONGBENCH_E_TASKS) == 13 and set(LONGBENCH_E_TASKS) <= set(LONGBENCH_EN_TASKS)
    assert not {"narrativeqa", "musique", "qmsum"} & set(LONGBENCH_E_TASKS)
    assert FIRST_LINE_TASKS == ("trec", "triviaqa", "samsum", "lsht")
    flat = [t for tasks in TASK_CATEGORIES.values() for t in tasks]
    assert sorted(flat) == sorted(LONGBENCH_ALL_TASKS) and len(flat) == len(set(flat))
    assert list(TASK_CATEGORIES) == ["Single-doc QA", "Multi-doc QA", "Summarization", "Few-shot", "Synthetic", "Code"]
    # the paper's column order is the category order
    assert [t for tasks in TASK_CATEGORIES.values() for t in tasks if t in LONGBENCH_EN_TASKS] == list(LONGBENCH_EN_TASKS)
    assert task_category("lsht") == "Few-shot" and task_category("qasper_e") == "Single-doc QA"
    assert task_category("nope") is None


def test_average_scores():
    result = average_scores({"narrativeqa": 10.0, "qasper": 20.0, "hotpotqa": 30.0, "lcc": 41.0})
    assert result["average"] == 25.25 and result["n_tasks"] == 4
    assert result["categories"] == {"Single-doc QA": 15.0, "Multi-doc QA": 30.0, "Code": 41.0}
    # the paper's LWM-Text-Chat-1M All-KV row (16 tasks), unweighted
    row = [18.18, 25.56, 40.94, 24.57, 19.39, 10.49, 27.97, 24.9, 24.81, 71.0, 60.9, 39.73, 3.17, 3.5, 44.4, 43.82]
    result = average_scores(dict(zip(LONGBENCH_EN_TASKS, row)))
    assert result["average"] == round(sum(row) / 16, 2) == 30.21
    assert result["categories"]["Synthetic"] == round((3.17 + 3.5) / 2, 2)
    assert average_scores({"mystery": 50.0, "lcc": 40.0}) == {
        "average": 45.0, "n_tasks": 2, "categories": {"Code": 40.0}
    }
    assert average_scores({"lcc_e": 40.0})["categories"] == {"Code": 40.0}
    with pytest.raises(ValueError):
        average_scores({})


# ---------------------------------------------------------------------------------------------
# config files
# ---------------------------------------------------------------------------------------------


def test_config_loaders():
    prompts = load_dataset2prompt()
    assert set(prompts) == set(LONGBENCH_ALL_TASKS)
    assert "asconcisely" in prompts["narrativeqa"]  # the official typo is kept
    filled = prompts["qasper"].format(context="CTX", input="Q?")
    assert "CTX" in filled and "Q?" in filled
    maxlen = load_dataset2maxlen()
    assert set(maxlen) == set(LONGBENCH_ALL_TASKS)
    assert {k: maxlen[k] for k in ("narrativeqa", "multifieldqa_en", "hotpotqa", "gov_report", "trec", "triviaqa", "samsum", "passage_count", "lcc", "dureader")} == {
        "narrativeqa": 128, "multifieldqa_en": 64, "hotpotqa": 32, "gov_report": 512, "trec": 64,
        "triviaqa": 32, "samsum": 128, "passage_count": 32, "lcc": 64, "dureader": 128,
    }
    models = load_model2maxlen()
    assert models["llama2-7b-chat-4k"] == 3500 and models["longchat-v1.5-7b-32k"] == 31500
    load_dataset2maxlen()["trec"] = 0  # fresh dicts each call
    assert load_dataset2maxlen()["trec"] == 64
    with pytest.raises(ValueError):
        read_config_text("../pyproject.toml")


@pytest.mark.parametrize("name", LONGBENCH_CONFIG_FILES)
def test_config_files_equal_reference(name):
    shipped = REPO_ROOT / "metrics" / "data" / "longbench" / name
    assert read_config_text(name).encode("utf-8") == shipped.read_bytes()
    json.loads(shipped.read_text(encoding="utf-8"))
    reference = REFERENCE_DIR / "longbench" / name
    if not reference.is_file():
        pytest.skip(f"reference file {reference} not present")
    assert shipped.read_bytes() == reference.read_bytes()


def test_source_note_present():
    text = (REPO_ROOT / "metrics" / "data" / "longbench" / "SOURCE.md").read_text(encoding="utf-8")
    assert "THUDM/LongBench" in text and "LongBench/config/" in text


# ---------------------------------------------------------------------------------------------
# package hygiene
# ---------------------------------------------------------------------------------------------


def test_metrics_imports_nothing_from_harness():
    for path in (REPO_ROOT / "metrics").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "harness" or n.startswith("harness.") for n in names), path


def test_import_is_light():
    code = (
        "import sys, metrics; "
        "print(sorted(m for m in ('jieba', 'rouge', 'numpy', 'Levenshtein', 'fuzzywuzzy', 'harness', 'torch') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT, timeout=60)
    assert out.stdout.strip() == "[]"
    assert "scorer" in metrics.__all__ and metrics.scorer is scorer
