"""The greedy decode loop: exactly `generate`'s tokens, last-position logits only, stops, batching."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, tiny_model
from harness.decoding import cache_argument, greedy_generate


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_generate_on_tiny_models(family):
    model = tiny_model(family, "sdpa")
    ids = torch.randint(0, 1000, (1, 50), generator=torch.Generator().manual_seed(1))
    ours = greedy_generate(model, ids, max_new_tokens=20, eos_token_ids=[7])
    ref = model.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=7, pad_token_id=0)[0, 50:].tolist()
    assert ours.tokens[0] == ref


def test_matches_generate_on_smollm2(smollm2):
    text = smollm2.format_chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    ids = torch.tensor([smollm2.encode(text)])
    ours = greedy_generate(smollm2.model, ids, max_new_tokens=24, eos_token_ids=smollm2.eos_token_ids)
    ref = smollm2.model.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=smollm2.eos_token_ids,
                                 pad_token_id=smollm2.eos_token_ids[0])[0, ids.shape[1]:].tolist()
    assert ours.tokens[0] == ref
    assert "Paris" in smollm2.tokenizer.decode(ours.tokens[0])


def test_prefill_computes_logits_for_the_last_position_only():
    model = tiny_model("llama", "sdpa")
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape)))
    greedy_generate(model, torch.randint(0, 1000, (1, 300)), max_new_tokens=3)
    handle.remove()
    assert seen == [(1, 1, 64)] * 3


def test_min_new_tokens_stop_tokens_and_ignore_eos():
    model = tiny_model("llama", "sdpa")
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(2))
    free = greedy_generate(model, ids, max_new_tokens=10)
    first = free.tokens[0][0]
    stopped = greedy_generate(model, ids, max_new_tokens=10, eos_token_ids=[first])
    assert stopped.tokens[0] == [first] and stopped.stopped_by == ["eos"]
    guarded = greedy_generate(model, ids, max_new_tokens=10, stop_token_ids=[first], min_new_tokens=1)
    assert guarded.tokens[0][0] != first
    forced = greedy_generate(model, ids, max_new_tokens=10, eos_token_ids=[first], ignore_eos=True)
    assert forced.tokens[0] == free.tokens[0] and len(forced.step_seconds) == 9


def test_stop_strings(smollm2):
    text = smollm2.format_chat([{"role": "user", "content": "List the numbers one to five, one per line."}])
    ids = torch.tensor([smollm2.encode(text)])
    out = greedy_generate(smollm2.model, ids, max_new_tokens=30, stop_strings=["\n"], tokenizer=smollm2.tokenizer)
    assert out.stopped_by == ["stop_string"]
    assert "\n" in smollm2.tokenizer.decode(out.tokens[0]) and len(out.tokens[0]) < 30


def test_batch_rows_equal_single_rows():
    model = tiny_model("qwen2", "eager")
    ids = torch.randint(0, 1000, (2, 30), generator=torch.Generator().manual_seed(4))
    both = greedy_generate(model, ids, max_new_tokens=6)
    for row in range(2):
        assert greedy_generate(model, ids[row : row + 1], max_new_tokens=6).tokens[0] == both.tokens[row]


def test_cache_argument_name_follows_the_installed_transformers():
    model = tiny_model("llama", "sdpa")
    import inspect

    assert cache_argument(model) in inspect.signature(model.forward).parameters


def test_timings_wait_for_every_gpu_of_a_sharded_model(monkeypatch):
    """device_map=auto puts later layers on other GPUs: a step is only done when every one of them is, so `_sync`
    waits for each CUDA device the model's tensors are on, and the loop passes the model, not the input's device."""
    from types import SimpleNamespace

    from harness import decoding

    class Sharded(torch.nn.Module):  # stands in for a model spread over cuda:0 and cuda:1 (this machine may have no GPU)
        def parameters(self, recurse=True):
            return iter([SimpleNamespace(device=torch.device("cuda", 1)), SimpleNamespace(device=torch.device("cuda", 0)),
                         SimpleNamespace(device=torch.device("cpu"))])

        def buffers(self, recurse=True):
            return iter([SimpleNamespace(device=torch.device("cuda", 1))])

    waited = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    decoding._sync(Sharded())
    assert waited == [torch.device("cuda", 0), torch.device("cuda", 1)]
    waited.clear()
    decoding._sync(torch.device("cpu"))
    assert waited == []

    seen = []
    monkeypatch.setattr(decoding, "_sync", seen.append)
    model = tiny_model("llama", "sdpa")
    out = greedy_generate(model, torch.randint(0, 1000, (1, 20)), max_new_tokens=4)
    assert len(out.step_seconds) == 3 and len(seen) == 2 + 3 and all(s is model for s in seen)
