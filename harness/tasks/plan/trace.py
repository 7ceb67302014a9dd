"""One planned (or measured) generation: the real code path under the live-storage tracker, with phases.

`trace_generation` runs `generate_settings` (the one prefill shared by a methods list, chunked or one-shot,
compression, the question prefill of the query-agnostic protocol, decoding to `new_tokens`) on a loaded
model, under `harness.memory_plan.planning` when the model is fake (a plan) or as it is when it is real (the
measurement the plan is checked against: tests/tasks/test_plan.py). Hooks on the model name the phase every
allocation happens in: `prefill layer 31 mlp`, `prefill layer 31 compression`, `question prefill layer 0
attention`, `decode step 7 logits`, ...
"""

from __future__ import annotations

import random
import weakref
from contextlib import contextmanager

from harness.memory_plan import StorageTracker, bounds, is_fake, planning
from harness.methods.engine import Session, attention_modules


class Phases:
    """Keeps `tracker.phase` current: which forward (prefill chunk, question prefill, decode step, a method's
    replay during compression), which layer, which part of it. `end`: tokens of the compressed part."""

    def __init__(self, model, tracker: StorageTracker, end: int, chunked: bool):
        self.tracker, self.end, self.chunked = tracker, end, chunked
        self.prefilled, self.chunk, self.step, self.forward = 0, 0, 0, ""
        self.compressing = False
        self.caches: list = []
        self.handles = [model.register_forward_pre_hook(self._model, with_kwargs=True)]
        for module in attention_modules(model):
            i = module.layer_idx
            self.handles.append(module.register_forward_pre_hook(lambda *_, i=i: self._at(f"layer {i} attention")))
            self.handles.append(module.register_forward_hook(lambda *_, i=i: self._at(f"layer {i} compression")))
        for name, module in model.named_modules():
            if name.endswith(".mlp") and name.split(".")[-2].isdigit():
                i = int(name.split(".")[-2])
                self.handles.append(module.register_forward_pre_hook(lambda *_, i=i: self._at(f"layer {i} mlp")))
        head = model.get_output_embeddings()
        if head is not None:
            self.handles.append(head.register_forward_pre_hook(lambda *_: self._at("logits")))

    def _at(self, part: str) -> None:
        self.tracker.phase = f"{self.forward} {part}".strip()

    def _model(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[1]) if ids is not None else 0
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None and all(c() is not cache for c in self.caches):
            self.caches.append(weakref.ref(cache))
        if self.compressing:
            self.forward = "compression replay"
        elif n == 1:
            self.step += 1
            self.forward = f"decode step {self.step}"
        elif self.prefilled < self.end:
            self.chunk += 1
            self.prefilled += n
            self.forward = f"prefill chunk {self.chunk}" if self.chunked else "prefill"
        else:
            self.forward = "question prefill"
        self._at("")

    def live_caches(self) -> list:
        out = []
        for ref in self.caches:
            cache = ref()
            if cache is not None:
                out.append(cache)
                for layer in getattr(cache, "layers", ()):  # decode_together's RowsCache holds the settings' layers
                    out.extend(_Rows(row) for row in getattr(layer, "rows", ()) or ())
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _Rows:
    """One cache layer seen as a cache of one layer (for the tracker's breakdown)."""

    def __init__(self, layer):
        self.layers = [layer]


@contextmanager
def _compression_phase(phases: Phases):
    """Label what the engine allocates once a layer's attention has run (selection) and after the forward
    (across-layer methods: CAKE, KVzip and its replays) as compression."""
    original = Session.after_forward

    def after_forward(self, *args, **kwargs):
        phases.compressing, phases.forward = True, "compression"
        phases._at("across layers")
        try:
            return original(self, *args, **kwargs)
        finally:
            phases.compressing = False

    Session.after_forward = after_forward
    try:
        yield
    finally:
        Session.after_forward = original


def prompt_ids(length: int, vocab: int, seed: int = 0) -> list[int]:
    """Random token ids (the same for every setting of a point): values never change a planned shape."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def trace_generation(loaded, methods: list[tuple[str, object]], length: int, *, batch_size: int = 1, query_aware: bool = True,
                     question_tokens: int = 0, new_tokens: int = 8, chunk_size: int | None = None, mode=None,
                     target: str = "cuda", decode_together: bool = True, seed: int = 0) -> dict:
    """The peak of live tensor bytes of one generation of a `length`-token prompt (batch `batch_size`) under
    `methods` (one shared prefill), with its phase and breakdown. `mode`: the fake mode the model was built in
    (a plan), or None (a real run, measured). Raises the first setting's error."""
    from harness.generation.generate import generate_settings
    from harness.generation.prompt import Prompt

    model = loaded.model
    vocab = int(getattr(model.config, "vocab_size", 0) or model.get_input_embeddings().num_embeddings)
    ids = prompt_ids(length, vocab, seed)
    question_start = length - question_tokens if question_tokens else None
    prompts = [Prompt(ids=list(ids), question_start=question_start) for _ in range(batch_size)]
    end = length if query_aware or question_start is None else question_start
    tracker = StorageTracker(baseline=[*model.parameters(), *model.buffers()])
    phases = Phases(model, tracker, end, bool(chunk_size) and chunk_size < end)
    tracker.caches = phases.live_caches
    fake = mode is not None
    planned = planning(mode, target) if fake else _nothing()
    try:
        with planned, _compression_phase(phases), tracker:
            out = generate_settings(loaded, methods, prompts if batch_size > 1 else prompts[0], query_aware=query_aware,
                                    chunk_size=chunk_size, max_new_tokens=int(new_tokens), ignore_eos=True,
                                    decode_together=decode_together)
            why_bound = bounds() if fake else []
    finally:
        phases.close()
    for row in out if isinstance(out, list) else [out]:
        for outcome in row.values():
            if outcome.error is not None:
                raise outcome.error
    peak = tracker.peak
    first = out[0] if isinstance(out, list) else out
    cache_bytes = {tag: o.diagnostics.get("cache_bytes") for tag, o in first.items()}
    return {"cache_bytes": cache_bytes[methods[0][0]] if len(methods) == 1 else cache_bytes,"peak_bytes": peak.bytes, "peak_phase": peak.phase, "weights_bytes": peak.parts.get("weights", 0),
            "kv_cache_bytes": peak.parts.get("kv_cache", 0), "other_bytes": peak.parts.get("other", 0),
            "largest_temporaries": [{"bytes": b, "tensor": what, "allocated_in": where} for b, what, where in peak.largest],
            "prefill_logits_bytes": max((v for k, v in tracker.phase_peaks.items() if k.startswith("prefill") and k.endswith("logits")),
                                        default=None),
            "bound": bool(why_bound), "bound_reasons": why_bound, "fake": fake and is_fake(next(model.parameters()))}


@contextmanager
def _nothing():
    yield
