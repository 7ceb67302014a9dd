"""One out-of-memory detector (harness.errors.is_out_of_memory) for the shared-prefill fallback, the per-item
failure records and the bench: every form running out of memory takes is recognised by all three."""

from __future__ import annotations

import torch

from harness import errors
from harness.generation import generate
from harness.generation.generate import generate_settings
from harness.generation.prompt import Prompt
from harness.tasks import contract
from harness.tasks.bench import worker as bench_worker
from test_batched_items import loaded_of, methods
from tiny_models import tiny_model

OOM = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), MemoryError(),
       RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"),
       RuntimeError("mmap failed: Cannot allocate memory"), RuntimeError("std::bad_alloc")]


def test_one_out_of_memory_detector_for_the_fallback_and_the_bench(monkeypatch, one_thread):
    assert all(errors.is_out_of_memory(e) for e in OOM)
    assert not errors.is_out_of_memory(RuntimeError("shape mismatch")) and not errors.is_out_of_memory(ValueError("memory"))
    assert bench_worker.is_out_of_memory is errors.is_out_of_memory and generate.is_out_of_memory is errors.is_out_of_memory
    assert contract.is_out_of_memory is errors.is_out_of_memory
    # the shared-prefill fallback splits the settings on each form (here the host's std::bad_alloc), down to one
    # setting per prefill, which then fits; the failure record of a setting that fails alone says "oom"
    original, groups = generate._generate_group, []

    def fails_when_shared(loaded, group, prompts, **options):
        groups.append([tag for tag, _ in group])
        if len(group) > 1:
            raise RuntimeError("std::bad_alloc")
        return original(loaded, group, prompts, **options)

    monkeypatch.setattr(generate, "_generate_group", fails_when_shared)
    chosen = [(tag, m) for tag, m in methods() if tag in ("full", "snapkv")]
    prompt = Prompt(torch.arange(3, 115).tolist(), 96)
    out = generate_settings(loaded_of(tiny_model("llama")), chosen, prompt, max_new_tokens=2)
    assert groups == [["full", "snapkv"], ["full"], ["snapkv"]]
    assert all(out[tag].error is None and out[tag].diagnostics["shared_with"] == [tag] for tag, _ in chosen)
    assert contract._failure("item", ("a",), RuntimeError("std::bad_alloc"), "")["oom"] is True
