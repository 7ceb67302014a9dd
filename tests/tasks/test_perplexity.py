"""task=perplexity (harness/tasks/perplexity): chunked teacher-forced NLL under a decode-time rule.

References are independent of the code under test: one forward of the whole text with the model's own loss
(the full cache), and one forward of the whole text with a 4-D attention mask that lets token p see only the
sinks and the `budget` most recent positions (StreamingLLM's rolling cache, exact at chunk_size=1).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from harness.errors import HarnessError
from harness.methods import build_method
from harness.models import LoadedModel
from harness.generation.prompt import Setting
from harness.tasks.perplexity.task import check_settings, document_nll, paired_against_full, summarize, table
from metrics.perplexity import bucket_perplexity, perplexity


def loaded_of(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name="tiny", chat_format="none", eos_token_ids=[], max_positions=4096,
                       prompt_max_length=None, device=torch.device("cpu"))


def text(n=96, seed=0) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def masked_nll(model, ids, budget, sinks) -> list[float]:
    n = len(ids)
    p = torch.arange(n)
    visible = (p[None, :] <= p[:, None]) & ((p[None, :] < sinks) | (p[None, :] > p[:, None] - (budget - sinks) - 1))
    mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), attention_mask=mask).logits[0]
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none").tolist()


@pytest.mark.parametrize("chunk", [1, 7, 200])
def test_full_cache_chunks_equal_one_forward(chunk, one_thread):
    model = tiny_model("llama", "eager")
    ids = text()
    got = document_nll(loaded_of(model), build_method({"name": "full"}), ids, chunk)
    with torch.inference_mode():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert len(got["nll"]) == len(ids) - 1
    assert math.isclose(math.log(got["perplexity"]), float(loss), rel_tol=1e-4)


@pytest.mark.parametrize("sinks", [0, 4])
def test_streaming_at_chunk_1_equals_the_masked_full_text(sinks, one_thread):
    model = tiny_model("llama", "eager")
    ids, budget = text(), 24
    method = build_method({"name": "streamingllm", "budget": budget, "sink_tokens": sinks, "window_size": 0, "gqa": "mean",
                           "decode_interval": 1})
    got = document_nll(loaded_of(model), method, ids, 1)
    # after each token the cache keeps `budget` entries: the next token sees them and itself
    ref = masked_nll(model, ids, budget, sinks)
    torch.testing.assert_close(torch.tensor(got["nll"]), torch.tensor(ref), atol=2e-4, rtol=1e-4)
    assert got["decode_compressions"] == len(ids) - 1 - budget
    assert max(got["cache_entries_by_chunk"]) == budget + 1


def test_summary_buckets_and_paired_intervals():
    rows_full = [{"document": 0, "nll": [1.0] * 8 + [1.0] * 8, "seconds": 1.0}]
    rows_win = [{"document": 0, "nll": [1.0] * 8 + [2.0] * 8, "seconds": 1.0, "decode_events": [{"seen": 9}], "peak_cache_bytes": 10}]
    s = summarize(rows_win, 8)
    assert s["by_position"] == {"1": round(math.e, 4), "9": round(math.exp(2), 4)}
    assert s["perplexity_after_first_compression"] == round(math.exp(2), 4)
    paired = paired_against_full({"full": rows_full, "window": rows_win}, 8)["window"]
    assert paired["log_ppl_diff"] == 0.5 and paired["units"] == 2
    assert bucket_perplexity([0.0, 0.0, 1.0], 2) == [(1, 1.0), (3, math.e)]
    results = {"full": {"summary": summarize(rows_full, 8)}, "window": {"summary": {**s, "against_full": paired}}}
    text = table(results, "tiny", 4)
    assert "| full | 16 | 2.718 | – | – |" in text and f"| window | 16 | {math.exp(1.5):.3f} | 7.389 (9) | 1.649 [" in text
    assert perplexity([]) is None


def test_a_prefill_only_method_is_refused():
    s = Setting("snapkv", build_method({"name": "snapkv", "budget": 64}), None, None)
    with pytest.raises(HarnessError, match="decode_interval"):
        check_settings([s])
