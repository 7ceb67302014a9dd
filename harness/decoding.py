"""The one greedy decode loop every task uses.

A prefill over the prompt (one forward, or chunks through the same cache; logits for the last
position only), then one token at a time. Every forward gets explicit, true positions
(`prompt_length + t`): once a compression method has shrunk the cache, the cache length no longer
says where a new token sits. The pieces (`prefill`, `forward_tokens`, `greedy_decode`) are what the
task runner composes for shared prefills and question-after-compression protocols.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from harness.errors import HarnessError
from harness.memory_plan import values


@dataclass
class Generation:
    """Generated token ids per batch row, and the timings of the forwards that produced them."""

    tokens: list[list[int]]
    prompt_length: int
    prefill_seconds: float
    step_seconds: list[float] = field(default_factory=list)
    stopped_by: list[str] = field(default_factory=list)
    cache: object = None
    decoded_with: str = "alone"  # "batch of N" when N settings decoded together (harness/generation/batch_decode.py)

    @property
    def decode_seconds(self) -> float:
        return float(sum(self.step_seconds))


def _sync(where) -> None:
    """Wait for queued CUDA work before reading a clock. `where`: a model (every CUDA device its parameters and
    buffers are on: a `device_map=auto` model's later layers run on other GPUs than its input) or one device."""
    if not torch.cuda.is_available():
        return
    if isinstance(where, torch.nn.Module):
        devices = {t.device for t in (*where.parameters(), *where.buffers()) if t.device.type == "cuda"}
    else:
        devices = {torch.device(where)} if torch.device(where).type == "cuda" else set()
    for device in sorted(devices, key=lambda d: d.index or 0):
        torch.cuda.synchronize(device)


def cache_argument(model) -> str:
    """The keyword the current transformers release uses for the KV cache (`cache` or `past_key_values`)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_tokens(model, cache, ids: torch.Tensor, start) -> torch.Tensor:
    """One forward of `ids` (B, n) at true positions start .. start + n - 1 through `cache`; the
    logits of the last position only (B, vocab). `start`: one position for every row, or a (B,)
    tensor of each row's own (rows of different settings' caches decoded together, batch_decode.py)."""
    batch, n = ids.shape
    offsets = torch.arange(n, device=ids.device).unsqueeze(0)
    if isinstance(start, torch.Tensor):
        positions = start.to(ids.device).view(-1, 1) + offsets
    else:
        positions = (offsets + int(start)).expand(batch, -1)
    out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
    logits = out.logits[:, -1, :]
    del out
    return logits


def prefill(model, cache, ids: torch.Tensor, *, start: int = 0, chunk_size: int | None = None, before_last=None) -> torch.Tensor:
    """Prefill `ids` through `cache` at true positions, in one forward or in chunks of `chunk_size`
    tokens (exact: each chunk attends to everything cached before it). `before_last()` runs right
    before the last chunk's forward (where a compressing engine compresses). Returns the last logits."""
    n = ids.shape[1]
    size = n if not chunk_size or chunk_size >= n else int(chunk_size)
    bounds = list(range(0, n, size))
    logits = None
    for i, lo in enumerate(bounds):
        if i == len(bounds) - 1 and before_last is not None:
            before_last()
        logits = forward_tokens(model, cache, ids[:, lo:lo + size], start + lo)
    return logits


@torch.inference_mode()
def greedy_decode(
    model,
    cache,
    logits: torch.Tensor,
    prompt_length,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int] = (),
    stop_token_ids: list[int] = (),
    stop_strings: list[str] = (),
    tokenizer=None,
    min_new_tokens: int = 0,
    ignore_eos: bool = False,
    repetition_penalty: float | None = None,
    penalty_history: list[list[int]] | None = None,
) -> tuple[list[list[int]], list[float], list[str]]:
    """Greedy decoding from the prefill's last `logits` (B, vocab); token t sits at prompt_length + t
    (`prompt_length`: an int, or a (B,) tensor of each row's own, as `forward_tokens` takes).

    Stops a row at any EOS id or stop token id (the token is kept, as `generate` does), or when its
    decoded text contains a stop string. `min_new_tokens` forbids EOS/stop tokens for the first
    steps (LongBench's samsum rule). `ignore_eos` decodes exactly `max_new_tokens` (benchmarks).
    `repetition_penalty` (off when None or 1; LooGLE's 2.0): before each argmax, the logit of every token a row has
    seen (its `penalty_history`, the uncompressed prompt ids it was asked, then its own new tokens) is divided by
    the penalty where positive and multiplied where negative, as transformers' RepetitionPenaltyLogitsProcessor
    does over `generate`'s input_ids (the prompt and the tokens so far).
    Returns (tokens per row, seconds per step, why each row stopped)."""
    device = logits.device
    batch = logits.shape[0]
    enders = list(dict.fromkeys([*eos_token_ids, *stop_token_ids]))
    banned = torch.tensor(enders, dtype=torch.long, device=device) if enders else None
    tokens: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    stopped = ["length"] * batch
    steps: list[float] = []
    active, positions = list(range(batch)), prompt_length  # the rows still computed (logits has one row each)
    seen = _seen_tokens(penalty_history, batch, logits) if repetition_penalty not in (None, 1, 1.0) else None
    from harness.methods.inplace import reserve

    reserve(cache, max_new_tokens)  # room for every token to come: appends write in place (at most one copy now)
    for t in range(max_new_tokens):
        if banned is not None and t < min_new_tokens:
            logits = logits.clone()
            logits[:, banned] = float("-inf")
        if seen is not None:
            logits = penalize_repetition(logits, seen[active], float(repetition_penalty))
        next_ids = logits.argmax(dim=-1)
        ids = values(next_ids)  # a planned run (fake tensors, harness/memory_plan.py) has no values to read
        for row, tok in zip(active, ids):
            if done[row]:
                continue
            tokens[row].append(tok)
            if seen is not None:
                seen[row, tok] = True
            if not ignore_eos and tok in enders:
                done[row], stopped[row] = True, "eos"
            elif stop_strings and tokenizer is not None:
                tail = tokenizer.decode(tokens[row][-16:], skip_special_tokens=True)
                if any(s in tail for s in stop_strings):
                    done[row], stopped[row] = True, "stop_string"
        if all(done) or t == max_new_tokens - 1:
            break
        # A cache that can drop finished rows (batch_decode.RowsCache: a setting whose rows all stopped) stops
        # computing them; any other cache computes every row to the end, the finished ones' tokens ignored.
        drop = getattr(cache, "drop_finished", None)
        if drop is not None and any(done[row] for row in active):
            kept = drop([done[row] for row in active])
            if len(kept) < len(active):
                index = torch.tensor(kept, dtype=torch.long, device=device)
                next_ids = next_ids[index]
                if isinstance(positions, torch.Tensor):
                    positions = positions[index.to(positions.device)]
                active = [active[j] for j in kept]
        start = time.perf_counter()
        logits = forward_tokens(model, cache, next_ids[:, None], positions + t)
        hook = getattr(cache, "_kvharness_after_step", None)  # decode-time compression (harness/methods/decode_time.py)
        if hook is not None:
            hook(cache)
        _sync(model)
        steps.append(time.perf_counter() - start)
    return tokens, steps, stopped


def _seen_tokens(history, batch: int, logits: torch.Tensor) -> torch.Tensor:
    """(batch, vocab) flags of the tokens each row has seen so far (its penalty history)."""
    if history is None or len(history) != batch:
        raise HarnessError(f"repetition_penalty needs one penalty_history (prompt ids) per row: {batch} rows, "
                           f"{'none' if history is None else len(history)} given")
    seen = torch.zeros(batch, logits.shape[-1], dtype=torch.bool, device=logits.device)
    for row, ids in enumerate(history):
        if len(ids):
            seen[row, torch.as_tensor(list(ids), dtype=torch.long, device=logits.device)] = True
    return seen


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The logits of the `seen` tokens divided by `penalty` where positive, multiplied where negative (in float32,
    as `generate` scores; a penalty of 2 is exact in any float type)."""
    scores = logits.float()
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


@torch.inference_mode()
def greedy_generate(
    model,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    keep_cache: bool = False,
    chunk_size: int | None = None,
    **decode_options,
) -> Generation:
    """Greedy decoding of `input_ids` (B, L), no padding: one prefill (logits for the last position
    only; in chunks of `chunk_size` tokens if given), then one token at a time at true positions.
    `decode_options` as `greedy_decode`."""
    from harness.methods.inplace import in_place_cache

    cache = in_place_cache(model, room=max_new_tokens)  # appends in place: no per-step copy of the cache
    _sync(model)
    start = time.perf_counter()
    logits = prefill(model, cache, input_ids, chunk_size=chunk_size)
    _sync(model)
    seconds = time.perf_counter() - start
    tokens, steps, stopped = greedy_decode(model, cache, logits, input_ids.shape[1], max_new_tokens=max_new_tokens, **decode_options)
    return Generation(tokens=tokens, prompt_length=input_ids.shape[1], prefill_seconds=seconds, step_seconds=steps,
                      stopped_by=stopped, cache=cache if keep_cache else None)
