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

from harness.errors import HarnessError, is_out_of_memory
from harness.methods.layout import LAYOUT_REASONS, layer_bytes
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
    if layers is None:
        # The layer count is unknown until the model loads (a GGUF or hub model without `architecture`):
        # check every option that does not depend on it with a nominal count (a per-layer list: its own
        # length; 2 layers otherwise, the fewest a PyramidKV schedule has). The loaded model is checked again.
        budget = getattr(method, "budget", None)
        layers = len(budget) if isinstance(budget, (list, tuple)) and budget else 2
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
    for layer in cache.layers:  # a linear-attention layer's fixed state counts; a shared-KV layer holds nothing
        keys = getattr(layer, "keys", None)
        heads.append(int(keys.shape[1]) if keys is not None else 0)
        lengths.append(int(keys.shape[2]) if keys is not None else 0)
        nbytes += layer_bytes(layer)
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
    after compression is reported (`<name>_kept`, `<name>_kept_by_layer`).

    Several questions over one context (`questions`, K >= 1 `Question`s): `ids` is then the context
    alone (`question_start` = its length) and each question holds the tokens that follow the context
    when it is asked, with its own spans (positions in context + that question; the context's spans,
    e.g. needles, are `spans`). `asked()` gives the K single-question prompts. Without `questions`
    the prompt is today's one question: `ids[question_start:]`."""

    ids: list[int]
    question_start: int | None = None
    spans: dict = field(default_factory=dict)
    questions: list[Question] = field(default_factory=list)

    def __post_init__(self):
        if self.questions:
            if self.question_start is None:
                self.question_start = len(self.ids)
            if self.question_start != len(self.ids):
                raise ValueError("a prompt with `questions` holds the context alone in `ids` (question_start = len(ids))")

    def compressed_end(self, query_aware: bool) -> int:
        if query_aware or self.question_start is None:
            return len(self.ids)
        return int(self.question_start)

    def asked(self) -> list[Prompt]:
        """One single-question prompt per question (context + that question), in order; [self] without `questions`."""
        if not self.questions:
            return [self]
        return [Prompt(self.ids + list(q.ids), self.question_start, {**self.spans, **q.spans}) for q in self.questions]


@dataclass
class Question:
    """One of several questions over a prompt's context: its tokens after the context, and its spans
    (e.g. {"question": (a, b)}) in positions of context + these tokens."""

    ids: list[int]
    spans: dict = field(default_factory=dict)


@dataclass
class Outcome:
    """One setting's result on one item: the generation and its compression diagnostics, or the error."""

    generation: Generation | None
    diagnostics: dict
    error: BaseException | None = None
    kept: dict = field(default_factory=dict)  # layer -> kept prompt positions (B, H, n), None: layer kept whole


def retention(records: dict, lo: int, hi: int, row: int | None = None) -> tuple[float | None, list]:
    """Fraction of positions [lo, hi) still cached after compression: per layer (mean over batch and
    heads, or over batch row `row`'s heads; None for sliding-window layers, which the model bounds itself
    and are never compressed) and its mean over the other layers."""
    by_layer: list = []
    for idx in sorted(records):
        rec = records[idx]
        if rec.reason in LAYOUT_REASONS:  # the model bounds or shares this layer's cache: not the method's
            by_layer.append(None)
        elif rec.positions is None or hi <= lo:
            by_layer.append(1.0)
        else:
            positions = rec.positions if row is None else rec.positions[row:row + 1]
            inside = ((positions >= lo) & (positions < hi)).sum(dim=-1).float() / (hi - lo)
            by_layer.append(round(float(inside.mean()), 4))
    values = [v for v in by_layer if v is not None]
    return (round(sum(values) / len(values), 4) if values else None), by_layer


def compression_diagnostics(state, method, prompt: Prompt, end: int, cache, row: int | None = None, rows: int = 1) -> dict:
    """What a setting kept of one item: layers compressed, the resolved budget, the retention of every
    span of the prompt (spans after `end` were prefilled after compression: kept by construction).
    Batched items: the item is batch row `row` of `rows` (its retention and its share of the cache bytes)."""
    records = state.layers if state is not None else {}
    out: dict = {}
    if records:
        out["kv_positions_after_prefill"] = [list(records[i].after) if row is None else _row_after(records[i], row)
                                             for i in sorted(records)]
        out["compressed_layers"] = [i for i in sorted(records) if records[i].compressed]
        whole = {}
        for i in sorted(records):
            if records[i].reason in LAYOUT_REASONS:
                whole.setdefault(records[i].reason, []).append(i)
        if whole:
            out["layers_kept_whole"] = whole  # why the others were not: sliding_window, chunked_attention, linear_attention, shared_kv
    if getattr(method, "compresses", False):
        out["budget_tokens"] = getattr(method, "budget", None)
        short = [i for i in sorted(records) if records[i].reason == "short_prompt"]
        if short and all(records[i].reason == "short_prompt" or records[i].reason in LAYOUT_REASONS for i in records):
            out["not_compressed"] = f"budget {out['budget_tokens']} >= the {end}-token compressed part: kept whole"
            _warn_once(repr(method), "%s: the budget (%s tokens) is at or above this item's %d-token compressed part: "
                       "nothing is compressed (the official rule); lower method.budget or use method.ratio",
                       getattr(method, "name", method), out["budget_tokens"], end)
    for name, (lo, hi) in prompt.spans.items():
        if lo >= end or not records:  # prefilled after compression (or nothing compressed): all of it is cached
            by_layer = [None if records[i].reason in LAYOUT_REASONS else 1.0 for i in sorted(records)]
            out[f"{name}_kept"], out[f"{name}_kept_by_layer"] = 1.0, by_layer
        else:
            out[f"{name}_kept"], out[f"{name}_kept_by_layer"] = retention(records, lo, min(hi, end), row)
    if cache is not None:
        out["cache_bytes"] = kv_stats(cache)["cache_bytes"] if row is None else row_cache_bytes(cache, row)
    if state is not None:
        out.update(state.extra)  # what the method adds (KVzip: its reconstruction forwards)
    return out


def _row_after(record, row: int) -> list[int]:
    """(heads, entries) batch row `row` keeps in one layer: its longest head (rows of a per-head-budget layer
    are padded to the batch's longest, positions -1)."""
    if record.positions is None:
        return list(record.after)
    return [int(record.after[0]), int((record.positions[row] >= 0).sum(dim=-1).max())]


def row_cache_bytes(cache, row: int) -> int:
    """The bytes batch row `row` of a cache holds: its share of every layer, a ragged layer's padding excluded
    (a batch of one measures the tensors themselves, `kv_stats`)."""
    total = 0
    batch = next((int(layer.keys.shape[0]) for layer in cache.layers if getattr(layer, "keys", None) is not None), 1)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:  # a linear layer's fixed state, one per row (a shared layer: nothing)
            total += round(layer_bytes(layer) / batch)
            continue
        rows, length = int(layer.keys.shape[0]), int(layer.keys.shape[2])
        nbytes = layer_bytes(layer)
        owner = getattr(layer, "_kvharness_owner", None)  # ragged (harness/methods/ragged.py): -1 marks padding
        share = int((owner[row] >= 0).sum()) / max(length, 1) if owner is not None else 1.0
        total += round(nbytes / rows * share)
    return total


_WARNED_SLIDING: set[str] = set()
_WARNED: set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message, *args)


def _warn_if_nothing_compressible(loaded: LoadedModel, session) -> None:
    """Once per model and process: every layer has its own sliding window, so no method compressed anything."""
    for state in session.states.values():
        layers = state.layers.values()
        if layers and all(r.reason in LAYOUT_REASONS for r in layers) and loaded.name not in _WARNED_SLIDING:
            _WARNED_SLIDING.add(loaded.name)
            log.warning("%s: every layer uses a sliding window, which bounds its cache itself; no layer is compressed "
                        "(results equal the full cache)", loaded.name)


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate_settings(loaded: LoadedModel, methods: list[tuple[str, object]], prompt: Prompt | list[Prompt], **options):
    """Greedy generation of one prompt under every (tag, method), from one prefill when memory allows.

    A shared prefill holds, before the first decode, every setting's compressed cache (plus the full
    cache when `full` is listed). When it runs out of memory, the settings are split in two groups,
    each with its own prefill, and so on down to one setting at a time, which is exactly that
    setting's separate run: a long item fails for a setting only where its own run fails. Every
    outcome records `shared_with`: the tags whose prefill it shared (itself alone: a separate run).

    Batched items (`prompt` a list, `batch_refusal` says which lists can be): the prompts are one batch,
    prefilled together, each row compressed on its own (every method scores and selects per batch row),
    decoded together; returns one {tag: Outcome} per prompt, each equal to that prompt's own run.
    """
    prompts = list(prompt) if isinstance(prompt, (list, tuple)) else [prompt]
    why = batch_refusal(prompts, options.get("keep_answers", False))
    if why is not None:
        raise HarnessError(f"these items cannot be batched: {why}")
    pending, outcomes = [list(methods)], [{} for _ in prompts]
    while pending:
        group = pending.pop(0)
        try:
            out = _generate_group(loaded, group, prompts, **options)
        except ITEM_ERRORS as exc:
            if not is_out_of_memory(exc):
                raise
            if len(group) == 1:  # its own run fails too: that setting's item fails, the others stand
                for row in outcomes:
                    row[group[0][0]] = Outcome(None, {"shared_with": [group[0][0]]}, exc)
                continue
            out = None
        if out is None:  # outside the except block: the failed prefill's frames and tensors are released
            _release_memory()
            half = (len(group) + 1) // 2
            log.warning("shared prefill of %d settings ran out of memory; retrying in groups of %d and %d",
                        len(group), half, len(group) - half)
            pending[:0] = [group[:half], group[half:]]
            continue
        tags = [tag for tag, _ in group]
        for row, got in zip(outcomes, out):
            for outcome in got.values():
                outcome.diagnostics["shared_with"] = tags
            row.update(got)
    return outcomes if isinstance(prompt, (list, tuple)) else outcomes[0]


def _row_positions(positions, row: int, rows: int):
    """Batch row `row`'s kept positions (1, H, n): a per-head-budget layer's padding (-1) past its longest head cut."""
    if positions is None or rows == 1:
        return positions
    mine = positions[row:row + 1]
    return mine[..., :int((mine >= 0).sum(dim=-1).max())]


def batch_refusal(prompts: list[Prompt], keep_answers: bool = False) -> str | None:
    """Why these prompts cannot be one batch (one line), or None: a batch needs prompts of one length whose
    compressed parts end at the same token and whose questions (the tokens after the context) are the same,
    e.g. the needle cells of one length. Multi-turn conversations (`keep_answers`) go one item at a time."""
    if len(prompts) < 2:
        return None if prompts else "no prompt"
    first = prompts[0]
    if keep_answers:
        return "task.keep_answers=true (multi-turn) asks one item at a time"
    for p in prompts[1:]:
        if len(p.ids) != len(first.ids) or p.question_start != first.question_start:
            return f"prompts of {len(first.ids)} and {len(p.ids)} tokens (or contexts of different lengths)"
        if [list(q.ids) for q in p.questions] != [list(q.ids) for q in first.questions] or (
                not first.questions and first.question_start is not None and p.ids[first.question_start:] != first.ids[first.question_start:]):
            return "the prompts ask different questions (the tokens after the context differ)"
    return None


def _generate_group(loaded: LoadedModel, methods: list[tuple[str, object]], prompts: list[Prompt], *,
                    query_aware: bool = True, chunk_size: int | None = None, keep_answers: bool = False,
                    decode_together: bool = True, **decode) -> list[dict[str, Outcome]]:
    """Greedy generation of a batch of prompts (usually one) under every (tag, method), from ONE prefill of
    their compressed part; one {tag: Outcome} per prompt.

    The compressed part (the whole prompt, or the context alone when `query_aware` is false) is
    prefilled once, in chunks of `chunk_size` if given; right after each layer's attention in its
    last forward, every method builds its compressed layer from the same K/V and the statistics
    captured during that prefill (engine.py), each batch row on its own. Then `_answer` asks every
    setting the question: the rest of the prompt prefilled on top of its own cache (query-agnostic),
    then decoding. A method that does not compress (`full`) answers from the prefill's own cache. A
    runtime or out-of-memory error in one setting's answer, or a runtime error in its compression, fails
    that setting's item only. Every setting's tokens equal a separate run's.

    A prompt of K questions (`Prompt.questions`) gives each setting a `QuestionOutcomes`. Query-agnostic:
    the context is prefilled and compressed once; each question is asked on a rollback copy of every
    setting's compressed cache (`rollback_copy`), and every (setting, question) decodes in one batch, so each
    answer equals that question asked alone on the same compressed cache (the last question gets the cache
    itself: nothing follows it). `keep_answers` (multi-turn, one prompt): no copies; question i + 1 follows question i and its answer
    in the cache (the answer's last token, which decoding never feeds back, opens the next turn), at true
    positions. Query-aware: each question is compressed with the context, one prefill per question,
    shared by every setting.
    """
    from harness.decoding import Generation, _sync, prefill
    from harness.methods.engine import compression, new_cache

    model, device = loaded.model, loaded.device
    rows = len(prompts)
    asked = [p.asked() for p in prompts]  # per row, its single-question prompts (the same question tokens in every row)
    first = prompts[0]
    if not query_aware and first.question_start is not None:
        passes = [(int(first.question_start), list(range(len(asked[0]))))]  # one context prefill, every question on top
    else:
        passes = [(len(q.ids), [n]) for n, q in enumerate(asked[0])]  # each question inside its compressed prompt
    answers: list[dict[str, list[Outcome]]] = [{tag: [] for tag, _ in methods} for _ in prompts]
    for end, numbers_here in passes:
        ids = torch.tensor([row[numbers_here[0]].ids[:end] for row in asked], dtype=torch.long, device=device)
        resolved = [(tag, m.resolve(end)) for tag, m in methods]
        keep_full = any(not m.compresses for _, m in resolved)
        # Compressing methods first (the order of the separate runs; every cache is handed out before any answer).
        order = sorted(resolved, key=lambda tm: not tm[1].compresses)
        with torch.inference_mode(), compression(model, [tm for tm in resolved if tm[1].compresses], keep_full=keep_full,
                                                   tokenizer=loaded.tokenizer) as session:
            cache = new_cache(model)
            session.compress_now = False
            _sync(model)
            start = time.perf_counter()
            logits = prefill(model, cache, ids, chunk_size=chunk_size, before_last=lambda: setattr(session, "compress_now", True))
            _sync(model)
            shared_seconds = time.perf_counter() - start
            failed = {tag: state.error for tag, state in session.states.items() if state.error is not None}
            bases = {tag: session.cache_for(tag, cache) if m.compresses else cache for tag, m in order if tag not in failed}
            del cache
            _warn_if_nothing_compressible(loaded, session)
            kept = {tag: [{i: _row_positions(r.positions, b, rows) for i, r in session.states[tag].layers.items()}
                          if tag in session.states else {} for b in range(rows)] for tag, _ in order if tag not in failed}
            talks: dict[str, Turn] = {}  # keep_answers: each setting's conversation so far
            # Independent questions are asked all at once (every setting x question decodes in one batch); multi-turn
            # (keep_answers) asks them in order, each after the previous answers.
            rounds = [[n] for n in numbers_here] if keep_answers else [numbers_here]
            for numbers in rounds:
                turns, diagnostics, results = {}, {}, {}
                for number in numbers:
                    asking, last = asked[0][number], number == numbers_here[-1]
                    for tag, method in order:
                        key = (tag, number)
                        if tag in failed:  # its compression failed (Session.guarded): this setting's item fails alone
                            for b in range(rows):
                                results[(*key, b)] = Outcome(None, {}, failed[tag])
                            continue
                        if keep_answers and answers[0][tag] and answers[0][tag][-1].error is not None:
                            for b in range(rows):
                                results[(*key, b)] = Outcome(None, {}, answers[0][tag][-1].error)  # its conversation broke
                            continue
                        try:
                            diagnostics[key] = [compression_diagnostics(session.states.get(tag), method, asked[b][number], end, bases[tag],
                                                                        row=None if rows == 1 else b, rows=rows) for b in range(rows)]
                        except ITEM_ERRORS as exc:
                            for b in range(rows):
                                results[(*key, b)] = Outcome(None, {}, exc)
                            continue
                        before = talks.get(tag)
                        if keep_answers and before is not None:
                            turns[key] = Turn(before.cache, [*before.answer[-1:], *asking.ids[end:]], before.next_position)
                        else:  # the cache itself where nothing is asked after this question, else a rollback copy
                            base = bases[tag] if last or keep_answers else rollback_copy(bases[tag])
                            turns[key] = Turn(base, asking.ids[end:], end)
                if numbers_here[-1] in numbers:
                    bases.clear()  # the last answers own their caches: each is freed with its turn
                generations = _answer(loaded, turns, logits, together=decode_together, **decode)
                for key, per_row in diagnostics.items():
                    gen = generations[key]
                    for b, diag in enumerate(per_row):
                        if isinstance(gen, BaseException):
                            results[(*key, b)] = Outcome(None, {}, gen)
                            continue
                        mine = gen if rows == 1 else Generation(
                            tokens=[gen.tokens[b]], prompt_length=gen.prompt_length, prefill_seconds=gen.prefill_seconds,
                            step_seconds=gen.step_seconds, stopped_by=[gen.stopped_by[b]], decoded_with=gen.decoded_with)
                        mine.prefill_seconds += shared_seconds
                        diag["shared_prefill_seconds"] = round(shared_seconds, 4)
                        diag["decoded_with"] = mine.decoded_with
                        if rows > 1:
                            diag["items_batched"] = rows
                        if first.questions:  # where this question's first token sits (after the earlier turns: multi-turn)
                            asked_ids = asked[0][key[1]].ids
                            diag["question_position"] = turns[key].start + len(turns[key].ids) - (len(asked_ids) - end)
                        results[(*key, b)] = Outcome(mine, diag, kept=kept[key[0]][b])
                    if not isinstance(gen, BaseException):
                        turns[key].answer = gen.tokens[0]
                for number in numbers:  # in question order, each setting's answers
                    for tag, _ in order:
                        for b in range(rows):
                            answers[b][tag].append(results[(tag, number, b)])
                talks = {tag: turns[(tag, n)] for tag, n in turns} if keep_answers else {}
                del turns, generations
    if not first.questions:
        return [{tag: outs[0] for tag, outs in row.items()} for row in answers]
    return [{tag: QuestionOutcomes(None, {}, answers=outs) for tag, outs in row.items()} for row in answers]


@dataclass
class Turn:
    """One setting's part of one question: `ids` prefilled on top of `cache` at true positions `start`, ...,
    then decoding. `answer`: the tokens decoded (set once answered)."""

    cache: object
    ids: list[int]
    start: int
    answer: list[int] = field(default_factory=list)

    @property
    def next_position(self) -> int:
        """Where the next turn starts: after these ids and the answer's tokens the cache holds (all but its last)."""
        return self.start + len(self.ids) + max(0, len(self.answer) - 1)


def _answer(loaded: LoadedModel, turns: dict, logits: torch.Tensor, *, together: bool = True,
            **decode) -> dict:
    """Every turn's answer: its ids prefilled on top of its own cache at their true positions (no ids:
    `logits`, the compressed prefill's last logits, start decoding), then greedy decoding. `turns`: {key: Turn},
    one per setting (and per question, when several questions over one context are asked at once).
    Returns {key: Generation (prefill_seconds: this turn's own prefill), or the runtime/out-of-memory error that
    failed that answer}. With `together`, all turns decode as one batch, one forward per step
    (harness/batch_decode.py: each attends to its own cache only, at its own positions; tokens equal the
    separate decodes); on a model with sliding-window layers, turns at different positions decode as one batch
    per position. Where they cannot (one turn, an attention kernel it does not take), one after another, and
    every Generation's `decoded_with` says which and why. A batch that runs out of memory raises (the caller
    retries smaller groups of settings from their own prefills); another error fails every answer of the batch."""
    from harness.batch_decode import decode_together, decoded_with, refusal
    from harness.decoding import Generation, _sync, greedy_decode, prefill

    model, device = loaded.model, loaded.device
    options = {"eos_token_ids": loaded.eos_token_ids, **decode}
    why = "one setting" if len(turns) < 2 else None if together else "decode_together=false"
    if why is None:
        why = refusal(model, [t.cache for t in turns.values()])
    places: dict = {}
    for key, t in turns.items():
        places.setdefault((t.start, tuple(t.ids)), []).append(key)
    sliding = any(getattr(layer, "is_sliding", False) for t in turns.values() for layer in t.cache.layers)
    if why is None and len(places) > 1 and sliding:  # one window mask per batch: one batch per position
        out: dict = {}
        for keys in places.values():
            out.update(_answer(loaded, {k: turns[k] for k in keys}, logits, together=True, **decode))
        return out
    if why is None:
        ends = [t.start + len(t.ids) for t in turns.values()]
        suffixes = [torch.tensor([t.ids], dtype=torch.long, device=device) if t.ids else None for t in turns.values()]
        try:
            decoded = decode_together(model, [t.cache for t in turns.values()], [None if t.ids else logits for t in turns.values()],
                                      ends, suffix=suffixes, tokenizer=loaded.tokenizer, **options)
        except ITEM_ERRORS as exc:
            # The caches may hold part of the batch's work: no answer here can be trusted or redone on them.
            # Out of memory: `generate_settings` retries in smaller groups, each from its own prefill;
            # another runtime error fails these answers (the item is asked again by the next run).
            if is_out_of_memory(exc):
                raise
            return {key: exc for key in turns}
        else:
            label = decoded_with(len(turns), None)
            return {key: Generation(tokens=d.tokens, prompt_length=end, prefill_seconds=d.suffix_seconds,
                                    step_seconds=d.step_seconds, stopped_by=d.stopped_by, decoded_with=label)
                    for key, d, end in zip(turns, decoded, ends)}
    out: dict[str, Generation | BaseException] = {}
    for tag, turn in turns.items():
        try:
            first, seconds = logits, 0.0
            if turn.ids:
                start = time.perf_counter()
                rows = int(logits.shape[0])  # batched items: every row asks the same question
                ids = torch.tensor([turn.ids], dtype=torch.long, device=device).expand(rows, -1)
                first = prefill(model, turn.cache, ids, start=turn.start)
                _sync(model)
                seconds = time.perf_counter() - start
            length = turn.start + len(turn.ids)
            tokens, steps, stopped = greedy_decode(model, turn.cache, first, length, tokenizer=loaded.tokenizer, **options)
            out[tag] = Generation(tokens=tokens, prompt_length=length, prefill_seconds=seconds, step_seconds=steps,
                                  stopped_by=stopped, decoded_with=decoded_with(1, why))
        except ITEM_ERRORS as exc:
            out[tag] = exc
    return out


def rollback_copy(cache):
    """A cache to ask one question on and drop: the same tensors as `cache`, its own cache and layer objects.
    Cache updates replace a layer's tensors (torch.cat) and reassign its counters (a sliding-window layer's
    `cumulative_length`), never write into them, so whatever the copy appends leaves `cache` as it was.
    The layer class is kept (gqa=expand's expanding subclass, sliding-window layers)."""
    import copy

    from harness.methods.layout import own_copy

    out = copy.copy(cache)
    out.layers = [own_copy(layer) for layer in cache.layers]  # a linear layer's state is updated in place: its own copy
    return out


@dataclass
class QuestionOutcomes(Outcome):
    """One setting's result on a prompt of K questions: `answers[i]` is question i's Outcome (its generation
    and diagnostics, or the error that failed it). `diagnostics` holds what concerns the whole item
    (`shared_with`); `question_outcomes` merges it into each answer."""

    answers: list = field(default_factory=list)


def question_outcomes(outcome: Outcome, questions: int) -> list[Outcome]:
    """The per-question outcomes of one setting's result on a prompt of `questions` questions (a plain Outcome:
    one question), each with the item's diagnostics; a setting that failed as a whole fails every question."""
    if isinstance(outcome, QuestionOutcomes):
        return [Outcome(a.generation, {**a.diagnostics, **outcome.diagnostics}, a.error, a.kept) for a in outcome.answers]
    if outcome.error is not None:
        return [outcome] * questions
    return [outcome]


def question_records(outcomes: dict, questions: int, logs: dict, make: Callable) -> dict:
    """Per setting, one record per question (`make(i, answer)`, in question order): {tag: [records]}, or the
    first error that failed one of its questions (the answered ones are appended to that tag's log here, so
    a rerun asks only the missing ones)."""
    out = {}
    for tag, outcome in outcomes.items():
        records, error = [], None
        for i, answer in enumerate(question_outcomes(outcome, questions)):
            if answer.error is not None:
                error = error or answer.error
            else:
                records.append(make(i, answer))
        if error is not None and records:
            logs[tag].append(records)
        out[tag] = records if error is None else error
    return out


class QuestionLog:
    """A task's log seen per item of K questions, for `run_shared_items`: records are keyed by the item's key
    plus `question_index`; an item is in it once all K question records are, and `append` takes the item's
    list of question records (those already there are skipped by the log). A partly done item (a question
    failed, or the run stopped between records) is asked again and only its missing records are added."""

    def __init__(self, log: JsonlLog, questions):
        """questions: K for every item, or a function of the item's key giving its K."""
        self.log = log
        self.questions = questions if callable(questions) else (lambda key, k=int(questions): k)

    def __contains__(self, key) -> bool:
        return all((*key, i) in self.log for i in range(self.questions(key)))

    def append(self, records: list[dict]) -> None:
        for record in records:
            self.log.append(record)

    @property
    def records(self) -> dict:
        return self.log.records


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
                     failures_paths: dict | None = None, progress: bool = True, batch_size: int = 1,
                     batch_key: Callable | None = None, work_batch: Callable | None = None) -> dict[str, ItemResult]:
    """Run every item for every setting (tag) whose log does not hold it yet, one `work` call per item.

    `work(item, tags)` gets the tags still missing that item and returns {tag: record, or the
    exception that failed that tag}. Records are appended as they come; an out-of-memory or runtime
    error is recorded (key, error, short traceback) in that tag's failures file as soon as it
    happens, and the loop goes on; an error raised by `work` itself fails the item for every tag
    asked. Failed items are not in the logs, so the next run retries exactly them (and only for the
    settings that failed). A HarnessError (a user error) ends the run.

    Batched items (`batch_size` > 1 with `work_batch(items, tags)`, which returns one such dict per item):
    consecutive items with the same `batch_key` and the same missing tags go together, up to `batch_size`.
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
    batches: list[list] = []
    for item, missing in todo:
        same = bool(batches) and batch_size > 1 and work_batch is not None and len(batches[-1]) < batch_size and (
            batches[-1][0][1] == missing and (batch_key is None or batch_key(batches[-1][0][0]) == batch_key(item)))
        if same:
            batches[-1].append((item, missing))
        else:
            batches.append([(item, missing)])
    bar = tqdm(total=len(todo), desc=desc, unit="item", disable=not progress, dynamic_ncols=True)
    for batch in batches:
        missing = batch[0][1]
        try:
            outs = work_batch([it for it, _ in batch], missing) if len(batch) > 1 else [work(batch[0][0], missing)]
        except HarnessError:
            raise
        except ITEM_ERRORS as exc:
            outs = [{tag: exc for tag in missing} for _ in batch]
            tb = traceback.format_exc(limit=-3)
        else:
            tb = None
        oom = False
        for (item, _), out in zip(batch, outs):
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
        bar.update(len(batch))
        del outs
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
