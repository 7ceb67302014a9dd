"""The one greedy decode loop every task uses.

A single prefill forward over the whole prompt (logits for the last position only), then one token
at a time. Every forward gets explicit, true positions (`prompt_length + t`): once a compression
method has shrunk the cache, the cache length no longer says where a new token sits.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class Generation:
    """Generated token ids per batch row, and the timings of the forwards that produced them."""

    tokens: list[list[int]]
    prompt_length: int
    prefill_seconds: float
    step_seconds: list[float] = field(default_factory=list)
    stopped_by: list[str] = field(default_factory=list)
    cache: object = None

    @property
    def decode_seconds(self) -> float:
        return float(sum(self.step_seconds))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_argument(model) -> str:
    """The keyword the current transformers release uses for the KV cache (`cache` or `past_key_values`)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def greedy_generate(
    model,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int] = (),
    stop_token_ids: list[int] = (),
    stop_strings: list[str] = (),
    tokenizer=None,
    min_new_tokens: int = 0,
    ignore_eos: bool = False,
    keep_cache: bool = False,
) -> Generation:
    """Greedy decoding of `input_ids` (B, L), no padding.

    Stops a row at any EOS id or stop token id (the token is kept, as `generate` does), or when its
    decoded text contains a stop string. `min_new_tokens` forbids EOS/stop tokens for the first
    steps (LongBench's samsum rule). `ignore_eos` decodes exactly `max_new_tokens` (benchmarks).
    """
    device = input_ids.device
    batch, length = input_ids.shape
    cache = DynamicCache(config=model.config)
    cache_kw = {cache_argument(model): cache}
    enders = list(dict.fromkeys([*eos_token_ids, *stop_token_ids]))
    banned = torch.tensor(enders, dtype=torch.long, device=device) if enders else None

    _sync(device)
    start = time.perf_counter()
    positions = torch.arange(length, device=device).unsqueeze(0).expand(batch, -1)
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, logits_to_keep=1, **cache_kw)
    logits = out.logits[:, -1, :]
    del out
    _sync(device)
    prefill = time.perf_counter() - start

    tokens: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    stopped = ["length"] * batch
    steps: list[float] = []
    for t in range(max_new_tokens):
        if banned is not None and t < min_new_tokens:
            logits = logits.clone()
            logits[:, banned] = float("-inf")
        next_ids = logits.argmax(dim=-1)
        ids = next_ids.tolist()
        for row, tok in enumerate(ids):
            if done[row]:
                continue
            tokens[row].append(tok)
            if not ignore_eos and tok in enders:
                done[row], stopped[row] = True, "eos"
            elif stop_strings and tokenizer is not None:
                tail = tokenizer.decode(tokens[row][-16:], skip_special_tokens=True)
                if any(s in tail for s in stop_strings):
                    done[row], stopped[row] = True, "stop_string"
        if all(done) or t == max_new_tokens - 1:
            break
        start = time.perf_counter()
        step_positions = torch.full((batch, 1), length + t, dtype=torch.long, device=device)
        out = model(input_ids=next_ids[:, None], position_ids=step_positions, use_cache=True, logits_to_keep=1, **cache_kw)
        logits = out.logits[:, -1, :]
        del out
        _sync(device)
        steps.append(time.perf_counter() - start)
    return Generation(
        tokens=tokens,
        prompt_length=length,
        prefill_seconds=prefill,
        step_seconds=steps,
        stopped_by=stopped,
        cache=cache if keep_cache else None,
    )
