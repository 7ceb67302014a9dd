"""Needle-in-a-haystack prompts: the template around the context, the needle's placement, one cell's ids.

A cell is `prefix + context-with-needle + suffix`, all token ids, exactly `length` tokens long:
the prefix is the template text before the context (system prompt / instructions, BOS), the suffix
the template text after it (the question and what the template puts after it). The needle goes in
at `depth` percent of the context by the original rule: at `point = int(len(context) * depth / 100)`,
walk back to just after the previous sentence-final period token (depth 100 appends at the end).

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
from typing import Any, Collection

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


def insert_needle(context: list[int], needle: list[int], depth: float, is_period) -> tuple[list[int], int]:
    """The original rule: at `depth`% of the context, walking back to just after a period token
    (`is_period`: a set of ids or a predicate on an id); 100 appends at the end, no period before
    the point gives position 0."""
    test = is_period if callable(is_period) else is_period.__contains__
    if depth >= 100:
        return context + needle, len(context)
    point = int(len(context) * depth / 100)
    while point > 0 and not test(context[point - 1]):
        point -= 1
    return context[:point] + needle + context[point:], point


def build_cell(haystack: list[int], parts: PromptParts, length: int, depth: float) -> NeedleCell:
    """The cell's prompt, exactly `length` tokens; a needle placed too far from `depth` is a HarnessError."""
    n_context = length - len(parts.prefix) - len(parts.suffix) - len(parts.needle)
    if n_context <= 0:
        raise HarnessError(f"task.lengths: {length} tokens cannot hold the prompt template and needle ({length - n_context} tokens)")
    if len(haystack) < n_context:
        raise HarnessError(f"task.lengths: {length} needs {n_context} haystack tokens but the haystack has {len(haystack)}")
    context, at = insert_needle(haystack[:n_context], parts.needle, depth, parts.periods)
    actual = 100.0 if depth >= 100 else 100.0 * at / n_context
    point = int(n_context * depth / 100) if depth < 100 else n_context
    if abs(actual - depth) > parts.depth_tolerance and point - at > SENTENCE_TOKENS:
        raise HarnessError(
            f"needle cell length={length} depth={depth:g}: the needle starts at {actual:.1f}% of the {n_context}-token context "
            f"(token {at}, the requested point is token {point}): more than {parts.depth_tolerance:g} points and {SENTENCE_TOKENS} "
            f"tokens away, because the haystack has no sentence-final period token (decoded text ending in '.', no letters) "
            f"in between; use a haystack of '.'-terminated sentences (task.haystack_dir) or raise task.depth_tolerance")
    start = len(parts.prefix) + at
    ids = parts.prefix + context + parts.suffix
    return NeedleCell(ids=ids, needle_start=start, needle_end=start + len(parts.needle),
                      question_start=len(ids) - len(parts.suffix), depth_actual=round(actual, 4))
