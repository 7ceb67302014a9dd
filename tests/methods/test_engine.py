"""The engine against an independent reference, shared prefills, chunked prefill, hybrid layers,
FlashAttention's name, and cache lifetimes.

The reference decodes with the model's FULL cache and a plain attention function written here: for
every query after the compressed part it hides, per head, the prompt positions the method dropped
(the kept positions are what the engine reports; the selection rules themselves are tested against
the official rules elsewhere). Positions are the cache's own (nothing is compressed), so a wrong
position, mask, cache layout or expanded-head bookkeeping in the engine shows up as a difference.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from conftest import BACKENDS, compose, tiny_model
from harness.decoding import greedy_generate
from harness.errors import HarnessError
from harness.methods import METHODS, build_method, compression
from harness.models import LoadedModel
from harness.generation.generate import generate_settings
from harness.generation.prompt import Prompt

PROMPT, QUESTION_AT, NEW = 160, 140, 10


def methods(gqa: str, per_layer: bool = False) -> dict:
    snap_budget = [40, 72] if per_layer else 48
    return {
        "full": build_method({"name": "full"}),
        "snapkv": build_method({"name": "snapkv", "budget": snap_budget, "window_size": 8, "kernel_size": 5, "pooling": "maxpool", "gqa": gqa}),
        "snapkv_b64": build_method({"name": "snapkv", "budget": 64, "window_size": 8, "kernel_size": 5, "pooling": "maxpool", "gqa": gqa}),
        "h2o": build_method({"name": "h2o", "budget": 48, "window_size": 8, "block_size": 33, "gqa": gqa}),
        "pyramidkv": build_method({"name": "pyramidkv", "budget": 48, "window_size": 8, "kernel_size": 5, "pooling": "maxpool", "beta": 4, "gqa": gqa}),
        "streamingllm": build_method({"name": "streamingllm", "budget": 48, "sink_tokens": 4, "window_size": 0, "gqa": gqa}),
        "ratio": build_method({"name": "snapkv", "budget": None, "ratio": 0.3, "window_size": 8, "kernel_size": 5, "pooling": "maxpool", "gqa": gqa}),
        **{name: method for name, method in registered_methods(gqa).items() if name not in HAND_SET},
    }


HAND_SET = ("full", "snapkv", "h2o", "pyramidkv", "streamingllm")


def registered_methods(gqa: str) -> dict:
    """Every registered method from its own config (conf/method/<name>.yaml), at a budget of 48 tokens and
    a window of at most 8, so each one is held to the same reference as the hand-set ones above."""
    out = {}
    for name in sorted(METHODS):
        cfg = compose(f"method={name}").method
        options = {k: v for k, v in dict(cfg).items() if k != "tag"}
        if "budget" in options:
            options.update(budget=48, ratio=None)
        if isinstance(options.get("window_size"), int) and options["window_size"] > 8:
            options["window_size"] = 8
        if "gqa" in options:
            options["gqa"] = gqa
        out[name] = build_method(options)
    return out


class CharTokenizer:
    """Text -> ids for the tiny models (methods that tokenize text of their own: KVzip's replay prompt)."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(c) % 990 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def loaded_of(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=CharTokenizer(), name="tiny", chat_format="none", eos_token_ids=[], max_positions=4096,
                       prompt_max_length=None, device=torch.device("cpu"))


def prompt_ids(batch: int = 1, length: int = PROMPT, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ the reference


class Reference:
    """A plain attention function over the full cache that hides dropped prompt positions per head.

    It computes each family's attention from the model's config and the arguments the model passes, written
    here: sliding windows and Llama 4's chunks (from `layer_types`), Gemma 2's soft-cap (`softcap`), gpt-oss's
    learned sinks (`s_aux`, in the softmax denominator), and Gemma 4's shared KV (a layer reading the last
    earlier layer of its type that stores KV: that layer's dropped positions are hidden from it too)."""

    name = "kvharness_test_reference"

    def __init__(self, model, keep: dict, end: int):
        self.model, self.keep, self.end = model, keep, end  # keep: layer -> (B, Hq, end) bool, or absent
        config = model.config.get_text_config()
        layer_types = getattr(config, "layer_types", None) or []
        self.window = {i: config.sliding_window for i, t in enumerate(layer_types) if t == "sliding_attention"}
        self.chunk = {i: config.attention_chunk_size for i, t in enumerate(layer_types) if t == "chunked_attention"}
        modes = config.kv_sharing_modes if getattr(config, "num_kv_shared_layers", 0) else []
        self.reads = {i: max(j for j in range(i) if modes[j] == "store" and layer_types[j] == layer_types[i])
                      for i, mode in enumerate(modes) if mode == "reuse"}

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        q_len, k_len = query.shape[2], key.shape[2]
        logits = query @ key.transpose(2, 3) * (scaling if scaling is not None else module.scaling)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        q_pos = torch.arange(k_len - q_len, k_len)
        k_pos = torch.arange(k_len)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if module.layer_idx in self.window:
            allowed &= k_pos[None, :] > q_pos[:, None] - self.window[module.layer_idx]
        if module.layer_idx in self.chunk:
            allowed &= (k_pos[None, :] // self.chunk[module.layer_idx]) == (q_pos[:, None] // self.chunk[module.layer_idx])
        allowed = allowed[None, None].expand(query.shape[0], query.shape[1], q_len, k_len).clone()
        keep = self.keep.get(self.reads.get(module.layer_idx, module.layer_idx))
        after = q_pos >= self.end
        if keep is not None and after.any():
            allowed[:, :, after, : self.end] &= keep[:, :, None, :]
        logits = logits.masked_fill(~allowed, float("-inf")).float()
        if s_aux is not None:  # the sink logit joins every row's softmax; its weight is dropped
            logits = torch.cat([logits, s_aux.float().reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)], dim=-1)
            weights = torch.softmax(logits, dim=-1)[..., :-1].to(query.dtype)
        else:
            weights = torch.softmax(logits, dim=-1).to(query.dtype)
        return (weights @ value).transpose(1, 2).contiguous(), weights

    def cache(self):
        """A cache of every layer the model holds (one forward: nothing is bounded yet); a linear-attention layer needs
        its state layer from the config."""
        linear = "linear_attention" in (getattr(self.model.config.get_text_config(), "layer_types", None) or [])
        return DynamicCache(config=self.model.config) if linear else DynamicCache()

    def logits(self, ids: torch.Tensor, tokens: list[list[int]]) -> torch.Tensor:
        """Teacher-forced logits of every decode step (prompt + generated tokens), full cache, one forward."""
        ALL_ATTENTION_FUNCTIONS.register(self.name, self.attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(self.name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        original = self.model.config._attn_implementation
        self.model.config._attn_implementation = self.name
        try:
            full = torch.cat([ids, torch.tensor(tokens)[:, :-1]], dim=1)
            with torch.inference_mode():
                out = self.model(input_ids=full, cache=self.cache(), use_cache=True)
            return out.logits[:, ids.shape[1] - 1:]
        finally:
            self.model.config._attn_implementation = original


def keep_masks(kept: dict, heads: int, end: int) -> dict:
    """layer -> (B, Hq, end) bool: which prompt positions each query head still sees."""
    masks = {}
    for idx, pos in kept.items():
        if pos is None:
            continue
        pos = pos.repeat_interleave(heads // pos.shape[1], dim=1)
        pos = torch.where(pos < 0, end, pos)  # -1: padding after a head's own count (per-head budgets)
        masks[idx] = torch.zeros(pos.shape[0], heads, end + 1, dtype=torch.bool).scatter_(2, pos, True)[..., :end]
    return masks


def engine_logits(model, run):
    """Run `run()` with the lm_head's outputs captured: the logits of every forward the engine made."""
    from harness.methods.engine import attention_modules

    seen = []
    first_attention = attention_modules(model)[0]

    def keep(module, args, output):
        session = getattr(first_attention, "_kvharness_session", None)
        if session is None or session.replaying is None:  # not a method's own replay forward (KVzip)
            seen.append(output[:, -1:].detach().clone())

    handle = model.lm_head.register_forward_hook(keep)
    try:
        result = run()
    finally:
        handle.remove()
    return result, torch.cat(seen, dim=1)


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.parametrize("gqa", ["expand", "mean"])
@pytest.mark.parametrize("query_aware", [True, False])
def test_every_method_decodes_like_the_masked_full_cache(attn, gqa, query_aware, one_thread):
    model = tiny_model("llama", attn, heads=4, kv_heads=2)
    loaded = loaded_of(model)
    ids = prompt_ids()
    prompt = Prompt(ids[0].tolist(), QUESTION_AT)
    end = prompt.compressed_end(query_aware)
    cases = [(tag, m) for tag, m in methods(gqa).items() if m.compresses] + [("per_layer", methods(gqa, per_layer=True)["snapkv"])]
    for tag, method in cases:
        out, seen = engine_logits(model, lambda: generate_settings(loaded, [(tag, method)], prompt, query_aware=query_aware,
                                                                    max_new_tokens=NEW)[tag])
        assert out.error is None and len(out.generation.tokens[0]) == NEW
        keep = keep_masks(out.kept, model.config.num_attention_heads, end)
        assert len(keep) == 2, f"{tag} must have compressed both layers ({end} prompt tokens)"
        ref = Reference(model, keep, end).logits(ids, out.generation.tokens)
        # the last NEW forwards produced the NEW tokens (prefill or question prefill, then the decode steps)
        torch.testing.assert_close(seen[:, -NEW:], ref, atol=2e-4, rtol=1e-4, msg=f"{tag} {gqa} {attn} query_aware={query_aware}")
        assert [int(x) for x in ref[0].argmax(-1)] == out.generation.tokens[0]


@pytest.mark.parametrize("gqa", ["expand", "mean"])
def test_batch_of_two_decodes_like_the_masked_full_cache(gqa, one_thread):
    model = tiny_model("qwen2", "sdpa", heads=4, kv_heads=2)
    ids = prompt_ids(batch=2, seed=4)
    for tag, method in methods(gqa).items():
        if not method.compresses or tag == "ratio":
            continue
        if tag == "kvzip":  # scores one sequence at a time (as kvpress): refused in one line
            with pytest.raises(HarnessError, match="one sequence at a time"):
                _run_in_place(model, method, ids)
            continue
        (gen, session), seen = engine_logits(model, lambda: _run_in_place(model, method, ids))
        keep = keep_masks({i: r.positions for i, r in session.states[method.name].layers.items()},
                          model.config.num_attention_heads, PROMPT)
        assert keep
        ref = Reference(model, keep, PROMPT).logits(ids, gen.tokens)
        torch.testing.assert_close(seen, ref, atol=2e-4, rtol=1e-4, msg=tag)


def _run_in_place(model, method, ids):
    with compression(model, method) as session:
        gen = greedy_generate(model, ids, max_new_tokens=NEW, ignore_eos=True)
    return gen, session


@pytest.mark.parametrize("query_aware", [True, False])
@pytest.mark.parametrize("gqa", ["expand", "mean"])
def test_one_prefill_for_all_methods_equals_separate_runs(query_aware, gqa, one_thread):
    """Tokens and kept positions of a shared prefill equal each method's own run, for every method,
    and equal again with a chunked prefill."""
    model = tiny_model("mistral", "sdpa", heads=4, kv_heads=2)
    loaded = loaded_of(model)
    prompt = Prompt(prompt_ids(seed=2)[0].tolist(), QUESTION_AT, {"question": (QUESTION_AT, PROMPT)})
    all_methods = methods(gqa)
    shared = generate_settings(loaded, list(all_methods.items()), prompt, query_aware=query_aware, max_new_tokens=NEW)
    for tag, method in all_methods.items():
        for chunk in (None, 37):
            alone = generate_settings(loaded, [(tag, method)], prompt, query_aware=query_aware, max_new_tokens=NEW, chunk_size=chunk)[tag]
            assert alone.generation.tokens == shared[tag].generation.tokens, (tag, chunk)
            assert alone.diagnostics.get("kv_positions_after_prefill") == shared[tag].diagnostics.get("kv_positions_after_prefill")
            assert alone.diagnostics.get("question_kept") == shared[tag].diagnostics.get("question_kept")
        if not query_aware:
            assert shared[tag].diagnostics["question_kept"] == 1.0  # prefilled after compression, by construction
    assert shared["ratio"].diagnostics["budget_tokens"] == int(0.3 * prompt.compressed_end(query_aware))


def test_chunked_prefill_keeps_the_same_positions():
    model = tiny_model("llama", "eager", heads=4, kv_heads=2)
    ids = prompt_ids(seed=5)[0].tolist()
    for tag, method in methods("expand").items():
        if not method.compresses:
            continue
        kept = [generate_settings(loaded_of(model), [(tag, method)], Prompt(ids), max_new_tokens=2, chunk_size=chunk)[tag].kept
                for chunk in (None, 16, 50)]
        assert kept[0] and all(kept[0][i] is not None for i in kept[0]), tag
        for other in kept[1:]:
            assert all(torch.equal(kept[0][i], other[i]) for i in kept[0]), tag


def tiny_gemma3(layers: int = 6, window: int = 16):
    config = AutoConfig.for_model("gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=1000,
                                  max_position_embeddings=4096, sliding_window=window, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(layers)])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_hybrid_sliding_layers_stay_whole_and_generation_crosses_the_window(one_thread):
    model = tiny_gemma3()
    loaded = loaded_of(model)
    ids = prompt_ids(length=96, seed=7)
    prompt = Prompt(ids[0].tolist(), 80, {"question": (80, 96)})
    sliding = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    full = generate_settings(loaded, [("full", methods("expand")["full"])], prompt, max_new_tokens=24)["full"]
    assert full.generation.tokens == greedy_generate(model, ids, max_new_tokens=24).tokens  # 24 > window 16
    for query_aware in (True, False):
        for tag in ("snapkv", "h2o", "streamingllm"):
            out = generate_settings(loaded, [(tag, methods("mean")[tag]), ("full", methods("mean")["full"])], prompt,
                                    query_aware=query_aware, max_new_tokens=24)[tag]
            assert out.diagnostics["compressed_layers"] == [i for i in range(6) if i not in sliding]
            assert all(out.diagnostics["question_kept_by_layer"][i] is None for i in sliding)
            assert all(out.kept[i] is None for i in sliding)
            end = prompt.compressed_end(query_aware)
            # the module's own softmax scale (query_pre_attn_scalar 24, not head_dim 16) is the one the reference uses
            ref = Reference(model, keep_masks(out.kept, 4, end), end).logits(ids, out.generation.tokens)
            assert [int(x) for x in ref[0].argmax(-1)] == out.generation.tokens[0], (tag, query_aware)


def test_all_sliding_layers_are_left_whole_past_the_window(one_thread, caplog):
    """Mistral v0.1-style: every layer has a 64-token window. Nothing is compressed (the model's own
    window bounds every layer), decoding past the window equals the uncompressed model, and the run
    says so once."""
    model = tiny_model("mistral", "sdpa", heads=4, kv_heads=2)
    model.config.sliding_window = 64
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    ids = prompt_ids(length=100, seed=9)
    plain = greedy_generate(model, ids, max_new_tokens=30).tokens
    for tag in ("snapkv", "streamingllm"):
        with caplog.at_level("WARNING"):
            out = generate_settings(loaded_of(model), [(tag, methods("mean")[tag])], Prompt(ids[0].tolist()), max_new_tokens=30)[tag]
        assert out.generation.tokens == plain and out.diagnostics["compressed_layers"] == []
        assert "sliding window" in caplog.text


def test_flash_attention_keeps_its_name_for_the_kernel_loader(one_thread):
    """transformers hands config._attn_implementation to its flash-kernel loader: the engine must not
    rename it. A stand-in registered as flash_attention_2 (sdpa underneath) records what it sees."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    seen = []

    def stand_in(module, query, key, value, attention_mask, **kwargs):
        seen.append(module.config._attn_implementation)
        return sdpa(module, query, key, value, None if query.shape[2] == 1 else attention_mask, **kwargs)

    saved = ALL_ATTENTION_FUNCTIONS._global_mapping.get("flash_attention_2")
    saved_mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get("flash_attention_2")
    ALL_ATTENTION_FUNCTIONS.register("flash_attention_2", stand_in)
    ALL_MASK_ATTENTION_FUNCTIONS.register("flash_attention_2", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    try:
        model = tiny_model("llama", "sdpa")
        ids = prompt_ids()
        model.config._attn_implementation = "flash_attention_2"
        with compression(model, methods("expand")["snapkv_b64"]) as session:
            assert model.config._attn_implementation == "flash_attention_2"
            out = greedy_generate(model, ids, max_new_tokens=6)
        assert session.after == {0: (4, 64), 1: (4, 64)}
        assert seen and set(seen) == {"flash_attention_2"}
        assert ALL_ATTENTION_FUNCTIONS["flash_attention_2"] is stand_in  # restored after the block
        # the flash path (the stand-in runs sdpa underneath) must decode exactly as sdpa with the same compression
        model.config._attn_implementation = "sdpa"
        with compression(model, methods("expand")["snapkv_b64"]) as plain:
            expected = greedy_generate(model, ids, max_new_tokens=6)
        assert plain.after == session.after
        assert len(out.tokens[0]) == 6 and out.tokens == expected.tokens
    finally:
        if saved is None:
            ALL_ATTENTION_FUNCTIONS._global_mapping.pop("flash_attention_2", None)
        else:
            ALL_ATTENTION_FUNCTIONS._global_mapping["flash_attention_2"] = saved
        if saved_mask is not None:
            ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["flash_attention_2"] = saved_mask


@pytest.mark.parametrize("gqa", ["expand", "mean"])
def test_an_items_caches_are_freed_without_a_collector_pass(gqa):
    """No reference cycle keeps a compressed cache alive after its item (gqa=expand once made one)."""
    from harness.methods import engine

    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    loaded = loaded_of(model)
    alive = []
    original = engine.Session.cache_for

    def spy(self, t, shared):
        cache = original(self, t, shared)
        alive.extend(weakref.ref(layer.keys) for layer in cache.layers)
        alive.append(weakref.ref(cache))
        return cache

    gc.collect()
    gc.disable()
    engine.Session.cache_for = spy
    try:
        for seed in range(3):
            for pairs in ([("s", methods(gqa)["snapkv"])], [("s", methods(gqa)["snapkv"]), ("h", methods(gqa)["h2o"])]):
                out = generate_settings(loaded, pairs, Prompt(prompt_ids(seed=seed)[0].tolist()), max_new_tokens=4)
                del out
        assert alive and all(ref() is None for ref in alive), f"{sum(r() is not None for r in alive)} cache objects still alive"
    finally:
        engine.Session.cache_for = original
        gc.enable()


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("keep_full", [False, True])
def test_a_dropped_full_layer_frees_its_storage(keep_full, one_thread):
    """After the shared prefill, the shared full layers hold no storage unless `full` is compared, and
    each method's layers hold exactly their own entries (no view into the full layer's storage)."""
    from harness.decoding import prefill
    from harness.methods.engine import new_cache

    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    pairs = [("a", methods("expand")["snapkv"]), ("b", methods("mean")["snapkv_b64"]), ("s", methods("mean")["streamingllm"])]
    with torch.inference_mode(), compression(model, pairs, keep_full=keep_full) as session:
        cache = new_cache(model)
        prefill(model, cache, prompt_ids())
        full_bytes = [_storage_bytes(layer.keys) for layer in cache.layers]
        own = {tag: session.cache_for(tag, cache) for tag, _ in pairs}
    if keep_full:
        from harness.methods.inplace import MIN_ROOM

        # (1, 2 heads, 160, 16) float32 and the room reserved behind them for appends (harness/methods/inplace.py)
        assert full_bytes == [(PROMPT + MIN_ROOM) * 2 * 16 * 4] * 2
    else:
        assert full_bytes == [0, 0], "the dropped full layers still hold their storage"
    expected_length = {"a": 48, "b": 64, "s": 48}
    for tag, c in own.items():
        for layer in c.layers:
            for t in (layer.keys, layer.values):
                assert t.shape[2] == expected_length[tag]
                assert _storage_bytes(t) == t.numel() * t.element_size(), f"{tag}: holds more storage than its entries"


def test_one_method_in_place_keeps_only_its_entries(one_thread):
    from harness.decoding import prefill
    from harness.methods.engine import new_cache

    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    with torch.inference_mode(), compression(model, methods("mean")["streamingllm"]):
        cache = new_cache(model)
        prefill(model, cache, prompt_ids())
    for layer in cache.layers:
        assert layer.keys.shape[2] == 48 and _storage_bytes(layer.keys) == layer.keys.numel() * 4


def test_hybrid_chunked_prefill_with_an_uneven_last_chunk_runs_every_method(one_thread):
    """Gemma-3-style hybrid layers (window 16), 120 tokens in chunks of 33 (the last one 21 tokens):
    every registered method compresses the full-attention layers only, captures nothing on the sliding
    layers, and keeps the positions a one-shot prefill keeps, under both protocols."""
    model = tiny_gemma3()
    loaded = loaded_of(model)
    ids = prompt_ids(length=120, seed=11)[0].tolist()
    prompt = Prompt(ids, 104, {"question": (104, 120)})
    sliding = {i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"}
    every = {tag: m for tag, m in methods("mean").items() if m.supports_sliding_layers}
    for tag, m in methods("mean").items():
        if not m.supports_sliding_layers:  # refused in one line before any prefill
            with pytest.raises(HarnessError, match="cannot run on a model with sliding-window layers"):
                generate_settings(loaded, [(tag, m)], prompt, max_new_tokens=1)
    for query_aware in (True, False):
        chunked = generate_settings(loaded, list(every.items()), prompt, query_aware=query_aware, chunk_size=33, max_new_tokens=4)
        one_shot = generate_settings(loaded, list(every.items()), prompt, query_aware=query_aware, max_new_tokens=4)
        for tag, method in every.items():
            out = chunked[tag]
            assert out.error is None, (tag, out.error)
            assert out.generation.tokens == one_shot[tag].generation.tokens, (tag, query_aware)
            if method.compresses:
                assert set(out.diagnostics["compressed_layers"]) == set(range(6)) - sliding, tag
                for i in out.kept:
                    if i in sliding:
                        assert out.kept[i] is None
                    else:
                        assert torch.equal(out.kept[i], one_shot[tag].kept[i]), (tag, i)


def test_nothing_is_captured_on_sliding_layers(one_thread):
    from harness.decoding import prefill
    from harness.methods.engine import Session, new_cache

    model = tiny_gemma3()
    captured = []
    original = Session.after_attention

    def spy(self, module, args, kwargs, output):
        captured.append((module.layer_idx, self.queries.get(module.layer_idx), self.sums.get(module.layer_idx)))
        return original(self, module, args, kwargs, output)

    Session.after_attention = spy
    try:
        with torch.inference_mode(), compression(model, [("h", methods("mean")["h2o"]), ("s", methods("mean")["snapkv"])]) as session:
            session.compress_now = False
            prefill(model, new_cache(model), prompt_ids(length=60), chunk_size=25,
                    before_last=lambda: setattr(session, "compress_now", True))
    finally:
        Session.after_attention = original
    sliding = {i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"}
    assert sorted(idx for idx, _, _ in captured) == sorted(list(range(6)) * 3)  # 3 chunks x 6 layers
    for idx, queries, sums in captured:
        if idx in sliding:
            assert queries is None and sums is None, idx
        else:
            assert queries is not None and sums is not None, idx


def test_a_shared_prefill_out_of_memory_falls_back_to_smaller_groups(one_thread, monkeypatch):
    """An injected out-of-memory whenever a prefill holds more than two caches: the list is split until
    each group fits, every setting gets its separate run's tokens, and `shared_with` says who shared."""
    from harness.methods import engine

    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    loaded = loaded_of(model)
    prompt = Prompt(prompt_ids(seed=3)[0].tolist(), QUESTION_AT)
    every = [(t, methods("mean")[t]) for t in ("full", "snapkv", "h2o", "streamingllm", "pyramidkv")]
    alone = {tag: generate_settings(loaded, [(tag, m)], prompt, max_new_tokens=NEW)[tag] for tag, m in every}
    original = engine.Session.after_attention
    prefills = []

    def limited(capacity):
        def after_attention(self, module, args, kwargs, output):
            if module.layer_idx == 0 and self.compress_now is not False:
                prefills.append(sorted(self.states) + (["full"] if self.keep_full else []))
                if len(self.states) + self.keep_full > capacity:
                    raise torch.OutOfMemoryError("injected: the shared prefill does not fit")
            return original(self, module, args, kwargs, output)
        return after_attention

    monkeypatch.setattr(engine.Session, "after_attention", limited(2))
    shared = generate_settings(loaded, every, prompt, max_new_tokens=NEW)
    assert prefills[0] == ["h2o", "pyramidkv", "snapkv", "streamingllm", "full"]
    for tag, _ in every:
        assert shared[tag].error is None, tag
        assert shared[tag].generation.tokens == alone[tag].generation.tokens, tag
    assert shared["full"].diagnostics["shared_with"] == ["full", "snapkv"]
    assert shared["h2o"].diagnostics["shared_with"] == ["h2o"]
    assert shared["pyramidkv"].diagnostics["shared_with"] == ["streamingllm", "pyramidkv"]

    monkeypatch.setattr(engine.Session, "after_attention", limited(0))  # nothing compressed fits, even alone
    none_fit = generate_settings(loaded, every, prompt, max_new_tokens=NEW)
    assert none_fit["full"].error is None and none_fit["full"].generation.tokens == alone["full"].generation.tokens
    for tag in ("snapkv", "h2o", "streamingllm", "pyramidkv"):
        assert isinstance(none_fit[tag].error, torch.OutOfMemoryError), tag


def test_a_budget_above_the_prompt_says_nothing_was_compressed(one_thread, caplog):
    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    with caplog.at_level("WARNING"):
        out = generate_settings(loaded_of(model), [("s", methods("mean")["snapkv_b64"])], Prompt(prompt_ids(length=50)[0].tolist()),
                                max_new_tokens=2)["s"]
    assert out.diagnostics["compressed_layers"] == [] and "kept whole" in out.diagnostics["not_compressed"]
    assert "nothing is compressed" in caplog.text
    compressed = generate_settings(loaded_of(model), [("s", methods("mean")["snapkv_b64"])], Prompt(prompt_ids()[0].tolist()),
                                   max_new_tokens=2)["s"]
    assert "not_compressed" not in compressed.diagnostics


def test_attention_probe_sees_every_call():
    from harness.methods.engine import attention_probe

    model = tiny_model("llama", "eager")
    calls = []
    with attention_probe(model, lambda m, q, k: calls.append((m.layer_idx, q.shape[2], k.shape[2]))):
        greedy_generate(model, prompt_ids(length=20), max_new_tokens=3)
    assert calls == [(0, 20, 20), (1, 20, 20), (0, 1, 21), (1, 1, 21), (0, 1, 22), (1, 1, 22)]
    assert math.isclose(model.model.layers[0].self_attn.scaling, 16 ** -0.5)
