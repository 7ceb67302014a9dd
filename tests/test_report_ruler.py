"""The RULER section of the report: tables per model/protocol/length, paired differences to `full` computed
by hand here, the score-vs-compression-ratio picture, and protocols never merged."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from harness.report import build

TASK_CFG = {"name": "ruler", "tasks": ["niah_single_1", "vt"], "lengths": [4096], "samples": 5, "seed": 42, "template": "model"}


def _write(folder: Path, rel: str, method: dict, tag: str, protocol: str, scores: dict[str, list[float]],
           budget: int | None = None) -> None:
    rows = []
    for task, values in scores.items():
        for i, v in enumerate(values):
            rows.append({"task": task, "length": 4096, "index": i, "score": v, "references": ["x"], "response": "",
                         "protocol": protocol, "prompt_tokens": 4000, "question_start": 3900,
                         **({"budget_tokens": budget} if budget is not None else {})})
    # task scores as RULER computes them: mean of the sample scores (here whole-sample hits), averaged over tasks
    tasks = {t: round(sum(v) / len(v), 2) for t, v in scores.items()}
    data = {"task": "ruler", "model": {"name": "m"}, "method": method, "method_tag": tag, "status": "complete",
            "summary": {"protocol": protocol, "main_score": round(sum(tasks.values()) / 2, 2),
                        "by_length": {"4096": {"tasks": tasks, "average": round(sum(tasks.values()) / 2, 2), "complete": True}}},
            "rows": rows, "provenance": {"device": "cpu"},
            "config": {"task": {**TASK_CFG, "query_aware": protocol == "query_aware"}, "model": {"name": "m"}, "seed": 0}}
    path = folder / rel / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_ruler_table_paired_deltas_and_picture(tmp_path):
    runs = tmp_path / "runs"
    full = {"niah_single_1": [100.0] * 5, "vt": [100.0, 80.0, 60.0, 100.0, 100.0]}
    snap = {"niah_single_1": [100.0, 0.0, 100.0, 100.0, 0.0], "vt": [100.0, 80.0, 60.0, 100.0, 100.0]}
    _write(runs, "agn/full", {"name": "full"}, "full", "query_agnostic", full)
    _write(runs, "agn/snapkv", {"name": "snapkv", "ratio": 0.25, "window_size": 32, "kernel_size": 7, "pooling": "maxpool"},
           "snapkv_r0.25", "query_agnostic", snap, budget=975)
    # KVzip: one budget over every layer and head, no per-head budget in its records; ratio 0.5 kept -> 0.5 removed
    _write(runs, "agn/kvzip", {"name": "kvzip", "ratio": 0.5, "budget": None}, "kvzip_r0.5", "query_agnostic", full)
    # a query-aware run: never paired with the query-agnostic full run
    _write(runs, "aware/snapkv", {"name": "snapkv", "ratio": 0.25, "window_size": 32, "kernel_size": 7, "pooling": "maxpool"},
           "snapkv_r0.25", "query_aware", snap, budget=1000)
    out = tmp_path / "report"
    written = build(runs, out, resamples=200)
    assert "ruler.md" in written["sections"]
    md = (out / "ruler.md").read_text()
    # by hand: niah_single_1 deltas (0, -100, 0, 0, -100) -> -40; vt deltas all 0 -> 0; average (-40 + 0) / 2 = -20
    assert "-20.00 [" in md
    paired = list(csv.DictReader((out / "ruler_paired.csv").open()))
    got = {r["task"]: float(r["delta"]) for r in paired if r["setting"] == "agn/snapkv"}
    assert got == {"niah_single_1": -40.0, "vt": 0.0, "average": -20.0}
    assert not [r for r in paired if r["setting"] == "aware/snapkv"]
    table = {r["run"]: r for r in csv.DictReader((out / "ruler.csv").open())}
    # removed: query-agnostic compresses the 3900-token context, 975 kept -> 1 - 975/3900 = 0.75;
    # query-aware compresses all 4000 tokens, 1000 kept -> 0.75; full removes nothing
    assert float(table["agn/snapkv"]["removed"]) == 0.75 and float(table["aware/snapkv"]["removed"]) == 0.75
    assert float(table["agn/full"]["removed"]) == 0.0 and float(table["agn/kvzip"]["removed"]) == 0.5
    # task columns and the average: (60 + 88) / 2 = 74 for snapkv; (100 + 88) / 2 = 94 for full
    assert float(table["agn/snapkv"]["average"]) == 74.0 and float(table["agn/full"]["average"]) == 94.0
    assert float(table["agn/snapkv"]["vt"]) == 88.0
    # one table (and one picture) per model, protocol and length: the protocols are separate
    assert "### m · 4096 tokens · query_agnostic" in md and "### m · 4096 tokens · query_aware" in md
    assert (out / "ruler" / "m_query_agnostic_4096.png").stat().st_size > 0
    assert (out / "ruler" / "m_query_aware_4096.png").stat().st_size > 0
    runs_csv = {r["run"]: r for r in csv.DictReader((out / "runs.csv").open())}
    assert "ruler" in runs_csv["agn/full"]["tables"]


def test_no_ruler_runs_no_section(tmp_path):
    (tmp_path / "runs").mkdir()
    written = build(tmp_path / "runs", tmp_path / "out", resamples=10)
    assert "ruler.md" not in written["sections"] and not (tmp_path / "out" / "ruler.md").exists()


def test_leaderboard_rows_carry_the_reuse_gap_for_generated_samples(tmp_path):
    """RULER declares PAIRING: a setting run under both protocols gets its reuse gap in leaderboard_kvpress.csv (the mean
    over tasks of the mean per-sample aware - agnostic difference, by hand here: niah_single_1 +40, vt 0 -> +20), and the
    dataset column says the samples were generated here (ruler_harness), not kvpress's `ruler`."""
    from harness.report.html import LEADERBOARD

    runs = tmp_path / "runs"
    aware = {"niah_single_1": [100.0] * 5, "vt": [100.0, 80.0, 60.0, 100.0, 100.0]}
    agnostic = {"niah_single_1": [100.0, 0.0, 100.0, 100.0, 0.0], "vt": [100.0, 80.0, 60.0, 100.0, 100.0]}
    snap = {"name": "snapkv", "ratio": 0.25, "window_size": 32, "kernel_size": 7, "pooling": "maxpool"}
    _write(runs, "aware/snapkv", snap, "snapkv_r0.25", "query_aware", aware, budget=1000)
    _write(runs, "agn/snapkv", snap, "snapkv_r0.25", "query_agnostic", agnostic, budget=975)
    out = tmp_path / "report"
    build(runs, out, resamples=200, kvpress=True)
    rows = list(csv.DictReader((out / LEADERBOARD).open()))
    assert len(rows) == 2 and {r["dataset"] for r in rows} == {"ruler_harness"} and {r["data_dir"] for r in rows} == {"4096"}
    for r in rows:
        assert float(r["reuse_gap"]) == 20.0 and float(r["reuse_gap_low"]) <= 20.0 <= float(r["reuse_gap_high"])
    gap = list(csv.DictReader((out / "reuse_gap.csv").open()))
    assert {(g["task"], float(g["delta"])) for g in gap} == {("niah_single_1", 40.0), ("vt", 0.0), ("average", 20.0)}
