"""Today's model families through the engine (harness/methods/layout.py), on their tiny random configs
(conf/model/tiny-<family>.yaml, built from the config classes: no download).

gpt-oss (learned sinks, sliding : full), Gemma 2 (soft-capped logits, sliding : global), Llama 4 (chunked
RoPE layers : a global NoPE layer), SmolLM3 (RoPE and NoPE global layers), Qwen3.5 (linear-attention layers :
a gated full-attention layer) and Gemma 4 (sliding : global layers of another head dim, the last layers
reading earlier layers' KV) run every registered method; DeepSeek V3 (multi-head latent attention) is
refused in one line before any work. The reference decodes from the full cache with an attention function
written in test_engine.py (`Reference`), hiding what each method dropped.
"""

from __future__ import annotations

import pytest
import torch

from test_engine import QUESTION_AT, Reference, engine_logits, keep_masks, loaded_of, prompt_ids, registered_methods
from tiny_models import family_model

from harness.errors import HarnessError
from harness.methods import build_method, compression
from harness.methods.attention import window_attention
from harness.generation.generate import generate_settings
from harness.generation.prompt import Prompt, Question

NEW = 6  # tokens decoded per setting (test_engine decodes 10: these run every method on six families)
RUNNING = ("gpt-oss", "gemma2", "llama4", "smollm3", "qwen3.5", "gemma4")
# Which layers each family compresses and why the others stay whole: written from each family's published layout
# (the yaml's layer_types, no_rope_layers, num_kv_shared_layers), not read from the engine.
LAYERS = {
    "gpt-oss": ([1], {"sliding_window": [0]}),
    "gemma2": ([1], {"sliding_window": [0]}),
    "llama4": ([3], {"chunked_attention": [0, 1, 2]}),
    "smollm3": ([0, 1, 2, 3], {}),
    "qwen3.5": ([3], {"linear_attention": [0, 1, 2]}),
    "gemma4": ([1, 3], {"sliding_window": [0, 2], "shared_kv": [4, 5]}),
}
_MODELS: dict = {}


def model_of(family: str):
    if family not in _MODELS:
        _MODELS[family] = family_model(family)
    return _MODELS[family]


def every_method(family: str, gqa: str) -> tuple[dict, dict]:
    """(runs, refused): every registered compressing method at budget 48, split by whether this family takes it.
    KVzip replays over every layer's full cache: it runs on all-global models only (SmolLM3 here)."""
    runs, refused = {}, {}
    for name, method in registered_methods(gqa).items():
        if not method.compresses:
            continue
        (runs if method.supports_sliding_layers or family == "smollm3" else refused)[name] = method
    return runs, refused


@pytest.mark.parametrize("family", RUNNING)
def test_every_method_decodes_like_the_masked_full_cache(family, one_thread):
    """Both protocols (query-aware with gqa=expand, query-agnostic with gqa=mean), every method in one shared prefill:
    each decodes exactly as the full cache with its dropped positions hidden, and says which layers it compressed."""
    model = model_of(family)
    loaded = loaded_of(model)
    ids = prompt_ids(seed=3)
    prompt = Prompt(ids[0].tolist(), QUESTION_AT, {"question": (QUESTION_AT, ids.shape[1])})
    heads = model.config.get_text_config().num_attention_heads
    compressed, whole = LAYERS[family]
    for query_aware, gqa in ((True, "expand"), (False, "mean")):
        runs, refused = every_method(family, gqa)
        for tag, method in refused.items():  # refused in one line, before any prefill
            with pytest.raises(HarnessError, match="cannot run on a model with sliding-window layers"):
                generate_settings(loaded, [(tag, method)], prompt, max_new_tokens=1)
        end = prompt.compressed_end(query_aware)
        outs, seen = engine_logits(model, lambda: generate_settings(loaded, list(runs.items()), prompt, query_aware=query_aware,
                                                                    max_new_tokens=NEW, decode_together=False))
        # every forward's last logits: the shared prefill, then setting after setting (decode_together=false) its
        # question prefill (query-agnostic) and its decode steps; query-aware, the prefill's logits give every first token
        own = NEW - 1 if query_aware else NEW
        assert seen.shape[1] == 1 + own * len(outs), (family, seen.shape)
        for k, (tag, out) in enumerate(outs.items()):
            assert out.error is None, (family, tag, out.error)
            assert out.diagnostics["compressed_layers"] == compressed, (family, tag)
            assert out.diagnostics.get("layers_kept_whole", {}) == whole, (family, tag)
            assert all(out.kept[i] is not None for i in compressed) and all(out.kept[i] is None for i in out.kept if i not in compressed)
            ref = Reference(model, keep_masks(out.kept, heads, end), end).logits(ids, out.generation.tokens)
            assert [int(x) for x in ref[0].argmax(-1)] == out.generation.tokens[0], (family, tag, query_aware)
            mine = seen[:, 1 + k * own: 1 + (k + 1) * own]
            logits = torch.cat([seen[:, :1], mine], dim=1) if query_aware else mine
            torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4, msg=f"{family} {tag} query_aware={query_aware}")


def _questions_prompt(seed: int, questions: int = 2) -> Prompt:
    ids = prompt_ids(length=QUESTION_AT + 20 * questions, seed=seed)[0].tolist()
    asked = [Question(ids[QUESTION_AT + 20 * n: QUESTION_AT + 20 * (n + 1)], {"question": (QUESTION_AT, QUESTION_AT + 20)})
             for n in range(questions)]
    return Prompt(ids[:QUESTION_AT], questions=asked)


@pytest.mark.parametrize("family", RUNNING)
def test_a_methods_list_equals_separate_chunked_runs_and_each_question_alone(family, one_thread):
    """Query-agnostic, two questions over one context: the methods list (one prefill, batched decode where the
    layout allows) gives each method the tokens of its own run with a chunked prefill (37 tokens, uneven), and
    each question's answer equals that question asked alone (a linear layer's state, updated in place, is
    copied for every question and every setting)."""
    model = model_of(family)
    loaded = loaded_of(model)
    prompt = _questions_prompt(seed=5)
    runs, _ = every_method(family, "mean")
    pairs = [("full", build_method({"name": "full"})), *runs.items()]
    shared = generate_settings(loaded, pairs, prompt, query_aware=False, max_new_tokens=4)
    for tag, method in pairs:
        alone = generate_settings(loaded, [(tag, method)], prompt, query_aware=False, max_new_tokens=4, chunk_size=37)[tag]
        for a, b in zip(alone.answers, shared[tag].answers):
            assert a.error is None and b.error is None, (family, tag, a.error, b.error)
            assert a.generation.tokens == b.generation.tokens, (family, tag)
            assert a.diagnostics.get("kv_positions_after_prefill") == b.diagnostics.get("kv_positions_after_prefill")
    for tag in ("full", "snapkv"):
        for n, question in enumerate(prompt.questions):
            one = Prompt(prompt.ids, questions=[question])
            single = generate_settings(loaded, [(tag, dict(pairs)[tag])], one, query_aware=False, max_new_tokens=4)[tag]
            assert single.answers[0].generation.tokens == shared[tag].answers[n].generation.tokens, (family, tag, n)


@pytest.mark.parametrize("family", [*RUNNING, "deepseek-v3"])
def test_full_equals_hf_generate(family, one_thread):
    """`full` through the harness (no compression installed) gives the tokens of transformers' own generate, past
    every window and chunk (16 tokens)."""
    model = model_of(family)
    ids = prompt_ids(length=40, seed=8)
    model.generation_config.eos_token_id = None
    expected = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, 40:].tolist()
    out = generate_settings(loaded_of(model), [("full", build_method({"name": "full"}))], Prompt(ids[0].tolist()),
                            max_new_tokens=24)["full"]
    assert out.generation.tokens[0] == expected


def test_latent_attention_is_refused_before_any_work():
    model = model_of("deepseek-v3")
    forwards = []
    handle = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        for name in ("snapkv", "knorm", "streamingllm"):
            method = build_method({"name": name, "budget": 48, "window_size": 8} if name != "streamingllm" else
                                  {"name": name, "budget": 48, "window_size": 0})
            with pytest.raises(HarnessError, match=r"multi-head latent attention \(one 32-wide latent \+ a 8-wide rotary key"):
                generate_settings(loaded_of(model), [(name, method)], Prompt(prompt_ids()[0].tolist()), max_new_tokens=2)
    finally:
        handle.remove()
    assert forwards == []


def _raise_sinks(model):
    for m in model.modules():
        if getattr(m, "sinks", None) is not None:
            m.sinks.data.fill_(5.0)


def _sharpen_queries(model):  # random weights give logits near 0, which no cap touches: larger ones
    for m in model.modules():
        if hasattr(m, "q_proj") and hasattr(m, "k_proj"):
            m.q_proj.weight.data.mul_(40.0)


@pytest.mark.parametrize("family,overrides,prepare", [("gemma2", {"attn_logit_softcapping": 1.0}, _sharpen_queries),
                                                      ("gpt-oss", {}, _raise_sinks)])
def test_scores_are_the_models_own_attention_weights(family, overrides, prepare):
    """SnapKV's window attention and H2O's column sums on a soft-capped layer (Gemma 2, cap 1.0 on sharpened logits) and
    a sink layer (gpt-oss, sinks raised to 5.0) equal the weights the model's own eager attention function returns
    for the same queries and keys; without the layer's layout they would not."""
    import sys

    from harness.methods.engine import attention_modules, attention_probe
    from harness.methods.attention import accumulated_attention
    from harness.methods.layout import model_layout

    model = family_model(family, **overrides)
    if prepare is not None:
        prepare(model)
    layer = LAYERS[family][0][-1]
    seen = {}
    with attention_probe(model, lambda m, q, k: seen.setdefault(m.layer_idx, (m, q, k))), torch.inference_mode():
        model(input_ids=prompt_ids(length=64, seed=2))
    module, query, key = seen[layer]
    length = key.shape[2]
    causal = torch.full((length, length), torch.finfo(query.dtype).min).triu(1)[None, None]
    kwargs = {"softcap": module.attn_logit_softcapping} if family == "gemma2" else {}
    _, weights = sys.modules[type(module).__module__].eager_attention_forward(module, query, key, key, causal,
                                                                             scaling=module.scaling, **kwargs)
    layout = model_layout(model, attention_modules(model))[layer]
    assert layout.compressed and (layout.softcap or layout.sinks is not None)
    window = 8
    ours = window_attention(query, key, window, module.scaling, layout)
    torch.testing.assert_close(ours, weights[:, :, -window:].to(ours.dtype), atol=1e-6, rtol=1e-5)
    plain = window_attention(query, key, window, module.scaling)
    assert (plain - ours).abs().max() > 1e-2  # the cap / the sinks change the weights
    sums = accumulated_attention(query, key, block_size=16, scaling=module.scaling, layout=layout)
    torch.testing.assert_close(sums, weights.float().sum(dim=2), atol=1e-5, rtol=1e-5)


def test_linear_layers_count_their_state_in_cache_bytes(one_thread):
    """Qwen3.5: the three Gated DeltaNet layers hold a fixed state (a conv state over the last 4 inputs of the
    q/k/v channels, a 16 x 16 recurrent state per value head), counted in cache_bytes beside the full layer's
    compressed K/V, whatever the prompt length."""
    model = model_of("qwen3.5")
    config = model.config
    conv = (2 * config.linear_num_key_heads * config.linear_key_head_dim
            + config.linear_num_value_heads * config.linear_value_head_dim) * config.linear_conv_kernel_dim
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    state_bytes = 3 * (conv + recurrent) * 4  # float32
    for length in (100, 160):
        snap = build_method({"name": "snapkv", "budget": 48, "window_size": 8, "gqa": "mean"})
        out = generate_settings(loaded_of(model), [("s", snap)], Prompt(prompt_ids(length=length)[0].tolist()), max_new_tokens=1)["s"]
        kv_bytes = 2 * config.num_key_value_heads * 48 * config.head_dim * 4  # one global layer, 48 entries per KV head
        assert out.diagnostics["cache_bytes"] == state_bytes + kv_bytes


def test_nope_and_partial_rotary_positions():
    """Expected Attention's rotation, per layer: identity on NoPE layers (SmolLM3's every 4th layer, which applies
    no rotary), and on Qwen3.5's partial rotary undoes exactly what the model's own apply_rotary_pos_emb did."""
    import sys

    from harness.methods.engine import attention_modules, rotary_of
    from harness.methods.expected_attention import partial_unrotate
    from harness.methods.layout import model_layout

    smol = model_of("smollm3")
    layout = model_layout(smol, attention_modules(smol))
    assert [l.rotary for l in layout] == [bool(m.use_rope) for m in attention_modules(smol)] == [True, True, True, False]
    cos, sin = rotary_of(smol, layout)(3, torch.arange(5))
    assert torch.equal(cos, torch.ones(5, 16)) and torch.equal(sin, torch.zeros(5, 16))

    qwen = model_of("qwen3.5")
    layout = model_layout(qwen, attention_modules(qwen))
    positions = torch.arange(7)
    cos, sin = rotary_of(qwen, layout)(3, positions)
    q = torch.randn(1, 4, 7, 16, generator=torch.Generator().manual_seed(0))
    apply = sys.modules[type(attention_modules(qwen)[0]).__module__].apply_rotary_pos_emb
    rotated, _ = apply(q, q, cos[None], sin[None])
    assert cos.shape[-1] < 16  # partial rotary: the rest of each head is not rotated
    torch.testing.assert_close(partial_unrotate(rotated, cos, sin), q, atol=1e-5, rtol=1e-5)


def test_shared_kv_is_compressed_once_with_its_owner(one_thread):
    """Gemma 4: layers 4 and 5 read layers 2 and 3's KV. Per-head budgets (AdaKV, a ragged cache) and gqa=expand:
    the owner's cache is the one compressed, the readers hold nothing and decode as the masked full cache."""
    model = model_of("gemma4")
    loaded = loaded_of(model)
    ids = prompt_ids(seed=6)
    prompt = Prompt(ids[0].tolist(), QUESTION_AT)
    for name, options in (("adakv", {"gqa": "mean"}), ("snapkv", {"gqa": "expand"})):
        method = registered_methods(options["gqa"])[name]
        out = generate_settings(loaded, [(name, method)], prompt, max_new_tokens=NEW)[name]
        assert out.diagnostics["kv_positions_after_prefill"][4:] == [[0, 0], [0, 0]]
        ref = Reference(model, keep_masks(out.kept, 4, prompt.compressed_end(True)), len(ids[0])).logits(ids, out.generation.tokens)
        assert [int(x) for x in ref[0].argmax(-1)] == out.generation.tokens[0], name


# family's hub config -> what its layout must be (counts of each kind, written from the published architecture)
HUB = {"gpt-oss-20b": {"sliding": 12, "global": 12}, "gemma-2-9b-it": {"sliding": 21, "global": 21},
       "llama-4-scout": {"chunked": 36, "global NoPE": 12}, "smollm3-3b": {"global": 27, "global NoPE": 9},
       "qwen3.5-27b": {"linear": 48, "global": 16}, "gemma-4-e2b-it": {"sliding": 17, "global": 3, "shared": 10}}


@pytest.mark.parametrize("name", [*HUB, "deepseek-v3"])
def test_hub_configs_build_their_layout(name):
    """Each family's hub config (conf/model/<name>.yaml) builds its random-weight architecture (on the meta device: no
    memory) with the layout the published model has, or is refused in one line (DeepSeek V3's latent attention)."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from harness import CONF_DIR
    from harness.methods.engine import attention_modules
    from harness.methods.layout import model_layout, refusal
    from harness.models import build_architecture_config

    cfg = OmegaConf.load(f"{CONF_DIR}/model/{name}.yaml")
    assert cfg.source == "hub" and "/" in cfg.path and cfg.chat_format == "template"
    config = build_architecture_config(cfg.architecture)
    config._attn_implementation = cfg.attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation)
    if name == "deepseek-v3":
        assert "multi-head latent attention (one 512-wide latent + a 64-wide rotary key" in refusal(model)
        return
    assert refusal(model) is None
    kinds: dict = {}
    for layer in model_layout(model, attention_modules(model)):
        label = layer.kind + ("" if layer.rotary else " NoPE")
        kinds[label] = kinds.get(label, 0) + 1
    assert kinds == HUB[name]


@pytest.mark.parametrize("model_type,expected", [
    ("qwen3_next", {"linear": 3, "global": 1}),  # Qwen3-Next: Qwen3.5's layout (3 Gated DeltaNet : 1 full)
    ("deepseek_v32", "multi-head latent attention"),  # MLA + an indexer
    ("glm_moe_dsa", "multi-head latent attention"),  # GLM-5-style: MLA + an indexer
    ("deepseek_v4", "compressed_sparse_attention, heavily_compressed_attention layers, a layout the engine does not describe"),
])
def test_other_families_of_the_issue(model_type, expected):
    """transformers' own default configs of the other families the issue lists (4 layers, meta device): Qwen3-Next has
    Qwen3.5's layout; the latent-attention and compressed-attention families are refused in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.methods.engine import attention_modules
    from harness.methods.layout import model_layout, refusal

    config = AutoConfig.for_model(model_type, num_hidden_layers=4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if isinstance(expected, str):
        assert expected in refusal(model)
        return
    assert refusal(model) is None
    kinds: dict = {}
    for layer in model_layout(model, attention_modules(model)):
        kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
    assert kinds == expected
