"""SCBench (microsoft/MInference scbench: run_scbench.py, eval_utils.create_scdq_prompt / create_multiturn_prompt,
GreedySearch.test_scdq / test, compute_scores.py), both shared-context modes from one run (`task.modes`), each an item
of its own over one compressed context:

- multi_request (--same_context_different_query): the context prompt is the task's scdq template rendered in the chat
  template up to the user message's end (the authors split the rendered text at a delimiter); each query is the text
  after the delimiter in a chat of an empty system message and the delimiter + the query. Context tokens are
  `tok.encode(text)` (special tokens on top of the template's own, as the authors), middle-truncated to
  `max_seq_length - max_new_tokens * turns - 1000`; queries `encode(query, add_special_tokens=False)`.
- multi_turn (the default mode, golden context): turn 1 is the context and the first query in one user message
  (multiturn_templates), truncated to `max_seq_length - max_new_tokens * turns`; turn i > 1 is
  `[system "", assistant: <turn i-1's GOLD answer>, user: <query i>]` rendered with the generation prompt, its empty-system
  prefix cut off. The authors' decoding keeps every prompt in the cache and drops every generated token (a temporary
  cache), so turn i is answered after the compressed context + turn 1's query + the gold follow-ups 2..i.
- multi_turn with `task.keep_answers=true` (the authors' --disable_golden_context): the conversation goes on in one
  cache, the model's own answers kept. Turn i > 1 is `[user: <query i>]` rendered with the generation prompt, less the
  rendering of an empty system message without one (so a template's default system message stays, as the authors'
  .replace leaves it). Their decoding never feeds the last generated token: the cache holds each answer but its last
  token, then nothing if the answer stopped at an end token, else the tokenizer's EOS (`after_own_answer`), then turn i.
  Each turn decodes with its own budget (a mixed task's turn: its subtask's). Records say `history`: golden | own_answers.

Both are the harness's query-agnostic many-questions protocol (`task.query_aware` must be false): the context is
prefilled and compressed once per item and mode, every question prefilled on top of it, uncompressed, and answered
greedily with at most DATA_NAME_TO_MAX_NEW_TOKENS; in multi_turn question i holds turn 1's query and the follow-ups up to
i. One named difference: turn 1's query is prefilled after compression (the text after `{context}` in its template),
where the authors compress it with the context. Answers are decoded with their special tokens (as the authors) and
scored per turn by metrics/scbench.py (`task.scorer`: official | corrected).

The mixed tasks (scbench_summary_with_needles, scbench_repoqa_and_kv) give each turn the new-token budget of its own
subtask (the turn's `task`) and reserve `sum(budgets) * turns // 2` of the context; every question of an item is
decoded with the largest budget and each answer cut to its own (greedy: the first n tokens of a longer greedy answer
are the n-token answer). Their scores are reported per subtask. scbench_repoqa needs tree-sitter (the optional extra
`scbench-repoqa`); without it the task is refused in one line.

Data: `task.data_dir` holding the authors' `<task>.jsonl` (eval_utils.DATA_NAME_TO_PATH) or the hub's layout
`<task>/test-00000-of-00001.parquet`; without data_dir that parquet file of `task.hub_repo` (the config and split
run_scbench.py loads: load_dataset("microsoft/SCBench", <task>, split="test")).
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache, partial
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import require
from harness.generation.prompt import Prompt, Question
from harness.models import LoadedModel
from harness.tasks import contract, field_tables
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.hub_files import data_file, file_rows
from harness.tasks.longbench.data import suffix_start
from metrics.scbench import FUNCTION_QUERY, MIXED, SCORERS, TASKS, score_column, score_turn, tree_sitter_missing

log = logging.getLogger(__name__)

PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
GRID_KEYS = ("tasks", "limit", "modes")  # not max_turns: the context budget depends on the turn count
MODES = ("multi_request", "multi_turn")
DELIMITER = "[SEPSEPSEP]"
SCORED = tuple(t for t in TASKS if t != "scbench_passkey") + tuple(MIXED)  # passkey is only a part of summary_with_needles
HUB_FILE = "{task}/test-00000-of-00001.parquet"  # the hub's parquet config, split test
REPOQA = ("scbench_repoqa", "scbench_repoqa_and_kv")


@lru_cache(maxsize=1)
def templates() -> dict:
    return json.loads(resources.files("metrics").joinpath("data", "scbench", "templates.json").read_text(encoding="utf-8"))


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


def turn_fields(turn: dict, task: str) -> dict:
    """The template values of one turn (create_multiturn_prompt)."""
    out = {"input": turn["input"], "question": turn["input"]}
    if task == "scbench_choice_eng":
        out.update({f"OPTION_{c}": turn["options"][i] for i, c in enumerate("ABCD")})
    if task == "scbench_mf":
        found = re.findall(r"The .+ is", turn["input"])
        require(found, "SCBench scbench_mf: no 'The ... is' in a turn's input")
        out["prefix"] = f"What is {found[0].lower()[:-3]}?"
    return out


def multiturn_texts(tokenizer, row: dict, task: str, golden: bool = True, mf_prefix: str = "last") -> tuple[str, str, list[str]]:
    """create_multiturn_prompt with the chat template: (first turn's text, its text after the context, the follow-up texts
    of turns 2..n). Golden context: `[system "", assistant: gold answer i-1, user: query i]` rendered with the generation
    prompt, less the empty system message's rendering with it. Own answers (--disable_golden_context): `[user: query i]`
    rendered with the generation prompt, less the empty system message's rendering WITHOUT it (the authors' .replace: a
    template that adds its own default system message to a conversation without one, as SmolLM2's, keeps it).
    scbench_mf (`mf_prefix`): the authors' chat-template follow-ups format `{prefix}` with the variable their loop over
    the turns left behind, the LAST turn's "What is <target>?", before every turn's own input (`last`, official);
    `own` gives each turn its own prefix (as their text-only path does)."""
    turns, first_t = row["multi_turns"], templates()["multiturn_templates"][task]
    values = turn_fields(turns[0], task)
    last = turn_fields(turns[-1], task) if task == "scbench_mf" and mf_prefix == "last" else {}

    def fields(i: int) -> dict:
        own = turn_fields(turns[i], task)
        return {**own, "prefix": last["prefix"]} if last else own

    first = tokenizer.apply_chat_template([{"role": "user", "content": first_t.format(context=row["context"], **values)}],
                                          add_generation_prompt=True, tokenize=False)
    tail = first_t.split("{context}", 1)[1].format(**values)
    system = tokenizer.apply_chat_template([{"role": "system", "content": ""}], add_generation_prompt=golden, tokenize=False)
    before = (lambda i: [{"role": "system", "content": ""}, {"role": "assistant", "content": str(turns[i - 1]["answer"])}]) if golden else (lambda i: [])
    follow = [tokenizer.apply_chat_template(
        [*before(i), {"role": "user", "content": templates()["query_templates"][task].format(**fields(i))}],
        add_generation_prompt=True, tokenize=False).replace(system, "") for i in range(1, len(turns))]
    if task == "scbench_summary":  # create_multiturn_prompt primes every follow-up summary with "This paper"
        follow = [text + "This paper" for text in follow]
    return first, tail, follow


def after_own_answer(enders: tuple, eos: int, answer: list[int]) -> list[int]:
    """What the authors feed between a turn's own answer and the next turn (GreedySearch._decode and _process_texts with
    disable_golden_context): their decoding never feeds the last token it generates, so the conversation holds the answer
    without it; an answer that stopped at an end token is followed by nothing (no end-of-turn marker), one cut by its
    budget by the tokenizer's EOS."""
    return [] if answer and answer[-1] in enders else [eos]


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
        if task in MIXED:
            require(t.get("task") in MIXED[task], f"{where}: multi_turns[{k}] needs a task, one of {', '.join(MIXED[task])}")
        if task in REPOQA and (task == "scbench_repoqa" or t.get("task") == "scbench_repoqa"):
            require(isinstance(t.get("name"), str), f"{where}: multi_turns[{k}] needs the function's name")
    if task in REPOQA:
        require(row.get("lang") in FUNCTION_QUERY and isinstance(row.get("repo"), str),
                f"{where}: needs repo and lang (one of {', '.join(FUNCTION_QUERY)})")
    return row


def _checked(row, where: str, task: str) -> dict:
    return check_row(row, task, where)


def load_rows(task_cfg: DictConfig, task: str) -> tuple[list[dict], str]:
    """The task's rows: from task.data_dir (`<task>.jsonl`, else the hub's parquet layout) or the hub's parquet."""
    hub_name = HUB_FILE.format(task=task)
    local = task_cfg.get("data_dir") and (Path(str(task_cfg.data_dir)).expanduser() / hub_name).is_file()
    path, origin = data_file(task_cfg, hub_name if local or not task_cfg.get("data_dir") else f"{task}.jsonl", "SCBench")
    rows = file_rows(path, _checked, task)[: task_cfg.get("limit") or None]
    turns = task_cfg.get("max_turns")
    return ([{**r, "multi_turns": r["multi_turns"][:turns]} for r in rows] if turns else rows), origin


def task_names(task_cfg: DictConfig) -> list[str]:
    return list(SCORED) if task_cfg.get("tasks") is None else [str(t) for t in task_cfg.tasks]


def validate(task_cfg: DictConfig) -> None:
    names = task_names(task_cfg)
    require(names, "task.tasks is empty")
    for n in names:
        require(n in SCORED, f"task.tasks: {n!r} is not an SCBench task ({', '.join(SCORED)})")
        require(n not in REPOQA or not tree_sitter_missing(), f"task.tasks: {n}: {tree_sitter_missing()}")
    modes = list(task_cfg.get("modes") or [])
    require(modes and all(m in MODES for m in modes) and len(set(modes)) == len(modes),
            f"task.modes={modes!r}: give one or both of {', '.join(MODES)}")
    require(task_cfg.get("query_aware") is False,
            "task=scbench asks every query over one compressed context: set task.query_aware=false")
    require(task_cfg.get("use_chat_template", True) or modes == ["multi_request"],
            "task.use_chat_template=false: only the multi_request mode is provided without the chat template")
    require(task_cfg.get("scorer", "official") in SCORERS, f"task.scorer={task_cfg.get('scorer')!r} is not one of {', '.join(SCORERS)}")
    require(isinstance(task_cfg.get("keep_answers", False), bool), f"task.keep_answers={task_cfg.get('keep_answers')!r}: give true or false")
    require(task_cfg.get("mf_prefix", "last") in ("last", "own"),
            f"task.mf_prefix={task_cfg.get('mf_prefix')!r}: give last (the authors' chat-template follow-ups) or own")
    turns, limit = task_cfg.get("max_turns"), task_cfg.get("limit")
    require(turns is None or (isinstance(turns, int) and turns > 0), f"task.max_turns={turns!r} must be a positive count or null")
    require(limit is None or (isinstance(limit, int) and limit > 0), f"task.limit={limit!r} must be a positive item count or null")
    for n in names:
        load_rows(task_cfg, n)


class SCBench(GenerationTask):
    log_name, key_fields, noun = "scbench", ("task", "index", "mode"), "items"
    csv_columns = ("task", "index", "mode", "question_index", "score", "protocol", "prompt_tokens", "question_start", "truncated",
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
        self.modes = [str(m) for m in self.task.modes]
        self.scorer = str(self.task.get("scorer", "official"))
        self.decode = dict(eos_token_ids=loaded.eos_token_ids)
        self.needles = {n: needles(rows) for n, rows in self.rows.items() if n in REPOQA}
        self.keep_answers = bool(self.task.get("keep_answers", False))
        self.history = "own_answers" if self.keep_answers else "golden"
        self.mf_prefix = str(self.task.get("mf_prefix", "last"))
        require(not (self.keep_answers and "multi_turn" in self.modes and loaded.tokenizer.eos_token_id is None),
                f"task.keep_answers=true: {loaded.name}'s tokenizer has no EOS token, which the authors put after an answer cut by its budget")

    def items(self) -> list[tuple]:
        return [(n, i, m) for m in self.modes for n in self.names for i in range(len(self.rows[n]))]

    def questions(self, key) -> int:
        return len(self.rows[key[0]][key[1]]["multi_turns"])

    def budget(self, name: str, turns: int, mode: str) -> int:
        """run_scbench.py: max_seq_length - max_new_tokens * turns, minus 1000 in the multi-request mode; capped at the model."""
        new = templates()["max_new_tokens"][name]
        reserved = sum(new.values()) * turns // 2 if isinstance(new, dict) else new * turns  # mixed: run_scbench.py's rule
        official = self.max_seq_length - reserved - (1000 if mode == "multi_request" else 0)
        own = self.loaded.prompt_max_length
        return min(official, int(own)) if own else official

    def build(self, item) -> Built:
        name, index, mode = item
        row, tok = self.rows[name][index], self.loaded.tokenizer
        turns = len(row["multi_turns"])
        if mode == "multi_request":
            context, queries = chat_parts(tok, *texts(row, name), self.chat)
            raw = tok.encode(context)
            ids = kept = truncate_ids(raw, self.budget(name, turns, mode))
            asked = [tok.encode(q, add_special_tokens=False) for q in queries]
        else:
            first, tail, follow = multiturn_texts(tok, row, name, golden=not self.keep_answers, mf_prefix=self.mf_prefix)
            raw = tok.encode(first)
            kept = truncate_ids(raw, self.budget(name, turns, mode))
            start = suffix_start(kept, tok, tail)
            ids, asked = kept[:start], [kept[start:]]
            for text in follow:  # golden: turn i asks turn 1's query and the gold follow-ups 2..i; own answers: its own turn
                asked.append([*(asked[-1] if not self.keep_answers else []), *tok.encode(text, add_special_tokens=False)])
        new = templates()["max_new_tokens"][name]
        own = mode == "multi_turn" and self.keep_answers
        opens = partial(after_own_answer, tuple(self.loaded.eos_token_ids), tok.eos_token_id) if own else None
        budgets = [new[t["task"]] if own and isinstance(new, dict) else None for t in row["multi_turns"]]  # a mixed turn's own
        questions = [Question(q, {"question": (len(ids), len(ids) + len(q))}, after_answer=opens if k else None, max_new_tokens=b)
                     for k, (q, b) in enumerate(zip(asked, budgets))]
        return Built(Prompt(ids, questions=questions), decode={"max_new_tokens": max(new.values()) if isinstance(new, dict) else new,
                                                               **({"keep_answers": True} if own else {})},
                     data={"raw_prompt_tokens": len(raw), "truncated": len(kept) < len(raw)})

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        name, index, mode = item
        turn = self.rows[name][index]["multi_turns"][i]
        row, label, subtask = self.rows[name][index], ground_truth(turn, name), turn.get("task") if name in MIXED else None
        tokens = list(answer.generation.tokens[0])
        if subtask:  # every question was decoded with the largest budget: the turn's own budget is a prefix of it
            tokens = tokens[: templates()["max_new_tokens"][name][subtask]]
        # the authors decode the answer with its special tokens (tokenizer.decode without skip_special_tokens)
        prediction = self.loaded.tokenizer.decode(tokens)
        repoqa = None
        if name in REPOQA and (subtask or name) == "scbench_repoqa":
            repoqa = {"lang": row["lang"], "func_name": turn["name"], "needles": self.needles[name][row["repo"]]}
        try:
            score, error = score_turn(name, prediction, label, self.scorer, subtask=subtask, mode=mode, repoqa=repoqa), None
        except (TypeError, ValueError) as exc:  # the official scorer raises here (e.g. a list label for a substring test)
            score, error = None, f"{type(exc).__name__}: {exc}"
        extra = {"subtask": subtask} if subtask else {}
        if mode == "multi_turn":  # what the earlier turns left in the conversation: gold answers or the model's own
            extra["history"] = self.history
        if name in REPOQA:
            extra.update(lang=row["lang"], repo=row["repo"], func_name=turn.get("name"))
        return {"task": name, "index": index, "id": row.get("id", index), "turn_idx": i, **extra,
                "prediction": prediction, "ground_truth": label, "score": score, "score_error": error, "mode": mode,
                "new_tokens_allowed": len(tokens) if subtask else None,
                "raw_prompt_tokens": built.data["raw_prompt_tokens"], "truncated": built.data["truncated"]}

    def summarize(self, rows: list[dict]) -> dict:
        """Per mode: each task's score over all turns and per turn (100 x the mean); None where the official scorer raised."""
        out: dict = {"score_name": "scbench", "main_score": None, "modes": self.modes, "scorer_errors": {},
                     "use_chat_template": self.chat, "scorer": self.scorer, "data": self.origin, "max_seq_length": self.max_seq_length,
                     "turns": len(rows), "sampling": "greedy (GreedySearch)", "turn1_query": "prefilled after compression",
               "multi_turn_history": self.history if "multi_turn" in self.modes else None,
               "mf_prefix": self.mf_prefix if "scbench_mf" in self.names and "multi_turn" in self.modes else None}
        for mode in self.modes:
            out[mode] = mode_scores([r for r in rows if r["mode"] == mode], out["scorer_errors"], mode)
        return out


def column(record: dict) -> str:
    """The score column of a turn's record: its task, or task/subtask for the mixed tasks."""
    return score_column(record["task"], record.get("subtask"))


def mode_scores(rows: list[dict], errors: dict | None = None, mode: str = "") -> dict:
    """One mode's records: each column's score over its turns and per turn (100 x the mean; None where the official
    scorer raised). A mixed task's subtask has no entry for a turn without it (compute_scores writes 0.000 there)."""
    by_task, by_turn = {}, {}
    for name in dict.fromkeys(column(r) for r in rows):
        mine = [r for r in rows if column(r) == name]
        bad = [r for r in mine if r["score_error"]]
        if bad and errors is not None:
            errors[f"{mode}/{name}"] = f"{len(bad)} turn(s): {bad[0]['score_error']}"
        by_task[name] = None if bad else _pct([r["score"] for r in mine])
        by_turn[name] = {str(t): (None if bad else _pct([r["score"] for r in mine if r["turn_idx"] == t]))
                         for t in sorted({r["turn_idx"] for r in mine})}
    return {"scores": by_task, "by_turn": by_turn}


def needles(rows: list[dict]) -> dict:
    """compute_scores' needle_by_repo: per repository, (name, function) of every repoqa turn of the run's items."""
    out: dict = {}
    for row in rows:
        for turn in row["multi_turns"]:
            if turn.get("task", "scbench_repoqa") == "scbench_repoqa":
                out.setdefault(row["repo"], []).append((turn["name"], turn["answer"]))
    return out


def _pct(values: list[float]) -> float:
    return round(100 * sum(values) / len(values), 2)


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    """Both modes' items for every setting (contract.run); `scbench_table.md`: per mode, per task, then per turn."""
    task = SCBench(cfg, loaded)
    results = contract.run(task, settings, progress=progress)
    reference = field_tables.full_tag(settings)
    sections = []
    for mode in task.modes:
        rows = {tag: [r for r in res["rows"] if r["mode"] == mode] for tag, res in results.items()}
        turns = sorted({r["turn_idx"] for recs in rows.values() for r in recs})
        for title, columns, group in (
                ("per task", list(dict.fromkeys(column(r) for recs in rows.values() for r in recs)), lambda r: (column(r),)),
                ("per turn, over the tasks", [f"turn {t + 1}" for t in turns], lambda r: (f"turn {r['turn_idx'] + 1}",))):
            deltas = (field_tables.paired(rows, reference, lambda r: (r["task"], r["index"], r["turn_idx"]), lambda r: r["score"],
                                          group, columns) if reference else {})
            scores = {tag: field_tables.grouped(recs, group, columns, 2, strict=True) for tag, recs in rows.items()}
            sections.append(field_tables.markdown(f"SCBench · {mode.replace('_', '-')} · {title}", columns, scores, deltas,
                                                  reference, [], digits=2))
            if title == "per task":
                for s in settings:
                    results[s.tag]["summary"].setdefault("paired_vs_full", {})[mode] = deltas.get(s.tag, {})
    if settings:
        history = "the model's own answers kept" if task.keep_answers else "golden context"
        note = (f"{loaded.name}, chat template={task.chat}, greedy, query-agnostic (turn 1's query prefilled after compression), "
                f"multi-turn: {history}. "
                "Score (%) over the turns; '–': none, or the official scorer raised (the summary's scorer_errors).")
        text = "\n".join(sections) + "\n" + note + "\n"
        log.info("SCBench table: %s", field_tables.write(Path(settings[0].run_dir.path).parent, "scbench", text))
    return results
