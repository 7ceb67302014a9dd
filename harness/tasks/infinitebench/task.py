"""InfiniteBench (OpenBMB/InfiniteBench, src/eval_utils.py + eval_yarn_mistral.py + compute_scores.py): 12 tasks.

The model input is the authors' open-model one: the `yarn_mistral_templates` prompt of the task (the set they use
for YaRN-Mistral, Yi-200K and ChatGLM3; metrics/data/infinitebench) filled as `create_prompt` fills it (code_run:
the first `func_N(x)` call of the input; math_find: "What is <the ... > in the following list?" from the input;
the choice tasks: options A-D); middle truncation on its tokens (special tokens included) to `task.max_length`
(TRUNCATE_LEN = 128 * 1024) keeping `ids[:L//2] + ids[-(L//2):]`, decoded without special tokens; the text is
tokenized raw (`task.chat=false`, as eval_yarn_mistral.py; `true` wraps it in the model's chat format). Greedy, at
most DATA_NAME_TO_MAX_NEW_TOKENS[task] new tokens (math_calc: 30000; `task.max_new_tokens` caps every task, a named
departure), stopped at EOS. Scores: metrics/infinitebench.py (`task.scorer`), per task 100 x the mean.

Protocols: the part of the template after `{context}` (the question, options, answer cue) is what a query-agnostic
run prefills on top of the compressed context; what the template puts before it (code_run's function name,
math_find's "What is the largest number ...") stays in the compressed part, where the authors put it.
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.generation.prompt import Prompt
from harness.models import LoadedModel
from harness.tasks import contract, field_tables
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.hub_files import jsonl_rows
from harness.tasks.longbench.data import suffix_start
from metrics.infinitebench import DISPLAY, README_ORDER, SCORERS, TASKS, OfficialScorerError, get_answer, score_one

log = logging.getLogger(__name__)

PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
GRID_KEYS = ("tasks", "limit")
TRUNCATE_LEN = 128 * 1024
MAX_NEW_TOKENS = {"passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_sum_eng": 1200, "longbook_choice_eng": 40,
                  "longbook_qa_eng": 40, "longbook_qa_chn": 40, "longdialogue_qa_eng": 40, "math_find": 3, "math_calc": 30000,
                  "code_run": 5, "code_debug": 5}
CHOICE_TASKS = ("code_debug", "longbook_choice_eng")


@lru_cache(maxsize=1)
def templates() -> dict[str, str]:
    return json.loads(resources.files("metrics").joinpath("data", "infinitebench", "yarn_mistral_templates.json").read_text(encoding="utf-8"))


def fields(row: dict, task: str) -> dict:
    """create_prompt's values for the template of `task` (its yarn-mistral branch)."""
    out = {"context": row["context"], "input": row.get("input", "")}
    if task in CHOICE_TASKS:
        out.update({f"OPTION_{c}": row["options"][i] for i, c in enumerate("ABCD")})
    if task in ("longbook_choice_eng", "longbook_qa_eng", "longbook_qa_chn"):
        out["question"] = row["input"]
    if task == "code_run":
        calls = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", row["input"])
        require(calls, f"InfiniteBench code_run item {row.get('id')}: no func_N(x) call in its input")
        out.update(func_call=calls[0], func=calls[0].split("(")[0])
    if task == "math_find":
        found = re.findall(r"The .+ of", row["input"])
        require(found, f"InfiniteBench math_find item {row.get('id')}: no 'The ... of' in its input")
        out["prefix"] = f"What is {found[0].lower()[:-3]} in the following list?"
    return out


def truncate(prompt: str, tokenizer, max_len: int) -> tuple[str, int, bool]:
    """truncate_by_tokens: encode with special tokens; over max_len keep ids[:L//2] + ids[-(L//2):]; decode."""
    ids = tokenizer.encode(prompt)
    if len(ids) <= max_len:
        return prompt, len(ids), False
    half = max_len // 2
    return tokenizer.decode(ids[:half] + ids[-half:], skip_special_tokens=True), len(ids), True


def check_row(row, where: str, task: str) -> dict:
    require(isinstance(row, dict), f"{where}: expected a JSON object")
    need = ("context", "answer") + (("input",) if task not in ("longbook_sum_eng", "math_calc", "longdialogue_qa_eng") else ()) \
        + (("options",) if task in CHOICE_TASKS else ())
    missing = [f for f in need if f not in row]
    require(not missing, f"{where}: missing field(s) {', '.join(missing)}")
    try:
        get_answer(row, task)
    except ValueError as exc:
        raise HarnessError(f"{where}: {exc}") from None
    return row


def load_rows(task_cfg: DictConfig, task: str) -> tuple[list[dict], str]:
    return jsonl_rows(task_cfg, f"{task}.jsonl", "InfiniteBench", check_row, task)


def task_names(task_cfg: DictConfig) -> list[str]:
    return list(README_ORDER) if task_cfg.get("tasks") is None else [str(t) for t in task_cfg.tasks]


def validate(task_cfg: DictConfig) -> None:
    names = task_names(task_cfg)
    require(names, "task.tasks is empty; give InfiniteBench task names, e.g. task.tasks=[passkey,kv_retrieval]")
    for n in names:
        require(n in TASKS, f"task.tasks: unknown InfiniteBench task {n!r}; known: {', '.join(TASKS)}")
    require(len(set(names)) == len(names), "task.tasks lists a task twice")
    require(task_cfg.get("scorer", "official") in SCORERS, f"task.scorer={task_cfg.get('scorer')!r} is not one of {', '.join(SCORERS)}")
    limit, cap = task_cfg.get("limit"), task_cfg.get("max_new_tokens")
    require(limit is None or (isinstance(limit, int) and limit > 0), f"task.limit={limit!r} must be a positive item count or null")
    require(cap is None or (isinstance(cap, int) and cap > 0), f"task.max_new_tokens={cap!r} must be a positive token count or null")
    require(isinstance(task_cfg.get("max_length"), int) and task_cfg.max_length > 1,
            f"task.max_length={task_cfg.get('max_length')!r}: the truncation budget in tokens (official: 131072)")
    for n in names:
        load_rows(task_cfg, n)


class InfiniteBench(GenerationTask):
    log_name, key_fields, noun = "infinitebench", ("task", "index"), "items"
    csv_columns = ("task", "index", "id", "score", "score_error", "protocol", "prompt_tokens", "question_start", "truncated",
                   "question_kept", "new_tokens", "stopped_by", "prediction")

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        self.names = task_names(self.task)
        loaded_rows = {n: load_rows(self.task, n) for n in self.names}
        self.rows = {n: rows for n, (rows, _) in loaded_rows.items()}
        self.origin = next(iter(loaded_rows.values()))[1]
        self.scorer, self.chat = str(self.task.get("scorer", "official")), bool(self.task.get("chat", False))
        self.budget = self.capped_budget(self.task.max_length)
        self.cap = self.task.get("max_new_tokens")
        self.decode = dict(eos_token_ids=loaded.eos_token_ids)

    def new_tokens(self, name: str) -> int:
        return min(MAX_NEW_TOKENS[name], int(self.cap)) if self.cap else MAX_NEW_TOKENS[name]

    def items(self) -> list[tuple]:
        return [(n, i) for n in self.names for i in range(len(self.rows[n]))]

    def build(self, item) -> Built:
        name, index = item
        row, template = self.rows[name][index], templates()[name]
        values = fields(row, name)
        text, raw_tokens, truncated = truncate(template.format(**values), self.loaded.tokenizer, self.budget)
        if self.chat:
            ids = list(self.loaded.encode(self.loaded.format_chat([{"role": "user", "content": text}])))
        else:
            ids = list(self.loaded.tokenizer(text)["input_ids"])
        split = suffix_start(ids, self.loaded.tokenizer, template.split("{context}", 1)[1].format(**values))
        spans = {"question": (split, len(ids))} if split < len(ids) else {}
        return Built(Prompt(ids, split, spans), decode={"max_new_tokens": self.new_tokens(name)},
                     data={"raw_prompt_tokens": raw_tokens, "truncated": truncated, "text": text})

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        name, index = item
        row = self.rows[name][index]
        label = get_answer(row, name)
        out = {"task": name, "index": index, "id": row.get("id", index), "prediction": text, "ground_truth": label,
               "raw_prompt_tokens": built.data["raw_prompt_tokens"], "truncated": built.data["truncated"],
               "max_new_tokens": self.new_tokens(name)}
        try:
            out["score"], out["score_error"] = score_one(name, text, label, self.scorer), None
        except OfficialScorerError as exc:  # the official compute_scores.py stops here: the task gets no score
            out["score"], out["score_error"] = None, str(exc)
        if self.task.get("log_prompts"):
            out["prompt"] = built.data["text"]
        return out

    def summarize(self, rows: list[dict]) -> dict:
        scores, errors = {}, {}
        for n in self.names:
            mine = [r for r in rows if r["task"] == n]
            bad = [r for r in mine if r["score_error"]]
            if bad:
                errors[n] = f"{len(bad)} item(s): {bad[0]['score_error']}"
            scores[n] = round(100 * sum(r["score"] for r in mine) / len(mine), 2) if mine and not bad else None
        for n, why in errors.items():
            log.warning("infinitebench %s: no score, the official scorer raises on %s (task.scorer=corrected scores it)", n, why)
        return {"score_name": "infinitebench", "main_score": None, "scores": scores, "scorer_errors": errors,
                "items": {n: sum(r["task"] == n for r in rows) for n in self.names}, "scorer": self.scorer,
                "chat": self.chat, "template": "yarn-mistral", "data": self.origin, "truncation_budget": self.budget,
                "official_truncation_budget": self.official_budget, "max_new_tokens_cap": self.cap,
                "truncated_items": sum(bool(r["truncated"]) for r in rows), "sampling": "greedy (as eval_yarn_mistral.py)"}


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    task = InfiniteBench(cfg, loaded)
    results = contract.run(task, settings, progress=progress)
    columns = [DISPLAY[n] for n in README_ORDER if n in task.names]
    rows = {tag: res["rows"] for tag, res in results.items()}
    reference = field_tables.full_tag(settings)
    deltas = (field_tables.paired(rows, reference, lambda r: (r["task"], r["index"]), lambda r: r["score"],
                                  lambda r: (DISPLAY[r["task"]],), columns) if reference else {})
    scores = {tag: {DISPLAY[n]: v for n, v in res["summary"]["scores"].items()} for tag, res in results.items()}
    notes = [f"{loaded.name}, {task.protocol}, scorer={task.scorer}, yarn-mistral prompts, chat={task.chat}, truncation "
             f"budget {task.budget} tokens (official {task.official_budget}), greedy"
             + (f", new tokens capped at {task.cap}" if task.cap else ", official new tokens per task") + ". Score (%) per task "
             "(README's names and order); '–': not run, or the official scorer raised (see the summary's scorer_errors)."]
    for s in settings:
        results[s.tag]["summary"]["paired_vs_full"] = deltas.get(s.tag, {})
    if settings:
        text = field_tables.markdown("InfiniteBench", columns, scores, deltas, reference, notes, digits=2)
        log.info("InfiniteBench table: %s", field_tables.write(Path(settings[0].run_dir.path).parent, "infinitebench", text))
    return results
