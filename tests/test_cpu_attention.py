"""Decode-step attention on a CPU as two matmuls (harness/cpu_attention.py), and float16 refused on a CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import compose
from harness.cpu_attention import single_query_attention, use_matmul_decode
from harness.decoding import greedy_generate
from harness.errors import HarnessError
from harness.models import load_model
from tiny_models import tiny_model


def reference(query, key, value, mask, scaling):
    """torch's SDPA with the keys expanded to the query heads (no grouping in play)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=None if mask is None else
                                         (mask if mask.dtype == torch.bool else mask.float()), scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)], ids=str)
@pytest.mark.parametrize("layout", ["gqa", "expanded", "ragged", "bool_mask", "view_with_room"])
def test_single_query_attention_equals_sdpa(dtype, tol, layout):
    gen = torch.Generator().manual_seed(0)
    b, hq, d, k = 2, 6, 16, 37
    hkv = {"gqa": 2, "expanded": 6, "ragged": 1, "bool_mask": 3, "view_with_room": 2}[layout]
    query = torch.randn(b, hq, 1, d, generator=gen).to(dtype)
    key, value = (torch.randn(b, hkv, k, d, generator=gen).to(dtype) for _ in range(2))
    if layout == "view_with_room":  # a cache layer in place: heads not contiguous (the per-head path in half precision)
        key, value = (torch.cat([t, torch.zeros(b, hkv, 5, d, dtype=dtype)], dim=2)[:, :, :k] for t in (key, value))
        assert not key.is_contiguous()
    mask = None
    if layout == "ragged":  # a per-head additive mask in the dtype's own minimum (ragged.pending_mask)
        visible = torch.rand(b, hq, 1, k, generator=gen) < 0.5
        visible[..., 0] = True
        mask = torch.zeros(b, hq, 1, k, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    elif layout == "bool_mask":
        mask = torch.rand(b, 1, 1, k, generator=gen) < 0.7
        mask[..., 0] = True
    got, none = single_query_attention(query, key, value, mask, 0.3)
    assert none is None and got.shape == (b, 1, hq, d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), reference(query, key, value, mask, 0.3), atol=tol, rtol=tol)


def test_a_cpu_model_decodes_the_same_tokens_with_either_path(one_thread):
    model = tiny_model("llama", attn="sdpa")
    ids = torch.randint(3, 1000, (1, 50), generator=torch.Generator().manual_seed(0))
    plain = greedy_generate(model, ids, max_new_tokens=12, ignore_eos=True).tokens
    calls = []
    from harness.cpu_attention import MARK

    assert use_matmul_decode(model) == "matmul"
    import harness.cpu_attention as cpu_attention

    real = cpu_attention.single_query_attention
    cpu_attention.single_query_attention = lambda *a: calls.append(1) or real(*a)
    try:
        fast = greedy_generate(model, ids, max_new_tokens=12, ignore_eos=True).tokens
    finally:
        cpu_attention.single_query_attention = real
        assert use_matmul_decode(model, "sdpa") == "sdpa"
    assert fast == plain and len(calls) == 11 * model.config.num_hidden_layers  # every decode step, every layer
    assert not any(getattr(m, MARK, False) for m in model.modules())
    with pytest.raises(HarnessError, match="cpu_decode_attention"):
        use_matmul_decode(model, "fast")


def test_load_model_records_the_decode_attention():
    loaded = load_model(compose("model=tiny-random").model)
    assert loaded.info["cpu_decode_attention"] == "matmul"
    loaded = load_model(compose("model=tiny-random", "+model.cpu_decode_attention=sdpa").model)
    assert loaded.info["cpu_decode_attention"] == "sdpa"


def test_float16_on_a_cpu_is_refused_beyond_tiny_models():
    assert load_model(compose("model=tiny-random", "model.dtype=float16").model).model.dtype == torch.float16  # 3M parameters
    larger = ("model=tiny-random", "model.dtype=float16", "model.architecture.hidden_size=256")  # 13M parameters
    with pytest.raises(HarnessError, match="float16 on a CPU runs ~50x slower"):
        load_model(compose(*larger).model)
    assert load_model(compose(*larger, "+model.allow_cpu_float16=true").model).model.dtype == torch.float16


# ------------------------------------------------------------------------------------------ model.dtype=auto

@pytest.mark.parametrize("flags, expected", [((False, False), ("float32", "neither AVX512-BF16 nor AMX")),
                                             ((True, False), ("bfloat16", "avx512_bf16")),
                                             ((True, True), ("bfloat16", "amx_bf16"))])
def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it_natively(monkeypatch, flags, expected):
    from harness.models import resolve_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: flags[0])
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: flags[1])
    name, why = resolve_dtype("auto", torch.device("cpu"))
    assert name == expected[0] and expected[1] in why
    assert resolve_dtype("float32", torch.device("cpu")) == ("float32", None)  # a named dtype is taken as given


def test_the_packaged_models_default_to_auto_and_the_cpu_presets_keep_float32():
    assert compose().model.dtype == "auto" and compose("model=gemma3-270m").model.dtype == "auto"
    assert compose("+experiment=ruler_methods_cpu").model.dtype == "float32"  # the committed tables' dtype
    assert compose("+experiment=ruler_methods_cpu", "model.dtype=auto").model.dtype == "auto"


def test_a_run_records_the_dtype_auto_chose(tmp_path, monkeypatch, one_thread):
    """config.yaml holds the dtype that ran (a resume on a machine resolving otherwise is a different config), the
    results the rule; the model computes in it."""
    import json

    from harness.app import execute
    from test_robustness import small_haystack

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    args = ["model=tiny-random", "model.dtype=auto", "progress=false", "task.max_new_tokens=2", "task.lengths=[128]",
            "task.depths=[50]", f"task.haystack_dir={small_haystack(tmp_path / 'haystack')}"]
    execute(compose(*args), tmp_path / "run", overrides=args)
    config = (tmp_path / "run" / "full" / "config.yaml").read_text()
    assert "dtype: bfloat16" in config and "dtype_from: auto" in config
    model = json.loads((tmp_path / "run" / "full" / "results.json").read_text())["model"]
    assert model["dtype"] == "bfloat16" and model["dtype_rule"] == "auto: bfloat16 (the CPU has avx512_bf16)"
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)  # another machine: float32
    with pytest.raises(HarnessError, match="different config"):
        execute(compose(*args), tmp_path / "run", overrides=args)


def test_a_plan_resolves_auto_for_the_gpu_it_plans(monkeypatch):
    """task=plan plans a CUDA run: `auto` is the GPU's bfloat16 whatever this CPU computes."""
    from harness.models import resolve_config_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    planned, here = compose("task=plan", "model.device=cpu"), compose("model.device=cpu")
    resolve_config_dtype(planned)
    resolve_config_dtype(here)
    planned, here = planned.model, here.model
    assert (planned.dtype, here.dtype) == ("bfloat16", "float32") and planned.dtype_from == "auto"
