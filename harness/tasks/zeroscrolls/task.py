"""ZeroSCROLLS (tau-nlp/zero_scrolls, Shaham et al. 2023): 10 long-text tasks, scored by the official hub metric.

Data: the hub dataset `tau/zero_scrolls` stores one `<task>.zip` per task holding `<split>.jsonl` (test: the leaderboard's
hidden-answer split; validation: ~20 examples a task with their outputs). Each row: `id`, `pid`, `input` (the whole
zero-shot prompt: instruction, document, query, answer cue), `output`, `document_start_index`, `document_end_index`,
`query_start_index`, `query_end_index`, `truncation_seperator`. Rows sharing an `id` are one item whose references are
their outputs (the official verify/evaluate scripts' drop_duplicates_in_input).

The model input is experiments/hf/run_hf_model.py's `process_model_input`: the input tokenized; over the budget, the
text before `query_start_index` is tokenized and cut to budget - len(tokens of truncation_seperator + the text from
query_start_index), and those tokens follow it. Budget: `task.max_input_tokens` (run_hf_model's 8192), capped at
`model.prompt_max_length`. Raw text, no chat template (as run_hf_model). Named difference: the official code was
written for T5, whose tokenizer ends every piece with an EOS; here the pieces are tokenized without special tokens
and the model's own (its BOS) are added once in front. Greedy, at most the per-task generation budget of the authors'
API runner (experiments/api/api.py `dataset_to_leave_tokens_for_generations`, also kvpress's), stopped at EOS.

Protocols: the text from `query_start_index` (query and answer cue; with truncation, the separator and them) is what a
query-agnostic run prefills on top of the compressed document.

Scoring: the official metric from the user's copy (`task.scorer_dir`, harness/tasks/zeroscrolls/scorer.py): a task's
score is its `zero_scrolls_score` over all its items; each record also carries the score of its one item (the paired
intervals against full). Items without outputs (the test split) are not scored: the predictions are the run's product
(the leaderboard's submission), and no scorer is needed.
"""

from __future__ import annotations

import json
import logging
import zipfile
from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.generation.prompt import Prompt
from harness.models import LoadedModel
from harness.tasks import contract, field_tables
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.hub_files import data_file
from harness.tasks.longbench.data import suffix_start
from harness.tasks.zeroscrolls.names import DISPLAY, MAX_NEW_TOKENS, TASKS
from harness.tasks.zeroscrolls.scorer import OfficialScorer

log = logging.getLogger(__name__)

PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
GRID_KEYS = ("tasks", "limit", "split")
SPLITS = ("validation", "test")
FIELDS = ("id", "input", "query_start_index", "truncation_seperator")


def task_names(task_cfg: DictConfig) -> list[str]:
    return list(TASKS) if task_cfg.get("tasks") is None else [str(t) for t in task_cfg.tasks]


@lru_cache(maxsize=32)
def _read(path: str, split: str, _version: tuple) -> tuple[dict, ...]:
    """The `<split>.jsonl` member of a task's zip (at any folder depth), rows in file order."""
    try:
        with zipfile.ZipFile(path) as z:
            members = [n for n in z.namelist() if n.rsplit("/", 1)[-1] == f"{split}.jsonl"]
            require(members, f"{path} holds no {split}.jsonl (members: {', '.join(z.namelist()[:6])})")
            text = z.read(members[0]).decode("utf-8")
    except zipfile.BadZipFile:
        raise HarnessError(f"{path} is not a zip file; task.data_dir must hold the hub's <task>.zip files") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HarnessError(f"{path}:{split}.jsonl:{number}: not valid JSON ({exc.msg})") from None
        missing = [f for f in FIELDS if not isinstance(row, dict) or f not in row]
        require(not missing, f"{path}:{split}.jsonl:{number}: missing field(s) {', '.join(missing)}")
        require(0 <= int(row["query_start_index"]) <= len(row["input"]), f"{path}:{split}.jsonl:{number}: query_start_index "
                f"{row['query_start_index']} is outside the input ({len(row['input'])} characters)")
        rows.append(row)
    require(rows, f"{path}: {split}.jsonl has no rows")
    return tuple(rows)


def load_items(task_cfg: DictConfig, name: str) -> tuple[list[dict], str]:
    """The task's items: one per `id` (first row's input), references = the outputs of its rows; first `limit`."""
    path, origin = data_file(task_cfg, f"{name}.zip", "ZeroSCROLLS")
    st = path.stat()
    items: dict[str, dict] = {}
    for row in _read(str(path), str(task_cfg.get("split") or "validation"), (st.st_mtime_ns, st.st_size)):
        item = items.setdefault(str(row["id"]), {**row, "references": []})
        if row.get("output") is not None:
            item["references"].append(str(row["output"]))
    return list(items.values())[: task_cfg.get("limit") or None], origin


def validate(task_cfg: DictConfig) -> None:
    names = task_names(task_cfg)
    require(names, "task.tasks is empty; give ZeroSCROLLS task names, e.g. task.tasks=[qasper,quality]")
    for n in names:
        require(n in TASKS, f"task.tasks: unknown ZeroSCROLLS task {n!r}; known: {', '.join(TASKS)}")
    require(len(set(names)) == len(names), "task.tasks lists a task twice")
    require(str(task_cfg.get("split") or "validation") in SPLITS, f"task.split={task_cfg.get('split')!r} is not one of {', '.join(SPLITS)}")
    limit, cap, budget = task_cfg.get("limit"), task_cfg.get("max_new_tokens"), task_cfg.get("max_input_tokens")
    require(limit is None or (isinstance(limit, int) and limit > 0), f"task.limit={limit!r} must be a positive item count or null")
    require(cap is None or (isinstance(cap, int) and cap > 0), f"task.max_new_tokens={cap!r} must be a positive token count or null")
    require(isinstance(budget, int) and budget > 1, f"task.max_input_tokens={budget!r}: the input budget in tokens (official: 8192)")
    scored = False
    for n in names:
        items, _ = load_items(task_cfg, n)
        scored = scored or any(i["references"] for i in items)
    if scored:  # outputs to score against: the official scorer must be there (refused in one line without it)
        OfficialScorer(task_cfg.get("scorer_dir"))


class ZeroScrolls(GenerationTask):
    log_name, key_fields, noun = "zeroscrolls", ("task", "index"), "items"
    csv_columns = ("task", "index", "id", "score", "protocol", "prompt_tokens", "question_start", "truncated", "question_kept",
                   "new_tokens", "stopped_by", "prediction")

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        self.names = task_names(self.task)
        loaded_items = {n: load_items(self.task, n) for n in self.names}
        self.items_by_task = {n: items for n, (items, _) in loaded_items.items()}
        self.origin = next(iter(loaded_items.values()))[1]
        self.split = str(self.task.get("split") or "validation")
        scored = any(i["references"] for items in self.items_by_task.values() for i in items)
        self.scorer = OfficialScorer(self.task.get("scorer_dir")) if scored else None
        self.budget = self.capped_budget(self.task.max_input_tokens)
        self.cap = self.task.get("max_new_tokens")
        self.decode = dict(eos_token_ids=loaded.eos_token_ids)

    def new_tokens(self, name: str) -> int:
        return min(MAX_NEW_TOKENS[name], int(self.cap)) if self.cap else MAX_NEW_TOKENS[name]

    def items(self) -> list[tuple]:
        return [(n, i) for n in self.names for i in range(len(self.items_by_task[n]))]

    def build(self, item) -> Built:
        name, index = item
        row = self.items_by_task[name][index]
        ids, split, raw, truncated = model_input(self.loaded.tokenizer, row, self.budget)
        spans = {"question": (split, len(ids))} if split < len(ids) else {}
        return Built(Prompt(ids, split, spans), decode={"max_new_tokens": self.new_tokens(name)},
                     data={"raw_prompt_tokens": raw, "truncated": truncated})

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        name, index = item
        row = self.items_by_task[name][index]
        refs = row["references"]
        out = {"task": name, "index": index, "id": row["id"], "prediction": text, "references": refs,
               "score": self.scorer.score(name, [text], [refs]) / 100 if refs and self.scorer else None,
               "raw_prompt_tokens": built.data["raw_prompt_tokens"], "truncated": built.data["truncated"],
               "max_new_tokens": self.new_tokens(name)}
        if self.task.get("log_prompts"):
            out["prompt"] = row["input"]
        return out

    def summarize(self, rows: list[dict]) -> dict:
        scores, official = {}, {}
        for n in self.names:
            mine = sorted((r for r in rows if r["task"] == n and r["references"]), key=lambda r: r["index"])
            if mine and self.scorer:  # the official corpus score of the task (ROUGE: its geometric mean over the task)
                result = self.scorer.compute(n, [r["prediction"] for r in mine], [r["references"] for r in mine])
                official[n] = {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                scores[n] = float(result["zero_scrolls_score"])
            else:
                scores[n] = None
        done = [v for v in scores.values() if v is not None]
        return {"score_name": "zero_scrolls_score", "main_score": round(sum(done) / len(done), 4) if done and len(done) == len(scores) else None,
                "scores": scores, "official": official, "items": {n: sum(r["task"] == n for r in rows) for n in self.names},
                "split": self.split, "data": self.origin, "scorer": str(self.scorer.path) if self.scorer else None,
                "truncation_budget": self.budget, "official_truncation_budget": self.official_budget, "max_new_tokens_cap": self.cap,
                "truncated_items": sum(bool(r["truncated"]) for r in rows), "sampling": "greedy (as run_hf_model.py)"}


def model_input(tokenizer, row: dict, budget: int) -> tuple[list[int], int, int, bool]:
    """(ids, index where the text from query_start_index begins, the whole input's token count, truncated?)."""
    text, q = str(row["input"]), int(row["query_start_index"])
    full = list(tokenizer(text)["input_ids"])
    if len(full) <= budget:
        return full, suffix_start(full, tokenizer, text[q:]), len(full), False
    tail = list(tokenizer(str(row["truncation_seperator"]) + text[q:], add_special_tokens=False)["input_ids"])
    require(len(tail) < budget, f"ZeroSCROLLS item {row.get('id')}: its query alone ({len(tail)} tokens) exceeds the input "
            f"budget of {budget} tokens")
    head = list(tokenizer(text[:q])["input_ids"])[: budget - len(tail)]
    return head + tail, len(head), len(full), True


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    task = ZeroScrolls(cfg, loaded)
    results = contract.run(task, settings, progress=progress)
    columns = [DISPLAY[n] for n in TASKS if n in task.names] + ["Avg."]
    rows = {tag: res["rows"] for tag, res in results.items()}
    reference = field_tables.full_tag(settings)
    deltas = (field_tables.paired(rows, reference, lambda r: (r["task"], r["index"]), lambda r: r["score"],
                                  lambda r: (DISPLAY[r["task"]],), columns) if reference else {})
    scores = {}
    for tag, res in results.items():
        s = res["summary"]
        scores[tag] = {**{DISPLAY[n]: v for n, v in s["scores"].items()}, "Avg.": s["main_score"]}
    notes = [f"{loaded.name}, {task.protocol}, {task.split} split, scorer {task.scorer.path if task.scorer else 'none (no outputs)'} (task.scorer_dir), "
             f"input budget {task.budget} tokens (official {task.official_budget}), greedy"
             + (f", new tokens capped at {task.cap}" if task.cap else ", the authors' new tokens per task")
             + ". zero_scrolls_score per task (the leaderboard's abbreviations and order), Avg. = their mean; the paired "
             "differences use each item's own score."]
    for s in settings:
        results[s.tag]["summary"]["paired_vs_full"] = deltas.get(s.tag, {})
    if settings:
        text = field_tables.markdown("ZeroSCROLLS", columns, scores, deltas, reference, notes, digits=2)
        log.info("ZeroSCROLLS table: %s", field_tables.write(Path(settings[0].run_dir.path).parent, "zeroscrolls", text))
    return results
