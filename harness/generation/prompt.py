"""The types a generation speaks: a run's method `Setting`, an item's `Prompt` (segments, spans, several
`Question`s over one context), and each setting's `Outcome` on it (`QuestionOutcomes` for several questions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from harness.decoding import Generation


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
    # Multi-turn (keep_answers) only. `after_answer`: the tokens fed between the previous answer and `ids`, a function of
    # that answer's tokens (the cache already holds all but its last: decoding never feeds it back); None: its last token,
    # so the conversation holds the whole answer. `max_new_tokens`: this turn's own budget (None: the prompt's).
    after_answer: Callable[[list[int]], list[int]] | None = None
    max_new_tokens: int | None = None


@dataclass
class Outcome:
    """One setting's result on one item: the generation and its compression diagnostics, or the error."""

    generation: Generation | None
    diagnostics: dict
    error: BaseException | None = None
    kept: dict = field(default_factory=dict)  # layer -> kept prompt positions (B, H, n), None: layer kept whole


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
