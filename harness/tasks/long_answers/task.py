"""task=long_answers: answers that are long and checkable, so that compression while the model writes matters.

A document of `n` lines `<key>: <value>` (RULER-style generated offline: the keys and 5-digit values of
LongEval-Lines' deterministic sequences, harness/tasks/lines.py, drawn by (task.seed, sample)), then the request
to list every key with its value, in order, one per line. The answer is n lines long (about 10 tokens each).

Scoring (exact matches, in order): the response's lines are parsed as `key: value` (the first `n`); `score` is
the fraction of positions i whose parsed pair equals the document's i-th pair; `all_correct` when every pair is
right and nothing is missing. Records also carry the output length (`new_tokens`), `decode_seconds` and the
cache's `peak_cache_bytes`: measured every step under decode-time compression (method.decode_interval), and for
prefill-only compression the bytes after the prefill plus the bytes of every generated token (the cache only
grows then). Both compression modes run side by side as two entries of one methods list (one prefill per item,
decoded together): `{name: snapkv, budget: 256}` and `{name: snapkv, budget: 256, decode_interval: 32}`.
"""

from __future__ import annotations

import logging
import re

from omegaconf import DictConfig

from harness.errors import require
from harness.models import LoadedModel
from harness.tasks import contract
from harness.generation.prompt import Prompt
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.lines.task import line_sequence

log = logging.getLogger(__name__)
PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
GRID_KEYS = ("keys", "samples")
LINE = re.compile(r"^\s*(?:[-*\d.)]+\s*)?([a-z]+-[a-z]+)\s*:\s*<?(\d+)>?\s*$")


def validate(task: DictConfig) -> None:
    require(len(task["keys"]) > 0, "task.keys is empty: give the numbers of keys per document, e.g. task.keys=[10,20]")
    for n in task["keys"]:
        require(isinstance(n, int) and n >= 1, f"task.keys: {n!r} is not a positive number of keys")
    require(int(task.samples) >= 1, "task.samples must be >= 1")
    require("{key}" in task.line_template and "{value}" in task.line_template, "task.line_template needs {key} and {value}")


def document(task: DictConfig, n: int, sample: int) -> list[tuple[str, int]]:
    return list(line_sequence(int(task.seed), int(sample), task.get("words_dir"))[:n])


def parse_pairs(response: str) -> list[tuple[str, int]]:
    """The `key: value` lines of a response, in order (list markers and <> around the value tolerated)."""
    out = []
    for line in (response or "").splitlines():
        m = LINE.match(line)
        if m:
            out.append((m.group(1), int(m.group(2))))
    return out


def score_pairs(response: str, expected: list[tuple[str, int]]) -> dict:
    got = parse_pairs(response)[:len(expected)]
    hits = sum(1 for a, b in zip(got, expected) if a == b)
    return {"score": round(hits / len(expected), 4), "pairs_correct": hits, "pairs_parsed": len(got),
            "all_correct": hits == len(expected)}


def peak_cache_bytes(loaded: LoadedModel, answer) -> int | None:
    """The cache's largest size in bytes while the answer was written: measured every step under a decode rule
    (the evictor's `peak_cache_bytes`); for prefill-only compression (and `full`) the cache only grows, so it is the
    bytes after the prefill plus one token's keys and values, every layer, per generated token."""
    diag = answer.diagnostics
    if diag.get("peak_cache_bytes") is not None:
        return diag["peak_cache_bytes"]
    if diag.get("cache_bytes") is None:
        return None
    config = loaded.model.config.get_text_config() if hasattr(loaded.model.config, "get_text_config") else loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    size = next(loaded.model.parameters()).element_size()
    # heads stored per KV head (gqa=expand keeps one per query head): from the first layer's heads after prefill
    after = diag.get("kv_positions_after_prefill")
    kv_heads = int(config.num_key_value_heads)
    heads = kv_heads * (max(1, int(after[0][0]) // kv_heads) if after else 1)
    token_bytes = 2 * config.num_hidden_layers * heads * head_dim * size
    return diag["cache_bytes"] + len(answer.generation.tokens[0]) * token_bytes


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class LongAnswersTask(GenerationTask):
    log_name, key_fields, noun = "long_answers", ("keys", "sample"), "items"
    csv_columns = ("keys", "sample", "prompt_tokens", "protocol", "score", "pairs_correct", "pairs_parsed", "all_correct",
                   "new_tokens", "stopped_by", "decode_seconds", "peak_cache_bytes", "decode_compressions", "response")

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        self.counts = [int(n) for n in self.task["keys"]]
        self.samples = list(range(int(self.task.samples)))
        self.per_key = int(self.task.tokens_per_key)
        self.decode = {"min_new_tokens": 0}
        log.info("long_answers: %s keys x %d sample(s), %s", self.counts, len(self.samples), self.protocol)

    def items(self):
        return [(n, s) for n in self.counts for s in self.samples]

    def build(self, item) -> Built:
        n, sample = item
        pairs = document(self.task, n, sample)
        body = "".join(self.task.line_template.format(key=k, value=v) for k, v in pairs)
        context = self.loaded.encode(self.loaded.format_chat([{"role": "user", "content": f"{self.task.header}{body}"}]))
        ids = self.loaded.encode(self.loaded.format_chat([{"role": "user", "content": f"{self.task.header}{body}{self.task.question}"}]))
        split = common_prefix(context, ids)
        return Built(Prompt(ids, split, {"question": (split, len(ids))}), decode={"max_new_tokens": n * self.per_key + 16},
                     data={"expected": pairs})

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        n, sample = item
        expected = built.data["expected"]
        return {"keys": n, "sample": sample, "response": text.strip(), "peak_cache_bytes": peak_cache_bytes(self.loaded, answer),
                "reference": "\n".join(f"{k}: {v}" for k, v in expected), **score_pairs(text, expected)}

    def summarize(self, rows: list[dict]) -> dict:
        def mean(key, subset=None):
            values = [float(r[key]) for r in (rows if subset is None else subset) if r.get(key) is not None]
            return round(sum(values) / len(values), 4) if values else None

        return {"score_name": "pair_accuracy", "main_score": mean("score"), "accuracy": mean("score"),
                "all_correct_rate": mean("all_correct"), "mean_new_tokens": mean("new_tokens"),
                "mean_decode_seconds": mean("decode_seconds"), "max_peak_cache_bytes": max((r.get("peak_cache_bytes") or 0 for r in rows), default=0),
                "by_keys": {str(n): mean("score", [r for r in rows if r["keys"] == n]) for n in self.counts}, "items": len(rows)}


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    return contract.run(LongAnswersTask(cfg, loaded), settings, progress=progress)
