"""What every task runner shares: building the model and method, generating one item, and the
resumable item loop (progress bar, per-item failures recorded, nothing redone)."""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from harness.decoding import Generation, greedy_generate
from harness.errors import HarnessError
from harness.methods import build_method, compression
from harness.models import LoadedModel, load_model
from harness.rundir import JsonlLog, write_json

log = logging.getLogger(__name__)

# Per-item errors that are recorded (and the run goes on) rather than ending the run.
ITEM_ERRORS = (torch.OutOfMemoryError, RuntimeError)


def load_model_and_method(cfg):
    """Build the method first (cheap, fails early on bad options), then load the model and check the
    method against it."""
    method = build_method(cfg.method)
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

    An out-of-memory or runtime error in one item is recorded (with the error) in `failures_path`
    and the loop goes on; the caller reports the count and sets the exit status.
    """
    items = list(items)
    todo = [it for it in items if key(it) not in log_file]
    result = ItemResult(skipped=len(items) - len(todo), failures=[])
    if result.skipped:
        log.info("%s: %d of %d items already done in %s, resuming", desc, result.skipped, len(items), log_file.path.parent)
    bar = tqdm(todo, desc=desc, unit="item", disable=not progress, dynamic_ncols=True)
    for item in bar:
        try:
            record = work(item)
        except HarnessError:
            raise
        except ITEM_ERRORS as exc:
            if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("%s: item %s failed: %s", desc, key(item), message)
            result.failures.append({"key": list(key(item)), "error": message, "traceback": traceback.format_exc(limit=3)})
            continue
        log_file.append(record)
        result.done += 1
    bar.close()
    if failures_path is not None:
        write_json(failures_path, result.failures)
    return result
