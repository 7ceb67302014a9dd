"""report.html sections, the table set and the paired reports of the tasks that compress while the model writes or reads
(harness/tasks/answer_tables.py through field_tables' builder: reasoning and long_answers; harness/tasks/perplexity/report.py),
and ZeroSCROLLS' section (field_tables). Reasoning, long_answers and perplexity from small real runs on the tiny random
model (both compression modes); ZeroSCROLLS from hand-written records. Expected values are computed here from the runs'
own records (results.json rows and summaries), never from the report code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import REPO, compose
from harness.report import build
from harness.report.html import page_data
from harness.results import collect

DECODE = "{name: snapkv, budget: 40, window_size: 8, decode_interval: 4}"
METHODS = f"methods=[full,{{name: snapkv, budget: 40, window_size: 8}},{DECODE}]"


def _execute(folder: Path, *overrides: str) -> None:
    from harness.app import execute

    execute(compose("model=tiny-random", "progress=false", *overrides), folder, overrides=list(overrides))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """gsm8k (6 fixture problems, 6 new tokens), long_answers (4 and 6 keys, 3 documents each), perplexity (one 160-token
    document, buckets of 64, full / window only / StreamingLLM), each in one methods list."""
    root = tmp_path_factory.mktemp("decoding")
    _execute(root / "gsm8k", "task=gsm8k", f"task.data_dir={REPO / 'tests' / 'fixtures' / 'gsm8k'}", "task.limit=6",
             "task.max_new_tokens=6", METHODS)
    _execute(root / "long_answers", "task=long_answers", "task.keys=[4,6]", "task.samples=3", "task.tokens_per_key=2", METHODS)
    _execute(root / "perplexity", "task=perplexity", "task.tokens=160", "task.bucket=64", "task.chunk_size=16",
             "methods=[full,{name: streamingllm, budget: 48, sink_tokens: 0, decode_interval: 1},"
             "{name: streamingllm, budget: 48, sink_tokens: 4, decode_interval: 1}]")
    return root


def _records(folder: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.rglob("results.json"))}


def _mean(values):
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _section(data: dict, sid: str) -> dict:
    return next(s for s in data["sections"] if s["id"] == sid)


def _own_tables(section: dict, prefix: str) -> list[dict]:
    return [b for b in section["blocks"] if b["kind"] == "table" and b["id"].startswith(prefix)]


@pytest.mark.parametrize("task, sid, key", [("gsm8k", "reasoning", lambda r: r["index"]),
                                            ("long_answers", "long_answers", lambda r: (r["keys"], r["sample"]))])
def test_answer_sections_accuracy_length_time_memory_and_paired_difference(runs, task, sid, key):
    folder = runs / task
    collected, _ = collect(folder)
    data, _ = page_data(collected, folder, resamples=200)
    section = _section(data, sid)
    recs = _records(folder)
    assert len(recs) == 3
    run_id = {r["rel"]: r["id"] for r in data["overview"]["runs"]}
    tag_of = {run_id[rel]: Path(rel).name for rel in run_id}
    (table,) = _own_tables(section, f"{sid}-")
    columns = [c["name"] for c in table["columns"]]
    full = {key(r): r for r in recs["full"]["rows"]}
    modes = set()
    for row in table["rows"]:
        tag = tag_of[row["run"]]
        rows, cells = recs[tag]["rows"], dict(zip(columns, row["cells"]))
        assert cells["All items"] == round(100 * _mean(r["score"] for r in rows), 1)
        assert cells["New tokens"] == round(_mean(r["new_tokens"] for r in rows), 1)
        assert cells["Decode s"] == round(_mean(r["decode_seconds"] for r in rows), 2)
        assert cells["Peak cache MiB"] == round(_mean(r["peak_cache_bytes"] for r in rows) / 2**20, 2)
        decoding = recs[tag]["method"].get("decode") is not None
        modes.add(cells["Compression"])
        assert cells["Compression"] == ("none (full cache)" if tag == "full" else "prefill + decode-time" if decoding else "prefill only")
        assert ("+ decode every 4 to" in cells["Setting"]) == decoding  # the two modes' labels differ
        if tag == "full":
            assert cells["Δ vs full"] is None
            continue
        diffs = [100 * (r["score"] - full[key(r)]["score"]) for r in rows]
        assert cells["Δ vs full"] == round(_mean(diffs), 2) and cells["n"] == len(diffs) == 6
        assert cells["CI low"] <= cells["Δ vs full"] <= cells["CI high"]
    assert len(modes) == 3
    if task == "long_answers":  # one column per number of keys
        assert columns[1:3] == ["4 keys", "6 keys"]
        row = next(r for r in table["rows"] if tag_of[r["run"]] == "full")
        assert row["cells"][1] == round(100 * _mean(r["score"] for r in recs["full"]["rows"] if r["keys"] == 4), 1)
    (chart,) = [b for b in section["blocks"] if b["kind"] == "chart"]
    assert len(chart["series"]) == 2 and all(p["x"] == 40 for s in chart["series"] for p in s["points"])  # one line per mode
    assert [h["y"] for h in chart["hlines"]] == [round(100 * _mean(r["score"] for r in recs["full"]["rows"]), 1)]
    # every item with each setting's response and the reference; reasoning: the problem and the answer the scorer read
    items = {k: v for k, v in data["items"].items() if f"|{task}|" in k}
    assert len(items) == 6
    for item in items.values():
        assert sorted(tag_of[s["run"]] for s in item["settings"]) == sorted(recs)
    if task == "long_answers":  # the reference: the document's pairs, one `key: value` line each, as the task scores them
        from harness.tasks.long_answers.task import parse_pairs

        first = recs["full"]["rows"][0]
        item = next(v for v in items.values() if v["title"].endswith(f"{first['keys']} keys · sample {first['sample']}"))
        assert item["reference"] == first["reference"] and len(parse_pairs(item["reference"])) == first["keys"]
    if task == "gsm8k":
        first = recs["full"]["rows"][0]
        item = next(v for v in items.values() if v["title"].endswith(f"problem 0 ({first['id']})"))
        assert item["reference"] == first["reference"] and item["context"][0]["text"] == first["problem"]
        answer = next(s for s in item["settings"] if tag_of[s["run"]] == "full")
        assert answer["response"] == f"[answer read: {first['pred']} · {'correct' if first['correct'] else 'wrong'}]\n{first['response']}"
    assert any(b.get("id") == "paired" for b in section["blocks"])  # PAIRING: the paired-differences table


def test_answer_tables_and_paired_deltas(runs, tmp_path):
    for task, name in (("gsm8k", "reasoning"), ("long_answers", "long_answers")):
        build(runs / task, tmp_path / task, resamples=200)
        text = (tmp_path / task / f"{name}.md").read_text(encoding="utf-8")
        for tag, rec in _records(runs / task).items():
            assert f"| {tag} |" in text
            assert f"| {100 * _mean(r['score'] for r in rec['rows']):.1f} |" in text
        paired = (tmp_path / task / "paired_deltas.csv").read_text(encoding="utf-8")
        assert paired.count("\n") - 1 == (2 if task == "gsm8k" else 2 * 3)  # two settings; long_answers: 4 keys, 6 keys, average
        runs_csv = (tmp_path / task / "runs.csv").read_text(encoding="utf-8")
        assert "no table" not in runs_csv


def test_perplexity_curve_and_table_are_the_runs_summaries(runs, tmp_path):
    folder = runs / "perplexity"
    collected, _ = collect(folder)
    data, _ = page_data(collected, folder, resamples=200)
    section = _section(data, "perplexity")
    recs = _records(folder)
    run_id = {r["rel"]: r["id"] for r in data["overview"]["runs"]}
    tag_of = {run_id[rel]: Path(rel).name for rel in run_id}
    (chart,) = [b for b in section["blocks"] if b["kind"] == "chart"]
    assert len(chart["series"]) == 3  # one line per setting, full included
    for series in chart["series"]:
        summary = recs[tag_of[series["points"][0]["run"]]]["summary"]
        assert [(p["x"], p["y"]) for p in series["points"]] == [(int(k), v) for k, v in summary["by_position"].items()]
        assert [p["x"] for p in series["points"]] == [1, 65, 129]
    nll = chart["variants"]["mean NLL (nats)"]["series"]
    for series in nll:
        summary = recs[tag_of[series["points"][0]["run"]]]["summary"]
        assert [p["y"] for p in series["points"]] == [round(math.log(v), 4) for v in summary["by_position"].values()]
    (table,) = _own_tables(section, "perplexity-")
    columns = [c["name"] for c in table["columns"]]
    for row in table["rows"]:
        s, cells = recs[tag_of[row["run"]]]["summary"], dict(zip(columns, row["cells"]))
        assert cells["Perplexity"] == s["perplexity"] and cells["from 65"] == s["by_position"]["65"]
        assert cells["After first compression"] == s["perplexity_after_first_compression"]
        if "against_full" in s:
            vs = s["against_full"]
            assert cells["Ratio to full"] == vs["ppl_ratio"] and cells["CI low"] == round(math.exp(vs["low"]), 4)
            assert cells["Units"] == vs["units"] == 3
        else:
            assert tag_of[row["run"]] == "full" and cells["Ratio to full"] is None
    build(folder, tmp_path, resamples=200, html=True)
    text = (tmp_path / "perplexity.md").read_text(encoding="utf-8")
    for tag, rec in recs.items():
        s = rec["summary"]
        assert f"| {tag} | {s['tokens_scored']} | {s['perplexity']:.3f} |" in text
        assert f"| {tag} | " + " | ".join(f"{v:.2f}" for v in s["by_position"].values()) + " |" in text
    assert (tmp_path / "report.html").is_file()


def _zeroscrolls(folder: Path, rel: str, method: dict, scores: dict[str, list]) -> None:
    rows = [{"task": t, "index": i, "id": f"{t}-{i}", "prediction": f"answer {i}", "references": [f"ref {i}", "other"], "score": s,
             "protocol": "query_aware"} for t, values in scores.items() for i, s in enumerate(values)]
    data = {"task": "zeroscrolls", "model": {"name": "m"}, "method": method, "method_tag": rel, "status": "complete",
            "summary": {"protocol": "query_aware"}, "rows": rows, "provenance": {"device": "cpu"},
            "config": {"task": {"name": "zeroscrolls", "query_aware": True}, "model": {"name": "m"}, "seed": 0}}
    (folder / rel).mkdir(parents=True)
    (folder / rel / "results.json").write_text(json.dumps(data))


def test_zeroscrolls_section(tmp_path):
    snap = {"name": "snapkv", "budget": 128, "window_size": 32, "kernel_size": 7, "pooling": "maxpool"}
    _zeroscrolls(tmp_path, "full", {"name": "full"}, {"qasper": [0.5, 1.0, 0.25, 0.75, 1.0], "quality": [1, 1, 0, 1, 1]})
    _zeroscrolls(tmp_path, "snapkv", snap, {"qasper": [0.25, 1.0, 0.0, 0.75, 0.5], "quality": [1, 0, 0, 1, 1]})
    collected, _ = collect(tmp_path)
    data, board = page_data(collected, tmp_path, resamples=200)
    section = _section(data, "zeroscrolls")
    (table,) = _own_tables(section, "zeroscrolls-")
    columns = [c["name"] for c in table["columns"]]
    assert columns[1:3] == ["Qspr", "QALT"]
    cells = dict(zip(columns, next(r["cells"] for r in table["rows"] if r["cells"][0].startswith("SnapKV"))))
    # by hand: qasper 2.5/5 = 50, quality 3/5 = 60, all 5.5/10 = 55; minus full ((3.5 + 4) / 10 = 75): -20 over 10 items
    assert (cells["Qspr"], cells["QALT"], cells["All items"], cells["Δ vs full"], cells["n"]) == (50.0, 60.0, 55.0, -20.0, 10)
    item = next(v for k, v in data["items"].items() if "|zeroscrolls|" in k and v["title"].endswith("Qspr · item 1"))
    assert item["reference"] == "ref 1 | other" and {s["response"] for s in item["settings"]} == {"answer 1"}
    assert {b["dataset"] for b in board} == {"zeroscrolls"}


def test_decoding_page_in_headless_chromium(runs, tmp_path):
    """The three sections draw without a console error; the perplexity chart switches to its NLL variant; a reasoning
    setting's row lists its problems and a problem opens with the problem text and every setting's response."""
    from harness.report.browser import console_errors, missing, open_page, start

    if missing():
        pytest.skip(missing())
    build(runs, tmp_path, resamples=200, html=True)
    problem = _records(runs / "gsm8k")["full"]["rows"][0]["problem"]
    driver = start()
    try:
        open_page(driver, tmp_path / "report.html")
        assert console_errors(driver) == []
        run = driver.execute_script
        assert run("return document.querySelectorAll('#perplexity polyline.series').length") == 3
        run("const s = document.querySelector('#perplexity select.variant'); s.value = 'mean NLL (nats)';"
            "s.dispatchEvent(new Event('change'))")
        assert run("return document.querySelectorAll('#perplexity polyline.series').length") == 3
        assert run("return document.querySelectorAll('#reasoning polyline.series, #long_answers polyline.series').length") >= 2
        run("document.querySelector('#reasoning table.sortable tbody tr.clickable').click()")
        assert run("return document.getElementById('drawer').classList.contains('hidden')") is False
        run("document.querySelector('#drawer a[data-item]').click()")
        assert run("return document.querySelectorAll('#drawer table.items tbody tr').length") == 3
        assert problem.strip()[:40] in run("return document.querySelector('#drawer .context pre').textContent")
        assert console_errors(driver) == []
    finally:
        driver.quit()
