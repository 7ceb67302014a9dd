"""LongBench (v1) task metadata: task lists, categories and the paper-style average.

Pure data and arithmetic; imports nothing heavy (no jieba, rouge, numpy).
"""

from __future__ import annotations

import math
from typing import Mapping

# The 16 English tasks used by SnapKV and most KV-compression papers, in the paper's column order.
LONGBENCH_EN_TASKS: tuple[str, ...] = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)

# The 5 Chinese tasks (not in the paper's 16).
LONGBENCH_ZH_TASKS: tuple[str, ...] = (
    "multifieldqa_zh",
    "dureader",
    "vcsum",
    "lsht",
    "passage_retrieval_zh",
)

# All 21 LongBench v1 datasets.
LONGBENCH_ALL_TASKS: tuple[str, ...] = LONGBENCH_EN_TASKS + LONGBENCH_ZH_TASKS

# LongBench-E: the 13 tasks that have a `<name>_e` file (length-balanced subsets).
LONGBENCH_E_TASKS: tuple[str, ...] = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)

# The six LongBench categories; English tasks first (paper order), then the Chinese ones.
TASK_CATEGORIES: dict[str, tuple[str, ...]] = {
    "Single-doc QA": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "Multi-doc QA": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "Summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "Few-shot": ("trec", "triviaqa", "samsum", "lsht"),
    "Synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "Code": ("lcc", "repobench-p"),
}

# Tasks whose prediction is cut to its first line before scoring (eval.py).
FIRST_LINE_TASKS: tuple[str, ...] = ("trec", "triviaqa", "samsum", "lsht")

# Bucket names of LongBench-E, by the row's `length` field: < 4000, < 8000, else.
LONGBENCH_E_BUCKETS: tuple[str, ...] = ("0-4k", "4-8k", "8k+")

_TASK_TO_CATEGORY: dict[str, str] = {
    task: category for category, tasks in TASK_CATEGORIES.items() for task in tasks
}


def base_task_name(task: str) -> str:
    """`qasper_e` -> `qasper` for the LongBench-E names; other names unchanged."""
    if task.endswith("_e") and task[:-2] in _TASK_TO_CATEGORY:
        return task[:-2]
    return task


def task_category(task: str) -> str | None:
    """The LongBench category of a task (``_e`` names accepted); None if unknown."""
    return _TASK_TO_CATEGORY.get(base_task_name(task))


def average_scores(task_scores: Mapping[str, float]) -> dict:
    """Unweighted means of per-task scores, as papers report them.

    Returns ``{"average": mean over all given tasks, "n_tasks": count,
    "categories": {category: mean over its tasks present}}``; every mean is
    rounded to 2 decimals (task scores are already on the 0-100 scale). Categories
    with no task present are omitted (in TASK_CATEGORIES order); tasks with no
    known category count in "average" only. The official code prints no average:
    this is the papers' convention (unweighted over tasks, not over items).
    """
    if not task_scores:
        raise ValueError("average_scores: no task scores given")
    values = {}
    for task, score in task_scores.items():
        value = float(score)
        if math.isnan(value):
            raise ValueError(f"average_scores: score of {task!r} is NaN")
        values[task] = value

    categories: dict[str, float] = {}
    for category in TASK_CATEGORIES:
        present = [v for t, v in values.items() if task_category(t) == category]
        if present:
            categories[category] = round(sum(present) / len(present), 2)
    return {
        "average": round(sum(values.values()) / len(values), 2),
        "n_tasks": len(values),
        "categories": categories,
    }
