"""report.html and the kvpress leaderboard export (harness/report/html.py), from a small real run made here: the
tiny random model on a needle grid, three settings (full, SnapKV and StreamingLLM at two budgets), both
protocols, prompts logged. Expected values come from the runs' own records (results.json rows and summaries),
never from the report. The browser test opens the page in headless Chromium (skipped, with the reason, where
Chromium, chromedriver or selenium is missing)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from conftest import compose
from harness.report import build
from harness.report.browser import missing
from harness.page_blocks import excerpt
from harness.report.html import LEADERBOARD, PAGE

METHODS = "methods=[full,{name: snapkv, budget: 64},{name: snapkv, budget: 128},{name: streamingllm, budget: 64}]"


def _haystack(folder: Path) -> str:
    from harness.tasks.needle import task as needle

    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(p.read_text(encoding="utf-8") for p in needle.haystack_files(compose().task)[:4])[:12000]
    (folder / "essays.txt").write_text(text, encoding="utf-8")
    return f"task.haystack_dir={folder}"


@pytest.fixture(scope="module")
def report(tmp_path_factory, one_thread):
    """Runs (both protocols) and the table set built from them with --html and --format kvpress."""
    from harness.app import execute

    root = tmp_path_factory.mktemp("html")
    haystack = _haystack(root / "haystack")
    for aware in ("true", "false"):
        cfg = compose("model=tiny-random", METHODS, "task.lengths=[256,320]", "task.depths=[10,50,90]", "task.log_prompts=true",
                      "task.max_new_tokens=6", f"task.query_aware={aware}", haystack, "progress=false")
        execute(cfg, root / "runs" / f"needle_{aware}")
    out = root / "tables"
    build(root / "runs", out, resamples=200, html=True, kvpress=True)
    return root / "runs", out


def _runs(folder: Path) -> dict[str, dict]:
    return {str(p.parent.relative_to(folder)): json.loads(p.read_text()) for p in sorted(folder.rglob("results.json"))}


def _page_data(out: Path) -> dict:
    text = (out / PAGE).read_text(encoding="utf-8")
    match = re.search(r'<script id="data" type="application/json">(.*?)</script>', text, re.S)
    return json.loads(match.group(1).replace("<\\/", "</"))


def test_page_is_one_offline_file(report):
    _, out = report
    text = (out / PAGE).read_text(encoding="utf-8")
    assert "<script src" not in text and "<link" not in text and "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in text


def test_needle_section_holds_every_run_and_item(report):
    runs_dir, out = report
    runs = _runs(runs_dir)
    data = _page_data(out)
    assert [r["rel"] for r in data["overview"]["runs"]] == sorted(runs)
    section = next(s for s in data["sections"] if s["id"] == "needle")
    chart = next(b for b in section["blocks"] if b["kind"] == "chart")
    # one line per method and protocol; each point the run's own mean score; full as a line per protocol
    by_run = {r["id"]: r["rel"] for r in data["overview"]["runs"]}
    lines = {(s["line"], s["protocol"]): s for s in chart["series"]}
    assert set(lines) == {(m, p) for m in ("snapkv_w32_k7_maxpool_expand", "streamingllm_s4_mean")
                          for p in ("query_aware", "query_agnostic")}
    assert [p["x"] for p in lines[("snapkv_w32_k7_maxpool_expand", "query_aware")]["points"]] == [64, 128]
    for s in chart["series"]:
        for p in s["points"]:
            assert p["y"] == pytest.approx(runs[by_run[p["run"]]]["summary"]["mean_score"], abs=1e-4)
            assert p["lo"] <= p["y"] <= p["hi"]  # 6 cells: a 95% band
    assert sorted(h["protocol"] for h in chart["hlines"]) == ["query_agnostic", "query_aware"]
    maps = next(b for b in section["blocks"] if b["kind"] == "heatmaps")["maps"]
    assert len(maps) == len(runs) and all(len(m["cells"]) == 6 for m in maps)
    # every cell is one item holding all 8 settings (4 per protocol) with response, score, per-layer retention
    keys = {k for m in maps for c in m["cells"] for k in c["keys"]}
    assert len(keys) == 6
    needle = compose().task.needle.strip()
    for key in keys:
        item = data["items"][key]
        assert len(item["settings"]) == 8
        window = next(w for w in item["context"] if w["marks"])
        a, b = window["marks"][0]
        assert window["text"][a:b] == needle
        for s in item["settings"]:
            rel = by_run[s["run"]]
            length, depth = map(float, re.search(r"\|(\d+)\|([\d.]+)\|0$", key).groups())
            rec = next(r for r in runs[rel]["rows"] if r["length"] == length and r["depth"] == depth)
            assert s["response"] == rec["response"] and s["score"] == pytest.approx(rec["score"], abs=1e-4)
            if runs[rel]["method"]["name"] != "full":
                assert s["kept"]["needle"] == [round(100 * v) for v in rec["needle_kept_by_layer"]]


def test_paired_table_and_reuse_gap_match_the_records(report):
    runs_dir, out = report
    runs = _runs(runs_dir)
    data = _page_data(out)
    by_run = {r["id"]: r["rel"] for r in data["overview"]["runs"]}
    section = next(s for s in data["sections"] if s["id"] == "needle")
    table = next(b for b in section["blocks"] if b["kind"] == "table")
    for row in table["rows"]:
        rel = by_run[row["run"]]
        full = str(Path(rel).parent / "full")
        mine = {(r["length"], r["depth"]): r["score"] for r in runs[rel]["rows"]}
        theirs = {(r["length"], r["depth"]): r["score"] for r in runs[full]["rows"]}
        assert row["cells"][4] == pytest.approx(sum(mine[k] - theirs[k] for k in mine) / len(mine), abs=1e-3)
    reuse = next(s for s in data["sections"] if s["id"] == "reuse")
    gaps = next(b for b in reuse["blocks"] if b["kind"] == "table")["rows"]
    assert len(gaps) == 4  # every setting ran under both protocols


def test_kvpress_leaderboard_columns_and_values(report):
    runs_dir, out = report
    runs = _runs(runs_dir)
    rows = list(csv.DictReader((out / LEADERBOARD).open()))
    assert list(rows[0])[:5] == ["dataset", "model", "method", "compression_ratio", "score"] or \
        list(rows[0])[:6] == ["dataset", "data_dir", "model", "method", "compression_ratio", "score"]
    assert {"protocol", "ci_low", "ci_high", "reuse_gap"} <= set(rows[0])
    assert len(rows) == len(runs)
    for row in rows:
        data = runs[row["run"]]
        assert row["dataset"] == "needle" and row["protocol"] == data["summary"]["protocol"]
        assert float(row["score"]) == pytest.approx(100 * data["summary"]["mean_score"], abs=1e-2)
        other = runs[re.sub(r"^needle_(true|false)", lambda m: "needle_" + ("false" if m.group(1) == "true" else "true"), row["run"])]
        aware, agnostic = (data, other) if row["protocol"] == "query_aware" else (other, data)
        key = lambda r: (r["length"], r["depth"])  # noqa: E731
        gap = [a["score"] - b["score"] for a, b in zip(sorted(aware["rows"], key=key), sorted(agnostic["rows"], key=key))]
        assert float(row["reuse_gap"]) == pytest.approx(sum(gap) / len(gap), abs=1e-3)
        if data["method"]["name"] == "full":
            assert row["method"] == "no_press" and float(row["compression_ratio"]) == 0.0
            continue
        end = "prompt_tokens" if data["summary"]["protocol"] == "query_aware" else "question_start"
        kept = [r["budget_tokens"] / r[end] for r in data["rows"]]
        assert float(row["compression_ratio"]) == pytest.approx(1 - sum(kept) / len(kept), abs=1e-3)


def test_plan_rows_are_drawn_with_the_gpu_line(tmp_path):
    from harness.report.html import page_data
    from harness.results import collect

    plan = tmp_path / "plan" / "lwm"
    plan.mkdir(parents=True)
    rows = [{"setting": s, "length": n, "batch_size": 1, "peak_bytes": b, "peak_phase": "prefill", "fits": b < 80 * 2**30}
            for s, pts in (("full", ((16384, 23.7e9), (131072, 95.2e9))), ("snapkv_c1024", ((16384, 15.65e9), (131072, 27.0e9))))
            for n, b in pts]
    (plan / "plan_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (plan / "results.json").write_text(json.dumps({"task": "plan", "config": {"task": {"gpu_memory_gb": 80}}}))
    runs, _ = collect(tmp_path)
    data, _ = page_data(runs, tmp_path)
    section = next(s for s in data["sections"] if s["id"] == "memory-plan")
    chart = next(b for b in section["blocks"] if b["kind"] == "chart")
    assert chart["gpu"] == 80
    assert {s["line"]: [p["y"] for p in s["points"]] for s in chart["series"]} == {
        "full · batch 1": [round(23.7e9 / 2**30, 3), round(95.2e9 / 2**30, 3)],
        "snapkv_c1024 · batch 1": [round(15.65e9 / 2**30, 3), round(27.0e9 / 2**30, 3)]}
    build(tmp_path, tmp_path / "tables")  # the plan task's own table in the table set: plan.md|csv
    table = list(csv.DictReader((tmp_path / "tables" / "plan.csv").open()))
    assert sorted((r["run"], r["setting"], int(r["length"]), float(r["peak_gib"]), r["fits"]) for r in table) == sorted(
        ("plan/lwm", r["setting"], r["length"], round(r["peak_bytes"] / 2**30, 3), str(r["fits"])) for r in rows)
    assert "## Memory plans" in (tmp_path / "tables" / "README.md").read_text()


def test_excerpt_windows_mark_each_answer_and_keep_the_question():
    prompt = "a" * 2000 + "NEEDLE" + "b" * 3000 + "ANSWER2" + "c" * 1000 + "Question?"
    windows = excerpt(prompt, ["NEEDLE", "ANSWER2", "absent"])
    assert [w["text"][a:b] for w in windows for a, b in w["marks"]] == ["NEEDLE", "ANSWER2"]
    assert windows[-1]["text"].endswith("Question?") and all(w["of"] == len(prompt) for w in windows)
    assert sum(len(w["text"]) for w in windows) < len(prompt)


# ------------------------------------------------------------------------------------------ in a browser

@pytest.mark.skipif(missing() is not None, reason=f"no headless browser: {missing()}")
def test_page_in_headless_chromium(report):
    from harness.report.browser import console_errors, open_page, start

    _, out = report
    driver = start()
    try:
        open_page(driver, out / PAGE)
        assert console_errors(driver) == []
        run = driver.execute_script
        # the chart is drawn: a line per method and protocol, with points
        lines = run("return [...document.querySelectorAll('#needle polyline.series')].map(p => [p.dataset.line, p.getAttribute('points')])")
        assert len(lines) == 4 and all(len(p.split()) >= 1 for _, p in lines)
        # the legend hides a method's lines and its band, and shows them again
        run("document.querySelector('#needle .lg[data-line=\"snapkv_w32_k7_maxpool_expand\"] input').click()")
        shown = run("return [...document.querySelectorAll('#needle polyline.series')].map(p => p.dataset.line)")
        assert shown == ["streamingllm_s4_mean", "streamingllm_s4_mean"]
        run("document.querySelector('#needle .lg[data-line=\"snapkv_w32_k7_maxpool_expand\"] input').click()")
        assert run("return document.querySelectorAll('#needle polyline.series').length") == 4
        # a heatmap cell opens its item: the prompt with the needle marked, every setting's response and retention
        run("document.querySelector('#needle .heat .cell').dispatchEvent(new MouseEvent('click', {bubbles: true}))")
        assert run("return document.getElementById('drawer').classList.contains('hidden')") is False
        assert run("return document.querySelector('#drawer mark').textContent") == compose().task.needle.strip()
        assert run("return document.querySelectorAll('#drawer table.items tbody tr').length") == 8
        assert run("return document.querySelectorAll('#drawer table.items svg.bars').length") >= 6  # compressed settings
        # sorting the paired table and clicking a row lists that run's items
        run("document.querySelector('#needle table.sortable th:nth-child(5)').click()")
        deltas = run("return [...document.querySelectorAll('#needle table.sortable tbody tr td:nth-child(5)')].map(t => t.textContent)")
        assert [float(d) for d in deltas] == sorted(float(d) for d in deltas)
        run("document.querySelector('#needle table.sortable tbody tr').click()")
        assert run("return document.querySelectorAll('#drawer a[data-item]').length") == 6
        assert console_errors(driver) == []
    finally:
        driver.quit()


def test_ruler_section_from_hand_written_runs(tmp_path):
    """RULER: the chart at kvpress's compression ratio (full at 0 starts each line), one variant per task, the per-task
    table with the paired difference (by hand: niah_single_1 -40, vt 0, average -20), each task column's samples."""
    from test_report_ruler import _write

    from harness.results import collect
    from harness.report.html import page_data

    full = {"niah_single_1": [100.0] * 5, "vt": [100.0, 80.0, 60.0, 100.0, 100.0]}
    snap = {"niah_single_1": [100.0, 0.0, 100.0, 100.0, 0.0], "vt": [100.0, 80.0, 60.0, 100.0, 100.0]}
    _write(tmp_path, "agn/full", {"name": "full"}, "full", "query_agnostic", full)
    _write(tmp_path, "agn/snapkv", {"name": "snapkv", "ratio": 0.25, "window_size": 32, "kernel_size": 7, "pooling": "maxpool"},
           "snapkv_r0.25", "query_agnostic", snap, budget=975)
    runs, _ = collect(tmp_path)
    data, board = page_data(runs, tmp_path, resamples=200)
    section = next(s for s in data["sections"] if s["id"] == "ruler")
    chart = next(b for b in section["blocks"] if b["kind"] == "chart")
    (line,) = chart["series"]
    assert line["line"] == "snapkv" and [(p["x"], p["y"]) for p in line["points"]] == [(0.0, 94.0), (0.75, 74.0)]
    assert [h["y"] for h in chart["hlines"]] == [94.0]  # full: (100 + 88) / 2
    vt = chart["variants"]["vt (VT)"]["series"][0]["points"]
    assert [p["y"] for p in vt] == [88.0, 88.0]
    table = next(b for b in section["blocks"] if b["kind"] == "table")
    snap_row = next(r["cells"] for r in table["rows"] if r["cells"][0].startswith("SnapKV"))
    assert snap_row[:6] == ["SnapKV ratio 0.25 (W32 k7 maxpool)", "query-agnostic", 0.75, 60.0, 88.0, 74.0]
    assert snap_row[6] == -20.0 and snap_row[7] <= -20.0 <= snap_row[8] and snap_row[9] == 10
    assert [len(table["colItems"][c]) for c in ("3", "4")] == [5, 5]
    # samples generated here (no task.source): not kvpress's `ruler` data, said in the leaderboard's dataset column
    assert {b["dataset"] for b in board} == {"ruler_harness"} and sorted(b["compression_ratio"] for b in board) == [0.0, 0.75]
