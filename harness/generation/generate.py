"""Greedy generation of one item under every method setting, from ONE prefill of its compressed part.

`generate_settings` is the one way a run generates: the compressed part is prefilled once for every setting
(`shared_prefill`: each method's compressed cache from the same K/V and statistics), then each setting is asked
its question(s) on its own cache and decoded (together, harness/generation/batch_decode.py, where possible). When
the shared prefill runs out of memory the settings are split, down to one setting's separate run.

The decoding and compression modules (and so transformers) are imported when first used.
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from harness.errors import HarnessError, is_out_of_memory
from harness.generation.diagnostics import compression_diagnostics
from harness.generation.prompt import Outcome, Prompt, QuestionOutcomes
from harness.memory_plan import scalar
from harness.methods import decode_time
from harness.methods.layout import LAYOUT_REASONS
from harness.models import LoadedModel

log = logging.getLogger(__name__)

# Per-item errors that are recorded (and the run goes on) rather than ending the run: out of memory
# on the device (torch.OutOfMemoryError is a RuntimeError) or on the host, and other runtime errors.
ITEM_ERRORS = (RuntimeError, MemoryError)


_WARNED_SLIDING: set[str] = set()


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
    return mine[..., :int(scalar((mine >= 0).sum(dim=-1).max(), planned=mine.shape[-1]))]  # a plan: its longest head


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


@dataclass
class Prefilled:
    """One shared prefill: every setting's cache (compressing methods first, the order of the separate runs; a method
    that does not compress gets the prefill's own cache; a setting whose compression failed has none), the prefill's
    last logits and wall seconds, the compression session (installed until the block ends) and the failures."""

    session: object
    caches: dict
    logits: torch.Tensor
    seconds: float
    failed: dict
    order: list


@contextmanager
def shared_prefill(model, resolved: list[tuple[str, object]], ids: torch.Tensor, *, chunk_size: int | None = None,
                   tokenizer=None, room: int = 0):
    """ONE prefill of `ids` (the compressed part) for every (tag, resolved method): right after each layer's attention in
    the last forward, every compressing method builds its layer from the same K/V and statistics (engine.py). Yields a
    `Prefilled`; the engine's session stays installed inside the block (later forwards see each cache's layout), and
    the caches stay usable after it."""
    from harness.decoding import _sync, prefill
    from harness.methods.engine import compression, new_cache

    keep_full = any(not m.compresses for _, m in resolved)
    order = sorted(resolved, key=lambda tm: not tm[1].compresses)
    with torch.inference_mode(), compression(model, [tm for tm in resolved if tm[1].compresses], keep_full=keep_full,
                                               tokenizer=tokenizer) as session:
        cache = new_cache(model, room)  # `room`: what will be appended (question + answer): appends write in place
        session.compress_now = False
        _sync(model)
        start = time.perf_counter()
        logits = prefill(model, cache, ids, chunk_size=chunk_size, before_last=lambda: setattr(session, "compress_now", True))
        _sync(model)
        seconds = time.perf_counter() - start
        failed = {tag: state.error for tag, state in session.states.items() if state.error is not None}
        caches = {tag: session.cache_for(tag, cache) if m.compresses else cache for tag, m in order if tag not in failed}
        del cache
        yield Prefilled(session, caches, logits, seconds, failed, order)


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
    in the cache (the answer's last token, which decoding never feeds back, opens the next turn, or what the question's
    `after_answer` says instead), at true positions, each with its own `max_new_tokens` where the question gives one. Query-aware: each question is compressed with the context, one prefill per question,
    shared by every setting.
    """
    from harness.decoding import Generation

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
        room = int(decode.get("max_new_tokens") or 0) + max(len(q.ids) for q in asked[0]) - end  # question + answer
        with shared_prefill(model, resolved, ids, chunk_size=chunk_size, tokenizer=loaded.tokenizer, room=room) as shared:
            session, logits, shared_seconds, failed, order = (shared.session, shared.logits, shared.seconds, shared.failed,
                                                              shared.order)
            bases = shared.caches
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
                            opens = first.questions[number].after_answer  # what follows the answer (default: its last token)
                            bridge = before.answer[-1:] if opens is None else list(opens(before.answer))
                            turns[key] = Turn(before.cache, [*bridge, *asking.ids[end:]], before.next_position,
                                              history=[[*h, *before.answer[:-1], *bridge, *asking.ids[end:]] for h in before.history])
                        else:  # the cache itself where nothing is asked after this question, else a rollback copy
                            base = bases[tag] if last or keep_answers else rollback_copy(bases[tag])
                            turns[key] = Turn(base, asking.ids[end:], end, history=[asked[b][number].ids for b in range(rows)])
                        if decode_time.evictor_of(turns[key].cache) is None:  # decode-time compression (its own per setting)
                            state = session.states.get(tag)
                            decode_time.attach(turns[key].cache, method, start=end, model=model,
                                               kept=None if state is None else {i: r.positions for i, r in state.layers.items()})
                if numbers_here[-1] in numbers:
                    bases.clear()  # the last answers own their caches: each is freed with its turn
                own = first.questions[numbers[0]].max_new_tokens if keep_answers and first.questions else None
                with decode_time.evicting(model, [t.cache for t in turns.values()]):  # a turn's own budget (multi-turn)
                    generations = _answer(loaded, turns, logits, together=decode_together,
                                          **{**decode, **({"max_new_tokens": own} if own is not None else {})})
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
                        evictor = decode_time.evictor_of(turns[key].cache)
                        if evictor is not None:
                            diag.update(evictor.diagnostics())
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
    history: list[list[int]] = field(default_factory=list)  # per batch row, the uncompressed ids asked (repetition_penalty)

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
    (harness/generation/batch_decode.py: each attends to its own cache only, at its own positions; tokens equal the
    separate decodes); on a model with sliding-window layers, turns at different positions decode as one batch
    per position. Where they cannot (one turn, an attention kernel it does not take), one after another, and
    every Generation's `decoded_with` says which and why. A batch that runs out of memory raises (the caller
    retries smaller groups of settings from their own prefills); another error fails every answer of the batch."""
    from harness.generation.batch_decode import decode_together, decoded_with, refusal
    from harness.decoding import Generation, _sync, greedy_decode, prefill

    model, device = loaded.model, loaded.device
    options = {"eos_token_ids": loaded.eos_token_ids, **decode}
    penalized = decode.get("repetition_penalty") not in (None, 1, 1.0)  # each row's history: the ids it was asked
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
                                      ends, suffix=suffixes, tokenizer=loaded.tokenizer, **options,
                                      **({"penalty_history": [h for t in turns.values() for h in t.history]} if penalized else {}))
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
            tokens, steps, stopped = greedy_decode(model, turn.cache, first, length, tokenizer=loaded.tokenizer, **options,
                                                   **({"penalty_history": turn.history} if penalized else {}))
            out[tag] = Generation(tokens=tokens, prompt_length=length, prefill_seconds=seconds, step_seconds=steps,
                                  stopped_by=stopped, decoded_with=decoded_with(1, why))
        except ITEM_ERRORS as exc:
            out[tag] = exc
    return out


def rollback_copy(cache):
    """A cache to ask one question on and drop: the same tensors as `cache`, its own cache and layer objects.
    Cache updates append in place only past their buffer's fill mark, which no other holder of the tensors
    sees, and copy otherwise (harness/methods/inplace.py); they reassign counters (a sliding-window layer's
    `cumulative_length`), so whatever the copy appends leaves `cache` as it was.
    The layer class is kept (gqa=expand's expanding subclass, sliding-window layers)."""
    import copy

    from harness.methods.layout import own_copy

    out = copy.copy(cache)
    out.layers = [own_copy(layer) for layer in cache.layers]  # a linear layer's state is updated in place: its own copy
    return out


