"""report.html and the paired reports for the field benchmarks (harness/tasks/field_tables.py html_section and pairing,
declared by longbench_v2, infinitebench and scbench report.py). SCBench from a real tiny-random run on its fixture (both
modes, three settings); LongBench-v2 and InfiniteBench from hand-written records (both protocols: the reuse gap).
Expected values are computed here from the records, never from the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, compose
from harness.report import build
from harness.report.html import page_data
from harness.results import collect

FIXTURES = REPO / "tests" / "fixtures" / "scbench"
METHODS = "methods=[full,{name: snapkv, budget: 32, window_size: 4},{name: snapkv, budget: 64, window_size: 4}]"


@pytest.fixture(scope="module")
def scbench_runs(tmp_path_factory, one_thread):
    """One SCBench run (qa_eng, kv, summary_with_needles), answers cut to 3 tokens to stay fast."""
    from harness.app import execute
    from harness.tasks import contract

    real = contract.generate_settings
    contract.generate_settings = lambda loaded, methods, prompt, **kw: real(loaded, methods, prompt, **{**kw, "max_new_tokens": 3})
    try:
        root = tmp_path_factory.mktemp("scb")
        args = ["task=scbench", "model=tiny-random", f"task.data_dir={FIXTURES}", "progress=false", METHODS,
                "task.tasks=[scbench_qa_eng,scbench_kv,scbench_summary_with_needles]"]
        execute(compose(*args), root / "runs", overrides=args)
    finally:
        contract.generate_settings = real
    return root / "runs"


def _records(folder: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.rglob("results.json"))}


def test_scbench_section_charts_tables_and_items(scbench_runs):
    runs, _ = collect(scbench_runs)
    data, board = page_data(runs, scbench_runs, resamples=200)
    section = next(s for s in data["sections"] if s["id"] == "scbench")
    recs = _records(scbench_runs)
    run_id = {r["rel"]: r["id"] for r in data["overview"]["runs"]}
    tag_of = {run_id[rel]: Path(rel).name for rel in run_id}
    charts = [b for b in section["blocks"] if b["kind"] == "chart"]
    tables = [b for b in section["blocks"] if b["kind"] == "table" and b["id"].startswith("scbench-")]
    # charts: multi-request, multi-turn; tables: those and multi-turn per turn (its chart would repeat multi-turn's)
    assert len(charts) == 2 and len(tables) == 3
    paired = [b for b in section["blocks"] if b["kind"] == "table" and not b["id"].startswith("scbench-")]
    assert paired and any("multi-request · scbench_kv" in str(r["cells"]) for r in paired[0]["rows"])  # the PAIRING table
    assert any("multi-request" in t["title"] and "reuse" in t["title"] for t in tables)

    def mean(tag, mode, pick=lambda r: True):
        values = [100 * r["score"] for r in recs[tag]["rows"] if r["mode"] == mode and pick(r)]
        return round(sum(values) / len(values), 2)

    for chart, mode in zip(charts, ("multi_request", "multi_turn")):
        (line,) = chart["series"]
        assert [p["x"] for p in line["points"]] == [32, 64]
        for p in line["points"]:
            assert p["y"] == mean(tag_of[p["run"]], mode)
        assert [h["y"] for h in chart["hlines"]] == [mean("full", mode)]
    request = tables[0]
    columns = [c["name"] for c in request["columns"]]
    assert "scbench_summary_with_needles/passkey" in columns and "scbench_summary_with_needles/summary" in columns
    full_rows = {(r["task"], r["index"], r["turn_idx"]): r for r in recs["full"]["rows"] if r["mode"] == "multi_request"}
    for row in request["rows"]:
        tag = tag_of[row["run"]]
        cells = dict(zip(columns, row["cells"]))
        assert cells["scbench_kv"] == mean(tag, "multi_request", lambda r: r["task"] == "scbench_kv")
        assert cells["All items"] == mean(tag, "multi_request")
        if tag == "full":
            assert cells["Δ vs full"] is None
            continue
        diffs = [100 * (r["score"] - full_rows[(r["task"], r["index"], r["turn_idx"])]["score"])
                 for r in recs[tag]["rows"] if r["mode"] == "multi_request"]
        assert cells["Δ vs full"] == round(sum(diffs) / len(diffs), 2) and cells["n"] == len(diffs) == 6
        assert cells["CI low"] <= cells["Δ vs full"] <= cells["CI high"]
    per_turn = tables[2]
    assert [c["name"] for c in per_turn["columns"]][1:3] == ["turn 1", "turn 2"]
    for row in per_turn["rows"]:
        assert row["cells"][1] == mean(tag_of[row["run"]], "multi_turn", lambda r: r["turn_idx"] == 0)
    # every turn of every mode is an item holding the three settings' answers and scores
    items = {k: v for k, v in data["items"].items() if "|scbench|" in k}
    assert len(items) == 2 * 6
    for item in items.values():
        assert sorted(tag_of[s["run"]] for s in item["settings"]) == sorted(recs)
    kv_cells = request["colItems"][str(columns.index("scbench_kv"))]
    assert len(kv_cells) == 2 and all(data["items"][k]["reference"] for k in kv_cells)
    assert {b["dataset"] for b in board} == {"scbench"} and len(board) == 3 * 3


def test_scbench_paired_deltas_per_mode_and_task(scbench_runs, tmp_path):
    build(scbench_runs, tmp_path, resamples=200, html=True)
    text = (tmp_path / "paired_deltas.md").read_text(encoding="utf-8")
    assert "multi-request · scbench_kv" in text and "multi-turn · scbench_summary_with_needles/passkey" in text
    assert (tmp_path / "report.html").is_file()


def _write(folder: Path, rel: str, task: str, method: dict, protocol: str, rows: list[dict]) -> None:
    data = {"task": task, "model": {"name": "m"}, "method": method, "method_tag": rel.split("/")[-1], "status": "complete",
            "summary": {"protocol": protocol}, "rows": [{**r, "protocol": protocol} for r in rows], "provenance": {"device": "cpu"},
            "config": {"task": {"name": task, "query_aware": protocol == "query_aware"}, "model": {"name": "m"}, "seed": 0}}
    path = folder / rel / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _lb2(scores):
    """LongBench-v2 records: items 0-3 easy/short, 4-7 hard/long; None = an output pred.py leaves out."""
    return [{"index": i, "_id": f"id{i}", "difficulty": "easy" if i < 4 else "hard", "length": "short" if i < 4 else "long",
             "answer": "B", "response": "The correct answer is (B)", "score": s} for i, s in enumerate(scores)]


def test_longbench_v2_and_infinitebench_sections_and_reuse_gap(tmp_path):
    snap = {"name": "snapkv", "budget": 128, "window_size": 32, "kernel_size": 7, "pooling": "maxpool"}
    for protocol, short in (("query_aware", "qa"), ("query_agnostic", "qg")):
        _write(tmp_path, f"{short}/lb2/full", "longbench_v2", {"name": "full"}, protocol, _lb2([1, 1, 0, 1, 1, 0, 1, None]))
        snap_lb = [1, 0, 0, 1, 1, 0, 0, None] if protocol == "query_aware" else [0, 0, 0, 1, 0, 0, 0, None]
        _write(tmp_path, f"{short}/lb2/snapkv", "longbench_v2", snap, protocol, _lb2(snap_lb))
        ib = lambda s: [{"task": t, "index": i, "prediction": "x", "ground_truth": ["x"], "score": s[k][i]}  # noqa: E731
                        for k, t in enumerate(("passkey", "kv_retrieval")) for i in range(4)]
        _write(tmp_path, f"{short}/ib/full", "infinitebench", {"name": "full"}, protocol, ib([[1, 1, 1, 1], [1, 0, 1, 1]]))
        _write(tmp_path, f"{short}/ib/snapkv", "infinitebench", snap, protocol, ib([[1, 1, 0, 1], [0, 0, 1, 0]]))
    runs, _ = collect(tmp_path)
    data, _ = page_data(runs, tmp_path, resamples=200)
    lb2 = next(s for s in data["sections"] if s["id"] == "longbench_v2")
    tables = [b for b in lb2["blocks"] if b["kind"] == "table" and b["id"].startswith("longbench_v2-")]
    assert len(tables) == 2  # one per protocol
    aware = next(t for t in tables if "query_aware" in t["title"])
    cols = [c["name"] for c in aware["columns"]]
    row = dict(zip(cols, next(r["cells"] for r in aware["rows"] if r["cells"][0].startswith("SnapKV"))))
    # by hand: snapkv 3 of 7 counted = 42.9, easy 2/4 = 50, hard 1/3 = 33.3; minus full (5/7): -2/7 = -28.6
    assert (row["Overall"], row["Easy"], row["Hard"], row["All items"]) == (42.9, 50.0, 33.3, 42.9)
    assert row["Δ vs full"] == -28.57 and row["n"] == 7
    ib = next(s for s in data["sections"] if s["id"] == "infinitebench")
    table = next(b for b in ib["blocks"] if b["kind"] == "table" and b["id"].startswith("infinitebench-"))
    cells = dict(zip([c["name"] for c in table["columns"]], next(r["cells"] for r in table["rows"] if r["cells"][0].startswith("SnapKV"))))
    assert cells["All items"] == 50.0 and cells["Δ vs full"] == -37.5 and cells["n"] == 8
    chart = next(b for b in ib["blocks"] if b["kind"] == "chart")
    assert chart["series"][0]["points"][0]["x"] == 128 and chart["hlines"][0]["y"] == 87.5
    # the reuse gap (aware - agnostic) now pairs the field benchmarks: LongBench-v2 3/7 - 1/7 = +28.57
    build(tmp_path, tmp_path / "tables", resamples=200)
    gap = (tmp_path / "tables" / "reuse_gap.csv").read_text(encoding="utf-8")
    rows = [line.split(",") for line in gap.splitlines()[1:]]
    (lb2_gap,) = [r for r in rows if r[1] == "Overall" and r[0].startswith("snapkv")]
    assert lb2_gap[2].startswith("28.57") and lb2_gap[5] == "7"
    # InfiniteBench: a gap per task (README name) and the mean over tasks
    assert {r[1] for r in rows if r[0].startswith("snapkv")} >= {"Overall", "average"}


def test_scbench_page_in_headless_chromium(scbench_runs, tmp_path):
    """The field section draws without a console error; a table cell lists its column's items; an item opens with
    every setting's answer."""
    from harness.report.browser import console_errors, missing, open_page, start

    if missing():
        pytest.skip(missing())
    build(scbench_runs, tmp_path, resamples=200, html=True)
    driver = start()
    try:
        open_page(driver, tmp_path / "report.html")
        assert console_errors(driver) == []
        run = driver.execute_script
        assert run("return document.querySelectorAll('#scbench polyline.series').length") == 2  # SnapKV in each chart
        run("document.querySelector('#scbench table.sortable tbody tr td.cellitems').click()")
        assert run("return document.getElementById('drawer').classList.contains('hidden')") is False
        run("document.querySelector('#drawer a[data-item]').click()")
        assert run("return document.querySelectorAll('#drawer table.items tbody tr').length") == 3
        assert console_errors(driver) == []
    finally:
        driver.quit()
