"""Peer parity, kvpress's side: the same token ids through kvpress 0.5.5's presses.

Run with the kvpress venv (`.venv-kvpress/bin/python scripts/peer_parity_kvpress.py --work DIR`, after
`peer_parity_ours.py --stage ids` wrote DIR/cells.pt); it writes DIR/theirs.pt. It imports nothing from
the harness: it reads from cells.pt the token ids, the weight folder (the harness's dequantized
safetensors copy), the EOS ids, the number of tokens and the press of each method, and loads the
weights with kvpress's own transformers.

How a run goes, as kvpress's pipeline does it (kvpress/pipeline.py): a plain `DynamicCache()`; the
compressed part (the whole prompt when query-aware, the context alone when query-agnostic) is prefilled
in one forward with the press's hooks in place; then, outside the press, the rest of the prompt is
forwarded with its true `position_ids` and greedy decoding follows, one token at a time at true
positions, stopping at an EOS id (ours.pt's list, the same as our side's) or after `max_new_tokens`.

Which positions a press kept, per layer and KV head: recovered from the cache the press leaves, not from
its internals. Every press's `forward_hook` is wrapped (`Recorder`): before it runs, the layer's full keys
are at hand; after it, the compressed keys are matched row by row (exact bytes: a gather copies them
bit for bit; post-RoPE keys of distinct positions differ) against the full keys of the same head. A
masked press (AdaKV: the cache stays whole, `module.masked_key_indices` lists the evicted entries) keeps
the complement of what it masked.

Two ways to drive the hooks:
- `hooks` (kvpress as shipped): `with press(model):` around the prefill, one prefill per press and ratio.
- `shared` (default): one prefill per cell and protocol; a hook on each compressed layer calls every
  press's own `forward_hook` in turn on that layer's full cache (restored between presses), exactly
  the call kvpress's hook makes, with the same arguments; each press then decodes from its own copy of
  the cache. A press only reads its own layer's inputs, so this equals one prefill per press; the
  `--hooks-cells` runs check that on real cells (variant `kvpress_hooks`).
A press whose own context manager does more than hook the prefill (KVzipPress: it replays the context
after the prefill, then masks what it prunes) always runs alone, as shipped; its kept positions are the
complement of the masks it leaves on each layer.

Gemma 3 (text-only Gemma3ForCausalLM): kvpress as shipped hooks every layer, the sliding-window ones
too (it skips them for Gemma3ForConditionalGeneration only). Variant `kvpress` hooks only the
full-attention layers (kvpress's own Gemma 3 rule, extended to the text-only class); variant
`kvpress_shipped` runs the press as shipped, every layer hooked.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from pathlib import Path

import torch

import kvpress
from kvpress.presses.base_press import BasePress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

log = logging.getLogger("peer_parity")


def build_press(spec: dict, compression_ratio: float):
    """A press from its table entry; a wrapper's ratio is its inner press's (kvpress's convention)."""
    cls = getattr(kvpress, spec["class"])
    kwargs = dict(spec.get("kwargs", {}))
    if "press" in spec:
        return cls(press=build_press(spec["press"], compression_ratio), **kwargs)
    return cls(compression_ratio=compression_ratio, **kwargs)


def runs_alone(spec: dict) -> bool:
    """A press whose own context manager does more than hook the prefill (KVzipPress replays the context after
    it, then masks what it prunes) cannot join the shared prefill: it runs alone, as shipped."""
    return getattr(kvpress, spec["class"]).__call__ is not BasePress.__call__


def kvzip_ids(folder: str) -> dict:
    """The ids KVzipPress builds its replay from, derived as it derives them (kvzip_press.py: the tokenizer it
    loads from the model's name_or_path; the chat template split around a dummy user message)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prefix, suffix = "", "\n"
    if tokenizer.chat_template is not None:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}], add_generation_prompt=True,
                                             tokenize=False, enable_thinking=False)
        before, suffix = text.split(separator)
        prefix = before.split(dummy)[0]
    return {"prefix": encode(prefix), "suffix": encode(suffix), "first": encode("\n\nRepeat the previous context exactly."),
            "later": encode("\n\nRepeat the part of the previous context exactly, starting with")}


def match_rows(full: torch.Tensor, kept: torch.Tensor) -> list[torch.Tensor]:
    """Positions of `kept`'s rows among `full`'s, per head: full (1, H, L, d), kept (1, H, n, d)."""
    out = []
    for h in range(full.shape[1]):
        rows = full[0, h].contiguous().cpu().numpy()
        index: dict[bytes, int] = {}
        for i, row in enumerate(rows):
            index.setdefault(row.tobytes(), i)
        if len(index) != rows.shape[0]:
            raise RuntimeError(f"head {h}: {rows.shape[0] - len(index)} duplicate key rows; positions are ambiguous")
        found = [index.get(row.tobytes(), -1) for row in kept[0, h].contiguous().cpu().numpy()]
        if -1 in found:
            raise RuntimeError(f"head {h}: a compressed key matches no prompt key (the press changed key values)")
        out.append(torch.tensor(sorted(found), dtype=torch.int64))
    return out


class Recorder:
    """Wraps one press's forward_hook and records, per layer it compressed: the kept positions per KV
    head, the compressed keys/values it left in the cache, and its masked entries (masked presses)."""

    def __init__(self, name: str, ratio: float, press, alone: bool = False):
        self.name, self.ratio, self.press = name, ratio, press
        self.original = press.forward_hook
        if not alone:  # a press that runs alone compresses after its prefill: see collect_masks
            press.forward_hook = self.hook  # what press(model) registers, and what the shared driver calls
        self.kept: dict[int, list[torch.Tensor]] = {}
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.masked: dict[int, tuple] = {}
        self.error: str | None = None

    def hook(self, module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        idx = module.layer_idx
        layer = cache.layers[idx]
        full_keys, full_values = layer.keys, layer.values
        module.masked_key_indices = None
        result = self.original(module, args, kwargs, output)
        keys, values = layer.keys, layer.values
        masked = getattr(module, "masked_key_indices", None)
        if keys is full_keys and masked is None:  # not a prefill forward (or ratio 0): nothing done
            return result
        positions = match_rows(full_keys, keys)
        if masked is not None:
            _, heads, seqs = masked
            for h in range(len(positions)):
                gone = set(seqs[heads == h].tolist())
                positions[h] = torch.tensor([p for p in positions[h].tolist() if p not in gone], dtype=torch.int64)
            self.masked[idx] = masked
        self.kept[idx] = positions
        self.layers[idx] = (keys, values)
        return result

    def collect_masks(self, model, layers: list[int], length: int) -> None:
        """A press that runs alone and masks once its prefill is over (KVzipPress: `masked_key_indices` on each
        attention module when its context manager exits, the cache left whole): per hooked layer, the kept
        positions are the complement of the masked entries of each KV head."""
        heads = model.config.num_key_value_heads
        for idx in layers:
            module = attention_of(model, idx)
            masked = getattr(module, "masked_key_indices", None)
            module.masked_key_indices = None
            if masked is None:
                continue
            _, head_of, seq_of = masked
            self.kept[idx] = [torch.tensor(sorted(set(range(length)) - set(seq_of[head_of == h].tolist())), dtype=torch.int64)
                              for h in range(heads)]
            self.masked[idx] = masked


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def language_model(model):
    """The decoder stack, found as press(model) finds it."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def compressible_layers(model, shipped: bool) -> list[int]:
    """The layers kvpress hooks: every layer as shipped for a text-only model; with kvpress's Gemma 3
    rule (its Gemma3ForConditionalGeneration path), only the layers without a sliding window."""
    layers = language_model(model).layers
    return [i for i, layer in enumerate(layers) if shipped or not getattr(layer.self_attn, "is_sliding", False)]


def prepare(model, press) -> None:
    """What press(model) does before it hooks: post_init_from_model and the rotary_emb attribute."""
    lm = language_model(model)
    press.post_init_from_model(model)
    for layer in lm.layers:
        layer.self_attn.rotary_emb = lm.rotary_emb


def attention_of(model, idx):
    return language_model(model).layers[idx].self_attn


def shared_prefill(model, recorders: list[Recorder], ids: torch.Tensor, layers: list[int]):
    """One prefill; on each hooked layer every press's forward_hook runs on the full layer in turn."""

    def hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        full = layer.keys, layer.values
        for rec in recorders:
            if rec.error is not None:
                continue
            try:
                rec.press.forward_hook(module, args, kwargs, output)
            except Exception as exc:  # noqa: BLE001  (one press failing must not stop the others)
                rec.error = describe(exc)
            finally:
                layer.keys, layer.values = full
                module.masked_key_indices = None
        return output

    for rec in recorders:
        prepare(model, rec.press)
    handles = [attention_of(model, i).register_forward_hook(hook, with_kwargs=True) for i in layers]
    cache = DynamicCache()
    try:
        logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    return cache, logits


def cache_for(rec: Recorder, shared) -> DynamicCache:
    """The press's own cache: the shared prefill's layers with this press's compressed ones."""
    cache = copy.copy(shared)
    cache.layers = []
    for idx, layer in enumerate(shared.layers):
        own = copy.copy(layer)
        if idx in rec.layers:
            own.keys, own.values = rec.layers[idx]
        cache.layers.append(own)
    return cache


def decode(model, cache, ids: torch.Tensor, end: int, logits, max_new_tokens: int, eos: set[int], masked: dict) -> list[int]:
    """kvpress's generate_answer: the rest of the prompt at true positions, then greedy tokens."""
    length = ids.shape[1]
    for idx, m in masked.items():
        attention_of(model, idx).masked_key_indices = m
    try:
        if end < length:
            pos = torch.arange(end, length).unsqueeze(0)
            logits = model(input_ids=ids[:, end:], past_key_values=cache, position_ids=pos, logits_to_keep=1).logits[0, -1]
        tokens: list[int] = []
        for i in range(max_new_tokens):
            token = int(logits.argmax())
            tokens.append(token)
            if token in eos or i == max_new_tokens - 1:
                break
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                           position_ids=torch.tensor([[length + i]])).logits[0, -1]
        return tokens
    finally:
        for idx in masked:
            attention_of(model, idx).masked_key_indices = None


def record_of(rec: Recorder, tokens, layers: list[int], error: str | None) -> dict:
    """A run's record: kept positions per hooked layer (None: the press left it whole), tokens, and the
    error of the prefill (no positions then) or of the decoding (positions kept, no tokens)."""
    if rec.error:
        return {"error": rec.error}
    record = {"kept": {i: rec.kept.get(i) for i in layers}, "hooked_layers": layers}
    if error:
        record["decode_error"] = error
    else:
        record["tokens"] = tokens
    return record


def run_group(model, ours: dict, key: str, protocol: str, names: list[str], ratios: list[float], variant: str,
              out: dict) -> None:
    cell = ours["cells"][key]
    ids = torch.tensor([cell["ids"]], dtype=torch.long)
    end = len(cell["ids"]) if protocol == "query_aware" else int(cell["question_start"])
    eos = set(ours["models"][cell["model"]]["eos_token_ids"])
    n_new = int(cell.get("max_new_tokens", ours["max_new_tokens"]))
    shipped = variant == "kvpress_shipped"
    layers = compressible_layers(model, shipped)
    specs = [(name, r) for name in names for r in ratios]
    alone = [(n, r) for n, r in specs if runs_alone(ours["pairs"][n]["kvpress"])]
    if variant == "kvpress_hooks":  # the check of the shared prefill: the presses that run alone ran so already
        specs = [s for s in specs if s not in alone]
    shared_specs = [s for s in specs if s not in alone] if variant == "kvpress" else []

    def new_recorder(name, r):
        spec = ours["pairs"][name]["kvpress"]
        return Recorder(name, r, build_press(spec, ours["kvpress_ratio"][str(r)]), alone=runs_alone(spec))

    start = time.perf_counter()
    if shared_specs:  # the shared prefill
        recorders = [new_recorder(n, r) for n, r in shared_specs]
        shared, logits = shared_prefill(model, recorders, ids[:, :end], layers)
        for rec in recorders:
            error = None
            tokens = None
            if rec.error is None:
                try:
                    tokens = decode(model, cache_for(rec, shared), ids, end, logits, n_new, eos, rec.masked)
                except Exception as exc:  # noqa: BLE001
                    error = describe(exc)
            out["runs"][f"{key}|{protocol}|{rec.name}|{rec.ratio}|{variant}"] = record_of(rec, tokens, layers, error)
            rec.layers.clear()
    for name, r in (s for s in specs if s not in shared_specs):  # each press as shipped: its own context manager
        rec = new_recorder(name, r)
        cache, error, tokens = DynamicCache(), None, None
        try:
            with rec.press(model):
                logits = model(input_ids=ids[:, :end], past_key_values=cache, logits_to_keep=1).logits[0, -1]
            if (name, r) in alone:
                short = [i for i in layers if cache.layers[i].keys.shape[2] != end]
                if short:
                    raise RuntimeError(f"layers {short} were shortened after the prefill: kept positions not recoverable")
                rec.collect_masks(model, layers, end)
        except Exception as exc:  # noqa: BLE001
            rec.error = describe(exc)
        if rec.error is None:
            try:
                tokens = decode(model, cache, ids, end, logits, n_new, eos, rec.masked)
            except Exception as exc:  # noqa: BLE001
                error = describe(exc)
        out["runs"][f"{key}|{protocol}|{name}|{r}|{variant}"] = record_of(rec, tokens, layers, error)
        del cache
    if specs:
        log.info("kvpress %s %s %s: %d runs in %.1f s", variant, key, protocol, len(specs), time.perf_counter() - start)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--hooks-cells", nargs="*", default=None,
                    help="cells (e.g. smollm2-135m/2048/50) also run with each press's own hooks, as shipped, to check the "
                         "shared prefill (default: the first SmolLM2 cell; none: skip)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_grad_enabled(False)
    ours = torch.load(args.work / "cells.pt", weights_only=True)
    out = {"kvpress_version": kvpress.__version__ if hasattr(kvpress, "__version__") else _version("kvpress"),
           "transformers_version": _version("transformers"), "torch_version": str(torch.__version__), "runs": {}, "hooked": {},
           "kvzip_tokenizer": {}}
    ratios = [float(r) for r in ours["ratios"]]
    names = [n for n, p in ours["pairs"].items() if "status" not in p]
    hooks_cells = args.hooks_cells
    if hooks_cells is None:
        hooks_cells = [k for k in ours["cells"] if k.startswith("smollm2")][:1]
    for model_name, info in ours["models"].items():
        keys = [k for k, c in ours["cells"].items() if c["model"] == model_name]
        if not keys:
            continue
        for eager in (False, True):
            group = [n for n in names if bool(ours["pairs"][n]["eager"]) == eager]
            if not group:
                continue
            attn = "eager" if eager else "sdpa"
            model = AutoModelForCausalLM.from_pretrained(info["folder"], dtype=torch.float32, attn_implementation=attn).eval()
            if "kvzip_ids" in info and "kvzip" in group:  # KVzipPress loads its tokenizer from model.config.name_or_path
                try:
                    theirs = kvzip_ids(model.config.name_or_path)
                    same = {k: theirs[k] == v for k, v in info["kvzip_ids"].items()}
                    out["kvzip_tokenizer"][model_name] = {"folder": model.config.name_or_path, "same": same, "theirs": theirs}
                except Exception as exc:  # noqa: BLE001  (the press itself then fails with its own error)
                    out["kvzip_tokenizer"][model_name] = {"folder": model.config.name_or_path, "error": describe(exc)}
                log.info("kvzip tokenizer %s: %s", model_name, out["kvzip_tokenizer"][model_name])
            gemma = "gemma3" in model.config.model_type
            variants = ["kvpress", "kvpress_shipped"] if gemma else ["kvpress"]
            out["hooked"][model_name] = {v: compressible_layers(model, v == "kvpress_shipped") for v in variants}
            for key in keys:
                for protocol in ("query_aware", "query_agnostic"):
                    for variant in variants + (["kvpress_hooks"] if key in hooks_cells else []):
                        run_group(model, ours, key, protocol, group, ratios, variant, out)
                    torch.save(out, args.work / "theirs.pt")  # partial results survive an interrupted run
            del model
    torch.save(out, args.work / "theirs.pt")
    print(f"kvpress: {len(out['runs'])} runs -> {args.work / 'theirs.pt'}")
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
