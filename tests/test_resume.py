"""Never lose work: torn lines, SIGKILL mid-run (at chosen points), resume, refusing a rerun with another
config or over records of other code, and the run-directory lock."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from conftest import compose, run_cli
from harness import rundir
from harness.errors import HarnessError
from harness.rundir import JsonlLog, RunDir, RunLock, code_changes, code_version, resume_mode, result_key_differences
from test_robustness import ENV, small_haystack

TIMING_FIELDS = {"prefill_seconds", "decode_seconds", "shared_prefill_seconds"}


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
    assert json.loads(lines[2])["_code"] == code_version()  # every appended record says which code wrote it


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
    same = _resolved("method=snapkv", "progress=false", "resume=false", "++task.log_prompts=true", "+task.shard.index=1",
                     "+task.shard.count=4", "model.device_map=auto", "+task.data_dir=/elsewhere")
    assert result_key_differences(base, same) == []
    assert result_key_differences({**base, "hydra": {"run": {"dir": "a"}}}, base) == []
    assert result_key_differences(base, _resolved("method=snapkv", "method.budget=128")) == ["method.budget", "method.tag"]
    assert result_key_differences(base, _resolved("method=snapkv", "seed=1", "task.depths=[5]")) == ["seed", "task.depths"]
    assert result_key_differences(base, _resolved("method=full")) == [
        "method.budget", "method.gqa", "method.kernel_size", "method.name", "method.pooling", "method.tag", "method.window_size"]
    full = _resolved("method=full")
    assert result_key_differences(full, _resolved("method=full", "method.budget=64", "method.ratio=0.5")) == []  # no-ops
    assert result_key_differences(base, {**base, "methods": ["full", "snapkv"]}) == []
    for key in ("resume", "progress", "task.log_prompts", "task.shard", "hydra", "task.data_dir", "model.device_map", "methods"):
        assert key in rundir.NON_RESULT_KEYS


def test_the_task_grid_is_not_a_difference():
    """A task's GRID_KEYS only choose which items run: another grid resumes the directory, anything else is compared."""
    from harness.tasks.lines import task as lines
    from harness.tasks.longbench import task as longbench
    from harness.tasks.needle import task as needle

    assert needle.GRID_KEYS == ("lengths", "depths") and lines.GRID_KEYS == ("lengths", "positions", "samples")
    assert longbench.GRID_KEYS == ("datasets", "limit")
    base = _resolved("method=snapkv")
    other_grid = _resolved("method=snapkv", "task.depths=[5]", "task.lengths=[128,8192]")
    assert result_key_differences(base, other_grid, needle.GRID_KEYS) == []
    assert result_key_differences(base, other_grid) == ["task.depths", "task.lengths"]
    assert result_key_differences(base, _resolved("method=snapkv", "task.depths=[5]", "seed=1"), needle.GRID_KEYS) == ["seed"]
    # a run directory of the code before the default prompt style followed the model: the resolved style is compared
    older = {**base, "task": {k: v for k, v in base["task"].items() if k != "prompt_style_by_chat_format"}}
    assert result_key_differences(older, base) == []
    assert result_key_differences(older, _resolved("method=snapkv", "task.prompt_style=completion")) == ["task.prompt_style"]


def test_rundir_with_a_grid_resumes_another_grid_and_refuses_the_rest(tmp_path):
    cfg = compose("model=tiny-random", "method=snapkv")
    RunDir(tmp_path, grid=("lengths", "depths")).prepare(cfg, resume=True)
    (tmp_path / "needle_cells.jsonl").write_text(_line({"length": 1, "depth": 0.0, "_code": code_version()}))
    sub = compose("model=tiny-random", "method=snapkv", "task.lengths=[2048]", "task.depths=[50]")
    RunDir(tmp_path, grid=("lengths", "depths")).prepare(sub, resume=True)  # accepted; config.yaml holds the latest grid
    assert "- 2048" in (tmp_path / "config.yaml").read_text() and (tmp_path / "needle_cells.jsonl").exists()
    with pytest.raises(HarnessError, match=r"holds a run with a different config \(task.depths: \[50\] -> "):
        RunDir(tmp_path).check(cfg, resume=True)  # without the task's grid keys: refused as before
    with pytest.raises(HarnessError, match=r"different config \(task.prompt_style: "):
        RunDir(tmp_path, grid=("lengths", "depths")).check(compose("model=tiny-random", "method=snapkv",
                                                                   "task.prompt_style=storybook"), resume=True)


def test_rundir_refuses_another_config_unless_resume_false(tmp_path):
    cfg = compose("model=tiny-random", "method=snapkv")
    run = RunDir(tmp_path)
    run.prepare(cfg, resume=True)
    (tmp_path / "needle_cells.jsonl").write_text(_line({"length": 1, "depth": 0.0, "_code": code_version()}))
    (tmp_path / "results.json").write_text("{}")
    other = compose("model=tiny-random", "method=snapkv", "method.budget=128")
    with pytest.raises(HarnessError) as err:
        RunDir(tmp_path).check(other, resume=True)
    message = str(err.value)
    assert "\n" not in message and "method.budget: 1024 -> 128" in message and "resume=false" in message
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
# Code versions: records of other code are not resumed unless resume=force
# ---------------------------------------------------------------------------------------------------


def test_resume_values():
    assert [resume_mode(v) for v in (True, False, "true", "false", "force", "FORCE")] == [True, False, True, False, "force", "force"]
    with pytest.raises(HarnessError, match=r"resume='maybe' is not one of true, false, force"):
        resume_mode("maybe")


def test_code_fingerprint_covers_source_data_and_libraries():
    code = code_version()
    assert set(code) == {"fingerprint", "torch", "transformers"} and len(code["fingerprint"]) == 12
    import torch
    import transformers

    assert torch.__version__.startswith(code["torch"].split("+")[0]) and code["transformers"] == transformers.__version__
    assert code_changes([code, code]) == []
    other = {**code, "fingerprint": "abcdef012345", "transformers": "0.0.1"}
    assert code_changes([code, other, None]) == [
        f"code changed (fingerprint abcdef012345 -> {code['fingerprint']})", f"transformers 0.0.1 -> {code['transformers']}",
        "1 record(s) without a code fingerprint (written before fingerprints were recorded)"]


def _record(code) -> str:
    return json.dumps({"length": 1, "depth": 0.0, "response": "a", **({"_code": code} if code is not None else {})}) + "\n"


@pytest.mark.parametrize("what", ["fingerprint", "torch", "transformers", "absent"])
def test_records_of_other_code_are_refused_unless_force(tmp_path, what):
    cfg = compose("model=tiny-random", "method=snapkv")
    RunDir(tmp_path).prepare(cfg, resume=True)
    current = code_version()
    code = None if what == "absent" else {**current, what: "abcdef012345" if what == "fingerprint" else "0.0.1"}
    (tmp_path / "needle_cells.jsonl").write_text(_line({"length": 1, "depth": 50.0, "_code": current}) + _record(code))
    expected = {"fingerprint": f"code changed (fingerprint abcdef012345 -> {current['fingerprint']})",
                "torch": f"torch 0.0.1 -> {current['torch']}", "transformers": f"transformers 0.0.1 -> {current['transformers']}",
                "absent": "1 record(s) without a code fingerprint"}[what]
    with pytest.raises(HarnessError) as err:
        RunDir(tmp_path).check(cfg, resume=True)
    message = str(err.value)
    assert "\n" not in message and expected in message and "resume=force" in message and "resume=false" in message
    forced = compose("model=tiny-random", "method=snapkv", "resume=force")
    run = RunDir(tmp_path)
    run.prepare(forced, resume="force")  # accepted, and recorded
    assert expected in json.loads((tmp_path / "provenance.json").read_text())["forced_resume"][0]
    RunDir(tmp_path).check(forced, resume=True)  # a caller passing bool(cfg.resume) still honours force
    RunDir(tmp_path).prepare(cfg, resume=False)  # afresh: the records are gone, nothing to refuse
    RunDir(tmp_path).check(cfg, resume=True)


def test_a_config_difference_is_still_refused_under_force(tmp_path):
    RunDir(tmp_path).prepare(compose("model=tiny-random", "method=snapkv"), resume=True)
    with pytest.raises(HarnessError, match=r"different config \(method\.budget: 1024 -> 64;"):
        RunDir(tmp_path).check(compose("model=tiny-random", "method=snapkv", "method.budget=64", "resume=force"), resume="force")


# ---------------------------------------------------------------------------------------------------
# The run-directory lock
# ---------------------------------------------------------------------------------------------------


def test_lock_makes_a_second_holder_wait(tmp_path):
    first = RunLock(tmp_path).acquire()
    assert "pid" in (tmp_path / ".lock").read_text()
    got = threading.Event()

    def second():
        lock = RunLock(tmp_path).acquire()
        got.set()
        lock.release()

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.3)
    assert not got.is_set(), "the second holder must wait"
    first.release()
    thread.join(timeout=10)
    assert got.is_set()


def test_lock_survives_the_holder_removing_the_file(tmp_path):
    """A rolled-back run removes its directory's lock file while another waits: the waiter locks afresh."""
    first = RunLock(tmp_path).acquire()
    holders = []

    def second():
        lock = RunLock(tmp_path).acquire()
        holders.append(os.fstat(lock._fd).st_ino == os.stat(tmp_path / ".lock").st_ino)
        third = RunLock(tmp_path)
        blocked = threading.Thread(target=lambda: holders.append(third.acquire() and "third"))
        blocked.start()
        time.sleep(0.2)
        holders.append(len(holders))  # the third has not got it while the second holds it
        lock.release()
        blocked.join(timeout=10)
        third.release()

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.2)
    first.release(remove=True)
    thread.join(timeout=10)
    assert holders == [True, 1, "third"]


# ---------------------------------------------------------------------------------------------------
# SIGKILL at chosen points, then resume: the same predictions as an uninterrupted run
# ---------------------------------------------------------------------------------------------------

GRID = ("model=tiny-random", "progress=false", "method=snapkv", "method.budget=64", "task.lengths=[128,256]",
        "task.depths=[0,25,50,75,100]", "task.max_new_tokens=6")
TAG = "snapkv_c64_w32_k7_maxpool_expand"
CELLS = 10


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """Two uninterrupted runs ("reference", "again") and, meanwhile, one run killed with SIGKILL twice at chosen
    points (harness.rundir.KILL_ENV): right after its 3rd record is appended, then (resumed) in the middle of
    writing its 2nd record, leaving half a line; then resumed to the end."""
    base = tmp_path_factory.mktemp("sigkill")
    args = (*GRID, f"task.haystack_dir={small_haystack(base / 'haystack')}")
    uninterrupted: dict = {}

    def run_to_end(name):
        uninterrupted[name] = run_cli(*args, f"hydra.run.dir={base / name}", env=ENV, timeout=300)

    threads = [threading.Thread(target=run_to_end, args=(name,)) for name in ("reference", "again")]
    for thread in threads:
        thread.start()
    run_path = base / "killed"
    cells = run_path / TAG / "needle_cells.jsonl"
    killed, snapshots = [], []
    for point in ("after:3", "mid:2"):
        killed.append(run_cli(*args, f"hydra.run.dir={run_path}", env={**ENV, rundir.KILL_ENV: point}, timeout=300))
        snapshots.append(cells.read_bytes())
    final = run_cli(*args, f"hydra.run.dir={run_path}", env=ENV, timeout=300)
    for thread in threads:
        thread.join()
    return {**uninterrupted, "final": final, "killed": killed, "snapshots": snapshots, "base": base, "args": args}


def test_sigkill_then_resume_equals_an_uninterrupted_run(killed_and_resumed):
    run = killed_and_resumed
    assert run["reference"].returncode == 0, run["reference"].stderr[-3000:]
    assert [p.returncode for p in run["killed"]] == [-9, -9], [p.stderr[-2000:] for p in run["killed"]]
    assert run["final"].returncode == 0, run["final"].stderr[-3000:]
    after_first, after_second = run["snapshots"]
    assert after_first.count(b"\n") == 3 and after_first.endswith(b"\n")  # killed right after the 3rd record
    assert after_second.startswith(after_first)
    whole, half = after_second[len(after_first):].split(b"\n")  # the second kill: one more record, then half a line
    assert json.loads(whole)["_code"] and half and not half.endswith(b"}")
    assert "3 of 10 item records already done" in run["killed"][1].stdout  # the first kill's 3 records resumed
    assert "4 of 10 item records already done" in run["final"].stdout  # the half line was cut off and redone
    texts = {name: (run["base"] / name / TAG / "needle_cells.jsonl").read_text() for name in ("reference", "killed")}
    records = {name: [json.loads(line) for line in text.splitlines()] for name, text in texts.items()}  # every line valid
    keys = {name: [(r["length"], r["depth"]) for r in recs] for name, recs in records.items()}
    assert len(keys["killed"]) == len(set(keys["killed"])) == CELLS  # no duplicates, nothing missing
    assert set(keys["killed"]) == set(keys["reference"])
    by_key = {name: {(r["length"], r["depth"]): r for r in recs} for name, recs in records.items()}
    for key, ref in by_key["reference"].items():
        got = by_key["killed"][key]
        assert {k: v for k, v in got.items() if k not in TIMING_FIELDS} == {k: v for k, v in ref.items() if k not in TIMING_FIELDS}, key
        assert set(got) == set(ref)
    results = {name: json.loads((run["base"] / name / TAG / "results.json").read_text()) for name in ("reference", "killed")}
    assert results["killed"]["summary"] == results["reference"]["summary"]
    assert results["killed"]["status"] == "complete" and results["killed"]["failures"] == 0
    # The rows of results.json follow the grid order whatever order the cells finished in.
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert strip(results["killed"]["rows"]) == strip(results["reference"]["rows"])
    prov = json.loads((run["base"] / "killed" / TAG / "provenance.json").read_text())
    assert len(prov["earlier_sessions"]) == 2, "a resumed run records the sessions it was made of"


def test_rerun_with_another_config_is_refused_in_one_line(killed_and_resumed):
    run = killed_and_resumed
    run_path = run["base"] / "reference" / TAG
    before = {p.name: p.read_bytes() for p in run_path.iterdir() if p.is_file()}
    proc = run_cli(*run["args"], "task.max_new_tokens=8", "seed=1", f"hydra.run.dir={run['base'] / 'reference'}", env=ENV, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    shown = f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, shown
    assert lines[0].startswith(f"error: {run_path} holds a run with a different config ("), shown
    assert "seed: 0 -> 1" in lines[0] and "task.max_new_tokens: 6 -> 8" in lines[0], shown
    assert "resume=false" in lines[0], shown
    print(lines[0])
    assert {p.name: p.read_bytes() for p in run_path.iterdir() if p.is_file()} == before  # untouched


def test_two_runs_differ_only_in_timings(killed_and_resumed):
    """Same config, two fresh processes: byte-identical predictions once the timing fields are removed,
    and the timing fields are the only fields that differ."""
    run = killed_and_resumed
    for name in ("reference", "again"):
        assert run[name].returncode == 0, run[name].stderr[-3000:]
    texts = [(run["base"] / name / TAG / "needle_cells.jsonl").read_text() for name in ("reference", "again")]
    records = [[json.loads(line) for line in text.splitlines()] for text in texts]
    assert len(records[0]) == len(records[1]) == CELLS
    for ra, rb in zip(*records):
        assert list(ra) == list(rb)  # same fields in the same order
        assert {k for k in ra if ra[k] != rb[k]} <= TIMING_FIELDS
        assert ra["kv_positions_after_prefill"]  # snapkv ran (and recorded what it kept)
    stripped = ["\n".join(json.dumps({k: v for k, v in r.items() if k not in TIMING_FIELDS}, ensure_ascii=False) for r in recs)
                for recs in records]
    assert stripped[0] == stripped[1]
    results = [json.loads((run["base"] / name / TAG / "results.json").read_text()) for name in ("reference", "again")]
    assert results[0]["summary"] == results[1]["summary"]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert strip(results[0]["rows"]) == strip(results[1]["rows"])
    # The run directory says where the numbers came from.
    prov = json.loads((run["base"] / "reference" / TAG / "provenance.json").read_text())
    assert {"git", "code", "torch", "transformers", "python", "seed", "device", "argv", "packages"} <= set(prov)
    assert prov["seed"] == 0 and prov["device"] == "cpu" and prov["earlier_sessions"] == []
