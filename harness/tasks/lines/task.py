"""LongEval-Lines (LongChat's line-retrieval test, DachengLi1/LongChat longeval), generated offline.

The SnapKV paper's pooling ablation (section 5.2, Figure 8) runs it on Mistral-7B-Instruct-v0.2 with
SnapKV W=16, max pooling k=5 vs no pooling (k=1): conf/experiment/paper_lines.yaml.

A record is a list of lines `line <adjective>-<noun>: REGISTER_CONTENT is <NNNNN>` (keys drawn without
repetition from the word lists in harness/data/lines/, values 5-digit numbers), between a header that
says what to memorize and a question asking for one key's value; the whole text is one user message
in the model's chat format. Everything is a deterministic function of (task.seed, sample): a record is
the first n lines of that sample's fixed sequence, n the most lines for which the prompt fits
`length` tokens (template included). The asked line sits at `position` percent of the record
(0 = the first line, 100 = the last). Scoring is LongEval's: the last integer in the response must
equal the value (exact match); `contains` (the value appears among the response's numbers) is kept
as well.

The protocol options apply as in every task: `task.query_aware=false` compresses the header and the
lines and prefills the question (and the chat format's closing text) on top, uncompressed;
`model.prefill_chunk_size` prefills the compressed part in chunks. Records carry `protocol` and
`question_start`; `question_kept` / `line_kept` say what compression left of the question and of
the asked line.
"""

from __future__ import annotations

import functools
import logging
import random
import re
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import require
from harness.models import LoadedModel
from harness.tasks import contract
from harness.generation.prompt import Prompt
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.longbench.data import question_start

log = logging.getLogger(__name__)
# Protocol options this task applies (harness.app refuses them for a task that does not list them).
PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
# Options that only choose which items run: a run directory takes another grid and reuses its items.
GRID_KEYS = ("lengths", "positions", "samples")
WORDS_DIR = Path(__file__).resolve().parents[2] / "data" / "lines"  # shipped as package data
LOG_FILE = "lines_cells.jsonl"


def validate(task: DictConfig) -> None:
    require(len(task.lengths) > 0, "task.lengths is empty; give at least one prompt length, e.g. task.lengths=[2048]")
    require(len(task.positions) > 0, "task.positions is empty; give at least one position in [0, 100]")
    for n in task.lengths:
        require(int(n) > 0, f"task.lengths: {n} is not a positive token count")
    for d in task.positions:
        require(0 <= float(d) <= 100, f"task.positions: {d} is outside [0, 100]")
    require(int(task.samples) >= 1, "task.samples must be >= 1")
    require("{key}" in task.line_template and "{value}" in task.line_template,
            "task.line_template needs {key} and {value}")
    require("{key}" in task.question, "task.question needs {key}")
    adjectives, nouns = word_lists(task.get("words_dir"))
    require(len(adjectives) * len(nouns) >= 100, "the word lists give fewer than 100 keys")


@functools.lru_cache(maxsize=4)
def word_lists(words_dir: str | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) from `words_dir` (default harness/data/lines): one word a line, '#' comments."""
    folder = Path(words_dir) if words_dir else WORDS_DIR

    def read(name: str) -> tuple[str, ...]:
        path = folder / name
        require(path.is_file(), f"task.words_dir: {path} is missing")
        words = [w.strip() for w in path.read_text(encoding="utf-8").splitlines()]
        words = [w for w in words if w and not w.startswith("#")]
        require(len(set(words)) == len(words), f"{path} lists a word twice")
        require(all(re.fullmatch(r"[a-z]+", w) for w in words), f"{path}: words must be lowercase letters only")
        return tuple(words)

    return read("adjectives.txt"), read("nouns.txt")


@functools.lru_cache(maxsize=16)
def line_sequence(seed: int, sample: int, words_dir: str | None = None) -> tuple[tuple[str, int], ...]:
    """The fixed sequence of (key, value) of one sample: every adjective-noun key once, in a seeded order,
    each with a seeded 5-digit value. A string seed: the same sequence on every Python version and platform."""
    adjectives, nouns = word_lists(words_dir)
    rng = random.Random(f"kv-harness lines seed={seed} sample={sample}")
    order = list(range(len(adjectives) * len(nouns)))
    rng.shuffle(order)
    return tuple((f"{adjectives[i // len(nouns)]}-{nouns[i % len(nouns)]}", rng.randint(10000, 99999)) for i in order)


def target_index(n_lines: int, position: float) -> int:
    """Index of the asked line among n lines at `position` percent (0 first, 100 last)."""
    return int(round(float(position) / 100 * (n_lines - 1)))


def record_text(task: DictConfig, lines: list[tuple[str, int]], target: int) -> tuple[str, str]:
    """(user message, the asked line's text)."""
    body = "".join(task.line_template.format(key=k, value=v) for k, v in lines)
    question = task.question.format(key=lines[target][0])
    asked = task.line_template.format(key=lines[target][0], value=lines[target][1])
    return f"{task.header}{body}{question}", asked


def render(task: DictConfig, loaded: LoadedModel, lines: list[tuple[str, int]], target: int) -> tuple[str, list[int], str]:
    message, asked = record_text(task, lines, target)
    text = loaded.format_chat([{"role": "user", "content": message}])
    return text, loaded.encode(text), asked


def build_prompt(task: DictConfig, loaded: LoadedModel, length: int, position: float, sample: int) -> tuple[list[int], dict]:
    """Token ids of one cell's prompt (at most `length` tokens: as many lines as fit) and what it holds:
    {"n_lines", "target_index", "key", "expected", "line_span": [start, end) token span of the asked line
    (None without a fast tokenizer), "question_start": where the question begins (the text after the
    lines: LongBench's rule for the template's text after {context}, on the final ids)}."""
    seq = line_sequence(int(task.seed), int(sample), task.get("words_dir"))

    def size(n: int) -> int:
        return len(render(task, loaded, list(seq[:n]), target_index(n, position))[1])

    require(size(1) <= length, f"task.lengths: {length} tokens cannot hold the header, one line and the question ({size(1)})")
    lo, hi = 1, min(len(seq), length)  # every line is at least one token
    if size(hi) <= length:
        lo = hi
    while lo < hi:  # the most lines that fit
        mid = (lo + hi + 1) // 2
        if size(mid) <= length:
            lo = mid
        else:
            hi = mid - 1
    n = lo
    target = target_index(n, position)
    lines = list(seq[:n])
    text, ids, asked = render(task, loaded, lines, target)
    info = {"n_lines": n, "target_index": target, "key": lines[target][0], "expected": lines[target][1],
            "line_span": _token_span(loaded, text, ids, asked),
            "question_start": question_start("lines", {"key": lines[target][0]}, ids, loaded.tokenizer,
                                             {"lines": "{context}" + str(task.question)})}
    return ids, info


def _token_span(loaded: LoadedModel, text: str, ids: list[int], asked: str) -> list[int] | None:
    tok = loaded.tokenizer
    if not getattr(tok, "is_fast", False):
        return None
    start = text.find(asked)
    if start < 0:
        return None
    end = start + len(asked)
    enc = tok(text, add_special_tokens=loaded.chat_format != "template", return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(ids):
        return None
    inside = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > start and a < end and b > a]
    return [inside[0], inside[-1] + 1] if inside else None


def score_record(response: str, expected: int) -> dict:
    """LongEval's rule: the last integer in the response is the answer; exact match with the value."""
    numbers = [int(x) for x in re.findall(r"\d+", response or "")]
    parsed = numbers[-1] if numbers else None
    correct = parsed == int(expected)
    return {"score": float(correct), "correct": correct, "parsed": parsed, "contains": int(expected) in numbers}


class LinesTask(GenerationTask):
    """A cell is (length, position, sample): one record of lines, one asked key."""

    log_name, key_fields, noun = LOG_FILE.removesuffix(".jsonl"), ("length", "position", "sample"), "cells"
    csv_columns = ("length", "position", "sample", "prompt_tokens", "n_lines", "target_index", "key", "expected", "parsed",
                   "protocol", "score", "contains", "question_kept", "line_kept", "new_tokens", "stopped_by", "prefill_seconds",
                   "decode_seconds", "response")

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        task = self.task
        self.lengths = [int(n) for n in task.lengths]
        self.positions = [float(d) for d in task.positions]
        self.samples = list(range(int(task.samples)))
        if loaded.max_positions:
            require(max(self.lengths) + int(task.max_new_tokens) <= loaded.max_positions,
                    f"task.lengths: {max(self.lengths)} + {task.max_new_tokens} new tokens exceeds {loaded.name}'s {loaded.max_positions} positions")
        self.decode = dict(max_new_tokens=int(task.max_new_tokens), min_new_tokens=int(task.min_new_tokens))
        log.info("lines: %d lengths x %d positions x %d sample(s), %s", len(self.lengths), len(self.positions), len(self.samples),
                 self.protocol)

    def items(self) -> list[tuple]:
        return [(n, d, s) for n in self.lengths for d in self.positions for s in self.samples]

    def build(self, cell) -> Built:
        ids, info = build_prompt(self.task, self.loaded, *cell)
        split = info["question_start"]
        spans = {"question": (split, len(ids))}
        if info["line_span"] is not None:
            spans["line"] = tuple(info["line_span"])
        return Built(Prompt(ids, split, spans), data=info)

    def record(self, cell, built: Built, i: int, text: str, answer) -> dict:
        length, position, sample = cell
        response = text.strip()
        return {"length": length, "position": position, "sample": sample, **built.data,
                "response": response, **score_record(response, built.data["expected"])}

    def summarize(self, rows: list[dict]) -> dict:
        return summarize(rows, self.lengths, self.positions)

    def finish(self, setting, rows: list[dict], summary: dict) -> None:
        from harness.tasks.lines.report import lines_heatmap

        lines_heatmap(rows, setting.run_dir.path / "lines_heatmap.png", title=f"{self.loaded.name} · {setting.tag}")


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    """Every cell for every setting (harness.generation.prompt.Setting), one prefill per cell: the pooling
    ablation's two SnapKV settings (and the full cache) decode from the same prefill (contract.run)."""
    return contract.run(LinesTask(cfg, loaded), settings, progress=progress)


def summarize(rows: list[dict], lengths: list[int], positions: list[float]) -> dict:
    def mean(values):
        values = list(values)
        return round(sum(values) / len(values), 4) if values else None

    return {
        "score_name": "exact_match",
        "mean_score": mean(r["score"] for r in rows),
        "accuracy": mean(r["score"] for r in rows),
        "contains_rate": mean(float(r["contains"]) for r in rows),
        "cells": len(rows),
        "by_length": {str(n): mean(r["score"] for r in rows if r["length"] == n) for n in lengths},
        "by_position": {f"{d:g}": mean(r["score"] for r in rows if r["position"] == d) for d in positions},
        "mean_lines": mean(r["n_lines"] for r in rows),
    }
