"""Never lose work: torn lines, SIGKILL mid-run, resume, and refusing a rerun with another config."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, compose, run_cli
from harness import rundir
from harness.errors import HarnessError
from harness.rundir import JsonlLog, RunDir, result_key_differences
from test_robustness import ENV, small_haystack

TIMING_FIELDS = {"prefill_seconds", "decode_seconds"}


# ---------------------------------------------------------------------------------------------------
# The JSONL log
# ---------------------------------------------------------------------------------------------------


def _line(record: dict) -> str:
    return json.dumps(record) + "\n"


def test_torn_last_line_is_cut_and_the_item_redone(tmp_path):
    path = tmp_path / "cells.jsonl"
    good = _line({"length": 1, "depth": 0.0, "response": "a"}) + _line({"length": 1, "depth": 50.0, "response": "b"})
    torn = _line({"length": 1, "depth": 100.0, "response": "c" * 50})[:-20]  # killed mid-write: no newline
    path.write_text(good + torn)
    log = JsonlLog(path, ("length", "depth"))
    assert len(log) == 2 and (1, 100.0) not in log and (1, 0.0) in log
    assert path.read_text() == good  # repaired on disk
    log.append({"length": 1, "depth": 100.0, "response": "c"})
    log.append({"length": 1, "depth": 100.0, "response": "again"})  # a duplicate key is never written twice
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(x) for x in lines)
    assert JsonlLog(path, ("length", "depth")).records[(1, 100.0)]["response"] == "c"


def test_torn_line_that_is_the_whole_file(tmp_path):
    path = tmp_path / "cells.jsonl"
    path.write_bytes(b'{"length": 1, "dep')
    assert len(JsonlLog(path, ("length", "depth"))) == 0 and path.read_bytes() == b""


def test_damaged_line_in_the_middle_is_refused_with_its_line_number(tmp_path):
    path = tmp_path / "cells.jsonl"
    path.write_text(_line({"length": 1, "depth": 0.0}) + "{oops\n" + _line({"length": 1, "depth": 50.0}))
    with pytest.raises(HarnessError, match=r"cells\.jsonl:2 is not valid JSON; delete that line or rerun with resume=false"):
        JsonlLog(path, ("length", "depth"))
    path.write_text(_line({"length": 1}))
    with pytest.raises(HarnessError, match=r"cells\.jsonl:1 is not a record with length, depth"):
        JsonlLog(path, ("length", "depth"))


# ---------------------------------------------------------------------------------------------------
# Config comparison and provenance
# ---------------------------------------------------------------------------------------------------


def _resolved(*overrides):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose("model=tiny-random", *overrides), resolve=True)


def test_keys_that_do_not_change_results_are_ignored():
    base = _resolved("method=snapkv")
    same = _resolved("method=snapkv", "progress=false", "resume=false", "+task.log_prompts=true", "+task.shard.index=1",
                     "+task.shard.count=4", "model.device_map=auto", "+task.data_dir=/elsewhere")
    assert result_key_differences(base, same) == []
    assert result_key_differences({**base, "hydra": {"run": {"dir": "a"}}}, base) == []
    assert result_key_differences(base, _resolved("method=snapkv", "method.budget=128")) == ["method.budget", "method.tag"]
    assert result_key_differences(base, _resolved("method=snapkv", "seed=1", "task.depths=[5]")) == ["seed", "task.depths"]
    assert result_key_differences(base, _resolved("method=full")) == [
        "method.budget", "method.gqa", "method.kernel_size", "method.name", "method.pooling", "method.tag", "method.window_size"]
    for key in ("resume", "progress", "task.log_prompts", "task.shard", "hydra", "task.data_dir", "model.device_map"):
        assert key in rundir.NON_RESULT_KEYS


def test_rundir_refuses_another_config_unless_resume_false(tmp_path):
    cfg = compose("model=tiny-random", "method=snapkv")
    run = RunDir(tmp_path)
    run.prepare(cfg, resume=True)
    (tmp_path / "needle_cells.jsonl").write_text(_line({"length": 1, "depth": 0.0}))
    (tmp_path / "results.json").write_text("{}")
    other = compose("model=tiny-random", "method=snapkv", "method.budget=128")
    with pytest.raises(HarnessError) as err:
        RunDir(tmp_path).check(other, resume=True)
    message = str(err.value)
    assert "\n" not in message and "method.budget: 256 -> 128" in message and "resume=false" in message
    RunDir(tmp_path).check(compose("model=tiny-random", "method=snapkv", "progress=false"), resume=True)  # fine
    RunDir(tmp_path).prepare(other, resume=False)  # starts afresh: earlier records and results are gone
    assert not (tmp_path / "needle_cells.jsonl").exists() and not (tmp_path / "results.json").exists()
    assert "budget: 128" in (tmp_path / "config.yaml").read_text()


def test_provenance_json_keeps_the_sessions_of_a_resumed_run(tmp_path, monkeypatch):
    cfg = compose("model=tiny-random")
    RunDir(tmp_path).prepare(cfg, resume=True, device="cpu")
    first = json.loads((tmp_path / "provenance.json").read_text())
    assert first["earlier_sessions"] == [] and first["device"] == "cpu" and first["seed"] == 0
    assert {"git", "torch", "transformers", "python", "argv", "hostname", "started_at", "packages"} <= set(first)
    RunDir(tmp_path).prepare(cfg, resume=True, device="cpu")  # the same process again: still one session
    assert json.loads((tmp_path / "provenance.json").read_text())["earlier_sessions"] == []
    monkeypatch.setattr(rundir, "SESSION_ID", "a-later-process")
    RunDir(tmp_path).prepare(cfg, resume=True, device="cpu")
    later = json.loads((tmp_path / "provenance.json").read_text())
    assert later["session"] == "a-later-process" and [s["session"] for s in later["earlier_sessions"]] == [first["session"]]


# ---------------------------------------------------------------------------------------------------
# SIGKILL at random moments, then resume: the same predictions as an uninterrupted run
# ---------------------------------------------------------------------------------------------------

GRID = ("model=tiny-random", "progress=false", "method=snapkv", "method.budget=64", "task.lengths=[128,256]",
        "task.depths=[0,25,50,75,100]", "task.max_new_tokens=6")
CELLS = 10


def _popen(args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=REPO, env={**os.environ, **ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """Two uninterrupted runs ("reference", "again") and, concurrently, a run killed with SIGKILL at
    random moments (a torn line planted after the first kill, as if it had hit a write), then resumed."""
    base = tmp_path_factory.mktemp("sigkill")
    args = (*GRID, f"task.haystack_dir={small_haystack(base / 'haystack')}")
    uninterrupted: dict = {}

    def run_to_end(name):
        uninterrupted[name] = run_cli(*args, f"hydra.run.dir={base / name}", env=ENV, timeout=300)

    threads = [threading.Thread(target=run_to_end, args=(name,)) for name in ("reference", "again")]
    for thread in threads:
        thread.start()
    seed = int(time.time())
    rng = random.Random(seed)
    run_path = base / "killed"
    cells = run_path / "needle_cells.jsonl"
    kills = []
    for attempt in range(2):
        before = _lines(cells)
        proc = _popen((*args, f"hydra.run.dir={run_path}"))
        deadline = time.time() + 240
        while proc.poll() is None and _lines(cells) <= before and time.time() < deadline:
            time.sleep(0.02)
        if _lines(cells) > before:  # somewhere inside one of the next two cells (or their writes)
            text = cells.read_text()
            last = json.loads(text[: text.rfind("\n")].splitlines()[-1])  # the last complete line
            time.sleep(rng.uniform(0, 2) * (last["prefill_seconds"] + last["decode_seconds"]))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills.append(_lines(cells))
        proc.communicate(timeout=60)
        if attempt == 0 and cells.exists():  # as if that kill had landed in the middle of a write
            last = cells.read_text().splitlines()[-1]
            with open(cells, "a") as f:
                f.write(last.replace('"length": ', '"length": 9', 1)[: len(last) // 2])
    final = run_cli(*args, f"hydra.run.dir={run_path}", env=ENV, timeout=300)
    for thread in threads:
        thread.join()
    return {**uninterrupted, "final": final, "kills": kills, "seed": seed, "base": base, "args": args}


def test_sigkill_then_resume_equals_an_uninterrupted_run(killed_and_resumed):
    run = killed_and_resumed
    about = f"kills after {run['kills']} lines (seed {run['seed']})"
    assert run["reference"].returncode == 0, run["reference"].stderr[-3000:]
    assert run["final"].returncode == 0, run["final"].stderr[-3000:]
    assert run["kills"], "no run was killed mid-way: the grid finished too fast"
    assert "already done" in run["final"].stdout, about
    texts = {name: (run["base"] / name / "needle_cells.jsonl").read_text() for name in ("reference", "killed")}
    records = {name: [json.loads(line) for line in text.splitlines()] for name, text in texts.items()}  # every line valid
    keys = {name: [(r["length"], r["depth"]) for r in recs] for name, recs in records.items()}
    assert len(keys["killed"]) == len(set(keys["killed"])) == CELLS, about  # no duplicates, nothing missing
    assert set(keys["killed"]) == set(keys["reference"]), about
    by_key = {name: {(r["length"], r["depth"]): r for r in recs} for name, recs in records.items()}
    for key, ref in by_key["reference"].items():
        got = by_key["killed"][key]
        assert {k: v for k, v in got.items() if k not in TIMING_FIELDS} == {k: v for k, v in ref.items() if k not in TIMING_FIELDS}, key
        assert set(got) == set(ref)
    results = {name: json.loads((run["base"] / name / "results.json").read_text()) for name in ("reference", "killed")}
    assert results["killed"]["summary"] == results["reference"]["summary"]
    assert results["killed"]["status"] == "complete" and results["killed"]["failures"] == 0
    # The rows of results.json follow the grid order whatever order the cells finished in.
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert strip(results["killed"]["rows"]) == strip(results["reference"]["rows"])
    prov = json.loads((run["base"] / "killed" / "provenance.json").read_text())
    assert len(prov["earlier_sessions"]) >= 1, "a resumed run records the sessions it was made of"


def test_rerun_with_another_config_is_refused_in_one_line(killed_and_resumed):
    run = killed_and_resumed
    run_path = run["base"] / "reference"
    before = {p.name: p.read_bytes() for p in run_path.iterdir() if p.is_file()}
    proc = run_cli(*run["args"], "method.budget=128", "method.window_size=8", f"hydra.run.dir={run_path}", env=ENV, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    shown = f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, shown
    assert lines[0].startswith(f"error: {run_path} holds a run with a different config ("), shown
    assert "method.budget: 64 -> 128" in lines[0] and "method.window_size: 16 -> 8" in lines[0], shown
    assert "resume=false" in lines[0], shown
    print(lines[0])
    assert {p.name: p.read_bytes() for p in run_path.iterdir() if p.is_file()} == before  # untouched


def test_two_runs_differ_only_in_timings(killed_and_resumed):
    """Same config, two fresh processes: byte-identical predictions once the timing fields are removed,
    and the timing fields are the only fields that differ."""
    run = killed_and_resumed
    for name in ("reference", "again"):
        assert run[name].returncode == 0, run[name].stderr[-3000:]
    texts = [(run["base"] / name / "needle_cells.jsonl").read_text() for name in ("reference", "again")]
    records = [[json.loads(line) for line in text.splitlines()] for text in texts]
    assert len(records[0]) == len(records[1]) == CELLS
    for ra, rb in zip(*records):
        assert list(ra) == list(rb)  # same fields in the same order
        assert {k for k in ra if ra[k] != rb[k]} <= TIMING_FIELDS
        assert ra["kv_positions_after_prefill"]  # snapkv ran (and recorded what it kept)
    stripped = ["\n".join(json.dumps({k: v for k, v in r.items() if k not in TIMING_FIELDS}, ensure_ascii=False) for r in recs)
                for recs in records]
    assert stripped[0] == stripped[1]
    results = [json.loads((run["base"] / name / "results.json").read_text()) for name in ("reference", "again")]
    assert results[0]["summary"] == results[1]["summary"]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert strip(results[0]["rows"]) == strip(results[1]["rows"])
    # The run directory says where the numbers came from.
    prov = json.loads((run["base"] / "reference" / "provenance.json").read_text())
    assert {"git", "torch", "transformers", "python", "seed", "device", "argv", "packages"} <= set(prov)
    assert prov["seed"] == 0 and prov["device"] == "cpu" and prov["earlier_sessions"] == []
