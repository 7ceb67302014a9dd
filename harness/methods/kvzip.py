"""KVzip (arXiv 2505.23416), query-agnostic: a KV pair matters if the model needs it to reconstruct the context.

After the compressed part is prefilled, the context (the part after the chat template's own prefix) is
split into chunks of `chunk_size` tokens and the model is asked to repeat each one, over the full cache:

    replay ids of chunk m = [prompt_m ; the chat template's assistant-turn suffix ; chunk m]
    prompt_1     = "\\n\\nRepeat the previous context exactly."
    prompt_{m>1} = "\\n\\nRepeat the part of the previous context exactly, starting with" + the last 8 ids of chunk m-1

In every layer, the replay tokens' queries (after RoPE) attend, in the model dtype, with a softmax over
only [the first min(n_sink, chunk start) keys ; chunk m's keys ; their own keys (causal)]; the score of
a chunk key is the max over the replay queries and the query heads of its KV head. The first `n_sink`
positions get the largest score + 1 (never evicted). Then, as kvpress 0.5.5 `KVzipPress` (the
authors' code there): the lowest-scored pairs are pruned by one top-k over layers x KV heads x
positions (`layerwise=false`, the default: every layer and head its own length) or per layer
(`layerwise=true`), and inside a layer by a bottom-k across its heads. Positions inside the chat
template's prefix (after the sinks) keep score 0 and go first, as in kvpress.

Costs, reported per item (`reconstruction_forwards`, `reconstruction_tokens`): ceil(L / chunk_size)
extra forwards over the full cache (about L more tokens; kvpress warns of 2-3x the prefill). The full
cache of every layer is held until the scores exist (as kvpress). Memory: kvpress masks the pruned keys
and saves nothing; here each layer is stored ragged (only the kept entries: harness/methods/ragged.py).

Budget: `ratio` = the fraction KEPT (kvpress's compression_ratio = 1 - ratio), or `budget` = tokens per
KV head per layer on average. Refused: sliding-window layers (kvpress refuses Gemma 3 too), batch > 1
(kvpress supports batch 1 only), `kvzip_plus_normalization` (not built: it needs each replay token's
hidden state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.errors import HarnessError, require
from harness.memory_plan import is_fake, largest_first, mark_bound, plan_values
from harness.memory_plan import values as values_of
from harness.methods.adakv import ragged_selection
from harness.methods.base import CompressionMethod, Selection
from harness.methods.registry import register

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
PREVIOUS_TAIL = 8
TEMPLATE_PREFIX_RULES = ("if_present", "always")
SINK_RULES = ("always", "kvpress")


def chat_prefix_and_suffix(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before a user message's content, ids after it up to the assistant turn) from the chat template,
    as kvpress derives them (a dummy message split at a separator); ([], "\\n") without a template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return [], tokenizer.encode("\n", add_special_tokens=False)
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)
    before, suffix = text.split(separator)
    prefix = before.split(dummy)[0]
    return tokenizer.encode(prefix, add_special_tokens=False), tokenizer.encode(suffix, add_special_tokens=False)


def replay_start(ids: list[int], prefix: list[int], rule: str) -> int:
    """Where the replayed context starts: after the chat template's prefix where the prompt opens with it
    ("if_present"), or after as many positions as the prefix has tokens whatever the prompt holds ("always",
    kvpress 0.5.5's rule)."""
    if rule == "always" or ids[:len(prefix)] == prefix:
        return min(len(prefix), len(ids))
    return 0


def replay_inputs(context: list[int], prefix_length: int, chunk_size: int, suffix: list[int], tokenizer) -> list[tuple[int, int, list[int]]]:
    """[(chunk start, chunk end, replay ids)] over context[prefix_length:], in chunks of `chunk_size`."""
    first = tokenizer.encode(FIRST_PROMPT, add_special_tokens=False)
    later = tokenizer.encode(LATER_PROMPT, add_special_tokens=False)
    out, previous = [], None
    for start in range(prefix_length, len(context), chunk_size):
        chunk = context[start:start + chunk_size]
        prompt = first if previous is None else later + previous[-PREVIOUS_TAIL:]
        out.append((start, start + len(chunk), prompt + suffix + chunk))
        previous = chunk
    return out


def reconstruction_scores(query: torch.Tensor, key: torch.Tensor, start: int, end: int, n_sink: int, scaling: float) -> torch.Tensor:
    """(B, Hkv, end - start): max over the replay queries and each KV head's query group of the softmax
    attention over [sinks ; keys[start:end] ; the replay's own keys (causal)], in the model dtype."""
    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    sink = min(n_sink, start)
    keys = torch.cat([key[:, :, :sink], key[:, :, start:end], key[:, :, -q_len:]], dim=2)
    # One plain batched product per KV head: its query group's rows (g x q) against its keys (no broadcast copy).
    grouped = query.reshape(b, hkv, (hq // hkv) * q_len, d)
    logits = torch.matmul(grouped, keys.transpose(-2, -1)).mul_(scaling).view(b, hkv, hq // hkv, q_len, -1)
    own = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).triu(1)
    logits[..., -q_len:].masked_fill_(own, torch.finfo(logits.dtype).min)
    attn = torch.softmax(logits, dim=-1)
    return attn[..., sink:sink + end - start].amax(dim=(2, 3))


@register
@dataclass
class KVzip(CompressionMethod):
    name = "kvzip"
    EXACT_BUDGET = False  # kept counts vary by head or layer (tests/methods/test_baselines.py)
    GLOBAL_BUDGET = True  # one budget over every layer and head: `ratio` is the fraction of all entries kept
    across_layers = True
    supports_sliding_layers = False
    supports_batches = False  # one sequence at a time (kvpress: batch 1)
    added_options = {"template_prefix": "if_present", "sink_rule": "always"}  # runs recorded before these options

    budget: int | None = 1024
    ratio: float | None = None
    window_size: int = 0  # no window: a shared knob of every method config, must stay 0
    n_sink: int = 4
    chunk_size: int = 2048
    layerwise: bool = False
    kvzip_plus_normalization: bool = False
    # The chat template's prefix (before a user message) that the replay skips: "if_present" (ours) skips it only
    # where the prompt opens with those ids; "always" (kvpress 0.5.5) skips that many leading positions whatever
    # the prompt holds (they keep score 0 and go first).
    template_prefix: str = "if_present"
    # Which of the first `n_sink` positions are never evicted: "always" (ours) all of them; "kvpress" (0.5.5) only
    # those before the replay's start (kvpress sets them to 1, then the chunks' scores overwrite the sinks that
    # lie in the replayed context: with a chat-template prefix shorter than n_sink, or none, fewer are protected).
    sink_rule: str = "always"

    @property
    def compresses(self) -> bool:
        return True

    def validate(self, num_layers, max_positions):
        require((self.budget is None) != (self.ratio is None),
                f"method kvzip: give exactly one of method.budget (tokens) and method.ratio (fraction kept); "
                f"got budget={self.budget!r}, ratio={self.ratio!r}")
        if self.ratio is not None:
            require(0 < float(self.ratio) <= 1, f"method.ratio={self.ratio} must be in (0, 1]: the fraction of the prompt kept")
        else:
            require(int(self.budget) > 0, f"method.budget={self.budget} must be > 0")
        require(self.window_size == 0, "method.window_size must be 0 for kvzip (it has no observation window)")
        require(self.chunk_size > 0, f"method.chunk_size={self.chunk_size} must be > 0")
        require(self.n_sink >= 0, f"method.n_sink={self.n_sink} must be >= 0")
        require(not self.kvzip_plus_normalization, "method.kvzip_plus_normalization=true is not built (it needs each replay "
                                                   "token's hidden state); use false")
        require(self.sink_rule in SINK_RULES, f"method.sink_rule={self.sink_rule!r} is not one of {', '.join(SINK_RULES)}")
        require(self.template_prefix in TEMPLATE_PREFIX_RULES,
                f"method.template_prefix={self.template_prefix!r} is not one of {', '.join(TEMPLATE_PREFIX_RULES)}")

    def resolve(self, length: int) -> "KVzip":
        return self

    def summarize(self, keys, values, stats):
        return stats.scaling if stats.scaling is not None else keys.shape[-1] ** -0.5

    def kept_total(self, pairs: int, length: int, layers: int, heads: int) -> int:
        """Pairs kept over every layer and head: kvpress prunes int(pairs x compression_ratio)."""
        if self.ratio is not None:
            return pairs - int(pairs * (1.0 - float(self.ratio)))
        return min(pairs, int(self.budget) * layers * heads)

    def finish(self, summaries, layers, num_layers, context=None):
        first_keys = next(iter(layers.values()))[0]
        b, hkv, length, _ = first_keys.shape
        require(b == 1, f"kvzip scores one sequence at a time (kvpress: batch 1); got a batch of {b}")
        if context is None or context.tokenizer is None:
            raise HarnessError("kvzip replays the context through the model and needs its tokenizer (compression(..., tokenizer=))")
        order = sorted(layers)
        # The scores depend on the replay (chunks, sinks), not on the budget: settings of one item that differ
        # only in budget share one replay (its forwards are reported by each, as each separate run makes them).
        memo_key = ("kvzip", self.n_sink, self.chunk_size, self.template_prefix, tuple(order))
        if memo_key not in context.memo:
            context.memo[memo_key] = self._replay_scores(context, summaries, order, first_keys)
        scores, extra, start = context.memo[memo_key]
        scores = scores.clone()
        context.state.extra = dict(extra)
        if self.sink_rule == "kvpress":
            scores[..., : min(self.n_sink, start)] = 1.0
        else:
            scores[..., : self.n_sink] = scores.amax() + 1.0
        kept = self.kept_total(scores.numel(), length, len(order), hkv)
        pruned_total = scores.numel() - kept
        if self.layerwise:
            per_layer = [pruned_total // len(order)] * len(order)
        else:
            lowest = torch.topk(-scores.reshape(-1), pruned_total).indices if pruned_total else scores.new_zeros(0, dtype=torch.long)
            per_layer = (self.planned_pruned(len(order), hkv * length, kept) if is_fake(scores)
                         else torch.bincount(lowest // (b * hkv * length), minlength=len(order)).tolist())
        out = {}
        for row, idx in enumerate(order):
            keys, values = layers[idx]
            n_pruned = int(per_layer[row])
            if n_pruned == 0:
                out[idx] = Selection(keys, values)
                continue
            flat = scores[row].reshape(b, -1)
            drop = torch.topk(-flat, n_pruned, dim=1).indices
            chosen = torch.ones_like(flat, dtype=torch.bool).scatter_(1, drop, False).view(b, hkv, length)
            if is_fake(chosen):  # a plan: one head as large as the layer's count allows
                plan_values(chosen, [largest_first(hkv * length - n_pruned, hkv, length)])
            out[idx] = ragged_selection(keys, values, chosen)
        return out

    @staticmethod
    def planned_pruned(layers: int, entries: int, kept: int) -> list[int]:
        """A plan's pruned count per layer (the global top-k has no scores to read): the first layers keep all
        they can, so one layer is as large as the budget allows."""
        mark_bound("kvzip: the global top-k's split over layers and heads depends on the scores; planned largest first")
        return [entries - k for k in largest_first(kept, layers, entries)]

    def _replay_scores(self, context, summaries, order, first_keys):
        """Every layer's reconstruction scores (layers, B, Hkv, L) from the context replay, its costs, and where
        the replayed context starts."""
        b, hkv, length, _ = first_keys.shape
        ids = values_of(context.ids[0])  # a plan (fake tensors) has no ids: -1s, replayed in the same chunks
        prefix, suffix = chat_prefix_and_suffix(context.tokenizer)
        prefix_length = replay_start(ids, prefix, self.template_prefix)
        scores = torch.zeros(len(order), b, hkv, length, dtype=first_keys.dtype, device=first_keys.device)
        forwards, tokens = 0, 0
        for start, end, replay in replay_inputs(ids, prefix_length, self.chunk_size, suffix, context.tokenizer):
            def observe(module, query, key, _start=start, _end=end):
                row = order.index(module.layer_idx)
                scores[row][..., _start:_end] = reconstruction_scores(query, key, _start, _end, self.n_sink, summaries[module.layer_idx])
            context.replay(torch.tensor([replay], device=first_keys.device), length, observe)
            forwards, tokens = forwards + 1, tokens + len(replay)
        return scores, {"reconstruction_forwards": forwards, "reconstruction_tokens": tokens}, prefix_length

    def describe(self, num_layers):
        return {"name": self.name, "budget": self.budget, "ratio": self.ratio, "n_sink": self.n_sink,
                "chunk_size": self.chunk_size, "layerwise": self.layerwise,
                "kvzip_plus_normalization": self.kvzip_plus_normalization, "template_prefix": self.template_prefix,
                "sink_rule": self.sink_rule}

