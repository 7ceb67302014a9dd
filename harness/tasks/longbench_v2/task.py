"""LongBench-v2 (THUDM/LongBench, pred.py + result.py): 503 four-choice questions over 8K-2M-word contexts.

The model input is pred.py's: the 0-shot template (metrics/data/longbench_v2/0shot.txt) filled by `str.replace`
with the stripped context, question and choices; middle truncation on the tokens of that text (special tokens
included) to `task.max_length` L (model2maxlen: 120000 for every model the authors list), keeping
`ids[:L//2] + ids[-L//2:]` (Python's -L//2 rounds down: an odd L keeps one token more at the end), decoded as one
text without special tokens; then the model's chat format (pred.py sends one user message to a chat endpoint). Capped at the
model's own `model.prompt_max_length` when that is smaller (recorded: `truncation_budget`). Generation: at most
128 new tokens, stopped at the model's EOS ids; greedy (the authors sample at temperature 0.1: a named
difference, `sampling` in the summary). Scoring: metrics/longbench_v2.py (`task.scorer`: official | corrected).

Protocols: query-aware compresses the whole prompt; query-agnostic compresses the template up to the document's
end and prefills the text after `$DOC$` (`</text>`, the question, the choices, the answer format) on top.
Tables (`longbench_v2_table.md` in the run directory): result.py's columns (Overall, Easy, Hard, Short, Medium,
Long), then each setting minus `full` with paired intervals.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.generation.prompt import Prompt
from harness.models import LoadedModel
from harness.tasks import contract, field_tables
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.hub_files import data_file
from harness.tasks.longbench.data import suffix_start
from metrics.longbench_v2 import GROUPS, SCORERS, counted, judge, table

log = logging.getLogger(__name__)

PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
GRID_KEYS = ("limit", "lengths")
DATA_FILE = "data.json"
FIELDS = ("_id", "domain", "sub_domain", "difficulty", "length", "question", "choice_A", "choice_B", "choice_C",
          "choice_D", "answer", "context")
LENGTHS = ("short", "medium", "long")
MAX_NEW_TOKENS = 128  # pred.py, without chain of thought
DOMAINS = ("Single-Document QA", "Multi-Document QA", "Long In-context Learning", "Long-dialogue History Understanding",
           "Code Repository Understanding", "Long Structured Data Understanding")


def template() -> str:
    return resources.files("metrics").joinpath("data", "longbench_v2", "0shot.txt").read_text(encoding="utf-8")


def fill(text: str, row: dict, context: str) -> str:
    """pred.py's replacements, in its order (so a `$Q$` inside the document is replaced as it is there)."""
    return (text.replace("$DOC$", context.strip()).replace("$Q$", row["question"].strip())
            .replace("$C_A$", row["choice_A"].strip()).replace("$C_B$", row["choice_B"].strip())
            .replace("$C_C$", row["choice_C"].strip()).replace("$C_D$", row["choice_D"].strip()))


def truncate(prompt: str, tokenizer, max_len: int) -> tuple[str, int, bool]:
    """pred.py: encode (special tokens included); if longer than max_len keep ids[:max_len//2] + ids[-max_len//2:]
    (for an odd max_len the end keeps one token more) and decode the joined ids without special tokens."""
    ids = tokenizer.encode(prompt)
    if len(ids) <= max_len:
        return prompt, len(ids), False
    return tokenizer.decode(ids[: max_len // 2] + ids[-max_len // 2:], skip_special_tokens=True), len(ids), True


def check_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise HarnessError(f"{where}: expected a JSON object per question, got {type(row).__name__}")
    missing = [f for f in FIELDS if f not in row]
    require(not missing, f"{where}: missing field(s) {', '.join(missing)} (LongBench-v2 data.json rows have {', '.join(FIELDS)})")
    require(row["answer"] in ("A", "B", "C", "D"), f"{where}: answer {row['answer']!r} is not one of A, B, C, D")
    return row


@lru_cache(maxsize=4)
def _read(path: str, _version: tuple) -> tuple[dict, ...]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HarnessError(f"{path} is not the official LongBench-v2 data.json (a JSON list): {exc}") from None
    require(isinstance(data, list) and data, f"{path}: expected a non-empty JSON list of questions")
    return tuple(check_row(r, f"{path} item {i}") for i, r in enumerate(data))


def load_rows(task: DictConfig) -> tuple[list[dict], str]:
    """(selected rows in file order, origin). `task.lengths` keeps those length classes, `task.limit` the first N."""
    path, origin = data_file(task, DATA_FILE, "LongBench-v2")
    st = path.stat()
    rows = [r for r in _read(str(path), (st.st_mtime_ns, st.st_size)) if not task.get("lengths") or r["length"] in task.lengths]
    return rows[: task.get("limit") or None], origin


def validate(task: DictConfig) -> None:
    require(task.get("scorer", "official") in SCORERS, f"task.scorer={task.get('scorer')!r} is not one of {', '.join(SCORERS)}")
    limit = task.get("limit")
    require(limit is None or (isinstance(limit, int) and limit > 0), f"task.limit={limit!r} must be a positive item count or null")
    for length in task.get("lengths") or []:
        require(length in LENGTHS, f"task.lengths: {length!r} is not one of {', '.join(LENGTHS)}")
    require(isinstance(task.get("max_length"), int) and task.max_length > 1,
            f"task.max_length={task.get('max_length')!r}: the truncation budget in tokens (official: 120000)")
    require(isinstance(task.get("compensated", False), bool), "task.compensated must be true or false")
    rows, _ = load_rows(task)
    require(rows, "no LongBench-v2 item selected (task.lengths / task.limit)")


class LongBenchV2(GenerationTask):
    log_name, key_fields, noun = "longbench_v2", ("index",), "items"
    csv_columns = ("index", "_id", "domain", "difficulty", "length", "answer", "pred", "judge", "counted", "score", "protocol",
                   "prompt_tokens", "question_start", "truncated", "question_kept", "new_tokens", "stopped_by", "response")

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        self.rows, self.origin = load_rows(self.task)
        self.scorer, self.compensated = str(self.task.get("scorer", "official")), bool(self.task.get("compensated", False))
        self.budget = self.capped_budget(self.task.max_length)
        self.template = template()
        self.decode = dict(max_new_tokens=MAX_NEW_TOKENS, eos_token_ids=loaded.eos_token_ids)

    def items(self) -> list[tuple]:
        return [(i,) for i in range(len(self.rows))]

    def build(self, item) -> Built:
        row = self.rows[item[0]]
        text, raw_tokens, truncated = truncate(fill(self.template, row, row["context"]), self.loaded.tokenizer, self.budget)
        ids = list(self.loaded.encode(self.loaded.format_chat([{"role": "user", "content": text}])))
        suffix = fill(self.template.split("$DOC$", 1)[1], row, "")
        split = suffix_start(ids, self.loaded.tokenizer, suffix)
        spans = {"question": (split, len(ids))} if split < len(ids) else {}
        return Built(Prompt(ids, split, spans), data={"raw_prompt_tokens": raw_tokens, "truncated": truncated, "text": text})

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        row = self.rows[item[0]]
        pred, correct = judge(text, row["answer"], self.scorer)
        kept = counted(text, self.scorer)
        # the item's share of result.py's accuracy: 1/0 (0.25 unanswered when compensated); None: left out (pred.py skips '')
        score = (0.25 if self.compensated and pred is None else float(correct)) if kept else None
        out = {"index": item[0], **{k: row[k] for k in ("_id", "domain", "sub_domain", "difficulty", "length", "answer")},
               "response": text, "pred": pred, "judge": correct, "counted": kept, "score": score,
               "raw_prompt_tokens": built.data["raw_prompt_tokens"], "truncated": built.data["truncated"]}
        if self.task.get("log_prompts"):
            out["prompt"] = built.data["text"]
        return out

    def summarize(self, rows: list[dict]) -> dict:
        kept = [r for r in rows if r["counted"]]
        scores = table(kept, self.compensated)
        domains = {d: table([r for r in kept if r["domain"] == d], self.compensated)["Overall"] for d in DOMAINS}
        return {"score_name": "accuracy", "main_score": scores["Overall"], "scores": scores, "domains": domains,
                "items": len(rows), "counted": len(kept), "dropped_empty": len(rows) - len(kept),
                "scorer": self.scorer, "compensated": self.compensated, "data": self.origin,
                "truncation_budget": self.budget, "official_truncation_budget": self.official_budget,
                "truncated_items": sum(bool(r["truncated"]) for r in rows), "max_new_tokens": MAX_NEW_TOKENS,
                "sampling": "greedy (official: temperature 0.1)", "template": "0shot"}


def groups(r: dict) -> tuple[str, ...]:
    return ("Overall", "Easy" if r["difficulty"] == "easy" else "Hard", {"short": "Short", "medium": "Medium"}.get(r["length"], "Long"))


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    task = LongBenchV2(cfg, loaded)
    results = contract.run(task, settings, progress=progress)
    rows = {tag: res["rows"] for tag, res in results.items()}
    reference = field_tables.full_tag(settings)
    deltas = field_tables.paired(rows, reference, lambda r: (r["index"], r["_id"]), lambda r: r["score"], groups, list(GROUPS)) if reference else {}
    scores = {tag: res["summary"]["scores"] for tag, res in results.items()}
    notes = [f"{loaded.name}, {task.protocol}, scorer={task.scorer}, compensated={task.compensated}, truncation budget "
             f"{task.budget} tokens (official {task.official_budget}), greedy, {MAX_NEW_TOKENS} new tokens. Accuracy (%), "
             "result.py's rounding; an output that is exactly '' is left out (official) unless scorer=corrected."]
    text = field_tables.markdown("LongBench-v2", list(GROUPS), scores, deltas, reference, notes)
    for s in settings:
        results[s.tag]["summary"]["paired_vs_full"] = deltas.get(s.tag, {})
    if settings:
        path = field_tables.write(Path(settings[0].run_dir.path).parent, "longbench_v2", text)
        log.info("LongBench-v2 table: %s", path)
    return results
