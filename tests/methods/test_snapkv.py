"""SnapKV: parity with the official selection rule, cache sizes, true positions, hook hygiene."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import BACKENDS, FAMILIES, compose, tiny_model
from harness.decoding import greedy_generate
from harness.errors import HarnessError
from harness.methods import build_method, compression
from harness.methods.engine import attention_modules
from harness.methods.snapkv import snapkv_compress


def official_votes(q, k, window, kernel, pooling):
    """The rule of ../shared/reference/snapkv.md, written out step by step (heads already matched)."""
    b, h, length, d = q.shape
    logits = q[:, :, -window:, :] @ k.transpose(2, 3) / math.sqrt(d)
    mask = torch.zeros(window, window)
    for i in range(window):
        for j in range(window):
            if j > i:
                mask[i, j] = torch.finfo(logits.dtype).min
    logits[:, :, :, -window:] += mask
    attn = torch.softmax(logits.float(), dim=-1).to(q.dtype)
    votes = attn[:, :, :, : length - window].sum(dim=2)
    if pooling == "maxpool":
        return F.max_pool1d(votes, kernel_size=kernel, padding=kernel // 2, stride=1)
    return F.avg_pool1d(votes, kernel_size=kernel, padding=kernel // 2, stride=1)


def kept_prefix_positions(keys_in, keys_out, window):
    """Recover which prefix positions were kept, per (batch, head), by matching key vectors."""
    b, h, length, _ = keys_in.shape
    out = []
    for bi in range(b):
        row = []
        for hi in range(h):
            prefix = keys_out[bi, hi, : keys_out.shape[2] - window]
            eq = (prefix[:, None, :] == keys_in[bi, hi, None, : length - window, :]).all(-1)
            assert (eq.sum(-1) == 1).all(), "every kept key must match exactly one prompt position"
            row.append(eq.float().argmax(-1).tolist())
        out.append(row)
    return out


@pytest.mark.parametrize("pooling", ["maxpool", "avgpool"])
@pytest.mark.parametrize("window,capacity,kernel", [(8, 40, 5), (4, 17, 7), (16, 64, 3), (8, 9, 1)])
def test_selection_matches_official_rule(pooling, window, capacity, kernel):
    torch.manual_seed(window * 100 + capacity)
    q, k, v = (torch.randn(2, 3, 96, 16) for _ in range(3))
    k_out, v_out = snapkv_compress(q, k, v, window_size=window, max_capacity_prompt=capacity, kernel_size=kernel, pooling=pooling)
    assert k_out.shape == (2, 3, capacity, 16) and v_out.shape == (2, 3, capacity, 16)
    # The window is appended unchanged.
    assert torch.equal(k_out[:, :, -window:], k[:, :, -window:]) and torch.equal(v_out[:, :, -window:], v[:, :, -window:])
    votes = official_votes(q, k, window, kernel, pooling)
    kept = kept_prefix_positions(k, k_out, window)
    for bi in range(2):
        for hi in range(3):
            idx = torch.tensor(kept[bi][hi])
            # Ties under pooling may break either way: compare the chosen positions by their pooled scores.
            chosen = votes[bi, hi, idx].sort(descending=True).values
            best = votes[bi, hi].topk(capacity - window).values
            assert torch.allclose(chosen, best, atol=0, rtol=0)
            assert torch.equal(v_out[bi, hi, : capacity - window], v[bi, hi, idx])


def test_gqa_inputs_are_expanded_like_official_repeat_kv():
    torch.manual_seed(1)
    q = torch.randn(1, 6, 50, 8)
    k, v = torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    k_out, _ = snapkv_compress(q, k, v, window_size=4, max_capacity_prompt=20, kernel_size=5, pooling="maxpool")
    k_rep = k.repeat_interleave(3, dim=1)
    ref, _ = snapkv_compress(q, k_rep, v.repeat_interleave(3, dim=1), window_size=4, max_capacity_prompt=20, kernel_size=5, pooling="maxpool")
    assert k_out.shape == (1, 6, 20, 8) and torch.equal(k_out, ref)


def test_no_compression_below_capacity_and_full_set_at_capacity():
    q, k, v = (torch.randn(1, 2, 30, 8) for _ in range(3))
    k_out, v_out = snapkv_compress(q, k, v, window_size=4, max_capacity_prompt=31, kernel_size=5, pooling="maxpool")
    assert k_out is k and v_out is v
    k_out, _ = snapkv_compress(q, k, v, window_size=4, max_capacity_prompt=30, kernel_size=5, pooling="maxpool")
    assert sorted(kept_prefix_positions(k, k_out, 4)[0][0]) == list(range(26))


@pytest.mark.parametrize(
    "options,message",
    [
        ({"kernel_size": 4}, "must be a positive odd number"),
        ({"budget": 16, "window_size": 16}, "must be larger than method.window_size"),
        ({"budget": 9000}, "exceeds the model's maximum positions"),
        ({"pooling": "median"}, "is not one of maxpool, avgpool"),
        ({"gqa": "sum"}, "is not one of expand, mean, max"),
        ({"budget": [64, 64, 64]}, "lists 3 per-layer budgets but the model has 2 layers"),
        ({"bogus": 1}, "has no option(s) bogus"),
    ],
)
def test_bad_options_fail_clearly(options, message):
    cfg = {"name": "snapkv", "budget": 64, "window_size": 8, "kernel_size": 5, "pooling": "maxpool", "gqa": "expand", **options}
    with pytest.raises(HarnessError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_method(cfg).validate(num_layers=2, max_positions=8192)


def snapkv(budget, gqa="expand", window=8, kernel=5):
    return build_method({"name": "snapkv", "budget": budget, "window_size": window, "kernel_size": kernel, "pooling": "maxpool", "gqa": gqa})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", BACKENDS)
def test_families_and_backends(family, attn):
    model = tiny_model(family, attn)
    ids = torch.randint(0, 1000, (1, 200), generator=torch.Generator().manual_seed(0))
    full = greedy_generate(model, ids, max_new_tokens=8)
    # A budget equal to the prompt: the selection runs (every layer compressed) and keeps every position,
    # so decoding is the uncompressed one.
    with compression(model, snapkv(200)) as state:
        same = greedy_generate(model, ids, max_new_tokens=8)
    assert all(r.compressed and r.positions.shape[-1] == 200 for r in state.states["snapkv"].layers.values())
    assert same.tokens == full.tokens
    for gqa, heads in (("expand", 4), ("mean", 2), ("max", 2)):
        with compression(model, snapkv(64, gqa)) as state:
            out = greedy_generate(model, ids, max_new_tokens=8, keep_cache=True)
        assert state.after == {0: (heads, 64), 1: (heads, 64)}
        for layer in out.cache.layers:  # 64 kept + 7 decoded tokens appended
            assert tuple(layer.keys.shape) == (1, heads, 64 + 7, 16)
    assert model.config._attn_implementation == attn


def test_per_layer_budgets_are_honoured():
    model = tiny_model("llama", "sdpa")
    ids = torch.randint(0, 1000, (1, 150), generator=torch.Generator().manual_seed(0))
    with compression(model, snapkv([40, 100], "mean")) as state:
        greedy_generate(model, ids, max_new_tokens=2)
    assert state.after == {0: (2, 40), 1: (2, 100)}


def test_hooks_are_removed_even_on_error():
    model = tiny_model("llama", "eager")
    modules = attention_modules(model)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa_before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with pytest.raises(ValueError):
        with compression(model, snapkv(64)):
            # the implementation keeps its own name (mask builders and kernel loaders read it)
            assert model.config._attn_implementation == "eager"
            assert getattr(ALL_ATTENTION_FUNCTIONS["eager"], "_kvharness_observer", False)
            assert all(len(m._forward_hooks) == 1 for m in modules)
            raise ValueError("boom")
    assert model.config._attn_implementation == "eager"
    assert "eager" not in ALL_ATTENTION_FUNCTIONS._global_mapping and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_before
    assert all(len(m._forward_hooks) == 0 for m in modules)
    assert not any("_kvharness_session" in m.__dict__ for m in modules)


@pytest.mark.parametrize("gqa", ["expand", "mean"])
def test_decode_step_attends_over_kept_keys_at_true_positions(gqa):
    """One decode step after compression equals attention computed by hand over the kept keys,
    with the new token's query and key rotated at its true position (prompt length)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model("llama", "eager", layers=1)
    length = 120
    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(3))
    with compression(model, snapkv(40, gqa)):
        out = greedy_generate(model, ids, max_new_tokens=1, keep_cache=True)
    layer = out.cache.layers[0]
    kept_k, kept_v = layer.keys.clone(), layer.values.clone()
    attn = model.model.layers[0].self_attn
    captured = {}
    handle = attn.register_forward_hook(lambda m, a, kw, o: captured.update(out=o[0]), with_kwargs=True)
    token = torch.tensor([[out.tokens[0][0]]])
    with compression(model, snapkv(40, gqa)):
        model(input_ids=token, position_ids=torch.tensor([[length]]), use_cache=True, cache=out.cache)
    handle.remove()

    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(token))
    cos, sin = model.model.rotary_emb(hidden, torch.tensor([[length]]))
    q = attn.q_proj(hidden).view(1, 1, -1, 16).transpose(1, 2)
    k = attn.k_proj(hidden).view(1, 1, -1, 16).transpose(1, 2)
    v = attn.v_proj(hidden).view(1, 1, -1, 16).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    groups = q.shape[1] // kept_k.shape[1] if gqa == "mean" else 1
    if gqa == "expand":
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    keys = torch.cat([kept_k, k], dim=2).repeat_interleave(groups, dim=1)
    values = torch.cat([kept_v, v], dim=2).repeat_interleave(groups, dim=1)
    weights = torch.softmax(q @ keys.transpose(2, 3) / math.sqrt(16), dim=-1)
    expected = attn.o_proj((weights @ values).transpose(1, 2).reshape(1, 1, -1))
    assert torch.allclose(captured["out"], expected, atol=1e-5)


def test_budget_covering_prompt_matches_full_on_smollm2(smollm2):
    prompt = smollm2.encode(smollm2.format_chat([{"role": "user", "content": "Name three colours of the rainbow."}]))
    ids = torch.tensor([prompt])
    full = greedy_generate(smollm2.model, ids, max_new_tokens=12, eos_token_ids=smollm2.eos_token_ids)
    with compression(smollm2.model, snapkv(len(prompt), "expand", window=4)) as state:
        same = greedy_generate(smollm2.model, ids, max_new_tokens=12, eos_token_ids=smollm2.eos_token_ids)
    layers = state.states["snapkv"].layers
    assert len(layers) == 30 and all(r.compressed and r.after == (9, len(prompt)) for r in layers.values())  # selected, all kept
    assert same.tokens == full.tokens


@pytest.mark.parametrize(
    "preset,expected",
    [
        ("snapkv_longbench_c1024", (1024, 32, 7, "maxpool")),
        ("snapkv_longbench_c2048", (2048, 32, 7, "maxpool")),
        ("snapkv_longbench_c4096", (4096, 32, 7, "maxpool")),
        ("snapkv_needle", (1024, 16, 5, "maxpool")),
    ],
)
def test_paper_presets(preset, expected):
    method = compose(f"method={preset}").method
    assert (method.budget, method.window_size, method.kernel_size, method.pooling) == expected
    assert method.name == "snapkv" and method.gqa == "expand"
