"""What every task runner shares: building the model and method, generating one item, and the
resumable item loop (progress bar, per-item failures recorded, nothing redone).

The decoding and compression modules (and so transformers) are imported when first used, so that
validating a config (`task.validate`, `check_method`) stays fast enough to fail before any model loads.
"""

from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from tqdm import tqdm

from harness.errors import HarnessError
from harness.models import LoadedModel, load_model
from harness.rundir import JsonlLog, write_json

if TYPE_CHECKING:
    from harness.decoding import Generation

log = logging.getLogger(__name__)

# Per-item errors that are recorded (and the run goes on) rather than ending the run: out of memory
# on the device (torch.OutOfMemoryError is a RuntimeError) or on the host, and other runtime errors.
ITEM_ERRORS = (RuntimeError, MemoryError)


def model_facts(model_cfg) -> tuple[int | None, int | None]:
    """(layers, maximum positions) as far as the model's config says without loading it; None if unknown."""
    arch = model_cfg.get("architecture")
    layers = positions = None
    facts: dict = {}
    if arch is not None:
        facts = dict(arch)
    elif model_cfg.get("source") == "local" and model_cfg.get("path"):
        try:
            facts = json.loads((Path(str(model_cfg.path)) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            facts = {}
    if isinstance(facts.get("num_hidden_layers"), int):
        layers = facts["num_hidden_layers"]
    positions = model_cfg.get("max_positions") or facts.get("max_position_embeddings")
    return layers, (int(positions) if positions else None)


def check_method(cfg):
    """Build the method and check it against what the model's config says, before any model loads:
    a bad budget, window or kernel fails in a second. `load_model_and_method` checks again against
    the loaded model."""
    from harness.methods import build_method

    method = build_method(cfg.method)
    layers, positions = model_facts(cfg.model)
    if layers is not None:
        method.validate(layers, positions or 0)
    return method


def load_model_and_method(cfg):
    """Build the method first (cheap, fails early on bad options), then load the model and check the
    method against it."""
    method = check_method(cfg)
    loaded = load_model(cfg.model)
    from harness.methods.engine import attention_modules

    method.validate(len(attention_modules(loaded.model)), loaded.max_positions)
    return loaded, method


def kv_stats(cache) -> dict:
    """Sizes of a cache: entries per layer and total bytes, measured from the tensors."""
    if cache is None:
        return {}
    heads, lengths, nbytes = [], [], 0
    for layer in cache.layers:
        heads.append(int(layer.keys.shape[1]))
        lengths.append(int(layer.keys.shape[2]))
        nbytes += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return {"cache_heads": heads, "cache_lengths": lengths, "cache_bytes": nbytes}


@dataclass
class Setting:
    """One method setting of a run: its tag, method, resolved config (what a separate `method=<entry>`
    run has) and its own run directory."""

    tag: str
    method: object
    cfg: object
    run_dir: object


@dataclass
class Prompt:
    """One item's prompt. `question_start`: where the text after the context begins (the question
    part; None: nothing follows the context). Under the query-agnostic protocol tokens
    [0, question_start) are prefilled and compressed, the rest is prefilled on top of the compressed
    cache, uncompressed, at its true positions. `spans`: named token ranges [a, b) whose retention
    after compression is reported (`<name>_kept`, `<name>_kept_by_layer`)."""

    ids: list[int]
    question_start: int | None = None
    spans: dict = field(default_factory=dict)

    def compressed_end(self, query_aware: bool) -> int:
        if query_aware or self.question_start is None:
            return len(self.ids)
        return int(self.question_start)


@dataclass
class Outcome:
    """One setting's result on one item: the generation and its compression diagnostics, or the error."""

    generation: Generation | None
    diagnostics: dict
    error: BaseException | None = None
    kept: dict = field(default_factory=dict)  # layer -> kept prompt positions (B, H, n), None: layer kept whole


def retention(records: dict, lo: int, hi: int) -> tuple[float | None, list]:
    """Fraction of positions [lo, hi) still cached after compression: per layer (mean over batch and
    heads; None for sliding-window layers, which the model bounds itself and are never compressed)
    and its mean over the other layers."""
    by_layer: list = []
    for idx in sorted(records):
        rec = records[idx]
        if rec.reason == "sliding_window":
            by_layer.append(None)
        elif rec.positions is None or hi <= lo:
            by_layer.append(1.0)
        else:
            inside = ((rec.positions >= lo) & (rec.positions < hi)).sum(dim=-1).float() / (hi - lo)
            by_layer.append(round(float(inside.mean()), 4))
    values = [v for v in by_layer if v is not None]
    return (round(sum(values) / len(values), 4) if values else None), by_layer


def compression_diagnostics(state, method, prompt: Prompt, end: int, cache) -> dict:
    """What a setting kept of one item: layers compressed, the resolved budget, the retention of every
    span of the prompt (spans after `end` were prefilled after compression: kept by construction)."""
    records = state.layers if state is not None else {}
    out: dict = {}
    if records:
        out["kv_positions_after_prefill"] = [list(records[i].after) for i in sorted(records)]
        out["compressed_layers"] = [i for i in sorted(records) if records[i].compressed]
    if getattr(method, "compresses", False):
        out["budget_tokens"] = getattr(method, "budget", None)
    for name, (lo, hi) in prompt.spans.items():
        if lo >= end or not records:  # prefilled after compression (or nothing compressed): all of it is cached
            by_layer = [None if records[i].reason == "sliding_window" else 1.0 for i in sorted(records)]
            out[f"{name}_kept"], out[f"{name}_kept_by_layer"] = 1.0, by_layer
        else:
            out[f"{name}_kept"], out[f"{name}_kept_by_layer"] = retention(records, lo, min(hi, end))
    out.update({k: v for k, v in kv_stats(cache).items() if k == "cache_bytes"})
    return out


_WARNED_SLIDING: set[str] = set()


def _warn_if_nothing_compressible(loaded: LoadedModel, session) -> None:
    """Once per model and process: every layer has its own sliding window, so no method compressed anything."""
    for state in session.states.values():
        layers = state.layers.values()
        if layers and all(r.reason == "sliding_window" for r in layers) and loaded.name not in _WARNED_SLIDING:
            _WARNED_SLIDING.add(loaded.name)
            log.warning("%s: every layer uses a sliding window, which bounds its cache itself; no layer is compressed "
                        "(results equal the full cache)", loaded.name)


def generate_settings(loaded: LoadedModel, methods: list[tuple[str, object]], prompt: Prompt, *,
                      query_aware: bool = True, chunk_size: int | None = None, **decode) -> dict[str, Outcome]:
    """Greedy generation of one prompt under every (tag, method), from ONE prefill.

    The compressed part (the whole prompt, or the context alone when `query_aware` is false) is
    prefilled once, in chunks of `chunk_size` if given; right after each layer's attention in its
    last forward, every method builds its compressed layer from the same K/V and the statistics
    captured during that prefill (engine.py). Then each method, in turn: the rest of the prompt is
    prefilled on top of its own cache (query-agnostic), and it decodes. A method that does not
    compress (`full`) decodes from the prefill's own cache. A runtime or out-of-memory error in one
    method's part fails that method's item only. Every method's tokens equal a separate run's.
    """
    from harness.decoding import Generation, _sync, greedy_decode, prefill
    from harness.methods.engine import compression, new_cache

    model, device = loaded.model, loaded.device
    ids = torch.tensor([prompt.ids], dtype=torch.long, device=device)
    length, end = len(prompt.ids), prompt.compressed_end(query_aware)
    resolved = [(tag, m.resolve(end)) for tag, m in methods]
    keep_full = any(not m.compresses for _, m in resolved)
    # Compressing methods first: `full` continues in the shared cache, the others' caches share its
    # sliding-window layers, so those are handed out before the shared cache moves on.
    order = sorted(resolved, key=lambda tm: not tm[1].compresses)
    outcomes: dict[str, Outcome] = {}
    with torch.inference_mode(), compression(model, [tm for tm in resolved if tm[1].compresses], keep_full=keep_full) as session:
        cache = new_cache(model)
        session.compress_now = False
        _sync(device)
        start = time.perf_counter()
        logits = prefill(model, cache, ids[:, :end], chunk_size=chunk_size, before_last=lambda: setattr(session, "compress_now", True))
        _sync(device)
        shared_seconds = time.perf_counter() - start
        caches = {tag: session.cache_for(tag, cache) for tag, m in order if m.compresses}
        _warn_if_nothing_compressible(loaded, session)
        for tag, method in order:
            own = caches.pop(tag) if method.compresses else cache
            try:
                diag = compression_diagnostics(session.states.get(tag), method, prompt, end, own)
                first, rest_seconds = logits, 0.0
                if end < length:
                    start = time.perf_counter()
                    first = prefill(model, own, ids[:, end:], start=end)
                    _sync(device)
                    rest_seconds = time.perf_counter() - start
                tokens, steps, stopped = greedy_decode(model, own, first, length, tokenizer=loaded.tokenizer,
                                                       **{"eos_token_ids": loaded.eos_token_ids, **decode})
                gen = Generation(tokens=tokens, prompt_length=length, prefill_seconds=shared_seconds + rest_seconds,
                                 step_seconds=steps, stopped_by=stopped)
                diag["shared_prefill_seconds"] = round(shared_seconds, 4)
                state = session.states.get(tag)
                kept = {i: r.positions for i, r in state.layers.items()} if state is not None else {}
                outcomes[tag] = Outcome(gen, diag, kept=kept)
            except ITEM_ERRORS as exc:
                outcomes[tag] = Outcome(None, {}, exc)
            finally:
                del own
    return outcomes


@dataclass
class ItemResult:
    done: int = 0
    skipped: int = 0
    failures: list | None = None


def _failure(desc: str, key, exc: BaseException, tb: str) -> dict:
    text = str(exc).strip()
    return {"desc": desc, "key": list(key), "error": f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}",
            "oom": isinstance(exc, (torch.OutOfMemoryError, MemoryError)), "traceback": tb}


def run_shared_items(items: Iterable, *, logs: dict[str, JsonlLog], key: Callable, work: Callable, desc: str,
                     failures_paths: dict | None = None, progress: bool = True) -> dict[str, ItemResult]:
    """Run every item for every setting (tag) whose log does not hold it yet, one `work` call per item.

    `work(item, tags)` gets the tags still missing that item and returns {tag: record, or the
    exception that failed that tag}. Records are appended as they come; an out-of-memory or runtime
    error is recorded (key, error, short traceback) in that tag's failures file as soon as it
    happens, and the loop goes on; an error raised by `work` itself fails the item for every tag
    asked. Failed items are not in the logs, so the next run retries exactly them (and only for the
    settings that failed). A HarnessError (a user error) ends the run.
    """
    items = list(items)
    results = {tag: ItemResult(failures=[]) for tag in logs}
    todo = []
    for it in items:
        missing = [tag for tag, lg in logs.items() if key(it) not in lg]
        for tag in logs:
            if tag not in missing:
                results[tag].skipped += 1
        if missing:
            todo.append((it, missing))
    done_before = sum(r.skipped for r in results.values())
    if done_before:
        log.info("%s: %d of %d item records already done, resuming", desc, done_before, len(items) * len(logs))
    paths = failures_paths or {}
    bar = tqdm(todo, desc=desc, unit="item", disable=not progress, dynamic_ncols=True)
    for item, missing in bar:
        try:
            out = work(item, missing)
        except HarnessError:
            raise
        except ITEM_ERRORS as exc:
            out = {tag: exc for tag in missing}
            tb = traceback.format_exc(limit=-3)
        else:
            tb = None
        oom = False
        for tag in missing:
            record = out.get(tag)
            if isinstance(record, BaseException):
                failure = _failure(desc, key(item), record, tb or "".join(traceback.format_exception(record, limit=-3)))
                log.warning("%s [%s]: item %s failed: %s", desc, tag, key(item), failure["error"])
                results[tag].failures.append(failure)
                oom = oom or failure["oom"]
                if paths.get(tag) is not None:
                    write_json(paths[tag], results[tag].failures)
            elif record is not None:
                logs[tag].append(record)
                results[tag].done += 1
        del out
        if oom:  # outside the except block: the failed item's frames and tensors are already released
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    bar.close()
    for tag, path in paths.items():
        if path is not None:
            write_json(path, results[tag].failures)
    return results


def run_items(items: Iterable, *, log_file: JsonlLog, key: Callable, work: Callable[[object], dict], desc: str,
              failures_path=None, progress: bool = True) -> ItemResult:
    """`run_shared_items` for one log: `work(item)` returns the item's record."""
    results = run_shared_items(items, logs={"_": log_file}, key=key, work=lambda item, tags: {"_": work(item)}, desc=desc,
                               failures_paths={"_": failures_path}, progress=progress)
    return results["_"]
