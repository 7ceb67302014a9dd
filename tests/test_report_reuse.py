"""The reuse gap section of `python -m harness.report` (harness/report/reuse.py), from run folders written here."""

from __future__ import annotations

import csv
import json
import random

import pytest

from harness.report import build
from harness.report.reuse import CSV_FIELDS

CELLS = [(n, d) for n in (2048, 4096) for d in (0.0, 50.0, 100.0)]
K = 3


def method(name: str, budget: int | None) -> dict:
    return {"name": name} if budget is None else {"name": name, "budget": budget, "window_size": 32, "gqa": "expand"}


def write_run(folder, rel: str, *, name: str, budget: int | None, query_aware: bool, scores: dict, keep_answers: bool = False,
              lengths=(2048, 4096), model: str = "smollm2-135m"):
    task = {"name": "needle", "lengths": list(lengths), "depths": [0, 50, 100], "needles": K, "query_aware": query_aware,
            "keep_answers": keep_answers}
    rows = [{"length": n, "depth": d, "question_index": q, "score": s} for (n, d, q), s in scores.items()]
    protocol = "query_aware" if query_aware else "query_agnostic"
    data = {"task": "needle", "model": {"name": model}, "method": method(name, budget),
            "method_tag": name if budget is None else f"{name}_c{budget}", "rows": rows,
            "summary": {"protocol": protocol, "keep_answers": keep_answers, "mean_score": 0.5},
            "config": {"task": task, "model": {"name": model}, "seed": 0}}
    path = folder / rel
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps(data))


def scores(seed: int, base: float) -> dict:
    rng = random.Random(seed)
    return {(n, d, q): min(1.0, max(0.0, base + rng.choice([-0.3, 0.0, 0.2]))) for n, d in CELLS for q in range(K)}


@pytest.fixture
def folder(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs, "aware/snapkv", name="snapkv", budget=64, query_aware=True, scores=scores(1, 0.8))
    write_run(runs, "agnostic/snapkv", name="snapkv", budget=64, query_aware=False, scores=scores(2, 0.1))
    write_run(runs, "aware/streamingllm", name="streamingllm", budget=64, query_aware=True, scores=scores(3, 0.3))
    agn = scores(4, 0.3)
    del agn[(4096, 100.0, 2)]  # one question unfinished: paired over the rest
    write_run(runs, "agnostic/streamingllm", name="streamingllm", budget=64, query_aware=False, scores=agn)
    write_run(runs, "multiturn/snapkv", name="snapkv", budget=64, query_aware=False, keep_answers=True, scores=scores(5, 0.4))
    # not pairable: another budget (no aware run), another grid
    write_run(runs, "agnostic/snapkv_128", name="snapkv", budget=128, query_aware=False, scores=scores(6, 0.5))
    write_run(runs, "aware_short/streamingllm", name="streamingllm", budget=64, query_aware=True, scores=scores(7, 0.9),
              lengths=(1024,))
    return tmp_path


def test_gap_per_setting_paired_by_item_and_question(folder):
    runs = folder / "runs"
    written = build(runs, folder / "out", resamples=500)
    out = folder / "out"
    assert "reuse_gap.md" in written["sections"]
    rows = list(csv.DictReader((out / "reuse_gap.csv").open()))
    assert list(rows[0])[:6] == ["setting", "task", "delta", "ci_low", "ci_high", "n"] and list(rows[0]) == CSV_FIELDS
    got = {(r["setting"], r["turns"]): r for r in rows}
    assert set(got) == {("snapkv_c64", "independent"), ("snapkv_c64", "multi-turn"), ("streamingllm_c64", "independent")}

    def load(rel):
        return {(r["length"], r["depth"], r["question_index"]): r["score"]
                for r in json.loads((runs / rel / "results.json").read_text())["rows"]}

    for (setting, turns), aware, agnostic in [(("snapkv_c64", "independent"), "aware/snapkv", "agnostic/snapkv"),
                                              (("snapkv_c64", "multi-turn"), "aware/snapkv", "multiturn/snapkv"),
                                              (("streamingllm_c64", "independent"), "aware/streamingllm", "agnostic/streamingllm")]:
        a, b = load(aware), load(agnostic)
        keys = [k for k in a if k in b]
        diffs = [a[k] - b[k] for k in keys]
        row = got[(setting, turns)]
        assert row["task"] == "needle" and int(row["n"]) == len(keys)
        assert float(row["delta"]) == pytest.approx(sum(diffs) / len(diffs), abs=1e-6)
        assert float(row["ci_low"]) <= float(row["delta"]) <= float(row["ci_high"])
        assert float(row["aware_score"]) - float(row["agnostic_score"]) == pytest.approx(float(row["delta"]), abs=1e-5)
        assert (row["aware_run"], row["agnostic_run"]) == (aware, agnostic)
    assert int(got[("streamingllm_c64", "independent")]["n"]) == len(CELLS) * K - 1
    assert float(got[("snapkv_c64", "independent")]["ci_low"]) > 0  # aware 0.8 vs agnostic 0.1: a real gap
    md = (out / "reuse_gap.md").read_text()
    assert "multi-turn" in md and "reuse_gap/smollm2-135m__needle.png" in md
    assert (out / "reuse_gap" / "smollm2-135m__needle.png").stat().st_size > 0
    assert "reuse_gap.md" in (out / "README.md").read_text() or "Reuse gap" in (out / "README.md").read_text()
    runs_csv = {r["run"]: r["tables"] for r in csv.DictReader((out / "runs.csv").open())}
    assert "reuse_gap" in runs_csv["agnostic/snapkv"] and "reuse_gap" not in runs_csv["agnostic/snapkv_128"]
    assert "reuse_gap" not in runs_csv["aware_short/streamingllm"]


def test_one_needle_runs_pair_on_question_zero_and_rebuild_is_clean(folder):
    runs = folder / "single"
    one = {(n, d, 0): 1.0 for n, d in CELLS}
    for rel, aware, score in (("a/full", True, 1.0), ("b/full", False, 0.5)):
        write_run(runs, rel, name="full", budget=None, query_aware=aware, scores={k: score for k in one})
        data = json.loads((runs / rel / "results.json").read_text())
        for r in data["rows"]:
            del r["question_index"]  # today's one-needle records
        (runs / rel / "results.json").write_text(json.dumps(data))
    out = folder / "out2"
    build(runs, out, resamples=200)
    rows = list(csv.DictReader((out / "reuse_gap.csv").open()))
    assert [(r["setting"], float(r["delta"]), int(r["n"])) for r in rows] == [("full", 0.5, len(CELLS))]
    (runs / "b").rename(folder / "moved")  # no pair left: the rebuilt table set holds no stale gap files
    build(runs, out, resamples=200)
    assert not (out / "reuse_gap.csv").exists() and not (out / "reuse_gap").exists()


def write_longbench(folder, rel: str, *, query_aware: bool, per_task: dict):
    path = folder / rel
    (path / "pred").mkdir(parents=True)
    summary = {"status": "complete", "protocol": "query_aware" if query_aware else "query_agnostic", "tasks": list(per_task),
               "scores": {t: round(100 * sum(s) / len(s), 2) for t, s in per_task.items()},
               "items": {t: len(s) for t, s in per_task.items()}}
    data = {"task": "longbench", "model": {"name": "m"}, "method": method("snapkv", 64), "method_tag": "snapkv_c64",
            "summary": summary, "config": {"task": {"name": "longbench", "query_aware": query_aware}, "model": {"name": "m"}}}
    (path / "results.json").write_text(json.dumps(data))
    for t, s in per_task.items():
        lines = [json.dumps({"index": i, "_id": f"{t}{i}", "pred": "x", "answers": ["x"], "score": v}) for i, v in enumerate(s)]
        (path / "pred" / f"{t}.jsonl").write_text("\n".join(lines) + "\n")


def test_longbench_items_give_per_task_gaps_and_the_average(tmp_path):
    runs = tmp_path / "runs"
    aware = {"qasper": [1.0, 0.5, 0.0, 1.0], "hotpotqa": [0.5, 0.5, 1.0]}
    agnostic = {"qasper": [0.0, 0.5, 0.0, 0.0], "hotpotqa": [0.0, 0.5, 0.5]}
    write_longbench(runs, "aware/run", query_aware=True, per_task=aware)
    write_longbench(runs, "agnostic/run", query_aware=False, per_task=agnostic)
    build(runs, tmp_path / "out", resamples=300)
    rows = {r["task"]: r for r in csv.DictReader((tmp_path / "out" / "reuse_gap.csv").open())}
    means = {}
    for t in aware:
        diffs = [100 * (a - b) for a, b in zip(aware[t], agnostic[t])]
        means[t] = sum(diffs) / len(diffs)
        assert float(rows[t]["delta"]) == pytest.approx(means[t]) and int(rows[t]["n"]) == len(diffs)
    assert set(rows) == {"qasper", "hotpotqa", "average"}
    assert float(rows["average"]["delta"]) == pytest.approx(sum(means.values()) / 2) and int(rows["average"]["n"]) == 7


def test_a_run_recorded_before_an_option_existed_pairs_at_that_options_old_default():
    """KVzip's template_prefix was added after runs were recorded without it: such a run ran `if_present` and must
    pair with a newer run that records it; a run of the other rule (`always`) must not."""
    from types import SimpleNamespace

    from harness.report.reuse import method_description

    old = {"name": "kvzip", "budget": 1024, "ratio": None, "n_sink": 4, "chunk_size": 2048, "layerwise": False}
    new = {**old, "template_prefix": "if_present"}
    other = {**old, "template_prefix": "always"}
    run = lambda method: SimpleNamespace(data={"method": method})  # noqa: E731
    assert method_description(run(old)) == method_description(run(new)) == {**new, "sink_rule": "always"}  # both added since
    assert method_description(run(other)) != method_description(run(old))
    snap = {"name": "snapkv", "budget": 512}
    assert method_description(run(snap)) == snap  # no option added since: as recorded
