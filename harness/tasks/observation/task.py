"""The SnapKV paper's own evidence (sections 3 and 4.2, Figures 2-5): does the attention of the last
prompt window predict which prompt positions generation attends to?

Every prompt runs with the FULL cache. Inside `attention_probe` (harness/methods/engine.py) every
attention call of every layer hands us its queries (after RoPE) and all the keys it attends to; we
compute attention ourselves from those, one layer at a time, never an L x L matrix, and keep only
reduced results (selection masks, sums). Any attention implementation works (sdpa, flash, eager).
A decode step only keeps its query (no tensor work, so a probed step costs about a plain one); the
generated queries' attention is computed after generation, a few batched softmaxes per layer
(`HitRateProbe.finish`, timed as `probe_seconds` in each prompt's record).

Definitions (the paper's, shared/reference/snapkv.md "The observation experiments", Eq. 4-8), with
L the prompt length, w = `window_tokens`, N = `prompt_windows`, p = `rate`, theta = `theta`:

- Prompt windows: the last N windows of w prompt tokens; window j (1..N) covers positions
  [L - (N - j + 1) w, L - (N - j) w); window N ends the prompt.
- Prefix (our choice, the paper leaves it open): positions [0, P) with P = L - N w, the prompt before
  the earliest window. Every window and every generated query is compared over this same set of
  positions, so the N windows' hit rates differ only by who votes.
- Vote of a window: C = sum over its w queries of their causal softmax attention (each query's
  softmax over every key it sees, [0, its own position], in float32 with the module's `scaling`),
  prefix columns only; a sum (the mean ranks the same). No pooling: the paper's observation
  sections come before clustering.
- Selection: I = TopK(C, k) per query head, k = floor(p P), as the mask M_vote. GQA: every query
  head votes and selects on its own (the official SnapKV layout).
- Important features of a generated query: M_cur = 1(A_cur > theta), A_cur its softmax attention
  over all keys (prompt + the tokens generated so far), prefix columns.
- `skip_first` (default 0, the paper's definition): leave the first positions (attention sinks) out of
  every set compared. With it at 0, a model whose generated queries give the sink most of their
  attention scores close to 1 for every window; a few positions more show what the rest looks like.
- Hit rate (Eq. 8): H = sum_{heads, positions} (M_cur AND M_vote) / sum_{heads, positions} M_cur,
  per generated query and layer; a query with no important feature in a layer (sum M_cur = 0) is
  left out of that layer's average (`counted_queries` says how many were counted).

The figures, per layer:

- Fig. 2 (`fig2_hit_rate`, layers x N): mean over all generated queries of H(M_cur, M_vote of
  window j). The paper's claim: the last window (j = N) matches generation best.
- Fig. 3 (`fig3_hit_rate`, layers x M): the G = M x `generation_window_tokens` generated queries
  in M windows; mean over each generation window's queries of H(M_cur, M_vote of window N).
  `fig3_vote_overlap`: the generation window's own vote (summed attention of its queries, TopK k)
  against window N's selection, |both| / |selected|.
- Fig. 4 (`fig4_hit_rate`, layers): the same document with different instructions (instruction at
  the end): H(M_vote_A, M_vote_B) = |I_A and I_B| / |I_A| (k equal, so symmetric) between the last
  windows' selections of two prompts, over the token positions both prompts share (the document;
  top-k recomputed there with k = floor(p P_common)), averaged over pairs.
  `fig4_generation_hit_rate`: the same between the selections of the whole responses (TopK of the
  summed attention of all generated queries): what the instruction-response pairs used.
- Fig. 5 (`fig5_hit_rate`: {"end", "begin"} -> layers): Fig. 2's last-window hit rate with the
  instruction at the end vs at the beginning of the prompt.

Generation: greedy, exactly G generated queries (G + 1 tokens: the last one is never fed back).
`eos: ban` (default) forbids end-of-sequence tokens so every response reaches G tokens, as the
paper kept responses longer than 512 tokens; `stop` ends at EOS (fewer queries); `ignore` decodes
past it.

Sources (`task.source`): `haystack` (needle essays with several needles, one question per needle:
the same document with different instructions), `longbench` (a LongBench dataset, default qmsum;
rows sharing a context are one document with several instructions), `folder` (plain-text
documents, instructions from `<name>.instructions.txt` or `task.instructions`).
One item = one document: all its prompts (instructions x positions) run in one item, and Fig. 4 is
computed inside it; per-item records go to observation_documents.jsonl (resumable).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.models import LoadedModel
from harness.tasks.contract import run_items

log = logging.getLogger(__name__)
SOURCES = ("haystack", "longbench", "folder")
POSITIONS = ("end", "begin")
EOS_RULES = ("ban", "stop", "ignore")
DOC_SENTINEL = "\x00DOCUMENT\x00"
INSTR_SENTINEL = "\x00INSTRUCTION\x00"
LOG_FILE = "observation_documents.jsonl"


# ------------------------------------------------------------------------------------------ parameters

@dataclass(frozen=True)
class Params:
    window_tokens: int = 128
    prompt_windows: int = 20
    generation_windows: int = 4
    generation_window_tokens: int = 128
    theta: float = 0.05
    rate: float = 0.05
    eos: str = "ban"
    skip_first: int = 0

    @property
    def generated_queries(self) -> int:
        return self.generation_windows * self.generation_window_tokens

    @property
    def windows_span(self) -> int:
        return self.prompt_windows * self.window_tokens

    def prefix_length(self, prompt_length: int) -> int:
        return prompt_length - self.windows_span

    def compared(self, prompt_length: int) -> int:
        """How many prefix positions are compared: [skip_first, P)."""
        return self.prefix_length(prompt_length) - self.skip_first

    def k(self, positions: int) -> int:
        return int(math.floor(self.rate * positions))

    def describe(self) -> dict:
        return {
            "window_tokens": self.window_tokens, "prompt_windows": self.prompt_windows,
            "generation_windows": self.generation_windows, "generation_window_tokens": self.generation_window_tokens,
            "generated_queries": self.generated_queries, "theta": self.theta, "rate_p": self.rate, "eos": self.eos,
            "skip_first": self.skip_first,
            "prefix": "positions [skip_first, L - prompt_windows * window_tokens): the prompt before the earliest window"
                      + (f", without the first {self.skip_first} (attention sinks)" if self.skip_first else ""),
            "vote": "sum over the window's queries of causal softmax attention (float32, module scaling), no pooling",
            "selection": "top floor(rate_p * prefix) positions per query head (GQA: per query head)",
            "important": "positions whose softmax attention from the generated query exceeds theta (per query head)",
            "hit_rate": "sum over heads and positions of (important AND selected) / sum of important, per query; "
                        "queries without important positions left out; mean over queries",
        }


def params_of(task: DictConfig) -> Params:
    return Params(int(task.window_tokens), int(task.prompt_windows), int(task.generation_windows),
                  int(task.generation_window_tokens), float(task.theta), float(task.rate), str(task.eos),
                  int(task.get("skip_first") or 0))


# ------------------------------------------------------------------------------------------ the math

def grouped_logits(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention logits (Hq, n, T) in float32 of queries (Hq, n, d) over keys (Hkv, T, d).

    Query head h reads key head h // (Hq / Hkv), as transformers' repeat_kv, without expanding the keys:
    the queries are grouped per key head instead. The product runs in the keys' dtype (the model's),
    the scaling and everything after in float32."""
    hq, n, d = queries.shape
    hkv, t, _ = keys.shape
    require(hq % hkv == 0, f"observation: {hq} query heads do not group onto {hkv} key heads")
    grouped = queries.to(keys.dtype).reshape(hkv, (hq // hkv) * n, d)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).float() * float(scaling)
    return logits.reshape(hq, n, t)


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, start: int, scaling: float) -> torch.Tensor:
    """Causal softmax attention (Hq, n, T) in float32 of the queries (Hq, n, d) at positions start .. start + n - 1
    over the keys (Hkv, T, d) at positions 0 .. T - 1: each query's softmax runs over the keys it sees
    ([0, its own position]); later keys get 0."""
    n, t = queries.shape[1], keys.shape[1]
    require(start + n <= t, "observation: causal_attention needs the keys up to the last query's position")
    logits = grouped_logits(queries, keys, scaling)
    rows = torch.arange(n, device=logits.device)
    cols = torch.arange(t, device=logits.device)
    logits.masked_fill_(cols[None, :] > (start + rows)[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def window_votes(queries: torch.Tensor, keys: torch.Tensor, start: int, prefix: int, scaling: float) -> torch.Tensor:
    """Vote (Hq, prefix) of the window of queries (Hq, w, d) at positions start .. start + w - 1.

    `keys` (Hkv, start + w, d): every key up to the window's end. Each query's softmax runs over the keys it
    sees causally ([0, its own position]); the votes are the sums over the window of the prefix columns."""
    require(keys.shape[1] == start + queries.shape[1], "observation: window_votes needs the keys up to the window's end")
    return causal_attention(queries, keys, start, scaling)[..., :prefix].sum(dim=1)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, prefix: int, scaling: float) -> torch.Tensor:
    """Softmax attention (Hq, prefix) of one new query (Hq, 1, d) over all keys (Hkv, T, d): the softmax
    over all T keys (prompt and generated so far), its prefix columns."""
    return causal_attention(query, keys, keys.shape[1] - 1, scaling)[:, 0, :prefix]


def topk_mask(votes: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask (..., P) of the k largest votes along the last axis (per head)."""
    mask = torch.zeros(votes.shape, dtype=torch.bool, device=votes.device)
    if k > 0:
        mask.scatter_(-1, votes.topk(k, dim=-1).indices, True)
    return mask


def hit_rate(important: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Eq. 8: sum(important AND selected) / sum(important) over the last two axes (heads, positions).

    `important` (H, P) bool, `selected` (..., H, P) bool; returns (...) float, NaN where nothing is important."""
    hits = (selected & important).sum(dim=(-1, -2)).double()
    total = important.sum().double()
    return hits / total if total > 0 else torch.full(hits.shape, float("nan"), dtype=torch.float64)


def overlap(selected_a: torch.Tensor, selected_b: torch.Tensor) -> float:
    """H(M_vote_a, M_vote_b) = |a AND b| / |a| over heads and positions (NaN if a is empty)."""
    total = int(selected_a.sum())
    return float((selected_a & selected_b).sum()) / total if total else float("nan")


# ------------------------------------------------------------------------------------------ the capture

BLOCK_ELEMENTS = 1 << 26  # float32 attention entries (256 MiB) one batched softmax may hold


@dataclass
class LayerCapture:
    masks: torch.Tensor                      # (N, Hq, P) bool: each prompt window's selection
    last_votes: torch.Tensor | None          # (Hq, P) float32 on the CPU (Fig. 4), when asked for
    queries: list = field(default_factory=list)   # each decode step's query (Hq, d), until `finish`
    keys: torch.Tensor | None = None         # the latest decode call's keys (Hkv, L + steps, d), until `finish`
    scaling: float = 1.0
    gen_votes: torch.Tensor | None = None    # (Hq, P) float32: attention summed over all generated queries
    fig2_sum: torch.Tensor | None = None     # (N,) float64
    fig3_sum: torch.Tensor | None = None     # (M,) float64
    fig3_count: torch.Tensor | None = None   # (M,) int64
    counted: int = 0                         # generated queries with an important position
    important: float = 0.0                   # important positions, summed over queries
    vote_overlap: list = field(default_factory=list)
    steps: int = 0


class HitRateProbe:
    """`attention_probe` callback for one prompt of `prompt_length` tokens (batch 1, one-shot prefill).

    Prefill call (q == k == L): the N windows' votes and selections, per layer, several windows per
    batched softmax. Decode call (q == 1): only keeps the generated query and a reference to the keys
    (no tensor work: a probed decode step costs what a plain one does). `finish()` (called by `results`
    and `votes`) then computes every generated query's attention in a few batched softmaxes per layer:
    query t sees the keys [0, L + t], exactly the keys its decode call saw (the cache only appends).
    `on_step`, if given, is called once per decode step (progress)."""

    def __init__(self, prompt_length: int, params: Params, *, keep_votes: bool = False, on_step=None):
        self.length = prompt_length
        self.params = params
        self.prefix = params.prefix_length(prompt_length)
        self.first = params.skip_first
        self.k = params.k(self.prefix - self.first)
        require(self.prefix - self.first > 0, f"observation: a prompt of {prompt_length} tokens has no prefix before its "
                                              f"{params.prompt_windows} windows of {params.window_tokens} tokens")
        require(self.k > 0, f"observation: rate {params.rate} of a {self.prefix - self.first}-position prefix selects nothing")
        self.keep_votes = keep_votes
        self.on_step = on_step
        self.layers: dict[int, LayerCapture] = {}
        self.skipped: dict[int, str] = {}
        self._first_layer: int | None = None

    def __call__(self, module, query: torch.Tensor, key: torch.Tensor) -> None:
        idx = int(module.layer_idx)
        q, t = query.shape[2], key.shape[2]
        if self.on_step is not None and q == 1 and idx == (self._first_layer if self._first_layer is not None else idx):
            self._first_layer = idx
            self.on_step()
        if idx in self.skipped:
            return
        require(query.shape[0] == 1, "observation: batch 1 only")
        window = getattr(module, "sliding_window", None)
        if window and self.length + self.params.generated_queries > int(window):
            self.skipped[idx] = f"sliding window of {window} tokens"
            return
        scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
        with torch.no_grad():
            if q == t == self.length:
                self._prefill(idx, query[0], key[0], scaling)
            elif q == 1 and t > self.length:
                self._decode(idx, query[0], key[0])
            else:
                raise HarnessError(f"observation: unexpected attention call in layer {idx} ({q} queries, {t} keys, "
                                   f"prompt {self.length}): the prompt must be prefilled in one forward")

    def _prefill(self, idx: int, queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> None:
        p = self.params
        hq, n, w = queries.shape[0], p.prompt_windows, p.window_tokens
        votes = torch.empty((n, hq, self.prefix - self.first), dtype=torch.float32, device=queries.device)
        group = max(1, min(n, BLOCK_ELEMENTS // (hq * w * self.length)))  # windows per batched softmax
        for j in range(0, n, group):
            g = min(group, n - j)
            start = self.length - (n - j) * w
            end = start + g * w                      # consecutive windows: one causal block of g * w queries
            attn = causal_attention(queries[:, start:end], keys[:, :end], start, scaling)[..., self.first:self.prefix]
            votes[j:j + g] = attn.reshape(hq, g, w, -1).sum(dim=2).transpose(0, 1)
            del attn
        self.layers[idx] = LayerCapture(masks=topk_mask(votes, self.k), last_votes=votes[-1].cpu() if self.keep_votes else None,
                                        scaling=scaling)

    def _decode(self, idx: int, query: torch.Tensor, keys: torch.Tensor) -> None:
        cap = self.layers.get(idx)
        if cap is None:
            raise HarnessError(f"observation: layer {idx} decoded before its prefill was seen")
        if keys.shape[1] != self.length + cap.steps + 1:
            raise HarnessError(f"observation: layer {idx} decode step {cap.steps} sees {keys.shape[1]} keys, expected "
                               f"{self.length + cap.steps + 1}: the probe needs a cache that only appends")
        cap.queries.append(query[:, 0])
        cap.keys = keys
        cap.steps += 1

    def finish(self) -> None:
        """Every generated query's hit rates, from the queries and keys kept (idempotent)."""
        with torch.no_grad():
            for cap in self.layers.values():
                if cap.gen_votes is None:
                    self._finish_layer(cap)

    def _finish_layer(self, cap: LayerCapture) -> None:
        p = self.params
        hq, n_windows = cap.masks.shape[1], p.prompt_windows
        dev = cap.masks.device
        cap.gen_votes = torch.zeros((hq, self.prefix - self.first), dtype=torch.float32, device=dev)
        cap.fig2_sum = torch.zeros(n_windows, dtype=torch.float64, device=dev)
        cap.fig3_sum = torch.zeros(p.generation_windows, dtype=torch.float64, device=dev)
        cap.fig3_count = torch.zeros(p.generation_windows, dtype=torch.int64, device=dev)
        if not cap.steps:
            return
        queries = torch.stack(cap.queries, dim=1)                   # (Hq, steps, d)
        keys, cap.queries, cap.keys = cap.keys, [], None
        masks = cap.masks.reshape(n_windows, -1).float()            # (N, Hq * P): 0/1, exact sums below 2^24
        last_mask = cap.masks[-1]
        gw = p.generation_window_tokens
        rows = max(1, BLOCK_ELEMENTS // (hq * keys.shape[1]))
        counted, important, window_votes = 0, 0.0, None
        lo = 0
        while lo < cap.steps:
            hi = min(cap.steps, lo + rows, (lo // gw + 1) * gw)     # a block never crosses a generation window
            attn = causal_attention(queries[:, lo:hi], keys[:, :self.length + hi], self.length + lo, cap.scaling)
            attn = attn[..., self.first:self.prefix]                  # (Hq, b, P - skip_first)
            imp = attn > p.theta
            total = imp.sum(dim=(0, 2)).double()                      # (b,)
            hits = imp.transpose(0, 1).reshape(hi - lo, -1).float() @ masks.T   # (b, N): important AND selected
            ok = total > 0
            rate = torch.where(ok[:, None], hits.double() / total.clamp(min=1)[:, None], torch.zeros_like(hits, dtype=torch.float64))
            cap.fig2_sum += rate.sum(dim=0)
            counted += int(ok.sum())
            important += float(total.sum())
            block_votes = attn.sum(dim=1)
            cap.gen_votes += block_votes
            m = lo // gw
            if m < p.generation_windows:
                cap.fig3_sum[m] += rate[:, -1].sum()
                cap.fig3_count[m] += ok.sum()
                window_votes = block_votes if lo % gw == 0 else window_votes + block_votes
                if hi == (m + 1) * gw:                                # the generation window is complete
                    mine = topk_mask(window_votes, self.k)
                    cap.vote_overlap.append(float((mine & last_mask).sum()) / max(1, int(mine.sum())))
            del attn, imp
            lo = hi
        cap.counted, cap.important = counted, important

    def results(self, num_layers: int) -> dict:
        """Per-layer arrays (None for a layer not measured), rounded for the record."""
        self.finish()
        p = self.params
        out = {"fig2_hit_rate": [], "fig3_hit_rate": [], "fig3_vote_overlap": [], "important_per_head": [],
               "counted_queries": [], "decoded_queries": []}
        for idx in range(num_layers):
            cap = self.layers.get(idx)
            if cap is None:
                for key in out:
                    out[key].append(None)
                continue
            counted = int(cap.counted)
            fig2 = (cap.fig2_sum / counted).tolist() if counted else [None] * p.prompt_windows
            counts = cap.fig3_count.tolist()
            fig3 = [s / c if c else None for s, c in zip(cap.fig3_sum.tolist(), counts)]
            overlaps = list(cap.vote_overlap) + [None] * (p.generation_windows - len(cap.vote_overlap))
            heads = cap.masks.shape[1]
            out["fig2_hit_rate"].append(_round(fig2))
            out["fig3_hit_rate"].append(_round(fig3))
            out["fig3_vote_overlap"].append(_round(overlaps))
            out["important_per_head"].append(_round(float(cap.important) / (cap.steps * heads)) if cap.steps else None)
            out["counted_queries"].append(counted)
            out["decoded_queries"].append(cap.steps)
        return out

    def votes(self, which: str) -> dict[int, torch.Tensor]:
        """Per layer (Hq, P - skip_first) float32 on the CPU (positions skip_first .. P - 1): `last` = the last
        prompt window's vote, `generation` = the attention summed over all generated queries."""
        if which == "last":
            return {i: c.last_votes for i, c in self.layers.items() if c.last_votes is not None}
        self.finish()
        return {i: c.gen_votes.cpu() for i, c in self.layers.items()}


def _round(x, digits: int = 4):
    if x is None:
        return None
    if isinstance(x, list):
        return [_round(v, digits) for v in x]
    x = float(x)
    return None if math.isnan(x) else round(x, digits)


# ------------------------------------------------------------------------------------------ documents

@dataclass
class Instruction:
    id: str
    text: str
    answer: str | None = None


@dataclass
class Document:
    id: str
    ids: list[int]
    instructions: list[Instruction]
    meta: dict = field(default_factory=dict)


def validate(task: DictConfig) -> None:
    p = params_of(task)
    require(task.source in SOURCES, f"task.source={task.source!r} is not one of {', '.join(SOURCES)}")
    for name in ("window_tokens", "prompt_windows", "generation_windows", "generation_window_tokens"):
        require(int(task[name]) > 0, f"task.{name}={task[name]} must be a positive integer")
    require(0 < p.theta < 1, f"task.theta={p.theta} must be in (0, 1): a softmax weight")
    require(0 < p.rate < 1, f"task.rate={p.rate} must be in (0, 1): the share of the prefix a window selects")
    require(p.eos in EOS_RULES, f"task.eos={p.eos!r} is not one of {', '.join(EOS_RULES)}")
    require(p.skip_first >= 0, f"task.skip_first={p.skip_first} must be >= 0")
    positions = list(task.positions)
    require(positions and all(x in POSITIONS for x in positions) and len(set(positions)) == len(positions),
            f"task.positions={positions} must be a non-empty subset of {list(POSITIONS)}")
    if task.source == "haystack":
        from harness.tasks.needle.task import haystack_files

        require(len(task.lengths) > 0, "task.lengths is empty; give at least one prompt length")
        for n in task.lengths:
            require(int(n) >= p.windows_span + p.window_tokens,
                    f"task.lengths: {n} tokens leave no prefix before {p.prompt_windows} windows of {p.window_tokens} "
                    f"tokens (at least {p.windows_span + p.window_tokens})")
        require(int(task.documents_per_length) > 0, "task.documents_per_length must be >= 1")
        require(len(task.needles) > 0, "task.needles is empty: the haystack source asks one question per needle")
        for nd in task.needles:
            require(all(k in nd for k in ("text", "question", "depth")), "each of task.needles needs text, question and depth")
            require(0 <= float(nd.depth) <= 100, f"task.needles: depth {nd.depth} is outside [0, 100]")
        haystack_files(task)
    elif task.source == "folder":
        require(task.folder, "task.source=folder needs task.folder=<folder of .txt documents>")
        folder_documents(task)
    else:
        from harness.tasks.longbench.data import data_source, file_stem, load_rows

        require(task.dataset, "task.source=longbench needs task.dataset (e.g. qmsum)")
        load_rows(data_source(task), file_stem("longbench", str(task.dataset)))
    for pos in positions:
        text = template(task, pos)
        require("{document}" in text and "{instruction}" in text, f"task.template_{pos} needs {{document}} and {{instruction}}")


def folder_documents(task: DictConfig) -> list[tuple[str, str, list[str]]]:
    """(name, text, instructions) of every `*.txt` of task.folder, sorted; instructions from
    `<name>.instructions.txt` (one per non-empty line) or task.instructions."""
    folder = Path(str(task.folder)).expanduser()
    require(folder.is_dir(), f"task.folder={folder} is not a folder")
    out = []
    for path in sorted(folder.glob("*.txt")):
        if path.name.endswith(".instructions.txt"):
            continue
        side = path.with_name(path.stem + ".instructions.txt")
        instructions = ([ln.strip() for ln in side.read_text(encoding="utf-8").splitlines() if ln.strip()]
                        if side.exists() else [str(x) for x in task.instructions or []])
        require(instructions, f"{path}: no instructions ({side.name} is missing and task.instructions is empty)")
        out.append((path.stem, path.read_text(encoding="utf-8", errors="replace"), instructions))
    require(out, f"task.folder={folder} has no .txt documents")
    return out


def template(task: DictConfig, position: str) -> str:
    """The prompt text around {document} and {instruction}: task.template_<position>; null means the
    source's default: for longbench at the end the dataset's official LongBench template ({context} ->
    {document}, {input} -> {instruction}), otherwise the document and the instruction on their own lines."""
    chosen = task.get(f"template_{position}")
    if chosen is None:
        if task.source == "longbench" and position == "end":
            from metrics.longbench_config import load_dataset2prompt

            chosen = load_dataset2prompt()[str(task.dataset)].replace("{context}", "{document}").replace("{input}", "{instruction}")
        else:
            chosen = "{document}\n\n{instruction}" if position == "end" else "{instruction}\n\n{document}"
    return str(chosen)


def render_parts(loaded: LoadedModel, task: DictConfig, position: str) -> list:
    """The prompt as token-id pieces with the markers "DOC" / "INSTR" where the document's and the
    instruction's ids go: the template with both sentinels, rendered by the model's chat format, split there
    (each text piece tokenized on its own, the first with the format's special tokens)."""
    import re

    content = template(task, position).replace("{document}", DOC_SENTINEL).replace("{instruction}", INSTR_SENTINEL)
    messages = [{"role": "system", "content": str(task.system_prompt)}] if task.get("system_prompt") else []
    messages.append({"role": "user", "content": content})
    text = loaded.format_chat(messages)
    parts = re.split(f"({re.escape(DOC_SENTINEL)}|{re.escape(INSTR_SENTINEL)})", text)
    require(parts.count(DOC_SENTINEL) == 1 and parts.count(INSTR_SENTINEL) == 1,
            "observation: the chat format lost the document or instruction placeholder")
    pieces: list = []
    for i, part in enumerate(parts):
        if part == DOC_SENTINEL:
            pieces.append("DOC")
        elif part == INSTR_SENTINEL:
            pieces.append("INSTR")
        elif i == 0:
            pieces.append(loaded.encode(part))
        elif part:
            pieces.append(loaded.tokenizer(part, add_special_tokens=False)["input_ids"])
    return pieces


def build_prompt(loaded: LoadedModel, task: DictConfig, doc_ids: list[int], instruction: str, position: str
                 ) -> tuple[list[int], dict]:
    """Token ids of one prompt and the token spans of its parts: {"document": [start, end], "instruction": [...]}."""
    instr_ids = loaded.tokenizer(instruction, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    spans = {}
    for piece in render_parts(loaded, task, position):
        if piece == "DOC":
            spans["document"] = [len(ids), len(ids) + len(doc_ids)]
            ids += doc_ids
        elif piece == "INSTR":
            spans["instruction"] = [len(ids), len(ids) + len(instr_ids)]
            ids += instr_ids
        else:
            ids += piece
    return ids, spans


def overhead(loaded: LoadedModel, task: DictConfig, instructions: list[Instruction]) -> int:
    """The most tokens any (instruction, position) adds around the document."""
    return max(len(build_prompt(loaded, task, [], ins.text, pos)[0]) for ins in instructions for pos in task.positions)


def truncate_middle(ids: list[int], budget: int) -> list[int]:
    if len(ids) <= budget:
        return ids
    half = budget // 2
    return ids[:half] + ids[len(ids) - (budget - half):]


def haystack_documents(task: DictConfig, loaded: LoadedModel) -> list[Document]:
    """One document per (length, copy): a slice of the needle haystack (consecutive slices for the copies)
    with every needle inserted at its depth by needle's rule and check (`needle_prompt.place_needles`: each
    point on the original slice, walked back to a sentence-final period token), so that the document is
    the same for every question; its length makes the longest prompt exactly `length` tokens. The record's
    meta holds each needle's token index in the document and its actual depth (`needle_depth_actual`)."""
    from harness.tasks.needle.task import haystack_files
    from harness.tasks.needle.prompt import DEPTH_TOLERANCE, PeriodRule, place_needles

    tok = loaded.tokenizer
    suffix = str(task.get("instruction_suffix") or "")
    instructions = [Instruction(f"q{i}", str(nd.question) + suffix, str(nd.get("answer") or "") or None)
                    for i, nd in enumerate(task.needles)]
    needles = [(tok(str(nd.text), add_special_tokens=False)["input_ids"], float(nd.depth)) for nd in task.needles]
    periods = PeriodRule(tok)
    tolerance = float(DEPTH_TOLERANCE if task.get("depth_tolerance") is None else task.depth_tolerance)
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in haystack_files(task))
    haystack = tok(text, add_special_tokens=False)["input_ids"]
    extra = overhead(loaded, task, instructions) + sum(len(n) for n, _ in needles)
    docs = []
    for length in [int(n) for n in task.lengths]:
        n_context = length - extra
        require(n_context > 0, f"task.lengths: {length} tokens cannot hold the template, questions and needles ({extra})")
        copies = int(task.documents_per_length)
        need = n_context * copies
        hay = haystack * math.ceil(need / len(haystack))
        for c in range(copies):
            context = hay[c * n_context:(c + 1) * n_context]
            placed = place_needles(context, needles, periods, tolerance=tolerance,
                                   where=f"observation document length={length} copy={c}")
            docs.append(Document(f"haystack-{length}-{c}", placed.ids, instructions,
                                 {"length": length, "copy": c, "needle_token_index": placed.starts,
                                  "needle_depth_actual": placed.depth_actual}))
    return docs


def text_documents(task: DictConfig, loaded: LoadedModel, items: list[tuple[str, str, list[tuple[str, str | None]]]],
                   budget: int) -> list[Document]:
    tok = loaded.tokenizer
    docs = []
    for name, text, instr in items:
        instructions = [Instruction(f"q{i}", t, a) for i, (t, a) in enumerate(instr)]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        room = budget - overhead(loaded, task, instructions)
        require(room > 0, f"observation: a prompt budget of {budget} tokens cannot hold {name}'s template and instructions")
        docs.append(Document(name, truncate_middle(ids, room), instructions, {"document_tokens": len(ids), "truncated": len(ids) > room}))
    return docs


def longbench_items(task: DictConfig) -> list[tuple[str, str, list[tuple[str, str | None]]]]:
    """Rows of the LongBench dataset grouped by context (file order): (id, context, [(input, first answer)])."""
    from harness.tasks.longbench.data import data_source, file_stem, load_rows

    rows = load_rows(data_source(task), file_stem("longbench", str(task.dataset)))
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["context"], []).append(row)
    items = []
    limit = int(task.limit) if task.get("limit") else None
    cap = int(task.max_instructions) if task.get("max_instructions") else None
    for context, members in list(groups.items())[:limit]:
        instr = [(str(r["input"]), (r.get("answers") or [None])[0]) for r in members[:cap]]
        items.append((f"{task.dataset}-{members[0]['_id']}", context, instr))
    return items


def make_documents(task: DictConfig, loaded: LoadedModel) -> list[Document]:
    if task.source == "haystack":
        return haystack_documents(task, loaded)
    budget = int(task.get("max_prompt_tokens") or loaded.prompt_max_length or
                 (loaded.max_positions - int(task.generation_windows) * int(task.generation_window_tokens) - 1))
    if task.source == "folder":
        items = [(name, text, [(t, None) for t in instr]) for name, text, instr in folder_documents(task)]
    else:
        items = longbench_items(task)
    return text_documents(task, loaded, items, budget)


# ------------------------------------------------------------------------------------------ one prompt

def observe_prompt(loaded: LoadedModel, ids: list[int], params: Params, *, keep_votes: bool, on_step=None
                   ) -> tuple[HitRateProbe, dict]:
    """Generate G tokens for `ids` with the full cache under the probe; returns the probe (finished) and the
    generation. `on_step()` runs once per decode step (progress). `probe_seconds`: the probe's batched
    analysis after generation (`HitRateProbe.finish`), outside the decode timings."""
    import time

    from harness.decoding import greedy_generate
    from harness.methods.engine import attention_probe

    probe = HitRateProbe(len(ids), params, keep_votes=keep_votes, on_step=on_step)
    g = params.generated_queries
    options = {"eos_token_ids": loaded.eos_token_ids}
    if params.eos == "ban":
        options["min_new_tokens"] = g + 1
    elif params.eos == "ignore":
        options["ignore_eos"] = True
    x = torch.tensor([ids], dtype=torch.long, device=loaded.device)
    with attention_probe(loaded.model, probe):
        gen = greedy_generate(loaded.model, x, max_new_tokens=g + 1, **options)
    started = time.perf_counter()
    probe.finish()
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    probe_seconds = time.perf_counter() - started
    tokens = gen.tokens[0]
    eos_at = next((i for i, t in enumerate(tokens) if t in set(loaded.eos_token_ids)), None)
    return probe, {"tokens": tokens, "eos_at": eos_at, "stopped_by": gen.stopped_by[0],
                   "prefill_seconds": round(gen.prefill_seconds, 4), "decode_seconds": round(gen.decode_seconds, 4),
                   "probe_seconds": round(probe_seconds, 4)}


def selection_overlaps(votes: list[dict[int, torch.Tensor]], common: int, params: Params, num_layers: int) -> list[list]:
    """Fig. 4 for every pair (a < b) of prompts: per layer H(top-k of a, top-k of b) over the first `common`
    compared positions (votes start at position skip_first)."""
    k = params.k(common)
    out = []
    for a in range(len(votes)):
        for b in range(a + 1, len(votes)):
            per_layer = []
            for idx in range(num_layers):
                va, vb = votes[a].get(idx), votes[b].get(idx)
                if va is None or vb is None or k == 0:
                    per_layer.append(None)
                    continue
                per_layer.append(_round(overlap(topk_mask(va[:, :common], k), topk_mask(vb[:, :common], k))))
            out.append(per_layer)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ------------------------------------------------------------------------------------------ the run

def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    """The task contract's shape (harness/tasks/contract.py) for a task that generates nothing: it measures the
    full cache's attention, so every setting must be the full cache; {tag: {"summary", "rows", "failures"}}."""
    compressing = [s.tag for s in settings if getattr(s.method, "compresses", False)]
    if compressing:
        raise HarnessError(f"task=observation measures the full cache; run it with method=full (not {', '.join(compressing)})")
    return {s.tag: observe(s.cfg, loaded, s.run_dir, progress=progress) for s in settings}


def observe(cfg: DictConfig, loaded: LoadedModel, run_dir, progress: bool = True) -> dict:
    """Every document's prompts observed (common.run_items: resume, progress, failures), then the summary and figures."""
    from harness.methods.engine import attention_modules
    from metrics.needle import keyword_recall

    task = cfg.task
    params = params_of(task)
    num_layers = len(attention_modules(loaded.model))
    g = params.generated_queries
    docs = make_documents(task, loaded)
    positions = list(task.positions)
    primary = "end" if "end" in positions else positions[0]
    longest = max(len(build_prompt(loaded, task, d.ids, i.text, p)[0]) for d in docs for i in d.instructions for p in positions)
    if loaded.max_positions:
        require(longest + g + 1 <= loaded.max_positions,
                f"observation: a {longest}-token prompt + {g + 1} generated tokens exceeds {loaded.name}'s {loaded.max_positions} positions")
    log.info("observation: %d document(s) x %d instruction(s) x %s; %d layers; G=%d", len(docs),
             max(len(d.instructions) for d in docs), positions, num_layers, g)
    doc_log = run_dir.log(LOG_FILE, key="document")
    tok = loaded.tokenizer
    # Progress in generated tokens (a document is minutes of work on a CPU): every prompt still to do adds G.
    from tqdm import tqdm

    todo = sum(len(d.instructions) * len(positions) for d in docs if (d.id,) not in doc_log.records)
    bar = tqdm(total=todo * g, desc="observation: generated tokens", unit="token", disable=not progress, dynamic_ncols=True)

    def work(doc: Document) -> dict:
        prompts = []
        end_votes: list[tuple[list[int], dict, dict]] = []
        for ins in doc.instructions:
            for pos in positions:
                ids, spans = build_prompt(loaded, task, doc.ids, ins.text, pos)
                prefix = params.prefix_length(len(ids))
                compared = params.compared(len(ids))
                row = {"instruction": ins.id, "position": pos, "prompt_tokens": len(ids), "prefix_tokens": prefix,
                       "k": params.k(compared), "spans": spans,
                       "instruction_in_windows": spans["instruction"][1] > prefix}
                bar.set_postfix_str(f"{doc.id} {ins.id} {pos}", refresh=False)
                counted_before = bar.n
                if prefix < params.window_tokens or params.k(compared) < 1:
                    row["skipped"] = f"prompt of {len(ids)} tokens: prefix {prefix} shorter than a window"
                    prompts.append(row)
                    bar.update(g)
                    continue
                probe, gen = observe_prompt(loaded, ids, params, keep_votes=(pos == primary), on_step=lambda: bar.update(1))
                bar.update(counted_before + g - bar.n)  # a response that ended at EOS still counts G
                response = tok.decode(gen["tokens"][:g], skip_special_tokens=True).strip()
                row.update(probe.results(num_layers))
                row.update({"chance": round(probe.k / (probe.prefix - probe.first), 4), "skipped_layers": {str(k): v for k, v in probe.skipped.items()},
                            "response": response, "eos_at": gen["eos_at"], "stopped_by": gen["stopped_by"],
                            "prefill_seconds": gen["prefill_seconds"], "decode_seconds": gen["decode_seconds"],
                            "probe_seconds": gen["probe_seconds"]})
                if ins.answer:
                    row["answer_recall"] = round(keyword_recall(response, ins.answer), 4)
                if pos == primary:
                    end_votes.append((ids, probe.votes("last"), probe.votes("generation")))
                del probe
                prompts.append(row)
        record = {"document": doc.id, "meta": doc.meta, "document_tokens": len(doc.ids), "prompts": prompts}
        if len(end_votes) >= 2:
            common = min(min(common_prefix(end_votes[0][0], e[0]) for e in end_votes[1:]),
                         min(params.prefix_length(len(e[0])) for e in end_votes)) - params.skip_first
            names = [r["instruction"] for r in prompts if r["position"] == primary and "skipped" not in r]
            pairs = [[names[a], names[b]] for a in range(len(names)) for b in range(a + 1, len(names))]
            record["fig4"] = {
                "position": primary, "compared_positions": common, "k": params.k(common), "pairs": pairs,
                "window": selection_overlaps([e[1] for e in end_votes], common, params, num_layers),
                "generation": selection_overlaps([e[2] for e in end_votes], common, params, num_layers),
            }
        return record

    try:
        outcome = run_items(docs, log_file=doc_log, key=lambda d: (d.id,), work=work, desc="observation documents",
                            failures_path=run_dir.path / "failures.json", progress=False)
    finally:
        bar.close()
    records = [doc_log.records[(d.id,)] for d in docs if (d.id,) in doc_log.records]
    summary = summarize(records, params, num_layers, primary)
    summary["failed_documents"] = len(outcome.failures)
    from harness.tasks.observation.report import observation_figures

    figures = observation_figures(summary, run_dir.path, title=f"{loaded.name} · {task.source}")
    summary["figures"] = [p.name for p in figures]
    rows = [{"document": r["document"], **p} for r in records for p in r["prompts"]]
    return {"summary": summary, "rows": rows, "failures": outcome.failures}


# ------------------------------------------------------------------------------------------ summary

def _mean_arrays(arrays: list) -> list | None:
    """Element-wise mean of equally shaped nested lists, ignoring None."""
    arrays = [a for a in arrays if a is not None]
    if not arrays:
        return None
    if not isinstance(arrays[0], list):
        vals = [float(a) for a in arrays if a is not None]
        return _round(sum(vals) / len(vals)) if vals else None
    return [_mean_arrays([a[i] for a in arrays]) for i in range(len(arrays[0]))]


def _flat(values) -> list[float]:
    if values is None:
        return []
    if isinstance(values, list):
        return [v for x in values for v in _flat(x)]
    return [float(values)]


def summarize(records: list[dict], params: Params, num_layers: int, primary: str) -> dict:
    prompts = [p for r in records for p in r["prompts"] if "skipped" not in p]
    main = [p for p in prompts if p["position"] == primary]
    fig2 = _mean_arrays([p["fig2_hit_rate"] for p in main])
    fig3 = _mean_arrays([p["fig3_hit_rate"] for p in main])
    fig3v = _mean_arrays([p["fig3_vote_overlap"] for p in main])
    pair_arrays = {}
    window_pairs, gen_pairs = [], []
    for r in records:
        f4 = r.get("fig4")
        if not f4:
            continue
        for pair, w, gpair in zip(f4["pairs"], f4["window"], f4["generation"]):
            pair_arrays.setdefault("-".join(pair), []).append(w)
            window_pairs.append(w)
            gen_pairs.append(gpair)
    fig5 = {}
    for pos in POSITIONS:
        at = [p for p in prompts if p["position"] == pos]
        if at:
            fig5[pos] = [(_mean_arrays([p["fig2_hit_rate"][i][-1] if p["fig2_hit_rate"][i] else None for p in at]))
                         for i in range(num_layers)]

    def stats(values):
        v = [x for x in _flat(values) if x is not None]
        return _round(sum(v) / len(v)) if v else None

    last = [row[-1] if row else None for row in fig2] if fig2 else []
    first = [row[0] if row else None for row in fig2] if fig2 else []
    valid_last = [x for x in last if x is not None]
    best_is_last = [row.index(max(v for v in row if v is not None)) == len(row) - 1 for row in (fig2 or []) if row and row[-1] is not None]
    summary = {
        "score_name": "last_window_hit_rate",
        "parameters": params.describe(),
        "layers": num_layers,
        "documents": len(records),
        "prompts": len(prompts),
        "primary_position": primary,
        "fig2_hit_rate": fig2,
        "fig3_hit_rate": fig3,
        "fig3_vote_overlap": fig3v,
        "fig4_hit_rate": _mean_arrays(window_pairs),
        "fig4_generation_hit_rate": _mean_arrays(gen_pairs),
        "fig4_pairs": {k: _mean_arrays(v) for k, v in pair_arrays.items()},
        "fig5_hit_rate": fig5,
        "important_per_head": _mean_arrays([p["important_per_head"] for p in main]),
        "chance": stats([p["chance"] for p in main]),
        # headline numbers
        "last_window_mean": stats(last),
        "first_window_mean": stats(first),
        "last_window_range": [min(valid_last), max(valid_last)] if valid_last else None,
        "layers_best_at_last_window": sum(best_is_last),
        "fig3_mean": stats(fig3),
        "fig4_mean": stats(_mean_arrays(window_pairs)),
        "fig4_generation_mean": stats(_mean_arrays(gen_pairs)),
        "fig5_mean": {k: stats(v) for k, v in fig5.items()},
        "responses_reaching_eos": sum(1 for p in prompts if p.get("eos_at") is not None),
    }
    summary["mean_score"] = summary["last_window_mean"]
    return summary
