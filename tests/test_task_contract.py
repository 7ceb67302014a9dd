"""The task contract (harness/tasks/contract.py): every generating task runs through the one runner, so the protocol
options reach every item and every record and summary carries the same common fields, whatever the task."""

from __future__ import annotations

import inspect
import json
from importlib import import_module

import pytest

from conftest import REPO, compose
from harness.app import execute
from harness.tasks import SELF_MANAGED, TASKS, contract

SNAP = "snapkv_c64_w32_k7_maxpool_expand"
TASK_ARGS = {
    "needle": (["task=needle", "task.lengths=[256]", "task.depths=[50]", "task.max_new_tokens=3"], "needle_cells.jsonl", "cells"),
    "ruler": (["task=ruler", "task.lengths=[512]", "task.samples=1", "task.tasks=[niah_single_1]"], "ruler_samples.jsonl", "samples"),
    "lines": (["task=lines", "task.lengths=[320]", "task.positions=[50]", "task.max_new_tokens=3"], "lines_cells.jsonl", "cells"),
    "longbench": (["task=longbench", f"task.data_dir={REPO / 'tests' / 'fixtures' / 'longbench'}", "task.datasets=[trec]",
                   "task.limit=1"], "pred/trec.jsonl", None),
    "gsm8k": (["task=gsm8k", f"task.data_dir={REPO / 'tests' / 'fixtures' / 'gsm8k'}", "task.limit=1", "task.max_new_tokens=3"],
              "gsm8k.jsonl", "problems"),
    "long_answers": (["task=long_answers", "task.keys=[4]", "task.samples=1", "task.tokens_per_key=2"], "long_answers.jsonl", "items"),
    "longbench_v2": (["task=longbench_v2", f"task.data_dir={REPO / 'tests' / 'fixtures' / 'longbench_v2'}", "task.limit=1"],
                     "longbench_v2.jsonl", "items"),
    "infinitebench": (["task=infinitebench", f"task.data_dir={REPO / 'tests' / 'fixtures' / 'infinitebench'}",
                       "task.tasks=[passkey]", "task.limit=1"], "infinitebench.jsonl", "items"),
}
READING_TASKS = ("observation", "perplexity")  # they generate nothing: no question, no protocol option
COMMON_RECORD = {"protocol", "prompt_tokens", "question_start", "new_tokens", "stopped_by", "prefill_seconds", "decode_seconds",
                 "question_kept"}


def test_every_task_has_the_one_module_shape():
    """validate(task_cfg) and run(cfg, loaded, settings, progress) for every per-setting task; the generating ones
    hold a GenerationTask and apply both protocol options; observation generates nothing and applies none."""
    for name, module_name in TASKS.items():
        if name in SELF_MANAGED:
            continue
        module = import_module(module_name)
        assert list(inspect.signature(module.run).parameters) == ["cfg", "loaded", "settings", "progress"], name
        assert callable(module.validate), name
        generating = [v for v in vars(module).values()
                      if inspect.isclass(v) and issubclass(v, contract.GenerationTask) and v is not contract.GenerationTask]
        if name in READING_TASKS:
            assert not generating and getattr(module, "PROTOCOL_OPTIONS", ()) == ()
        else:
            assert generating, name
            assert set(module.PROTOCOL_OPTIONS) == {"query_aware", "prefill_chunk_size"}, name


@pytest.mark.parametrize("name", sorted(TASK_ARGS))
def test_every_generating_task_applies_the_protocol_and_writes_the_common_fields(name, tmp_path, monkeypatch, one_thread):
    """Query-agnostic and chunked, two settings: every prefill the runner asks for carries both options and the
    item's split; every record and summary carries the common fields with those values."""
    args, log_file, noun = TASK_ARGS[name]
    seen = []
    real = contract.generate_settings

    def spy(loaded, methods, prompt, **kw):
        seen.append((kw["query_aware"], kw["chunk_size"], prompt.question_start, len(prompt.ids), tuple(t for t, _ in methods)))
        return real(loaded, methods, prompt, **kw)

    monkeypatch.setattr(contract, "generate_settings", spy)
    overrides = ["model=tiny-random", "progress=false", *args, "task.query_aware=false", "model.prefill_chunk_size=64",
                 "methods=[full,{name: snapkv, budget: 64}]"]
    execute(compose(*overrides), tmp_path, overrides=overrides)
    assert seen and all(qa is False and chunk == 64 for qa, chunk, *_ in seen)
    assert all(tags == ("full", SNAP) for *_, tags in seen)  # both settings from one prefill per item
    assert all(start is not None and 0 < start <= n for _, _, start, n, _ in seen)
    for tag in ("full", SNAP):
        records = [json.loads(line) for line in (tmp_path / tag / log_file).read_text().splitlines()]
        assert len(records) == len(seen)
        for r in records:
            assert COMMON_RECORD <= set(r), COMMON_RECORD - set(r)
            assert r["protocol"] == "query_agnostic" and r["question_kept"] == 1.0  # the question was prefilled after compression
            assert r["prompt_tokens"] >= r["question_start"] > 0
        summary = json.loads((tmp_path / tag / "results.json").read_text())["summary"]
        assert summary["protocol"] == "query_agnostic" and summary["prefill_chunk_size"] == 64
        if noun:
            assert summary[f"failed_{noun}"] == 0
            assert (tmp_path / tag / log_file.replace(".jsonl", ".csv")).exists()
