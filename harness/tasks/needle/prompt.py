"""Needle-in-a-haystack prompts: the template around the context, the needle's placement, one cell's ids.

A cell is `prefix + context-with-needle + suffix`, all token ids, exactly `length` tokens long:
the prefix is the template text before the context (system prompt / instructions, BOS), the suffix
the template text after it (the question and what the template puts after it). The needle goes in
at `depth` percent of the context by the original rule: at `point = int(len(context) * depth / 100)`,
walk back to just after the previous sentence-final period token (depth 100 appends at the end).
`place_needles` is that rule for one or several needles, with the placement check below: the one
placement function of every task that inserts token ids into a haystack (needle, observation). RULER places its
needles in text by sentence index, as RULER does, and tokenizes once (harness/tasks/ruler/task.py).

Period tokens (`is_period_token`): a token is a sentence-final period when its decoded text, with
whitespace stripped, ends with "." and holds no letter or digit. That is the rule for the ids the
haystack itself uses, whatever the vocabulary:

- SentencePiece (Llama-2: LWM-Text-Chat-1M, LongChat; Mistral): the period after a word is the bare
  "." (29889 in Llama-2), not "▁." (869), which is what `tok(".")` returns: the original trap,
  where a walk-back on `tok(".")` finds nothing and every needle lands at position 0;
- byte-level BPE (SmolLM2, Command-R): "." and " .";
- byte-level BPE with newline merges (Llama-3, Qwen2): also ".\\n", ".\\n\\n", ... (the period of a
  paragraph's last sentence);
- all: closing punctuation merged before the period (").", '").', "%."), the ellipsis.

Tokens with a letter or digit ("Mr.", "etc.", "3.") are abbreviations or numbers, not sentence
ends. The classification is per token id, from the tokens of the context the walk-back crosses,
cached per tokenizer: no list of ids is hard-coded and no vocabulary is scanned.

Placement check: `depth_actual` is the needle's start within the context as a percent of the
context length. The walk-back can only snap to the sentence before the point, so a cell is accepted
when the needle starts within `depth_tolerance` points (default DEPTH_TOLERANCE = 5) of the request,
or within SENTENCE_TOKENS tokens of the point (one sentence: the longest sentence of the Paul
Graham essays is ~230 tokens in the five vocabularies tested; a 5-point window is narrower than one
sentence for contexts under ~5K tokens). Anything further is a HarnessError naming the cell: the
haystack has no period by the rule near that point (the `tok(".")` bug, or a haystack without "."
sentence ends).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

from omegaconf import DictConfig

from harness.errors import HarnessError

PROMPT_STYLES = ("chat", "storybook", "completion")
SENTINEL = "\x00HAYSTACK\x00"
DEPTH_TOLERANCE = 5.0  # percentage points of the context
SENTENCE_TOKENS = 256  # the walk-back may always cross one sentence
_LETTER_OR_DIGIT = re.compile(r"[^\W_]")  # any Unicode letter or digit


def is_period_text(text: str) -> bool:
    """The rule on a token's decoded text: stripped of whitespace, it ends with "." and holds no
    letter or digit (".", "▁.", ".\\n\\n", ").", "%." yes; "Mr.", "3.", '."' no)."""
    core = text.strip()
    return core.endswith(".") and _LETTER_OR_DIGIT.search(core) is None


@dataclass
class PeriodRule:
    """`is_period_token` for one tokenizer, classifying each id once (by decoding it alone)."""

    tokenizer: Any = field(repr=False)
    _known: dict[int, bool] = field(default_factory=dict, repr=False)

    def __call__(self, token_id: int) -> bool:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = is_period_text(self.tokenizer.decode([token_id]))
        return known

    def ids_in(self, ids: Collection[int]) -> set[int]:
        """The period token ids among `ids` (e.g. a tokenized haystack)."""
        unseen = [i for i in set(ids) if i not in self._known]
        if unseen:
            for i, text in zip(unseen, self.tokenizer.batch_decode([[i] for i in unseen])):
                self._known[i] = is_period_text(text)
        return {i for i in set(ids) if self._known[i]}


def period_token_ids(tokenizer, ids: Collection[int]) -> set[int]:
    """The ids in `ids` (a tokenized haystack) that are sentence-final periods by the rule."""
    return PeriodRule(tokenizer).ids_in(ids)


@dataclass
class PromptParts:
    prefix: list[int]
    suffix: list[int]
    needle: list[int]
    periods: PeriodRule = field(repr=False)
    depth_tolerance: float = DEPTH_TOLERANCE


@dataclass
class NeedleCell:
    """One grid cell's prompt. `ids[needle_start:needle_end]` is the needle; `ids[question_start:]`
    is the template text after the haystack (the question, then whatever the template adds: the
    part a query-agnostic evaluation prefills after compression). `depth_actual` is the needle's
    start within the context as a percent of the context's length (0 at the start, 100 appended)."""

    ids: list[int]
    needle_start: int
    needle_end: int
    question_start: int
    depth_actual: float


def prompt_parts(task: DictConfig, loaded) -> PromptParts:
    """Token ids around the context for the chosen prompt style.

    chat: the model's chat formatting (system prompt; context; question + suffix as user turns).
    storybook: the KV papers' prompt (`task.storybook_template`), no chat template.
    completion: for base models without a chat template (`task.completion_template`: the
    instructions, "Document:", the haystack, then "Question: ...\\nAnswer:").
    The two templates have `{context}` and `{question}` (the bare `task.question`) placeholders;
    their text before `{context}` is tokenized with the tokenizer's special tokens (a BOS)."""
    tok = loaded.tokenizer
    if task.prompt_style == "chat":
        question = task.question + task.question_suffix
        messages = [
            {"role": "system", "content": task.system_prompt},
            {"role": "user", "content": SENTINEL},
            {"role": "user", "content": question},
        ]
        try:
            text = loaded.format_chat(messages)
        except Exception:  # templates that insist on alternating roles: one user turn
            text = loaded.format_chat([messages[0], {"role": "user", "content": f"{SENTINEL}\n\n{question}"}])
        before, after = text.split(SENTINEL)
        prefix = loaded.encode(before)
    else:
        key = f"{task.prompt_style}_template"
        template = str(task[key])
        if template.count("{context}") != 1:
            raise HarnessError(f"task.{key} must hold {{context}} exactly once")
        before, after = (part.replace("{question}", task.question) for part in template.split("{context}"))
        prefix = tok(before)["input_ids"]
    return PromptParts(
        prefix=list(prefix),
        suffix=tok(after, add_special_tokens=False)["input_ids"],
        needle=tok(task.needle, add_special_tokens=False)["input_ids"],
        periods=PeriodRule(tok),
        depth_tolerance=float(DEPTH_TOLERANCE if task.get("depth_tolerance") is None else task.depth_tolerance),
    )


@dataclass
class Placement:
    """Where `place_needles` put each needle: `ids` is the context with every needle inserted; per needle,
    in the order given, `starts` is its first token in `ids`, `points` its insertion point in the original
    context and `depth_actual` that point as a percent of the context's length (100 when appended)."""

    ids: list[int]
    starts: list[int]
    points: list[int]
    depth_actual: list[float]


def place_needles(context: Sequence[int], needles: Sequence[tuple[Sequence[int], float]], is_period, *,
                  tolerance: float = DEPTH_TOLERANCE, check: bool = True, where: str = "needle") -> Placement:
    """Insert needles into a haystack by the original rule, with the depth check. Every task that puts
    token ids into a haystack (needle, observation) calls this one function (RULER inserts in text, as RULER does).

    Inputs: `context`, the haystack's token ids (no template around it); `needles`, a list of
    (needle token ids, depth in percent of the context); `is_period`, which ids end a sentence (a
    `PeriodRule`, a predicate on an id, or a set of ids: never `tok(".")`, see the module docstring).
    Each needle's point is computed on the ORIGINAL context: `int(len(context) * depth / 100)`, walked
    back to just after the previous period token (depth >= 100 appends at the end). Needles sharing a
    point keep the order given. With `check`, a needle that starts more than `tolerance` points and
    more than SENTENCE_TOKENS tokens before its requested point is a HarnessError starting with
    `where` (name the cell there; with several needles, the needle's index and depth follow).

    Output: a `Placement`: the new ids (context + every needle) and, per needle in the order given, its
    start in the new ids, its point in the original context, and its actual depth in percent."""
    test = is_period if callable(is_period) else is_period.__contains__
    context = list(context)
    n = len(context)
    points, actual = [], []
    for i, (_, depth) in enumerate(needles):
        if depth >= 100:
            points.append(n)
            actual.append(100.0)
            continue
        point = want = int(n * depth / 100)
        while point > 0 and not test(context[point - 1]):
            point -= 1
        pct = 100.0 * point / n if n else 0.0
        if check and abs(pct - depth) > tolerance and want - point > SENTENCE_TOKENS:
            label = where if len(needles) == 1 else f"{where} needle {i} (depth {depth:g})"
            raise HarnessError(
                f"{label}: the needle starts at {pct:.1f}% of the {n}-token context (token {point}, the requested "
                f"point is token {want}): more than {tolerance:g} points and {SENTENCE_TOKENS} tokens away, because the "
                f"haystack has no sentence-final period token (decoded text ending in '.', no letters) in between; use a "
                f"haystack of '.'-terminated sentences (task.haystack_dir) or raise task.depth_tolerance")
        points.append(point)
        actual.append(round(pct, 4))
    order = sorted(range(len(needles)), key=lambda i: (points[i], i))
    ids: list[int] = []
    starts = [0] * len(needles)
    taken = 0
    for i in order:
        ids += context[taken:points[i]]
        taken = points[i]
        starts[i] = len(ids)
        ids += needles[i][0]
    ids += context[taken:]
    return Placement(ids=ids, starts=starts, points=points, depth_actual=actual)


def insert_needle(context: list[int], needle: list[int], depth: float, is_period) -> tuple[list[int], int]:
    """One needle by `place_needles`' rule, unchecked: (new ids, its position); no period before the
    point gives position 0."""
    placed = place_needles(context, [(needle, depth)], is_period, check=False)
    return placed.ids, placed.starts[0]


def build_cell(haystack: list[int], parts: PromptParts, length: int, depth: float) -> NeedleCell:
    """The cell's prompt, exactly `length` tokens; a needle placed too far from `depth` is a HarnessError."""
    n_context = length - len(parts.prefix) - len(parts.suffix) - len(parts.needle)
    if n_context <= 0:
        raise HarnessError(f"task.lengths: {length} tokens cannot hold the prompt template and needle ({length - n_context} tokens)")
    if len(haystack) < n_context:
        raise HarnessError(f"task.lengths: {length} needs {n_context} haystack tokens but the haystack has {len(haystack)}")
    placed = place_needles(haystack[:n_context], [(parts.needle, depth)], parts.periods, tolerance=parts.depth_tolerance,
                           where=f"needle cell length={length} depth={depth:g}")
    context, at, actual = placed.ids, placed.starts[0], placed.depth_actual[0]
    start = len(parts.prefix) + at
    ids = parts.prefix + context + parts.suffix
    return NeedleCell(ids=ids, needle_start=start, needle_end=start + len(parts.needle),
                      question_start=len(ids) - len(parts.suffix), depth_actual=actual)
