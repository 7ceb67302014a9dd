"""`python -m harness.report`: tables from synthetic results.json files shaped as the tasks write them
(LongBench: harness/app.py + tasks/longbench.py; needle: app.py + tasks/needle.py; bench: tasks/bench.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.report import build
from harness.report.claims import PAPER_CLAIMS
from harness.tables import method_setting
from harness.tasks.longbench.report import PAPER_TABLE, load_paper_table, paper_average
from harness.tasks.needle.report import length_bucket
from metrics.longbench_tasks import LONGBENCH_EN_TASKS

REPO = Path(__file__).resolve().parents[1]
PAPER = load_paper_table()

SNAPKV_PAPER = {"name": "snapkv", "budget": 1024, "window_size": 32, "kernel_size": 7, "pooling": "maxpool", "gqa": "expand",
                "layer_budgets": [1024] * 32}
H2O_4096 = {"name": "h2o", "budget": 4096, "window_size": 8, "block_size": 512, "gqa": "expand"}
FULL = {"name": "full"}


def longbench_results(model: str, method: dict, scores: dict[str, float], *, chat_format="none", guard=True, backend="difflib",
                      limit=None, random_weights=False, path=None, tag=None, status="complete") -> dict:
    tasks = list(scores)
    all16 = tasks == list(LONGBENCH_EN_TASKS)
    summary = {
        "benchmark": "LongBench", "status": status, "tasks": tasks, "scores": scores,
        "average": round(sum(scores.values()) / len(scores), 2) if scores else None, "n_tasks": len(scores),
        "all_16_en_tasks": all16, "limit": limit, "code_sim_backend": backend, "total_items": 200 * len(scores),
        "rules": {"chat_format": chat_format, "min_new_tokens_all_tasks": guard, "data_source": "hub:THUDM/LongBench/data.zip",
                  "truncation": {"mode": "middle", "budget_tokens": 31500}},
    }
    if status != "complete":
        summary = {"benchmark": "LongBench", "status": status, "message": "shard 0/2 done", "tasks": tasks, "rules": summary["rules"]}
    return {
        "schema": 1, "task": "longbench", "status": status,
        "model": {"name": model, "source": "hub", "random_weights": random_weights, "location": path, "chat_format": chat_format},
        "method": method, "method_tag": tag or method["name"], "summary": summary, "failures": 0, "failed_items": [],
        "rows": [], "config": {"model": {"name": model, "random_weights": random_weights, "path": path}, "task": {"name": "longbench"}},
        "provenance": {"device": "cuda:0", "cuda": "NVIDIA H100 80GB HBM3"},
    }


def write(folder: Path, rel: str, data: dict) -> Path:
    d = folder / rel
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps(data), encoding="utf-8")
    return d


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_paper_data_files():
    assert PAPER_TABLE.exists() and PAPER_CLAIMS.exists() and (PAPER_TABLE.parent / "SOURCE.md").exists()
    assert len(PAPER) == 20
    # the unweighted 16-task means quoted in shared/reference/snapkv.md
    assert paper_average(PAPER[("Mistral-7B-Instruct-v0.2", "All KV")]) == 42.56
    assert paper_average(PAPER[("Mistral-7B-Instruct-v0.2", "SnapKV 1024")]) == 41.45
    assert paper_average(PAPER[("Mistral-7B-Instruct-v0.2", "H2O 4096")]) == 40.45
    ids = {r["id"] for r in read_csv(PAPER_CLAIMS)}
    assert {"decode_speedup_16k", "max_length_ratio", "needle_max_length", "needle_full_oom"} <= ids


def test_method_setting_labels_and_paper_match():
    assert method_setting(FULL) == ("All KV", "All KV")
    assert method_setting(SNAPKV_PAPER) == ("SnapKV 1024", "SnapKV 1024")
    assert method_setting(H2O_4096) == ("H2O 4096 (W8)", "H2O 4096")  # the paper does not state its window
    label, paper = method_setting({**SNAPKV_PAPER, "window_size": 8})  # PyramidKV's setup: another setting
    assert paper is None and label == "SnapKV 1024 (W8 k7 maxpool)"
    assert method_setting({**SNAPKV_PAPER, "gqa": "mean"})[1] is None
    assert method_setting({**SNAPKV_PAPER, "budget": [512, 1024]})[1] is None


def test_longbench_table_paper_columns_and_deltas(tmp_path):
    runs = tmp_path / "runs"
    mistral_full = {t: v + 1.0 for t, v in PAPER[("Mistral-7B-Instruct-v0.2", "All KV")].items()}
    write(runs, "lb/mistral/full", longbench_results("mistral-7b-instruct-v0.2", FULL, mistral_full, tag="full"))
    snap = dict(PAPER[("Mistral-7B-Instruct-v0.2", "SnapKV 1024")])
    snap["qasper"] -= 2.0
    write(runs, "lb/mistral/snapkv", longbench_results("mistral-7b-instruct-v0.2", SNAPKV_PAPER, snap, tag="snapkv_c1024_w32"))
    # matched by the hub path's basename, not our config name
    lwm = dict(PAPER[("LWM-Text-Chat-1M", "H2O 4096")])
    write(runs, "lb/lwm/h2o", longbench_results("my-lwm", H2O_4096, lwm, chat_format="inst", path="LargeWorldModel/LWM-Text-Chat-1M",
                                                tag="h2o_c4096_w8"))
    # not the paper's settings / data: no paper number, or no delta
    write(runs, "lb/mistral/snapkv_w8", longbench_results("mistral-7b-instruct-v0.2", {**SNAPKV_PAPER, "window_size": 8}, snap,
                                                          tag="snapkv_c1024_w8"))
    write(runs, "lb/mistral/full_limit", longbench_results("mistral-7b-instruct-v0.2", FULL, mistral_full, limit=20, tag="full"))
    write(runs, "lb/lwm/random", longbench_results("lwm-text-chat-1m", FULL, mistral_full, random_weights=True, tag="full"))
    subset = {t: 10.0 for t in ("qasper", "hotpotqa")}
    write(runs, "lb/mistral/subset", longbench_results("mistral-7b-instruct-v0.2", FULL, subset, tag="full"))
    write(runs, "lb/mistral/unscored", longbench_results("mistral-7b-instruct-v0.2", FULL, {}, tag="full", status="incomplete"))

    out = tmp_path / "tables"
    written = build(runs, out)
    rows = read_csv(out / "longbench.csv")
    by_run = {r["run"]: r for r in rows}
    assert len(rows) == 7 and "lb/mistral/unscored" not in by_run

    full = by_run["lb/mistral/full"]
    assert full["setting"] == "All KV" and full["paper_model"] == "Mistral-7B-Instruct-v0.2"
    assert float(full["paper_avg"]) == 42.56 and float(full["avg"]) == 43.56 and float(full["delta_avg"]) == 1.0
    snap_row = by_run["lb/mistral/snapkv"]
    assert snap_row["setting"] == "SnapKV 1024" and float(snap_row["paper_avg"]) == 41.45
    assert float(snap_row["delta_avg"]) == pytest.approx(-0.12, abs=0.011)
    h2o = by_run["lb/lwm/h2o"]
    assert h2o["paper_model"] == "LWM-Text-Chat-1M" and h2o["paper_setting"] == "H2O 4096" and float(h2o["delta_avg"]) == 0.0

    assert by_run["lb/mistral/snapkv_w8"]["paper_avg"] == "" and by_run["lb/mistral/snapkv_w8"]["delta_avg"] == ""
    assert by_run["lb/mistral/snapkv_w8"]["setting"] == "SnapKV 1024 (W8 k7 maxpool)"
    assert by_run["lb/mistral/full_limit"]["paper_avg"] == "42.56" and by_run["lb/mistral/full_limit"]["delta_avg"] == ""
    assert "task.limit=20" in by_run["lb/mistral/full_limit"]["note"]
    assert by_run["lb/lwm/random"]["paper_model"] == "" and by_run["lb/lwm/random"]["paper_avg"] == ""
    assert by_run["lb/mistral/subset"]["delta_avg"] == "" and "2 task(s)" in by_run["lb/mistral/subset"]["note"]

    md = (out / "longbench.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| Model"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    # the paper's 16 columns in its order, then the average, the paper's and the delta
    task_cols = cols[cols.index("NrtvQA"):cols.index("RB-P") + 1]
    assert task_cols == ["NrtvQA", "Qasper", "MF-en", "HotpotQA", "2WikiMQA", "Musique", "GovReport", "QMSum", "MultiNews",
                         "TREC", "TriviaQA", "SAMSum", "PCount", "PRe", "Lcc", "RB-P"]
    assert cols[-3:] == ["Avg.", "Paper Avg.", "Δ"]
    for rule in ("Chat", "1st-token guard", "code_sim", "GQA", "Limit", "Random weights"):  # limit and weights vary here
        assert rule in cols
    assert "| mistral-7b-instruct-v0.2 | All KV | query-aware | none | all tasks | difflib | - |" in md and "+1.00" in md

    vs = read_csv(out / "longbench_vs_paper.csv")
    snap_vs = next(r for r in vs if r["run"] == "lb/mistral/snapkv")
    assert float(snap_vs["qasper"]) == -2.0 and float(snap_vs["narrativeqa"]) == 0.0
    assert "longbench.md" in written["sections"] and "longbench_vs_paper.md" in written["sections"]

    runs_table = {r["run"]: r for r in read_csv(out / "runs.csv")}
    assert runs_table["lb/mistral/unscored"]["tables"] == "" and "not scored" in runs_table["lb/mistral/unscored"]["note"]


def test_longbench_rules_never_share_a_row(tmp_path):
    runs = tmp_path / "runs"
    scores = dict(PAPER[("Mistral-7B-Instruct-v0.2", "All KV")])
    write(runs, "a", longbench_results("mistral-7b-instruct-v0.2", FULL, scores, chat_format="none", tag="full"))
    write(runs, "b", longbench_results("mistral-7b-instruct-v0.2", FULL, scores, chat_format="inst", tag="full"))
    write(runs, "c", longbench_results("mistral-7b-instruct-v0.2", FULL, scores, guard=False, tag="full"))
    write(runs, "d", longbench_results("mistral-7b-instruct-v0.2", FULL, scores, backend="levenshtein", tag="full"))
    write(runs, "e", longbench_results("mistral-7b-instruct-v0.2", SNAPKV_PAPER, scores, tag="snapkv_expand"))
    write(runs, "f", longbench_results("mistral-7b-instruct-v0.2", {**SNAPKV_PAPER, "gqa": "mean"}, scores, tag="snapkv_mean"))
    write(runs, "g", longbench_results("mistral-7b-instruct-v0.2", FULL, scores, tag="full"))  # same key as "a"
    build(runs, tmp_path / "out")
    rows = {r["run"]: r for r in read_csv(tmp_path / "out" / "longbench.csv")}
    assert len(rows) == 7
    assert {rows[k]["chat_format"] for k in "ab"} == {"none", "inst"}
    assert rows["c"]["first_token_guard"] == "samsum only" and rows["a"]["first_token_guard"] == "all tasks"
    assert rows["d"]["code_sim"] == "levenshtein"
    assert (rows["e"]["gqa"], rows["f"]["gqa"]) == ("expand", "mean")
    assert rows["e"]["paper_setting"] == "SnapKV 1024" and rows["f"]["paper_setting"] == ""
    # identical keys are both kept and flagged, never merged
    assert "same key as another run" in rows["a"]["note"] and "same key as another run" in rows["g"]["note"]
    assert "same key" not in rows["b"]["note"]
    md = (tmp_path / "out" / "longbench.md").read_text()
    assert "| inst |" in md and "| samsum only |" in md and "| levenshtein |" in md and "| mean |" in md


def test_runs_table_says_which_dtype_computed(tmp_path):
    """runs.csv's dtype: the one the model computed in (model.dtype: auto resolved, in the results' model record),
    else the config's (records older than auto), else '?'."""
    runs = tmp_path / "runs"
    scores = dict(PAPER[("Mistral-7B-Instruct-v0.2", "All KV")])
    auto = longbench_results("mistral-7b-instruct-v0.2", FULL, scores, tag="full")
    auto["model"].update(dtype="bfloat16", dtype_rule="auto: bfloat16 (CUDA with bf16)")
    auto["config"]["model"].update(dtype="bfloat16", dtype_from="auto")
    named = longbench_results("mistral-7b-instruct-v0.2", FULL, scores, tag="full")
    named["config"]["model"]["dtype"] = "float32"
    write(runs, "auto", auto)
    write(runs, "named", named)
    write(runs, "unknown", longbench_results("mistral-7b-instruct-v0.2", FULL, scores, tag="full"))
    build(runs, tmp_path / "out")
    table = {r["run"]: r["dtype"] for r in read_csv(tmp_path / "out" / "runs.csv")}
    assert table == {"auto": "bfloat16", "named": "float32", "unknown": "?"}


def needle_results(model: str, method: dict, tag: str, cells: list[tuple[int, float, float, bool]], failed=()) -> dict:
    rows = [{"length": n, "depth": d, "score": s, "keyword_recall": s, "strict": ok, "rouge1_f": s, "response": "..."}
            for n, d, s, ok in cells]
    return {
        "schema": 1, "task": "needle", "status": "items_failed" if failed else "complete",
        "model": {"name": model, "random_weights": False, "chat_format": "inst"}, "method": method, "method_tag": tag,
        "summary": {"score_name": "keyword_recall", "mean_score": None, "cells": len(rows)},
        "failures": len(failed), "failed_items": [{"desc": "needle cells", "key": [n, d], "error": "OutOfMemoryError: CUDA", "oom": True}
                                                  for n, d in failed],
        "rows": rows, "config": {"task": {"name": "needle", "prompt_style": "chat"}, "model": {"name": model}},
        "provenance": {"device": "cuda:0", "cuda": "NVIDIA A100-SXM4-80GB"},
    }


def test_needle_summary_buckets_oom_and_heatmaps(tmp_path):
    runs = tmp_path / "runs"
    snap = {"name": "snapkv", "budget": 1024, "window_size": 16, "kernel_size": 5, "pooling": "maxpool", "gqa": "expand"}
    cells = [(1000, 0, 1.0, True), (1000, 50, 1.0, True), (9603, 0, 1.0, True), (9603, 50, 0.5, False),
             (164460, 0, 0.0, False), (164460, 50, 1.0, True)]
    write(runs, "needle/lwm/snapkv", needle_results("lwm-text-chat-1m", snap, "snapkv_c1024_w16_k5", cells))
    full_cells = [(1000, 0, 1.0, True), (1000, 50, 1.0, True), (9603, 0, 1.0, True), (9603, 50, 1.0, True)]
    d = write(runs, "needle/lwm/full", needle_results("lwm-text-chat-1m", FULL, "full", full_cells,
                                                       failed=[(35413, 0), (35413, 50), (44016, 0)]))
    (d / "needle_heatmap.png").write_bytes(b"\x89PNG fake")  # an existing heatmap is copied as is
    out = tmp_path / "tables"
    build(runs, out)
    rows = {r["run"]: r for r in read_csv(out / "needle.csv")}
    s = rows["needle/lwm/snapkv"]
    assert s["setting"] == "SnapKV 1024 (W16 k5 maxpool)" and s["cells"] == "6"
    assert float(s["bucket ≤1K"]) == 1.0 and float(s["bucket 8K-16K"]) == 0.75 and float(s["bucket 128K-256K"]) == 0.5
    assert float(s["mean_score"]) == pytest.approx(0.75) and float(s["strict_accuracy"]) == pytest.approx(4 / 6, abs=1e-4)
    assert s["longest_all_strict"] == "1000" and s["max_length_done"] == "164460"
    f = rows["needle/lwm/full"]
    assert f["failed_cells"] == "3" and f["first_oom_length"] == "35413" and f["longest_all_strict"] == "9603"
    assert f["bucket 128K-256K"] == ""
    heatmaps = sorted(p.name for p in (out / "needle").glob("*.png"))
    assert len(heatmaps) == 2
    assert (out / "needle" / Path(f["heatmap"]).name).read_bytes() == b"\x89PNG fake"
    assert (out / "needle" / Path(s["heatmap"]).name).read_bytes()[:4] == b"\x89PNG"  # re-rendered from the rows
    assert (out / "needle_by_length.png").exists()
    md = (out / "needle.md").read_text()
    assert "3 (35413, OOM)" in md and "8K-16K" in md
    claims = {r["id"]: r for r in read_csv(out / "claims.csv")}
    assert claims["needle_full_oom"]["ours"] == "first out-of-memory cell at 35413 tokens"
    assert claims["needle_full_oom"]["device"] == "NVIDIA A100-SXM4-80GB"
    assert claims["needle_max_length"]["ours"] == "longest prompt done 164460 tokens"  # the paper's needle preset
    assert claims["needle_retrieval"]["ours"].startswith("all depths correct up to 1000")
    assert length_bucket(1024) == (1024, "≤1K") and length_bucket(1025) == (2048, "1K-2K") and length_bucket(379538)[1] == "256K-512K"


def bench_results(model: str, batch: int, by_method: dict, methods: list[dict], search: dict | None = None, random_weights=True) -> dict:
    return {
        "schema": 1, "task": "bench", "model": {"name": model, "random_weights": random_weights}, "methods": methods,
        "summary": {"isolation": "none", "by_method": by_method}, "failures": 0, "rows": [], "search": search,
        "config": {"task": {"name": "bench", "batch_size": batch, "decode_tokens": 64}, "model": {"name": model}},
        "provenance": {"device": "cuda:0", "cuda": "NVIDIA H100 80GB HBM3", "isolation": "none"},
    }


def _m(decode, kv, peak, full=None):
    e = {"prefill_s": 1.0, "compress_s": 0.01, "decode_median_ms": decode, "decode_p90_ms": decode * 1.1, "kv_bytes": kv,
         "peak_increase_bytes": peak}
    if full:
        e.update(decode_vs_full=round(decode / full[0], 4), kv_full_over_this=round(full[1] / kv, 4), peak_vs_full=round(peak / full[2], 4))
    else:
        e.update(decode_vs_full=1.0, kv_full_over_this=1.0, peak_vs_full=1.0)
    return e


def test_efficiency_ratios_max_length_and_claims(tmp_path):
    runs = tmp_path / "runs"
    MB = 1024 * 1024
    methods = [{"label": "full", "name": "full"},
               {"label": "snapkv-c2048", "name": "snapkv", "budget": 2048, "window_size": 32, "kernel_size": 7, "pooling": "maxpool", "gqa": "expand"}]
    full8, full16 = (60.0, 4096 * MB, 5000 * MB), (108.0, 8192 * MB, 9000 * MB)
    by_method = {
        "full": {"8192": _m(*full8), "16384": _m(*full16)},
        "snapkv-c2048": {"8192": _m(30.0, 1024 * MB, 2500 * MB, full8), "16384": _m(30.0, 1024 * MB, 3000 * MB, full16)},
    }
    # the bench's bound fields (bench/task.add_bounds) as a run records them: 2 TB/s, 14 GB of bf16 weights
    by_method["full"]["16384"].update(dtype="bfloat16", decode_bound_ms=11.2, decode_vs_bound=9.6429, cache_cost_vs_bound=2.25)
    write(runs, "speed/lwm/decode_b2", bench_results("lwm-text-chat-1m", 2, by_method, methods))
    search = {"memory_cap_gb": 80.0, "upper": 1048576, "methods": {
        "full": {"max_length": 16384, "first_failure": 17408, "reached_upper": False, "vs_full": 1.0},
        "snapkv-c2048": {"max_length": 134144, "first_failure": 135168, "reached_upper": False, "vs_full": 8.1875}}}
    write(runs, "speed/lwm/maxlen", bench_results("lwm-text-chat-1m", 2, {}, methods, search))
    out = tmp_path / "tables"
    build(runs, out)
    rows = read_csv(out / "efficiency.csv")
    snap16 = next(r for r in rows if r["method"] == "snapkv-c2048" and r["length"] == "16384")
    assert float(snap16["decode_speedup_vs_full"]) == pytest.approx(3.6, abs=1e-3)
    assert float(snap16["kv_full_over_this"]) == 8.0 and float(snap16["kv_mb"]) == 1024.0
    assert float(snap16["peak_vs_full"]) == pytest.approx(3000 / 9000, abs=1e-4)
    assert snap16["device"] == "NVIDIA H100 80GB HBM3" and snap16["batch"] == "2" and snap16["setting"] == "SnapKV 2048"
    full16_row = next(r for r in rows if r["method"] == "full" and r["length"] == "16384")
    assert float(full16_row["decode_speedup_vs_full"]) == 1.0
    assert (full16_row["dtype"], full16_row["decode_bound_ms"], full16_row["decode_vs_bound"], full16_row["cache_cost_vs_bound"]) == \
        ("bfloat16", "11.2", "9.6429", "2.25")
    maxlen = read_csv(out / "max_length.csv")
    assert {r["method"]: r["max_length"] for r in maxlen} == {"full": "16384", "snapkv-c2048": "134144"}
    md = (out / "efficiency.md").read_text()
    assert "3.60x" in md and "8.19x" in md and "8.00x" in md
    assert "| bfloat16 |" in md and "9.64x" in md and "2.25x" in md and "× bound" in md
    claims = {r["id"]: r for r in read_csv(out / "claims.csv")}
    assert claims["decode_speedup_16k"]["ours"].startswith("3.60x (full 0.108 s/tok, SnapKV 0.030 s/tok)")
    assert claims["decode_speedup_16k"]["paper_ratio"] == "3.6"
    assert claims["max_length_ratio"]["ours"].startswith("8.19x (full 16384, SnapKV 134144")
    assert claims["needle_max_length"]["ours"] == "not measured"


def test_cli_writes_next_to_the_papers_files_without_touching_them(tmp_path):
    runs = tmp_path / "runs"
    write(runs, "lb/full", longbench_results("mistral-7b-instruct-v0.2", FULL, dict(PAPER[("Mistral-7B-Instruct-v0.2", "All KV")])))
    (runs / "broken").mkdir()
    (runs / "broken" / "results.json").write_text("{not json")
    target = tmp_path / "results" / "paper"
    target.mkdir(parents=True)
    keep = {name: f"reference {name}" for name in ("longbench_table1.csv", "paper_claims.csv", "SOURCE.md", "notes.txt")}
    for name, text in keep.items():
        (target / name).write_text(text)
    (target / "needle.md").write_text("stale table")  # from an earlier build: replaced
    cmd = [sys.executable, "-m", "harness.report", str(runs), "--name", "paper", "--out", str(tmp_path / "results")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 run(s)" in proc.stdout or "2 run(s)" in proc.stdout
    for name, text in keep.items():
        assert (target / name).read_text() == text
    assert not (target / "needle.md").exists()
    assert (target / "longbench.md").exists() and (target / "longbench.csv").exists() and (target / "README.md").exists()
    runs_table = {r["run"]: r for r in read_csv(target / "runs.csv")}
    assert runs_table["broken"]["note"].startswith("unreadable")
    readme = (target / "README.md").read_text()
    assert "## LongBench (SnapKV Table 1 layout)" in readme and "## The paper's efficiency and needle claims" in readme
    # a missing folder: one line, status 2
    proc = subprocess.run([sys.executable, "-m", "harness.report", str(tmp_path / "nope")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error:")


def test_report_does_not_import_torch(tmp_path):
    code = ("import sys; from harness.report import build; "
            f"build({str(tmp_path)!r}, {str(tmp_path / 'out')!r}); print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------ protocol and paired deltas
# The coming layout: outputs/<task>/<model>/<setting tag>/results.json, the settings of one "methods" run side by side.

from harness.stats import bootstrap_mean_ci, stratified_bootstrap_ci  # noqa: E402

MISTRAL = "mistral-7b-instruct-v0.2"


def lb_methods_run(folder: Path, rel: str, method: dict, tag: str, correct: dict[str, list[bool]], *, query_aware=None,
                   protocol=None, store_scores=False, shards=1, limit=None, recorded: dict | None = None) -> Path:
    """A scored LongBench run with its pred/<task>.jsonl: passage_retrieval_en / passage_count items scored 0 or 1 by
    the official metric (the prediction names the gold paragraph / count, or another one)."""
    d = folder / rel
    (d / "pred").mkdir(parents=True, exist_ok=True)
    scores, items = {}, {}
    for task, oks in correct.items():
        lines: dict[int, list[str]] = {}
        for i, ok in enumerate(oks):
            if task == "passage_retrieval_en":
                answer, pred = f"Paragraph {i % 5 + 1}", f"Paragraph {i % 5 + 1 if ok else i % 5 + 2}"
            else:
                answer, pred = str(i % 7 + 1), str(i % 7 + 1 if ok else i % 7 + 2)
            rec = {"index": i, "_id": f"{task}-{i}", "pred": pred, "answers": [answer], "all_classes": None, "length": 1000}
            if store_scores:
                rec["score"] = 1.0 if ok else 0.0
            lines.setdefault(i % shards, []).append(json.dumps(rec))
        for k, recs in lines.items():
            name = f"{task}.jsonl" if shards == 1 else f"{task}.shard{k}of{shards}.jsonl"
            (d / "pred" / name).write_text("\n".join(recs) + "\n" + '{"index": 0, "_id": "torn', encoding="utf-8")  # a torn last line
        scores[task] = round(100 * sum(oks) / len(oks), 2)
        items[task] = len(oks)
    scores.update(recorded or {})
    data = longbench_results(MISTRAL, method, scores, tag=tag, limit=limit)
    data["summary"].update(items=items, shards_merged=shards, total_items=sum(items.values()))
    if protocol:
        data["summary"]["protocol"] = protocol
    data["config"]["task"] = {"name": "longbench", "datasets": list(correct), "limit": limit, "code_sim_backend": "difflib",
                              "shard": {"index": 0, "count": shards}}
    if query_aware is not None:
        data["config"]["task"]["query_aware"] = query_aware
    (d / "results.json").write_text(json.dumps(data), encoding="utf-8")
    return d


def paired(out: Path) -> dict[tuple[str, str], dict]:
    rows = read_csv(out / "paired_deltas.csv")
    return {(r["setting"], r["task"]): r for r in rows}


def test_paired_deltas_longbench_methods_layout(tmp_path):
    outputs = tmp_path / "outputs"
    base = "longbench/" + MISTRAL
    n = 20
    full_ok = {"passage_retrieval_en": [True] * n, "passage_count": [i % 2 == 0 for i in range(n)]}
    # SnapKV: retrieval loses items 0-5; count identical to full (delta 0, CI [0, 0]: noise)
    snap_ok = {"passage_retrieval_en": [i >= 6 for i in range(n)], "passage_count": list(full_ok["passage_count"])}
    lb_methods_run(outputs, f"{base}/full", FULL, "full", full_ok, shards=2)             # sharded predictions, query_aware absent
    lb_methods_run(outputs, f"{base}/snapkv_c1024", SNAPKV_PAPER, "snapkv_c1024", snap_ok, query_aware=True, store_scores=True)
    # query-agnostic settings of the same methods run: paired with the query-agnostic full cache only
    agn_full = {"passage_retrieval_en": [i % 4 != 0 for i in range(n)], "passage_count": [True] * n}
    agn_snap = {"passage_retrieval_en": [False] * n, "passage_count": [True] * n}
    lb_methods_run(outputs, f"{base}/full_qagn", FULL, "full_qagn", agn_full, query_aware=False)
    lb_methods_run(outputs, f"{base}/snapkv_c1024_qagn", SNAPKV_PAPER, "snapkv_c1024_qagn", agn_snap, protocol="query_agnostic")
    # stored per-item scores on the wrong scale: recomputed from the predictions instead
    lb_methods_run(outputs, f"{base}/h2o_c4096", H2O_4096, "h2o_c4096", snap_ok, store_scores=True)
    p = outputs / base / "h2o_c4096" / "pred" / "passage_count.jsonl"
    recs = [json.loads(x) for x in p.read_text().splitlines()[:-1]]
    p.write_text("".join(json.dumps({**r, "score": 100 * r["score"]}) + "\n" for r in recs))
    # other task settings (a limit): never paired with the full run of all items
    lb_methods_run(outputs, f"{base}/snapkv_limit", SNAPKV_PAPER, "snapkv_limit", {k: v[:10] for k, v in snap_ok.items()}, limit=10)
    # a recorded task score its predictions do not reproduce: that task is left out, with a note
    lb_methods_run(outputs, f"{base}/streamingllm", {"name": "streamingllm", "budget": 1024, "sink_tokens": 4}, "streamingllm",
                   snap_ok, recorded={"passage_count": 12.34})

    out = tmp_path / "tables"
    written = build(outputs, out, resamples=2000, seed=0)
    assert "paired_deltas.md" in written["sections"]
    assert (out / "paired_deltas.csv").read_text().splitlines()[0] == "setting,task,delta,ci_low,ci_high,n"
    rows = paired(out)

    # SnapKV minus full, computed here from the item outcomes
    snap = f"{base}/snapkv_c1024"
    ret = [100.0 * (s - f) for s, f in zip(snap_ok["passage_retrieval_en"], full_ok["passage_retrieval_en"])]
    r = rows[(snap, "passage_retrieval_en")]
    assert float(r["delta"]) == pytest.approx(-30.0) and r["n"] == str(n)
    expected = bootstrap_mean_ci(ret, n_resamples=2000, seed=0)
    assert (float(r["ci_low"]), float(r["ci_high"])) == (pytest.approx(expected.low, abs=1e-6), pytest.approx(expected.high, abs=1e-6))
    assert float(r["ci_low"]) < -30.0 < float(r["ci_high"]) < 0
    c = rows[(snap, "passage_count")]
    assert (float(c["delta"]), float(c["ci_low"]), float(c["ci_high"]), c["n"]) == (0.0, 0.0, 0.0, str(n))
    avg = rows[(snap, "average")]
    assert float(avg["delta"]) == pytest.approx(-15.0) and avg["n"] == str(2 * n)
    exp_avg = stratified_bootstrap_ci([ret, [0.0] * n], n_resamples=2000, seed=0)
    assert float(avg["ci_low"]) == pytest.approx(exp_avg.low, abs=1e-6) and float(avg["ci_high"]) == pytest.approx(exp_avg.high, abs=1e-6)

    # query-agnostic SnapKV is paired with the query-agnostic full run, never the query-aware one
    agn = f"{base}/snapkv_c1024_qagn"
    assert float(rows[(agn, "passage_retrieval_en")]["delta"]) == pytest.approx(-75.0)
    assert float(rows[(agn, "passage_count")]["delta"]) == 0.0
    # H2O: recomputed scores equal the stored-score run's
    h2o = f"{base}/h2o_c4096"
    assert rows[(h2o, "passage_count")]["delta"] == rows[(snap, "passage_count")]["delta"]
    assert rows[(h2o, "passage_retrieval_en")]["ci_low"] == rows[(snap, "passage_retrieval_en")]["ci_low"]
    assert not any(k[0] == f"{base}/snapkv_limit" for k in rows)
    streaming = f"{base}/streamingllm"
    assert (streaming, "passage_retrieval_en") in rows and (streaming, "passage_count") not in rows
    assert rows[(streaming, "average")]["n"] == str(n)
    assert not any(k[0].endswith("/full") or k[0].endswith("/full_qagn") for k in rows)  # full is the reference, never a row

    md = (out / "paired_deltas.md").read_text()
    assert "| PRe | -30.00 |" in md and "~ noise" in md
    snap_count = next(line for line in md.splitlines() if f"`{snap}`" in line and "| PCount |" in line)
    snap_ret = next(line for line in md.splitlines() if f"`{snap}`" in line and "| PRe |" in line)
    assert "~ noise" in snap_count and "~ noise" not in snap_ret and f"`{base}/full`" in snap_ret
    agn_line = next(line for line in md.splitlines() if f"`{agn}`" in line and "| PRe |" in line)
    assert "query-agnostic" in agn_line and f"`{base}/full_qagn`" in agn_line
    assert "no full-cache run" in md and "snapkv_limit" in md
    assert "passage_count: per-item scores give" in md and "12.34" in md
    readme = (out / "README.md").read_text()
    assert "## Paired differences to the full cache" in readme

    # the LongBench table: every setting of the tree, the protocol as a column, query-agnostic rows never matched to the paper
    lb = {r["run"]: r for r in read_csv(out / "longbench.csv")}
    assert len(lb) == 7
    assert lb[f"{base}/full"]["protocol"] == "query_aware" and lb[f"{base}/full_qagn"]["protocol"] == "query_agnostic"
    assert lb[agn]["protocol"] == "query_agnostic" and lb[agn]["paper_setting"] == "" and lb[snap]["paper_setting"] == "SnapKV 1024"
    assert "same key" not in lb[agn]["note"] and "same key" not in lb[snap]["note"]
    md_lb = (out / "longbench.md").read_text()
    header = next(line for line in md_lb.splitlines() if line.startswith("| Model"))
    assert [c.strip() for c in header.strip("|").split("|")][:3] == ["Model", "Setting", "Protocol"]
    order = [line.split("|")[3].strip() for line in md_lb.splitlines() if line.startswith(f"| {MISTRAL}")]
    assert order == sorted(order, key=lambda p: p != "query-aware")  # query-aware rows first, then query-agnostic
    runs_table = {r["run"]: r for r in read_csv(out / "runs.csv")}
    assert "paired_deltas" in runs_table[snap]["tables"] and "paired_deltas" in runs_table[f"{base}/full"]["tables"]

    # deterministic: a rebuild gives the same file; another seed moves the intervals, not the deltas
    first = (out / "paired_deltas.csv").read_text()
    build(outputs, out, resamples=2000, seed=0)
    assert (out / "paired_deltas.csv").read_text() == first
    build(outputs, tmp_path / "other", resamples=2000, seed=1)
    other = paired(tmp_path / "other")
    assert other[(snap, "passage_retrieval_en")]["delta"] == rows[(snap, "passage_retrieval_en")]["delta"]


def test_paired_deltas_needle_cells_and_protocols(tmp_path):
    outputs = tmp_path / "outputs"
    snap = {"name": "snapkv", "budget": 1024, "window_size": 16, "kernel_size": 5, "pooling": "maxpool", "gqa": "expand"}
    grid = [(n, d) for n in (1000, 2000, 4000) for d in (0, 50, 100)]
    full_scores = {c: 1.0 for c in grid}
    snap_scores = {c: (0.5 if c[1] == 50 else 1.0) for c in grid}
    full_cells = [(n, d, full_scores[(n, d)], True) for n, d in grid if n < 4000]  # 4000: out of memory
    snap_cells = [(n, d, s, s == 1.0) for (n, d), s in snap_scores.items()]

    def needle(rel, method, tag, cells, failed=(), query_aware=None, lengths=(1000, 2000, 4000)):
        data = needle_results("lwm-text-chat-1m", method, tag, cells, failed=failed)
        data["config"]["task"].update(lengths=list(lengths), depths=[0, 50, 100])
        if query_aware is not None:
            data["config"]["task"]["query_aware"] = query_aware
        write(outputs, rel, data)

    needle("needle/lwm/full", FULL, "full", full_cells, failed=[(4000, 0), (4000, 50), (4000, 100)])
    needle("needle/lwm/snapkv", snap, "snapkv", snap_cells)
    needle("needle/lwm/snapkv_qagn", snap, "snapkv_qagn", snap_cells, query_aware=False)    # no query-agnostic full run
    needle("needle/lwm/snapkv_short", snap, "snapkv_short", snap_cells[:3], lengths=(1000,))  # another grid
    out = tmp_path / "tables"
    build(outputs, out, resamples=1000, seed=0)
    rows = paired(out)
    assert set(rows) == {("needle/lwm/snapkv", "needle")}
    r = rows[("needle/lwm/snapkv", "needle")]
    common = [c for c in grid if c[0] < 4000]
    diffs = [snap_scores[c] - full_scores[c] for c in common]
    assert r["n"] == "6" and float(r["delta"]) == pytest.approx(sum(diffs) / len(diffs), abs=1e-6)
    expected = bootstrap_mean_ci(diffs, n_resamples=1000, seed=0)
    assert float(r["ci_low"]) == pytest.approx(expected.low, abs=1e-6) and float(r["ci_high"]) == pytest.approx(expected.high, abs=1e-6)
    md = (out / "paired_deltas.md").read_text()
    assert "needle mean" in md and "snapkv_qagn" in md and "no full-cache run" in md

    needle_rows = {x["run"]: x for x in read_csv(out / "needle.csv")}
    assert needle_rows["needle/lwm/snapkv_qagn"]["protocol"] == "query_agnostic"
    assert needle_rows["needle/lwm/snapkv"]["protocol"] == "query_aware"
    assert "same key" not in needle_rows["needle/lwm/snapkv_qagn"]["note"]
    header = next(line for line in (out / "needle.md").read_text().splitlines() if line.startswith("| Model"))
    assert [c.strip() for c in header.strip("|").split("|")][:3] == ["Model", "Setting", "Protocol"]
    heatmaps = sorted(x.name for x in (out / "needle").glob("*.png"))
    assert len(heatmaps) == 4 and any("query_agnostic" in h for h in heatmaps)


def test_protocol_from_summary_then_config():
    from harness.report import run_protocol

    assert run_protocol({}) == "query_aware"
    assert run_protocol({"config": {"task": {"query_aware": True}}}) == "query_aware"
    assert run_protocol({"config": {"task": {"query_aware": False}}}) == "query_agnostic"
    assert run_protocol({"summary": {"protocol": "query_agnostic"}, "config": {"task": {}}}) == "query_agnostic"
    assert run_protocol({"summary": {"protocol": "query_aware"}, "config": {"task": {"query_aware": False}}}) == "query_aware"


def test_cli_paired_options(tmp_path):
    outputs = tmp_path / "outputs"
    ok = {"passage_count": [True, False, True, True]}
    lb_methods_run(outputs, "longbench/m/full", FULL, "full", ok)
    lb_methods_run(outputs, "longbench/m/snapkv", SNAPKV_PAPER, "snapkv", {"passage_count": [False] * 4})
    cmd = [sys.executable, "-m", "harness.report", str(outputs), "--out", str(tmp_path / "r"), "--resamples", "500", "--seed", "3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "paired_deltas.md" in proc.stdout
    rows = paired(tmp_path / "r" / "outputs")
    assert float(rows[("longbench/m/snapkv", "passage_count")]["delta"]) == -75.0
    assert "500 paired bootstrap resamples" in (tmp_path / "r" / "outputs" / "paired_deltas.md").read_text()
    bad = subprocess.run([*cmd[:-4], "--resamples", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error:")


def test_recomputed_item_scores_reproduce_the_official_scorer_on_every_task(tmp_path):
    """The recompute path (no stored `score`): official metric per item, all 16 English tasks of the fixture data,
    predictions of graded quality; the task score from metrics.longbench.scorer must be reproduced exactly."""
    from harness.tasks.longbench.report import longbench_items
    from harness.report import collect
    from metrics.longbench import scorer

    fixtures = REPO / "tests" / "fixtures" / "longbench"
    d = tmp_path / "runs" / "longbench" / "m" / "full"
    (d / "pred").mkdir(parents=True)
    scores, items = {}, {}
    for task in LONGBENCH_EN_TASKS:
        rows = [json.loads(line) for line in (fixtures / f"{task}.jsonl").read_text().splitlines() if line.strip()]
        recs = []
        for i, row in enumerate(rows):
            answer = row["answers"][0]
            pred = [answer, answer[: max(1, len(answer) // 2)] + " and more words", "nothing relevant here"][i % 3]
            recs.append({"index": i, "_id": row["_id"], "pred": "\n" + pred if task == "samsum" and i == 1 else pred,
                         "answers": row["answers"], "all_classes": row["all_classes"], "length": row["length"]})
        (d / "pred" / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        scores[task] = scorer(task, [r["pred"] for r in recs], [r["answers"] for r in recs], recs[-1]["all_classes"])
        items[task] = len(recs)
    data = longbench_results(MISTRAL, FULL, scores, tag="full")
    data["summary"].update(items=items, shards_merged=1)
    (d / "results.json").write_text(json.dumps(data))
    runs, _ = collect(tmp_path / "runs")
    per_item, notes = longbench_items(runs[0])
    assert notes == [] and set(per_item) == set(LONGBENCH_EN_TASKS)
    for task, by_item in per_item.items():
        assert len(by_item) == items[task]
        assert round(sum(by_item.values()) / len(by_item), 2) == pytest.approx(scores[task], abs=0.011)
    assert 0 < sum(scores.values()) / len(scores) < 100  # graded: neither all right nor all wrong


def test_paired_prefers_a_scored_sibling_full_run(tmp_path):
    outputs = tmp_path / "outputs"
    ok = {"passage_count": [True, True, False, True]}
    lb_methods_run(outputs, "a/full", FULL, "full", ok)
    lb_methods_run(outputs, "b/full", FULL, "full", {"passage_count": [False] * 4})
    lb_methods_run(outputs, "b/snapkv", SNAPKV_PAPER, "snapkv", ok)           # sibling of b/full
    lb_methods_run(outputs, "c/full", FULL, "full", ok)
    lb_methods_run(outputs, "d/snapkv", SNAPKV_PAPER, "snapkv", ok)           # no sibling: the first in path order
    unscored = json.loads((outputs / "c/full/results.json").read_text())
    unscored["summary"] = {"status": "incomplete", "tasks": ["passage_count"]}
    (outputs / "c/full/results.json").write_text(json.dumps(unscored))
    lb_methods_run(outputs, "c/snapkv", SNAPKV_PAPER, "snapkv", ok)           # its sibling is not scored: a/full
    build(outputs, tmp_path / "t", resamples=200)
    rows = paired(tmp_path / "t")
    assert float(rows[("b/snapkv", "passage_count")]["delta"]) == 75.0
    assert float(rows[("d/snapkv", "passage_count")]["delta"]) == 0.0 and float(rows[("c/snapkv", "passage_count")]["delta"]) == 0.0
    md = (tmp_path / "t" / "paired_deltas.md").read_text()
    assert "`c/snapkv`: 3 full-cache runs match; paired with `a/full`" in md
    assert "`b/snapkv`: 3 full-cache runs match; paired with `b/full`" in md


def test_ratio_settings_are_labelled_with_their_ratio():
    from harness.tasks.lines.report import _lines_setting

    ratio = {**SNAPKV_PAPER, "budget": None, "ratio": 0.25, "layer_budgets": None}
    assert method_setting(ratio) == ("SnapKV ratio 0.25 (W32 k7 maxpool)", None)  # never the paper's SnapKV 1024 column
    assert method_setting({"name": "h2o", "budget": None, "ratio": 0.2, "window_size": None}) == ("H2O ratio 0.2 (W half the budget)", None)
    assert _lines_setting({"name": "snapkv", "budget": None, "ratio": 0.5, "window_size": 16, "kernel_size": 1}) == \
        "SnapKV ratio 0.5 (W16, no pooling)"
    assert "None" not in _lines_setting({"name": "streamingllm", "budget": None, "ratio": 0.1})


def test_line_plot_gives_every_series_its_own_style_and_keeps_the_legend_off_the_data():
    import matplotlib.pyplot as plt

    from harness.plots import line_figure

    series = {f"model · setting {i}": [(1024, i / 12), (2048, i / 13), (4096, None)] for i in range(12)}
    fig = line_figure(series, title="t", xlabel="x", ylabel="y", logx=True)
    try:
        ax = fig.axes[0]
        styles = [(tuple(line.get_color()), line.get_marker(), line.get_linestyle()) for line in ax.get_lines()]
        assert len(styles) == 12 and len(set(styles)) == 12
        assert len({c for c, _, _ in styles}) == 12  # 12 series: 12 colours (tab20), not tab10's cycle repeating
        fig.canvas.draw()
        legend = ax.get_legend().get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1  # right of the axes: it covers no data
    finally:
        plt.close(fig)


def test_paired_rows_below_the_minimum_items_show_no_interval(tmp_path):
    from harness.report.paired import MIN_INTERVAL_ITEMS

    outputs = tmp_path / "outputs"
    snap = {"name": "snapkv", "budget": 1024, "window_size": 16, "kernel_size": 5, "pooling": "maxpool", "gqa": "expand"}
    for depths in ([50], [0, 25, 50, 75, 100]):
        for rel, method, score in (("full", FULL, 1.0), ("snapkv", snap, 0.5)):
            data = needle_results("lwm-text-chat-1m", method, rel, [(1000, d, score, score == 1.0) for d in depths])
            data["config"]["task"].update(lengths=[1000], depths=depths)
            write(outputs, f"needle/n{len(depths)}/{rel}", data)
    out = tmp_path / "tables"
    build(outputs, out, resamples=200, seed=0)
    rows = paired(out)
    one, five = rows[("needle/n1/snapkv", "needle")], rows[("needle/n5/snapkv", "needle")]
    assert MIN_INTERVAL_ITEMS == 5
    assert (one["n"], float(one["delta"]), one["ci_low"], one["ci_high"]) == ("1", -0.5, "", "")
    assert five["n"] == "5" and float(five["ci_low"]) == float(five["ci_high"]) == -0.5  # every item differs by -0.5
    md = (out / "paired_deltas.md").read_text()
    line = next(x for x in md.splitlines() if "`needle/n1/snapkv`" in x)
    assert "n/a (n < 5)" in line and "~ noise" not in line and "[" not in line.split("|")[6]
    assert "Fewer than 5 paired items give no interval" in md
    # the needle table says which grid each mean covers: 1 cell and 5 cells are not one comparison
    grids = {r["run"]: (r["grid"], r["cells"]) for r in read_csv(out / "needle.csv")}
    assert grids["needle/n1/snapkv"] == ("1000 x 1", "1") and grids["needle/n5/full"] == ("1000 x 5", "5")
    assert "| Grid | Cells |" in (out / "needle.md").read_text()


def test_code_versions_are_named_and_mixed_runs_flagged(tmp_path):
    """runs.csv's `code` and README.md's paragraph: every code version behind the tables, with the commits its
    sessions ran at, and the runs whose records mix versions (a resume=force) named."""
    old = {"fingerprint": "aaaaaaaaaaaa", "torch": "2.13.0", "transformers": "5.24.0"}
    new = {"fingerprint": "bbbbbbbbbbbb", "torch": "2.13.0", "transformers": "5.24.0"}
    runs = tmp_path / "runs"
    for rel, codes, prov in [
        ("m/full", [old, old], {"git": {"commit": "a" * 40, "dirty": False}, "code": old}),
        ("m/snapkv", [old, new, new], {"git": {"commit": "b" * 40, "dirty": True}, "code": new}),
    ]:
        data = longbench_results("mistral-7b-instruct-v0.2", FULL, {"qasper": 30.0})
        data["provenance"] = {"device": "cpu", **prov}
        folder = write(runs, rel, data)
        if rel == "m/snapkv":  # the earlier session of a resumed run is in provenance.json only (as rundir writes it)
            (folder / "provenance.json").write_text(json.dumps({**prov, "earlier_sessions": [
                {"git": {"commit": "c" * 40, "dirty": False}, "code": old}]}))
        (folder / "longbench_items.jsonl").write_text("".join(json.dumps({"id": i, "_code": c}) + "\n" for i, c in enumerate(codes)))
    build(runs, tmp_path / "out")
    table = {r["run"]: r["code"] for r in read_csv(tmp_path / "out" / "runs.csv")}
    assert table == {"m/full": "aaaaaaaaaaaa (torch 2.13.0, transformers 5.24.0)",
                     "m/snapkv": "aaaaaaaaaaaa (torch 2.13.0, transformers 5.24.0) x1; bbbbbbbbbbbb (torch 2.13.0, transformers 5.24.0) x2"}
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "**Code versions: 2.**" in readme
    assert "- `aaaaaaaaaaaa (torch 2.13.0, transformers 5.24.0)` (git aaaaaaa, ccccccc): records in 2 run(s)" in readme
    assert "- `bbbbbbbbbbbb (torch 2.13.0, transformers 5.24.0)` (git bbbbbbb+dirty): records in 1 run(s)" in readme
    assert "1 run(s) hold records of more than one version (resumed with `resume=force`): `m/snapkv`" in readme

    (runs / "m" / "snapkv" / "longbench_items.jsonl").write_text(json.dumps({"id": 0, "_code": old}) + "\n")
    build(runs, tmp_path / "out")
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "Code version: every record of the 2 run(s) was written by `aaaaaaaaaaaa (torch 2.13.0, transformers 5.24.0)` (git aaaaaaa, ccccccc)." in readme
    assert "Code versions" not in readme
