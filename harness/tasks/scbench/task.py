"""SCBench multi-request mode (microsoft/MInference scbench: run_scbench.py --same_context_different_query,
eval_utils.create_scdq_prompt and GreedySearch.test_scdq): every query of an item asked over ONE compressed context.

The context prompt is the task's scdq template (metrics/data/scbench/scdq_templates.json) rendered in the model's chat
template up to the user message's end (the authors split the rendered text at a delimiter appended to the message);
each query is the text after that delimiter in a chat of an empty system message and the delimiter + the query (the
user turn's closing and the assistant header follow it). Context: `tok.encode(text)` (special tokens included, the
template's own BOS text too, as the authors) middle-truncated to `task.max_seq_length - max_new_tokens * turns - 1000`
tokens (ids[:L//2] + ids[-(L//2):]); queries: `encode(query, add_special_tokens=False)`. The context is prefilled and
compressed once; every query is prefilled on top of it, uncompressed, and answered greedily with at most the task's
DATA_NAME_TO_MAX_NEW_TOKENS, the query's tokens and answer discarded before the next query (update_global_past_kv=False):
the harness's query-agnostic many-questions protocol (docs/many_questions.md), so `task.query_aware` must be false.
Answers are decoded with their special tokens (the authors decode without skipping them) and scored per turn by
metrics/scbench.py.

Not provided (issue 36, see docs/field_benchmarks.md): the multi-turn mode (the authors feed each turn the previous
turn's GOLD answer, which the many-questions machinery cannot place yet), scbench_repoqa (its scorer parses code with
tree-sitter), and the mixed tasks scbench_summary_with_needles / scbench_repoqa_and_kv.
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
from harness.models import LoadedModel
from harness.tasks import contract, field_tables
from harness.tasks.common import Prompt, Question
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.hub_files import data_file
from metrics.scbench import TASKS, score_one

log = logging.getLogger(__name__)

PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
GRID_KEYS = ("tasks", "limit", "max_turns")
DELIMITER = "[SEPSEPSEP]"
SCORED = tuple(t for t in TASKS if t != "scbench_passkey")  # passkey is only a part of summary_with_needles


@lru_cache(maxsize=1)
def templates() -> dict:
    return json.loads(resources.files("metrics").joinpath("data", "scbench", "scdq_templates.json").read_text(encoding="utf-8"))


def ground_truth(turn: dict, task: str):
    """eval_utils.get_ground_truth: choice [answer, letter], qa_eng [answer], else the answer as stored."""
    if task == "scbench_choice_eng":
        return [turn["answer"], "ABCD"[turn["options"].index(turn["answer"])]]
    if task == "scbench_qa_eng":
        return [turn["answer"]]
    return turn["answer"]


def texts(row: dict, task: str) -> tuple[str, list[str]]:
    """create_scdq_prompt before the chat template: (context prompt, query prompts)."""
    context_t, query_t = templates()["context_templates"][task], templates()["query_templates"][task]
    turns = row["multi_turns"]
    if isinstance(context_t, list):  # choice / qa: (context part, question part)
        queries = [context_t[1].format(question=t["input"], **{f"OPTION_{c}": (t.get("options") or ["", "", "", ""])[i]
                                                              for i, c in enumerate("ABCD")}) for t in turns]
        return context_t[0].format(context=row["context"]), queries
    if task == "scbench_mf":
        queries = []
        for t in turns:
            found = re.findall(r"The .+ is", t["input"])
            require(found, f"SCBench scbench_mf item {row.get('id')}: no 'The ... is' in a turn's input")
            queries.append(query_t.format(prefix=f"What is {found[0].lower()[:-3]}?", input=t["input"]))
        return context_t.format(prefix=turns[0]["input"], context=row["context"]), queries
    return context_t.format(context=row.get("context", row.get("input"))), [t["input"] for t in turns]


def chat_parts(tokenizer, context: str, queries: list[str], use_chat_template: bool) -> tuple[str, list[str]]:
    if not use_chat_template:
        return context, queries
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": context + DELIMITER}], add_generation_prompt=True, tokenize=False)
    return rendered.split(DELIMITER)[0], [
        tokenizer.apply_chat_template([{"role": "system", "content": ""}, {"role": "user", "content": DELIMITER + q}],
                                      add_generation_prompt=True, tokenize=False).split(DELIMITER)[1] for q in queries]


def truncate_ids(ids: list[int], max_length: int) -> list[int]:
    if max_length < 0 or len(ids) <= max_length:
        return ids
    half = max_length // 2
    return ids[:half] + ids[-half:]


def check_row(row, task: str, where: str) -> dict:
    require(isinstance(row, dict) and isinstance(row.get("multi_turns"), list) and row["multi_turns"],
            f"{where}: expected an object with a non-empty `multi_turns` list (SCBench's format)")
    require("context" in row or "input" in row, f"{where}: missing field context")
    for k, t in enumerate(row["multi_turns"]):
        require(isinstance(t, dict) and "input" in t and "answer" in t, f"{where}: multi_turns[{k}] needs input and answer")
        if task == "scbench_choice_eng":
            require(t["answer"] in (t.get("options") or []), f"{where}: multi_turns[{k}] answer is not one of its options")
    return row


@lru_cache(maxsize=32)
def _read(path: str, task: str, _version: tuple) -> tuple[dict, ...]:
    p = Path(path)
    if p.suffix == ".parquet":
        import pandas as pd

        records = json.loads(pd.read_parquet(p).to_json(orient="records", force_ascii=False))
    else:
        records = []
        for number, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise HarnessError(f"{p}:{number}: not valid JSON ({exc.msg})") from None
    require(records, f"{p} has no rows")
    return tuple(check_row(r, task, f"{p} item {i}") for i, r in enumerate(records))


def load_rows(task_cfg: DictConfig, task: str) -> tuple[list[dict], str]:
    """`<task>.jsonl` (eval_utils.DATA_NAME_TO_PATH) from task.data_dir or the hub."""
    path, origin = data_file(task_cfg, f"{task}.jsonl", "SCBench")
    st = path.stat()
    rows = list(_read(str(path), task, (st.st_mtime_ns, st.st_size)))[: task_cfg.get("limit") or None]
    turns = task_cfg.get("max_turns")
    return ([{**r, "multi_turns": r["multi_turns"][:turns]} for r in rows] if turns else rows), origin


def task_names(task_cfg: DictConfig) -> list[str]:
    return list(SCORED) if task_cfg.get("tasks") is None else [str(t) for t in task_cfg.tasks]


def validate(task_cfg: DictConfig) -> None:
    names = task_names(task_cfg)
    require(names, "task.tasks is empty")
    for n in names:
        require(n in SCORED, f"task.tasks: {n!r} is not an SCBench task this harness runs ({', '.join(SCORED)}); "
                             "scbench_repoqa and the mixed tasks are not implemented")
    require(task_cfg.get("mode", "multi_request") == "multi_request",
            f"task.mode={task_cfg.get('mode')!r}: only multi_request runs here; SCBench's multi-turn mode feeds each turn the "
            "previous turn's gold answer, which is not implemented (docs/field_benchmarks.md)")
    require(task_cfg.get("query_aware") is False,
            "task=scbench asks every query over one compressed context: set task.query_aware=false (the multi-request mode)")
    turns, limit = task_cfg.get("max_turns"), task_cfg.get("limit")
    require(turns is None or (isinstance(turns, int) and turns > 0), f"task.max_turns={turns!r} must be a positive count or null")
    require(limit is None or (isinstance(limit, int) and limit > 0), f"task.limit={limit!r} must be a positive item count or null")
    for n in names:
        load_rows(task_cfg, n)


class SCBench(GenerationTask):
    log_name, key_fields, noun = "scbench", ("task", "index"), "items"
    csv_columns = ("task", "index", "question_index", "score", "protocol", "prompt_tokens", "question_start", "truncated",
                   "new_tokens", "stopped_by", "prediction")

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        self.multi_question = True
        self.names = task_names(self.task)
        loaded_rows = {n: load_rows(self.task, n) for n in self.names}
        self.rows = {n: r for n, (r, _) in loaded_rows.items()}
        self.origin = next(iter(loaded_rows.values()))[1]
        self.chat = bool(self.task.get("use_chat_template", True))
        self.max_seq_length = int(self.task.max_seq_length)
        self.decode = dict(eos_token_ids=loaded.eos_token_ids)

    def items(self) -> list[tuple]:
        return [(n, i) for n in self.names for i in range(len(self.rows[n]))]

    def questions(self, key) -> int:
        return len(self.rows[key[0]][key[1]]["multi_turns"])

    def budget(self, name: str, turns: int) -> int:
        """run_scbench.py: max_seq_length - max_new_tokens * turns, minus 1000 in the multi-request mode; capped at the model."""
        official = self.max_seq_length - templates()["max_new_tokens"][name] * turns - 1000
        own = self.loaded.prompt_max_length
        return min(official, int(own)) if own else official

    def build(self, item) -> Built:
        name, index = item
        row, tok = self.rows[name][index], self.loaded.tokenizer
        context, queries = chat_parts(tok, *texts(row, name), self.chat)
        raw = tok.encode(context)
        ids = truncate_ids(raw, self.budget(name, len(queries)))
        questions = []
        for q in queries:
            q_ids = tok.encode(q, add_special_tokens=False)
            questions.append(Question(q_ids, {"question": (len(ids), len(ids) + len(q_ids))}))
        return Built(Prompt(ids, questions=questions), decode={"max_new_tokens": templates()["max_new_tokens"][name]},
                     data={"raw_prompt_tokens": len(raw), "truncated": len(ids) < len(raw)})

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        name, index = item
        turn = self.rows[name][index]["multi_turns"][i]
        label = ground_truth(turn, name)
        # the authors decode the answer with its special tokens (tokenizer.decode without skip_special_tokens)
        prediction = self.loaded.tokenizer.decode(answer.generation.tokens[0])
        try:
            score, error = score_one(name, prediction, label), None
        except (TypeError, ValueError) as exc:  # the official scorer raises here (e.g. a list label for a substring test)
            score, error = None, f"{type(exc).__name__}: {exc}"
        return {"task": name, "index": index, "id": self.rows[name][index].get("id", index), "turn_idx": i,
                "prediction": prediction, "ground_truth": label, "score": score, "score_error": error, "mode": "multi_request",
                "raw_prompt_tokens": built.data["raw_prompt_tokens"], "truncated": built.data["truncated"]}

    def summarize(self, rows: list[dict]) -> dict:
        by_task, by_turn, errors = {}, {}, {}
        for n in self.names:
            mine = [r for r in rows if r["task"] == n]
            bad = [r for r in mine if r["score_error"]]
            if bad:
                errors[n] = f"{len(bad)} turn(s): {bad[0]['score_error']}"
            ok = mine and not bad
            by_task[n] = round(100 * sum(r["score"] for r in mine) / len(mine), 2) if ok else None
            turns = sorted({r["turn_idx"] for r in mine})
            by_turn[n] = {str(t): (round(100 * sum(r["score"] for r in mine if r["turn_idx"] == t)
                                         / sum(r["turn_idx"] == t for r in mine), 2) if ok else None) for t in turns}
        return {"score_name": "scbench", "main_score": None, "mode": "multi_request", "scores": by_task, "by_turn": by_turn,
                "scorer_errors": errors, "use_chat_template": self.chat, "data": self.origin,
                "max_seq_length": self.max_seq_length, "turns": len(rows), "sampling": "greedy (GreedySearch)"}


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    task = SCBench(cfg, loaded)
    results = contract.run(task, settings, progress=progress)
    columns = list(task.names)
    rows = {tag: res["rows"] for tag, res in results.items()}
    reference = field_tables.full_tag(settings)
    deltas = (field_tables.paired(rows, reference, lambda r: (r["task"], r["index"], r["turn_idx"]), lambda r: r["score"],
                                  lambda r: (r["task"],), columns) if reference else {})
    scores = {tag: res["summary"]["scores"] for tag, res in results.items()}
    notes = [f"{loaded.name}, multi-request (every query over one compressed context), chat template={task.chat}, greedy. "
             "Score (%) per task over all turns (per turn: the summary's by_turn); '–': the official scorer raised."]
    for s in settings:
        results[s.tag]["summary"]["paired_vs_full"] = deltas.get(s.tag, {})
    if settings:
        text = field_tables.markdown("SCBench · multi-request", columns, scores, deltas, reference, notes, digits=2)
        log.info("SCBench table: %s", field_tables.write(Path(settings[0].run_dir.path).parent, "scbench", text))
    return results
