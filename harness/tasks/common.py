"""What every task runner shares: building the model and method, generating one item, and the
resumable item loop (progress bar, per-item failures recorded, nothing redone).

The decoding and compression modules (and so transformers) are imported when first used, so that
validating a config (`task.validate`, `check_method`) stays fast enough to fail before any model loads.
"""

from __future__ import annotations

import gc
import json
import logging
import traceback
from dataclasses import dataclass
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
    """Sizes of the cache after generation: entries per layer and total bytes, measured from the tensors."""
    if cache is None:
        return {}
    heads, lengths, nbytes = [], [], 0
    for layer in cache.layers:
        heads.append(int(layer.keys.shape[1]))
        lengths.append(int(layer.keys.shape[2]))
        nbytes += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return {"cache_heads": heads, "cache_lengths": lengths, "cache_bytes": nbytes}


def generate(loaded: LoadedModel, method, prompt_ids: list[int], **kwargs) -> tuple[Generation, dict]:
    """Greedy generation of one prompt under `method`; returns the generation and the compression it did."""
    from harness.decoding import greedy_generate
    from harness.methods import compression

    ids = torch.tensor([prompt_ids], dtype=torch.long, device=loaded.device)
    with compression(loaded.model, method) as state:
        gen = greedy_generate(loaded.model, ids, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer, **kwargs)
    kept = {"kv_positions_after_prefill": [state.after.get(i, state.before.get(i)) for i in sorted(state.before)]} if state.before else {}
    return gen, kept


@dataclass
class ItemResult:
    done: int = 0
    skipped: int = 0
    failures: list | None = None


def run_items(items: Iterable, *, log_file: JsonlLog, key: Callable, work: Callable[[object], dict], desc: str,
              failures_path=None, progress: bool = True) -> ItemResult:
    """Run `work(item)` for every item not yet in `log_file`, appending each record as it finishes.

    An out-of-memory or runtime error in one item is recorded (key, error, short traceback) in
    `failures_path` as soon as it happens, and the loop goes on; the caller reports the count and
    sets the exit status. Failed items are not in `log_file`, so the next run retries exactly them.
    """
    items = list(items)
    todo = [it for it in items if key(it) not in log_file]
    result = ItemResult(skipped=len(items) - len(todo), failures=[])
    if result.skipped:
        log.info("%s: %d of %d items already done in %s, resuming", desc, result.skipped, len(items), log_file.path.parent)
    bar = tqdm(todo, desc=desc, unit="item", disable=not progress, dynamic_ncols=True)
    for item in bar:
        failure = None
        try:
            record = work(item)
        except HarnessError:
            raise
        except ITEM_ERRORS as exc:
            text = str(exc).strip()
            failure = {"desc": desc, "key": list(key(item)), "error": f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}",
                       "oom": isinstance(exc, (torch.OutOfMemoryError, MemoryError)), "traceback": traceback.format_exc(limit=-3)}
        if failure is None:
            log_file.append(record)
            result.done += 1
            continue
        # Outside the except block, so the failed item's frames (and its tensors) are already released.
        log.warning("%s: item %s failed: %s", desc, key(item), failure["error"])
        result.failures.append(failure)
        if failure["oom"]:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if failures_path is not None:
            write_json(failures_path, result.failures)
    bar.close()
    if failures_path is not None:
        write_json(failures_path, result.failures)
    return result
