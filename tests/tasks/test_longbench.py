"""LongBench runs end to end on the fixture data: results, streaming predictions, resume, sharding.

Most runs use the tiny random model with generation capped at a few tokens (a wrapper around the
task's `generate` records what the task asked for - the official max_new_tokens, stop ids, first-token
guard - and caps it); one SmolLM2 run generates the official number of tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, compose
from harness.app import execute
from harness.tasks import contract
from harness.tasks.longbench import task as longbench
from harness.tasks.longbench.data import load_rows, data_source
from metrics.longbench import scorer
from metrics.longbench_config import load_dataset2maxlen
from metrics.longbench_tasks import LONGBENCH_E_BUCKETS, LONGBENCH_EN_TASKS

FIXTURES = REPO / "tests" / "fixtures" / "longbench"
ALL_FIXTURE_TASKS = list(LONGBENCH_EN_TASKS) + ["multifieldqa_zh", "lsht"]
CAP = 3
NEWLINE = 198  # SmolLM2's "\n"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def capped(monkeypatch):
    """Record every generate call the task makes, and cap its new tokens at CAP."""
    real = contract.generate_settings
    calls: list[dict] = []

    def wrapper(loaded, methods, prompt, **kwargs):
        calls.append({"prompt_tokens": len(prompt.ids), "question_start": prompt.question_start, **kwargs})
        return real(loaded, methods, prompt, **{**kwargs, "max_new_tokens": min(kwargs["max_new_tokens"], CAP)})

    monkeypatch.setattr(contract, "generate_settings", wrapper)
    return calls


def run(tmp: Path, *overrides: str, model: str = "tiny-random", task: str = "longbench") -> dict:
    """Run into the run directory `tmp`; the setting's own directory is `out(tmp)` (`<tmp>/<method tag>`)."""
    cfg = compose(f"task={task}", f"model={model}", f"task.data_dir={FIXTURES}", "progress=false", *overrides)
    return execute(cfg, tmp)


def out(run_dir: Path) -> Path:
    """The one setting directory below a run directory."""
    (found,) = [p for p in Path(run_dir).iterdir() if p.is_dir() and (p / "config.yaml").exists()]
    return found


def datasets(names) -> str:
    return f"task.datasets=[{','.join(names)}]"


def preds(run_dir: Path, name: str, shard: str = "") -> list[dict]:
    return [json.loads(line) for line in (out(run_dir) / "pred" / f"{name}{shard}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_all_fixture_tasks_tiny_random_snapkv(tmp_path, capped):
    res = run(tmp_path, datasets(ALL_FIXTURE_TASKS), "task.limit=2", "task.log_prompts=true",
              "method=snapkv", "method.budget=64", "method.window_size=8", "model.eos_token_ids=[7]")
    s = res["summary"]
    assert s["status"] == "complete" and s["tasks"] == ALL_FIXTURE_TASKS
    assert list(s["scores"]) == ALL_FIXTURE_TASKS and all(isinstance(v, float) for v in s["scores"].values())
    assert s["items"] == {t: 2 for t in ALL_FIXTURE_TASKS} and s["total_items"] == 36
    assert s["n_tasks"] == 18 and not s["all_16_en_tasks"] and "NOT the papers' 16-task average" in s["average_note"]
    assert set(s["categories"]) == {"Single-doc QA", "Multi-doc QA", "Summarization", "Few-shot", "Synthetic", "Code"}
    assert s["code_sim_backend"] == "difflib"
    rules = s["rules"]
    assert rules["chat_format"] == "template" and rules["truncation"]["budget_tokens"] == 7500
    assert rules["raw_tasks"] == ["trec", "triviaqa", "samsum", "lcc", "repobench-p", "lsht"]
    assert rules["min_new_tokens"] == "samsum only (official pred.py)" and rules["samsum_stop_token_id"] == NEWLINE
    assert [r["task"] for r in res["rows"]] == ALL_FIXTURE_TASKS

    # what was asked of the decoder, per task (calls are in task order, 2 items each)
    maxlen = load_dataset2maxlen()
    for t, name in enumerate(ALL_FIXTURE_TASKS):
        for call in capped[2 * t: 2 * t + 2]:
            assert call["max_new_tokens"] == maxlen[name]
            assert call["stop_token_ids"] == ([NEWLINE] if name == "samsum" else [])
            # pred.py: samsum stops at [tokenizer.eos_token_id, "\n"] only; other tasks at every EOS id of the model
            assert call["eos_token_ids"] == ([2] if name == "samsum" else [2, 7])
            assert call["min_new_tokens"] == (1 if name == "samsum" else 0)

    for name in ALL_FIXTURE_TASKS:
        recs = preds(tmp_path, name)
        assert [r["index"] for r in recs] == [0, 1]
        rows = load_rows(data_source(compose("task=longbench", f"task.data_dir={FIXTURES}").task), name)
        for r, row in zip(recs, rows):
            assert (r["_id"], r["answers"], r["all_classes"], r["length"]) == (row["_id"], row["answers"], row["all_classes"], row["length"])
            assert r["prompt_tokens"] > 0 and r["prefill_seconds"] >= 0 and r["decode_seconds"] >= 0 and isinstance(r["pred"], str)
            assert [kept for _, kept in r["kv_positions_after_prefill"]] == [64, 64]  # (heads, positions) per layer: compressed
            chat = "<|im_start|>user\n" in r["prompt"]
            assert chat == (name not in rules["raw_tasks"]) == r["chat_formatted"]
        assert scorer(name, [r["pred"] for r in recs], [r["answers"] for r in recs], recs[-1]["all_classes"]) == s["scores"][name]

    on_disk = json.loads((out(tmp_path) / "results.json").read_text(encoding="utf-8"))
    assert on_disk["summary"]["scores"] == s["scores"] and on_disk["task"] == "longbench"
    table = (out(tmp_path) / "longbench_table.md").read_text(encoding="utf-8")
    header = next(line for line in table.splitlines() if line.startswith("| Method |"))
    assert header.startswith("| Method | NrtvQA | Qasper | MF-en | HotpotQA | 2WikiMQA | Musique | GovReport | QMSum | MultiNews | TREC")
    assert header.endswith("| Lcc | RB-P | MF-zh | LSHT | Avg. |")
    assert "code_sim backend: difflib" in table


def test_snapkv_first_token_guard_switch(tmp_path, capped):
    res = run(tmp_path, datasets(["trec", "samsum", "passage_count"]), "task.limit=1", "task.min_new_tokens=true")
    assert [c["min_new_tokens"] for c in capped] == [1, 1, 1]
    assert [c["stop_token_ids"] for c in capped] == [[], [NEWLINE], []]
    assert res["summary"]["rules"]["min_new_tokens_all_tasks"] is True
    assert res["summary"]["rules"]["min_new_tokens"] == "all tasks (SnapKV pred_snap.py)"


def test_longbench_e_bucket_scores(tmp_path, capped):
    res = run(tmp_path, "task.datasets=[qasper_e,trec,lcc]", task="longbench_e")
    s = res["summary"]
    assert s["benchmark"] == "LongBench-E" and s["tasks"] == ["qasper", "trec", "lcc"]
    assert set(s["bucket_scores"]) == {"qasper", "trec", "lcc"}
    for name, buckets in s["bucket_scores"].items():
        assert list(buckets) == list(LONGBENCH_E_BUCKETS) and all(isinstance(v, float) for v in buckets.values())
    assert set(s["bucket_average"]) == set(LONGBENCH_E_BUCKETS)
    assert [r["bucket_items"] for r in res["rows"]] == [{"0-4k": 1, "4-8k": 1, "8k+": 1}] * 3
    assert (out(tmp_path) / "pred" / "qasper.jsonl").exists()
    table = (out(tmp_path) / "longbench_table.md").read_text(encoding="utf-8")
    assert "| Task | 0-4k | 4-8k | 8k+ | All |" in table


def test_smollm2_generates_the_official_budget(tmp_path):
    res = run(tmp_path, datasets(["hotpotqa", "triviaqa"]), "task.limit=1", model="smollm2-135m")
    s = res["summary"]
    assert s["status"] == "complete" and set(s["scores"]) == {"hotpotqa", "triviaqa"}
    hp, tq = preds(tmp_path, "hotpotqa")[0], preds(tmp_path, "triviaqa")[0]
    assert hp["pred"].strip() and 0 < hp["new_tokens"] <= 32 and 0 < tq["new_tokens"] <= 32
    assert hp["chat_formatted"] and not tq["chat_formatted"]
    assert s["rules"]["eos_token_ids"] == res["model"]["eos_token_ids"]


def test_resume_after_interruption_redoes_only_missing_items(tmp_path, capped):
    args = (datasets(["qasper", "samsum", "lcc"]),)
    first = run(tmp_path, *args)
    before = {n: preds(tmp_path, n) for n in ("qasper", "samsum", "lcc")}
    assert len(capped) == 9
    # a crash: qasper lost its last two items, lcc was killed mid-line, samsum is complete
    q = out(tmp_path) / "pred" / "qasper.jsonl"
    q.write_text(q.read_text(encoding="utf-8").splitlines(keepends=True)[0], encoding="utf-8")
    with open(out(tmp_path) / "pred" / "lcc.jsonl", "a", encoding="utf-8") as f:
        f.write('{"index": 7, "_id": "torn", "pr')
    capped.clear()
    second = run(tmp_path, *args)
    assert len(capped) == 2  # only qasper's two lost items were generated again
    for n, old in before.items():
        new = preds(tmp_path, n)
        assert [r["index"] for r in new] == [0, 1, 2]
        assert [r["pred"] for r in new] == [r["pred"] for r in old]
    assert second["summary"]["scores"] == first["summary"]["scores"]


def test_sharded_runs_score_exactly_as_one_run(tmp_path, capped):
    names = ["qasper", "trec", "lcc", "samsum"]
    whole = run(tmp_path / "one", datasets(names))["summary"]

    two = tmp_path / "two"
    partial = run(two, datasets(names), "task.shard.index=0", "task.shard.count=2")["summary"]
    assert partial["status"] == "incomplete" and "scores" not in partial
    assert partial["message"].startswith("shard 0/2 done; not scored yet: shard(s) 1 of 2 unfinished")
    assert "qasper shard 1/2: 1 item(s) missing (1)" in partial["missing"]
    assert not (out(two) / "longbench_table.md").exists()
    assert [r["index"] for r in preds(two, "qasper", ".shard0of2")] == [0, 2]
    last = run(two, datasets(names), "task.shard.index=1", "task.shard.count=2")["summary"]
    assert last["status"] == "complete" and last["shards_merged"] == 2
    assert last["scores"] == whole["scores"] and last["average"] == whole["average"]

    three = tmp_path / "three"
    for k in (2, 0, 1):
        s = run(three, datasets(names), f"task.shard.index={k}", "task.shard.count=3")["summary"]
    assert s["status"] == "complete" and s["scores"] == whole["scores"]
    for name in names:
        merged = sorted((r for k in range(3) for r in preds(three, name, f".shard{k}of3")), key=lambda r: r["index"])
        assert [r["pred"] for r in merged] == [r["pred"] for r in preds(tmp_path / "one", name)]
    assert json.loads((out(three) / "results.json").read_text(encoding="utf-8"))["summary"]["scores"] == whole["scores"]


def test_merge_scores_in_item_order_with_real_scores(tmp_path):
    """Non-trivial scores (the random model scores 0): hand-made predictions in 1, 2 and 3 shard
    layouts merge to the same floats, bit for bit, and a gap is reported, not scored."""
    cfg = compose("task=longbench", f"task.data_dir={FIXTURES}", datasets(["qasper", "trec", "gov_report", "lcc", "passage_count"]))
    plan = longbench.make_plan(cfg.task)
    fake = {"qasper": ["eleven thousand years old", "yes", "no idea"], "trec": ["Individual", "Number of something", "City City"],
            "gov_report": ["The report reviews a railway.", "Glacier retreat. Comets.", "Small enterprises."],
            "lcc": ["        return math.acos(cos)", "        return count;", "result[key] = value"], "passage_count": ["3", "4 or 5", "2"]}
    results = []
    for count in (1, 2, 3):
        plan.shard_count = count
        folder = tmp_path / f"c{count}"
        (folder / "pred").mkdir(parents=True)
        for name, rows in plan.rows.items():
            for i, row in enumerate(rows):
                rec = {"index": i, "_id": row["_id"], "pred": fake[name][i], "answers": row["answers"], "all_classes": row["all_classes"],
                       "length": row["length"], "prompt_tokens": 1, "new_tokens": 1, "prefill_seconds": 0.0, "decode_seconds": 0.0}
                with open(longbench.pred_file(folder, name, i % count, count), "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
        merged, missing = longbench.collect(folder, plan)
        assert not missing
        summary, _ = longbench.score(plan, merged, cfg.task, rules={})
        results.append(summary)
    assert results[0]["scores"] == results[1]["scores"] == results[2]["scores"]
    assert all(v > 0 for v in results[0]["scores"].values())
    # drop one item of shard 2/3: refused, with the item named
    path = longbench.pred_file(tmp_path / "c3", "trec", 2, 3)
    path.write_text("", encoding="utf-8")
    merged, missing = longbench.collect(tmp_path / "c3", plan)
    assert missing == {"trec": {2: [2]}} and "trec" not in merged


def test_failed_item_is_recorded_not_scored_and_retried(tmp_path, capped, monkeypatch):
    capping = contract.generate_settings

    def flaky(loaded, methods, prompt, **kwargs):
        if len(capped) == 1:  # the second item
            capped.append({})
            raise RuntimeError("CUDA out of memory (simulated)\ndetails")
        return capping(loaded, methods, prompt, **kwargs)

    monkeypatch.setattr(contract, "generate_settings", flaky)
    first = run(tmp_path, datasets(["trec"]), "task.limit=2")
    assert first["status"] == "items_failed" and first["failures"] == 1
    assert first["summary"]["status"] == "incomplete" and first["summary"]["message"].startswith("1 item(s) failed")
    failed = json.loads((out(tmp_path) / "failures.json").read_text(encoding="utf-8"))
    assert [(f["task"], f["key"]) for f in failed] == [("trec", [1])]
    monkeypatch.setattr(contract, "generate_settings", capping)
    capped.clear()
    second = run(tmp_path, datasets(["trec"]), "task.limit=2")
    assert len(capped) == 1 and second["summary"]["status"] == "complete" and second["failures"] == 0
    capped.clear()
    third = run(tmp_path, datasets(["trec"]), "task.limit=2", "resume=false")  # a fresh start redoes everything
    assert len(capped) == 2 and third["summary"]["scores"] == second["summary"]["scores"]


@pytest.mark.parametrize("query_aware", [True, False])
def test_methods_list_equals_separate_runs_both_protocols(tmp_path, query_aware):
    """One prefill per item for every setting (issue 13) gives each setting exactly its separate run's
    predictions; query-agnostic runs prefill the text after {context} after compression (issue 12)."""
    names = ["qasper", "trec", "passage_count"]  # passage_count: only a fixed instruction after {context}
    base = ["task=longbench", "model=tiny-random", f"task.data_dir={FIXTURES}", "progress=false", datasets(names),
            "task.limit=1", f"task.query_aware={str(query_aware).lower()}"]
    listing = "methods=[full,{name: snapkv, budget: 64, window_size: 8},{name: h2o, budget: 64, window_size: 8}]"
    execute(compose(*base, listing), tmp_path / "shared", overrides=[*base, listing])
    separate = {"full": ["method=full"], "snapkv_c64_w8_k7_maxpool_expand": ["method=snapkv", "method.budget=64", "method.window_size=8"],
                "h2o_c64_w8_expand": ["method=h2o", "method.budget=64", "method.window_size=8"]}
    keys = ("pred", "prompt_tokens", "question_start", "protocol", "question_kept", "kv_positions_after_prefill")
    for tag, overrides in separate.items():
        alone = execute(compose(*base, *overrides), tmp_path / tag, overrides=[*base, *overrides])
        assert alone["summary"]["protocol"] == ("query_aware" if query_aware else "query_agnostic")
        for name in names:
            a = preds(tmp_path / tag, name)
            b = [json.loads(line) for line in (tmp_path / "shared" / tag / "pred" / f"{name}.jsonl").read_text().splitlines()]
            assert [{k: r.get(k) for k in keys} for r in a] == [{k: r.get(k) for k in keys} for r in b], (tag, name)
            for r in a:
                assert 0 < r["question_start"] < r["prompt_tokens"]  # every official template has text after {context}
                if tag != "full" and not query_aware:
                    assert r["question_kept"] == 1.0  # prefilled after compression, by construction


def test_leaderboard_compression_ratio_from_item_records(tmp_path):
    """`--format kvpress` fills LongBench's compression_ratio from the item records in pred/ (results.json's rows
    are per task): 1 - mean(budget / compressed length), the compressed length being the whole prompt
    query-aware; the full cache 0. Expected values from the records the run wrote."""
    import csv

    from harness.report import build
    from harness.report.html import LEADERBOARD

    names = ["trec", "passage_count"]
    base = ["task=longbench", "model=tiny-random", f"task.data_dir={FIXTURES}", "progress=false", datasets(names), "task.limit=2"]
    listing = "methods=[full,{name: snapkv, budget: 64, window_size: 8}]"
    execute(compose(*base, listing), tmp_path / "runs", overrides=[*base, listing])
    build(tmp_path / "runs", tmp_path / "tables", resamples=50, kvpress=True)
    rows = {r["method"]: r for r in csv.DictReader((tmp_path / "tables" / LEADERBOARD).open())}
    assert float(rows["no_press"]["compression_ratio"]) == 0.0
    recs = [json.loads(line) for name in names
            for line in (tmp_path / "runs" / "snapkv_c64_w8_k7_maxpool_expand" / "pred" / f"{name}.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["budget_tokens"] == 64 for r in recs)
    expected = 1 - sum(min(1.0, 64 / r["prompt_tokens"]) for r in recs) / len(recs)
    assert float(rows["snapkv"]["compression_ratio"]) == pytest.approx(expected, abs=1e-4) and expected > 0
