"""Tiny random-weight decoders of every family the harness supports, for tests (built in milliseconds).

    from tiny_models import tiny_model, tiny_config
    model = tiny_model("gemma3")                       # 6 layers: 5 sliding-window (16 tokens) : 1 full
    model = tiny_model("qwen3", num_hidden_layers=4)   # any config field can be overridden

All share hidden size 64, 4 query heads over 2 KV heads (GQA 2:1), head_dim 16, vocabulary 1000 and
4096 positions. Family specifics, as the real models have them:
- llama: plain GQA decoder.
- mistral: `sliding_window=None` (Mistral-7B-v0.2 and later have none; pass sliding_window=... to get one).
- qwen2: q/k/v biases (attention_bias is built in), no sliding window.
- qwen3: explicit head_dim, QK-norm, no biases.
- gemma3 (model_type gemma3_text, Gemma3ForCausalLM): 6 layers, `sliding_window=16`, layer_types
  5 sliding_attention : 1 full_attention (Gemma 3's pattern), separate RoPE bases per layer type,
  query_pre_attn_scalar = head_dim (so the score scaling is head_dim^-0.5, as in Gemma 3 270M / 12B).
`tests/conftest.py` has an older `tiny_model(family, attn, layers=..., ...)` for the first four families.
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
              max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
GEMMA3_PATTERN = 6  # every 6th layer full attention


def gemma3_layer_types(num_layers: int, pattern: int = GEMMA3_PATTERN) -> list[str]:
    """Gemma 3's layer types: layer i is full attention when (i + 1) % pattern == 0, else sliding window."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def family_defaults(family: str) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    kw = dict(COMMON, num_hidden_layers=2)
    if family == "mistral":
        kw["sliding_window"] = None
    elif family == "qwen3":
        kw["head_dim"] = 16
    elif family == "gemma3":
        kw.update(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    return kw


def tiny_config(family: str = "llama", **overrides):
    """The transformers config of `tiny_model(family, **overrides)`."""
    from transformers import AutoConfig

    kw = {**family_defaults(family), **overrides}
    if family == "gemma3" and "layer_types" not in overrides:
        kw["layer_types"] = gemma3_layer_types(int(kw["num_hidden_layers"]))
    return AutoConfig.for_model(MODEL_TYPES[family], **kw)


def tiny_model(family: str = "llama", *, attn: str = "sdpa", seed: int = 0, dtype=torch.float32, **overrides):
    """A seeded random-weight causal LM of `family` in eval mode, gradients off (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval().requires_grad_(False)


def tiny_architecture(family: str = "llama", **overrides) -> dict:
    """The same model as a `model.architecture` block (for load_model with model.random_weights=true)."""
    kw = {**family_defaults(family), **overrides}
    if family == "gemma3" and "layer_types" not in overrides:
        kw["layer_types"] = gemma3_layer_types(int(kw["num_hidden_layers"]))
    return {"model_type": MODEL_TYPES[family], **kw}


# --------------------------------------------------------------------------- today's families, from their model configs

# family -> its tiny random config (conf/model/<name>.yaml): the configs are the one description of each tiny model.
LAYOUT_FAMILIES = {"gpt-oss": "tiny-gpt-oss", "gemma2": "tiny-gemma2", "llama4": "tiny-llama4", "smollm3": "tiny-smollm3",
                   "qwen3.5": "tiny-qwen3.5", "gemma4": "tiny-gemma4", "deepseek-v3": "tiny-deepseek-v3"}


def family_model(family: str, **overrides):
    """The seeded random-weight model of conf/model/tiny-<family>.yaml, built from its config class (no tokenizer,
    no download), its config fields overridden by `overrides`; eval mode, gradients off."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from harness import CONF_DIR
    from harness.models import build_architecture_config

    cfg = OmegaConf.load(f"{CONF_DIR}/model/{LAYOUT_FAMILIES[family]}.yaml")
    config = build_architecture_config({**OmegaConf.to_container(cfg.architecture), **overrides})
    config._attn_implementation = cfg.attn_implementation
    torch.manual_seed(int(cfg.seed))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation)
    return model.eval().requires_grad_(False)
