"""Decode-time compression (harness/methods/decode_time.py).

- A methods list of decode-time settings (one shared prefill, decoded together) gives each setting's separate
  run token for token, in both protocols.
- StreamingLLM's rolling cache equals an independent reference: the FULL cache with an attention mask that hides
  everything but the sinks and the most recent tokens at every step (true positions), logits compared.
- Every eviction equals the same masked full-cache reference for a scored method (TOVA, the official rule at
  interval 1; SnapKV every 4 tokens): the model never reads a dropped entry and every kept entry sits at its
  true position. TOVA's choice itself is checked against the full model's own attention weights.
- rerotate: a key rotated by `rotate_keys` equals the key the model's RoPE gives at the new position.
- bad options fail in one line.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from harness.errors import HarnessError
from harness.methods import build_method
from harness.methods.decode_time import rotate_keys
from harness.methods.engine import rotary_of
from harness.models import LoadedModel
from harness.generation.generate import generate_settings
from harness.generation.prompt import Prompt

PROMPT, QUESTION_AT, NEW = 120, 100, 24


def loaded_of(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name="tiny", chat_format="none", eos_token_ids=[], max_positions=4096,
                       prompt_max_length=None, device=torch.device("cpu"))


def prompt_ids(length: int = PROMPT, seed: int = 0) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_settings():
    return [
        ("full", build_method({"name": "full"})),
        ("snapkv_d4", build_method({"name": "snapkv", "budget": 64, "window_size": 8, "kernel_size": 5, "pooling": "maxpool",
                                    "gqa": "expand", "decode_interval": 4, "decode_budget": 40, "decode_queries": 16})),
        ("h2o_d3", build_method({"name": "h2o", "budget": 48, "window_size": 8, "block_size": 64, "gqa": "mean",
                                 "decode_interval": 3, "decode_budget": 36})),
        ("tova_d1", build_method({"name": "tova", "budget": 40, "window_size": 0, "gqa": "mean", "decode_interval": 1})),
        ("rolling", build_method({"name": "streamingllm", "budget": 32, "sink_tokens": 4, "window_size": 0, "gqa": "mean",
                                  "decode_interval": 1})),
        ("rolling_rerot", build_method({"name": "streamingllm", "budget": 32, "sink_tokens": 4, "window_size": 0, "gqa": "mean",
                                        "decode_interval": 1, "rerotate": True})),
        ("knorm_ratio", build_method({"name": "knorm", "budget": 64, "window_size": 0, "gqa": "mean", "decode_interval": 5,
                                      "decode_ratio": 0.4})),
        ("rkv", build_method({"name": "rkv", "budget": 40, "window_size": 8, "decode_interval": 6})),
    ]


@pytest.mark.parametrize("query_aware", [True, False])
def test_a_decode_time_methods_list_equals_separate_runs(query_aware, one_thread):
    model = tiny_model("llama", "eager", heads=4, kv_heads=2)
    loaded = loaded_of(model)
    prompt = Prompt(prompt_ids(), QUESTION_AT)
    methods = decode_settings()
    shared = generate_settings(loaded, methods, prompt, query_aware=query_aware, max_new_tokens=NEW, ignore_eos=True)
    for tag, method in methods:
        alone = generate_settings(loaded, [(tag, method)], prompt, query_aware=query_aware, max_new_tokens=NEW, ignore_eos=True)[tag]
        assert shared[tag].generation.tokens == alone.generation.tokens, (tag, query_aware)
        assert shared[tag].generation.decoded_with == f"batch of {len(methods)}"
        if tag != "full":
            diag = shared[tag].diagnostics
            assert diag["decode_events"] == alone.diagnostics["decode_events"]
            assert diag["decode_compressions"] > 0 and diag["peak_cache_bytes"] > 0
            assert len(diag["cache_entries_by_step"]) == NEW - 1
    rolling = shared["rolling"].diagnostics
    # after the first step (query-agnostic: which also holds the 20 question tokens), 32 kept + the token just appended
    assert set(rolling["cache_entries_by_step"][1:]) == {33}
    ratio = shared["knorm_ratio"].diagnostics["decode_events"]
    assert [e["after"] for e in ratio] == [int(e["seen"] * 0.4) for e in ratio]  # kvpress's count of all tokens seen


def masked_full_reference(model, ids: list[int], new: int, kept_at) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding over the FULL cache; before step t's forward, `kept_at(t, n)` says which of the n cached
    positions the compressed cache still holds: the others are masked out (eager additive mask)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1]
        tokens, seen = [], []
        for t in range(new):
            tok = int(logits.argmax(-1))
            tokens.append(tok)
            seen.append(logits[0])
            if t == new - 1:
                break
            n = cache.get_seq_length()
            mask = torch.full((1, 1, 1, n + 1), float("-inf"))
            mask[..., list(kept_at(t, n)) + [n]] = 0.0
            out = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[n]]), past_key_values=cache,
                        attention_mask=mask, use_cache=True)
            logits = out.logits[:, -1]
    return tokens, torch.stack(seen)


def test_the_rolling_cache_equals_the_full_cache_masked_to_sinks_and_recent(one_thread):
    model = tiny_model("llama", "eager", heads=4, kv_heads=2)
    ids = prompt_ids(80)
    method = build_method({"name": "streamingllm", "budget": 24, "sink_tokens": 4, "window_size": 0, "gqa": "mean",
                           "decode_interval": 1})
    out = generate_settings(loaded_of(model), [("rolling", method)], Prompt(ids), max_new_tokens=20, ignore_eos=True)["rolling"]
    # the compressed cache before step t holds: sinks 0..3 + the 20 most recent of the n positions
    ref, _ = masked_full_reference(model, ids, 20, lambda t, n: [*range(4), *range(n - 20, n)])
    assert out.generation.tokens[0] == ref


def test_tova_official_rule_equals_the_full_model_own_attention(one_thread):
    """TOVA at interval 1, window 0 (the official rule): after every step keep the `budget` positions the newest
    token attends to most (mean over heads). The reference reads the full model's attention weights."""
    model = tiny_model("llama", "eager", heads=4, kv_heads=2, layers=1)
    ids, budget, new = prompt_ids(60), 30, 16
    method = build_method({"name": "tova", "budget": budget, "window_size": 0, "gqa": "mean", "decode_interval": 1})
    out = generate_settings(loaded_of(model), [("tova", method)], Prompt(ids), max_new_tokens=new, ignore_eos=True)["tova"]
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        res = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, output_attentions=True)
        attn = res.attentions[0][0, :, -1].mean(0)  # prefill: the last prompt token's attention
        kept = sorted(attn.topk(budget).indices.tolist())
        logits, tokens = res.logits[:, -1], []
        for t in range(new):
            tokens.append(int(logits.argmax(-1)))
            if t == new - 1:
                break
            n = cache.get_seq_length()
            mask = torch.full((1, 1, 1, n + 1), float("-inf"))
            mask[..., kept + [n]] = 0.0
            res = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[n]]), past_key_values=cache,
                        attention_mask=mask, use_cache=True, output_attentions=True)
            logits = res.logits[:, -1]
            weights = res.attentions[0][0, :, -1].mean(0)  # over the kept entries and the new one (masked: 0)
            candidates = kept + [n]
            top = weights[candidates].topk(budget).indices.tolist()
            kept = sorted(candidates[i] for i in top)
    assert out.generation.tokens[0] == tokens


def test_rerotated_keys_equal_keys_rotated_at_the_new_positions():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model("llama", "eager")
    rotary = rotary_of(model)
    k = torch.randn(1, 2, 5, 16)
    old = torch.tensor([3, 10, 500, 501, 777])
    new = torch.tensor([0, 1, 2, 3, 4])
    cos, sin = rotary(0, old)
    k_old, _ = apply_rotary_pos_emb(k, k, cos[None, None], sin[None, None], unsqueeze_dim=0)
    cos, sin = rotary(0, new)
    k_new, _ = apply_rotary_pos_emb(k, k, cos[None, None], sin[None, None], unsqueeze_dim=0)
    delta = (new - old).expand(1, 2, 5)
    torch.testing.assert_close(rotate_keys(k_old, delta, rotary, 0), k_new, atol=5e-5, rtol=1e-4)  # float32 RoPE at ~800 rad


@pytest.mark.parametrize("options, message", [
    ({"name": "snapkv", "budget": 64, "decode_budget": 32}, "need method.decode_interval"),
    ({"name": "snapkv", "budget": 64, "decode_interval": 0}, "positive integer"),
    ({"name": "snapkv", "budget": 64, "decode_interval": 8, "decode_budget": 16, "decode_ratio": 0.5}, "exclusive"),
    ({"name": "snapkv", "budget": 64, "window_size": 32, "decode_interval": 8, "decode_budget": 16}, "larger than method.window_size"),
    ({"name": "snapkv", "budget": 64, "window_size": 32, "decode_interval": 8, "decode_queries": 8}, "at least the 32 queries"),
    ({"name": "adakv", "budget": 64, "decode_interval": 8}, "cannot compress while decoding"),
])
def test_bad_decode_options_fail_in_one_line(options, message):
    with pytest.raises(HarnessError, match=message):
        build_method(options)


def test_rkv_scores_follow_the_paper_formula():
    """R-KV's score from its definition, computed here with the explicit n x n cosine matrix and a plain loop."""
    import math

    torch.manual_seed(0)
    b, hq, hkv, length, d, alpha, lam = 1, 4, 2, 30, 16, 8, 0.1
    q, k = torch.randn(b, hq, alpha, d), torch.randn(b, hkv, length, d)
    method = build_method({"name": "rkv", "budget": 16, "window_size": alpha, "kernel_size": 3, "mix_lambda": lam})
    got = method.prefix_scores(q, k, 0)
    n = length - alpha
    for h in range(hq):
        kv = h // (hq // hkv)
        logits = q[0, h] @ k[0, kv].T / math.sqrt(d)
        logits[:, n:] += torch.triu(torch.full((alpha, alpha), float("-inf")), 1)
        attn = torch.softmax(logits, dim=-1)[:, :n].mean(0)
        pooled = torch.stack([attn[max(0, j - 1):j + 2].max() for j in range(n)])
        unit = k[0, kv] / k[0, kv].norm(dim=-1, keepdim=True)
        cos = unit @ unit.T
        cos.fill_diagonal_(0)
        red = torch.softmax(cos.sum(-1)[:n] / (length - 1), dim=0)
        torch.testing.assert_close(got[0, h], lam * pooled - (1 - lam) * red, atol=1e-6, rtol=1e-5)



def test_configs_carry_the_decode_options_and_tags_say_them():
    from conftest import compose
    from harness.methods import build_method as build

    plain = compose("method=snapkv")
    assert plain.method.tag == "snapkv_c1024_w32_k7_maxpool_expand" and build(plain.method).decode is None  # earlier tags stay
    cfg = compose("method=snapkv", "method.decode_interval=64", "method.decode_budget=512")
    assert cfg.method.tag == "snapkv_c1024_w32_k7_maxpool_expand_d64c512"
    rule = build(cfg.method).decode
    assert (rule.interval, rule.budget, rule.queries, rule.rerotate) == (64, 512, 256, False)
    assert build(cfg.method).describe(2)["decode"]["budget"] == 512
    rkv = compose("method=rkv")
    assert rkv.method.tag == "rkv_c1024_w8_k7_l0.1_mean_d128" and build(rkv.method).decode.interval == 128
    assert compose("method=streamingllm", "method.decode_interval=1", "method.rerotate=true").method.tag.endswith("_d1_rerot")


def test_hybrid_sliding_layers_are_left_to_the_model(one_thread):
    """Gemma 3-style model (5 sliding layers of 16 tokens : 1 full): only the full layer is compressed while decoding;
    the methods list still equals the separate runs."""
    import tiny_models

    model = tiny_models.tiny_model("gemma3", attn="eager")
    loaded = loaded_of(model)
    prompt = Prompt(prompt_ids(80), 64)
    methods = [("full", build_method({"name": "full"})),
               ("tova_d2", build_method({"name": "tova", "budget": 40, "gqa": "mean", "decode_interval": 2})),
               ("rolling", build_method({"name": "streamingllm", "budget": 24, "window_size": 0, "decode_interval": 1}))]
    shared = generate_settings(loaded, methods, prompt, max_new_tokens=20, ignore_eos=True)
    for tag, method in methods:
        alone = generate_settings(loaded, [(tag, method)], prompt, max_new_tokens=20, ignore_eos=True)[tag]
        assert shared[tag].generation.tokens == alone.generation.tokens, tag
    diag = shared["rolling"].diagnostics
    assert diag["decode_compressions"] > 0 and set(diag["cache_entries_by_step"][1:]) == {25}
