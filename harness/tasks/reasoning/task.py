"""task=gsm8k, task=math500, task=aime25: reasoning problems whose answers are long (the model works step by step), so
that compression while the model writes matters.

Data: the hub files (`task.hub_repo`/`task.hub_file`: openai/gsm8k's main test parquet, HuggingFaceH4/MATH-500's
test.jsonl, math-ai/aime25's test.jsonl), or offline `task.data_dir` holding `task.data_file` in the same format (for
GSM8K the authors' grade_school_math/data/test.jsonl: the same columns); `task.limit` keeps the first N rows.
Prompt: one user message, `task.prompt` with `{problem}` replaced (default: the problem, then "Please reason step by
step, and put your final answer within \\boxed{}.", the zero-shot prompt of Qwen2.5-Math's and DeepSeek-R1's
evaluations), in the model's chat format; greedy, at most `task.max_new_tokens`, stopped at the model's EOS ids.
Scoring (`task.scorer`): GSM8K `flexible` | `strict` (lm-evaluation-harness's gsm8k filters) | `openai`
(grade-school-math's `#### ` rule), metrics/gsm8k.py; MATH500 `hendrycks` (the MATH paper's boxed answer and string
normalization, metrics/math_equivalence.py); AIME25 `lm_eval` (lm-evaluation-harness's aime25 rule) | `integer` (the
last box's integer, else the last integer; metrics/aime.py).
Records carry the answer read (`pred`), `correct`, the output length (`new_tokens`), `decode_seconds` and the cache's
`peak_cache_bytes` (harness/tasks/long_answers/task.py: measured every step under decode-time compression, else
bytes after prefill plus every generated token's). Both compression modes run side by side in one methods list:
`{name: snapkv, budget: 64}` (prefill only) and `{name: snapkv, budget: 64, decode_interval: 32}` (+ decode-time).
Protocols: query-aware compresses the whole prompt; query-agnostic compresses the problem and prefills the
instruction after it on top.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.generation.prompt import Prompt
from harness.models import LoadedModel
from harness.tasks import contract, field_tables
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.hub_files import data_file, file_rows
from harness.tasks.long_answers.task import common_prefix, peak_cache_bytes
from harness.tasks.answer_tables import markdown, paired_vs_full
from metrics import gsm8k
from metrics.aime import aime_answer, aime_correct, integer_answer, integer_correct
from metrics.math_equivalence import is_equiv, math_answer

log = logging.getLogger(__name__)
PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
GRID_KEYS = ("limit",)


def _gsm8k(output: str, row: dict, scorer: str) -> tuple:
    return gsm8k.extract(output, scorer), gsm8k.is_correct(output, row["answer"], scorer), gsm8k.reference(row["answer"])


def _math(output: str, row: dict, scorer: str) -> tuple:
    pred = math_answer(output)
    return pred, is_equiv(pred, str(row["answer"])), str(row["answer"])


def _aime(output: str, row: dict, scorer: str) -> tuple:
    if scorer == "integer":
        return integer_answer(output), integer_correct(output, row["answer"]), str(row["answer"])
    return aime_answer(output), aime_correct(output, row["answer"]), str(row["answer"])


@dataclass(frozen=True)
class Dataset:
    what: str                       # its name in messages and tables
    fields: tuple[str, ...]         # the columns every row has (the official file's)
    problem: str                    # the column the prompt is made of
    key: str | None                 # the column naming a row in records (None: the row's index)
    scorers: tuple[str, ...]        # task.scorer values
    judge: Callable                 # (output, row, scorer) -> (answer read, correct, reference)
    extra: tuple[str, ...] = ()     # columns copied into the records


DATASETS = {
    "gsm8k": Dataset("GSM8K", ("question", "answer"), "question", None, gsm8k.RULES, _gsm8k),
    "math500": Dataset("MATH500", ("problem", "solution", "answer", "subject", "level", "unique_id"), "problem", "unique_id",
                       ("hendrycks",), _math, ("subject", "level")),
    "aime25": Dataset("AIME25", ("problem", "answer", "id"), "problem", "id", ("lm_eval", "integer"), _aime),
}


def check_row(row, spec: Dataset, where: str) -> dict:
    require(isinstance(row, dict), f"{where}: expected a JSON object per problem, got {type(row).__name__}")
    missing = [f for f in spec.fields if f not in row]
    require(not missing, f"{where}: missing field(s) {', '.join(missing)} ({spec.what} rows have {', '.join(spec.fields)})")
    if spec is DATASETS["gsm8k"]:
        try:
            gsm8k.reference(row["answer"])
        except ValueError as exc:
            raise HarnessError(f"{where}: {exc}") from None
    return row


def _checked(row, where: str, name: str) -> dict:
    return check_row(row, DATASETS[name], where)


def load_rows(task: DictConfig) -> tuple[list[dict], str]:
    spec = DATASETS[str(task.name)]
    path, origin = data_file(task, str(task.data_file), spec.what, hub_filename=str(task.hub_file))
    return file_rows(path, _checked, str(task.name))[: task.get("limit") or None], origin


def validate(task: DictConfig) -> None:
    spec = DATASETS[str(task.name)]
    require(task.get("scorer") in spec.scorers, f"task.scorer={task.get('scorer')!r} is not one of {', '.join(spec.scorers)}")
    limit = task.get("limit")
    require(limit is None or (isinstance(limit, int) and limit > 0), f"task.limit={limit!r} must be a positive count or null")
    require(isinstance(task.get("max_new_tokens"), int) and task.max_new_tokens > 0, "task.max_new_tokens must be a positive integer")
    require("{problem}" in str(task.get("prompt") or ""), "task.prompt must contain {problem} (where the problem goes)")
    rows, _ = load_rows(task)
    require(rows, f"no {spec.what} problem selected (task.limit)")


class ReasoningTask(GenerationTask):
    key_fields, noun = ("index",), "problems"
    csv_columns = ("index", "id", "reference", "pred", "correct", "new_tokens", "stopped_by", "decode_seconds",
                   "peak_cache_bytes", "decode_compressions", "prompt_tokens", "protocol", "response")

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        self.log_name = str(self.task.name)
        self.spec = DATASETS[self.log_name]
        self.rows, self.origin = load_rows(self.task)
        self.scorer = str(self.task.scorer)
        self.decode = dict(max_new_tokens=int(self.task.max_new_tokens), eos_token_ids=loaded.eos_token_ids)
        log.info("%s: %d problems (%s), scorer %s, at most %d new tokens", self.spec.what, len(self.rows), self.origin,
                 self.scorer, self.task.max_new_tokens)

    def items(self) -> list[tuple]:
        return [(i,) for i in range(len(self.rows))]

    def build(self, item) -> Built:
        problem = str(self.rows[item[0]][self.spec.problem])
        text = str(self.task.prompt).replace("{problem}", problem)
        ids = list(self.loaded.encode(self.loaded.format_chat([{"role": "user", "content": text}])))
        alone = self.loaded.encode(self.loaded.format_chat([{"role": "user", "content": problem}]))
        split = common_prefix(alone, ids)  # query-agnostic: the problem is compressed, the instruction prefilled on top
        return Built(Prompt(ids, split, {"question": (split, len(ids))} if split < len(ids) else {}))

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        row = self.rows[item[0]]
        pred, correct, reference = self.spec.judge(text, row, self.scorer)
        return {"index": item[0], "id": row[self.spec.key] if self.spec.key else item[0], "reference": reference,
                "pred": pred, "correct": bool(correct), "score": float(correct), "response": text,
                "problem": str(row[self.spec.problem]),
                "peak_cache_bytes": peak_cache_bytes(self.loaded, answer), **{k: row[k] for k in self.spec.extra}}

    def summarize(self, rows: list[dict]) -> dict:
        def mean(key):
            values = [float(r[key]) for r in rows if r.get(key) is not None]
            return round(sum(values) / len(values), 4) if values else None

        return {"score_name": "accuracy", "main_score": mean("score"), "accuracy": mean("score"),
                "mean_new_tokens": mean("new_tokens"), "mean_decode_seconds": mean("decode_seconds"),
                "mean_peak_cache_bytes": mean("peak_cache_bytes"),
                "max_peak_cache_bytes": max((r.get("peak_cache_bytes") or 0 for r in rows), default=0),
                "stopped_at_max_new_tokens": sum(r.get("stopped_by") not in ("eos", "stop_string") for r in rows),
                "items": len(rows), "scorer": self.scorer, "data": self.origin, "max_new_tokens": int(self.task.max_new_tokens),
                "prompt": str(self.task.prompt), "sampling": "greedy"}


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    task = ReasoningTask(cfg, loaded)
    results = contract.run(task, settings, progress=progress)
    rows = {tag: res["rows"] for tag, res in results.items()}
    reference = field_tables.full_tag(settings)
    deltas = paired_vs_full(rows, reference) if reference else {}
    for s in settings:
        results[s.tag]["summary"]["paired_vs_full"] = deltas.get(s.tag, {})
    notes = [f"{loaded.name}, {task.protocol}, scorer={task.scorer}, greedy, at most {task.task.max_new_tokens} new tokens, "
             f"data {task.origin}."]
    if settings:
        text = markdown(task.spec.what, rows, reference, notes, deltas)
        path = field_tables.write(Path(settings[0].run_dir.path).parent, task.log_name, text)
        log.info("%s table: %s", task.spec.what, path)
    return results
