"""LooGLE (bigai-nlco/LooGLE: Prediction/pred_opensource_models.py, config/task2prompt.json + task2maxlen.json,
Evaluation/automatic_eval.py): four tasks, each a file of documents, most with several questions.

A document's questions (`qa_pairs`, a Python-literal list of {'Q', 'A', ...}; 'none' for summarization: one question,
the reference is `output`) are asked over ONE context through the many-questions machinery: the task's prompt
(metrics/data/loogle/task2prompt.json) up to and including `{input}` is the context, the text after it (with the
question `{Q}`: "\\nQuestion: {Q}\\nAnswer: ", the cloze's "... What are the masked entities? \\nAnswer:", the
summary's "\\n Summarization: ") is each question, where the official template puts it. Query-agnostic: the context
is prefilled and compressed once, every question prefilled on top of it; query-aware: each question is compressed
with the context (one prefill per question, shared by every setting).

Truncation: the authors cut each question's whole prompt in the middle to `--max_length` tokens (first L//2, last
L//2). One context serves every question here, so it keeps its first L//2 tokens and its last L//2 - q tokens, q the
longest question of the document: every question's prompt then fits L and keeps the context's head exactly as the
authors'; a shorter question sees up to (q - its length) fewer context tokens before it (a named difference), and the
kept halves stay token ids (the authors decode them, join the texts and tokenize again). L = `task.max_length`, or
the model's prompt_max_length when null (the authors set it per model), capped at the model's.

Generation as the authors': the raw prompt (no chat template), greedy, `repetition_penalty` 2.0 (a decoding option,
harness/decoding.py: every token of the question's uncompressed prompt and of the answer so far is penalized),
at most task2maxlen[task] new tokens (`task.max_new_tokens` caps them, a named departure), stopped at EOS, decoded
without special tokens. Scores: metrics/loogle.py (`task.scorer`, `task.metrics`), per task as the authors aggregate.
"""

from __future__ import annotations

import ast
import json
import logging
from functools import lru_cache
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.generation.prompt import Prompt, Question
from harness.models import LoadedModel
from harness.tasks import contract, field_tables
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.hub_files import jsonl_rows
from harness.tasks.loogle.report import value
from metrics.loogle import DISPLAY, SCORERS, TASKS, aggregate, hash_seed, meteor_refusal, score_answer, task_metrics

log = logging.getLogger(__name__)

PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
GRID_KEYS = ("tasks", "limit", "max_questions")
METRIC_GROUPS = {"bleu": ("bleu1", "bleu4"), "rouge": ("rouge1", "rouge2", "rougeL"), "meteor": ("meteor",)}


@lru_cache(maxsize=1)
def config() -> tuple[dict, dict]:
    """(task2prompt, task2maxlen) of the authors' config/."""
    folder = resources.files("metrics").joinpath("data", "loogle")
    return tuple(json.loads(folder.joinpath(f).read_text(encoding="utf-8")) for f in ("task2prompt.json", "task2maxlen.json"))


def qa_pairs(row: dict, where: str) -> list[dict]:
    """The document's questions: its `qa_pairs` literal (the authors `eval` it), or, for 'none', the one summary."""
    pairs = row["qa_pairs"]
    if pairs == "none":
        return [{"Q": None, "A": row["output"]}]
    if isinstance(pairs, str):
        try:
            pairs = ast.literal_eval(pairs)
        except (SyntaxError, ValueError) as exc:
            raise HarnessError(f"{where}: qa_pairs is not a Python literal ({type(exc).__name__})") from None
    require(isinstance(pairs, list) and pairs and all(isinstance(p, dict) and "Q" in p and "A" in p for p in pairs),
            f"{where}: qa_pairs must be a non-empty list of {{'Q', 'A'}} dicts or 'none'")
    return pairs


def check_row(row, where: str, task: str) -> dict:
    require(isinstance(row, dict), f"{where}: expected a JSON object (LooGLE's format)")
    missing = [f for f in ("input", "qa_pairs", "output") if f not in row]
    require(not missing, f"{where}: missing field(s) {', '.join(missing)}")
    pairs = qa_pairs(row, where)
    if task == "shortdep_cloze":
        require(all(isinstance(p["A"], dict) for p in pairs), f"{where}: a cloze answer must be a dict of '<mask-n>' to the entity")
    else:
        require(all(isinstance(p["A"], str) for p in pairs), f"{where}: every answer must be a string")
    require((pairs[0]["Q"] is None) == (task == "longdep_summarization"), f"{where}: qa_pairs 'none' is the summarization task's only")
    return {**row, "questions": pairs}


def load_rows(task_cfg: DictConfig, task: str) -> tuple[list[dict], str]:
    """`<task>.jsonl` (the authors' LooGLE-testdata names) from task.data_dir or the hub."""
    rows, origin = jsonl_rows(task_cfg, f"{task}.jsonl", "LooGLE", check_row, task)
    most = task_cfg.get("max_questions")
    return ([{**r, "questions": r["questions"][:most]} for r in rows] if most else rows), origin


def task_names(task_cfg: DictConfig) -> list[str]:
    return list(TASKS) if task_cfg.get("tasks") is None else [str(t) for t in task_cfg.tasks]


def metric_names(task_cfg: DictConfig) -> tuple[str, ...]:
    """The QA/summary metrics asked (task.metrics: groups bleu, rouge, meteor); the cloze has its two matches always."""
    return tuple(m for g in task_cfg.get("metrics") or () for m in METRIC_GROUPS[str(g)])


def validate(task_cfg: DictConfig) -> None:
    names = task_names(task_cfg)
    require(names, "task.tasks is empty; give LooGLE tasks, e.g. task.tasks=[shortdep_qa]")
    for n in names:
        require(n in TASKS, f"task.tasks: unknown LooGLE task {n!r}; known: {', '.join(TASKS)}")
    require(len(set(names)) == len(names), "task.tasks lists a task twice")
    require(task_cfg.get("scorer", "official") in SCORERS, f"task.scorer={task_cfg.get('scorer')!r} is not one of {', '.join(SCORERS)}")
    groups = [str(g) for g in task_cfg.get("metrics") or ()]
    require("bertscore" not in groups, "task.metrics: bertscore is not computed (it needs roberta-large, a download); drop it")
    for g in groups:
        require(g in METRIC_GROUPS, f"task.metrics: unknown metric {g!r}; known: {', '.join(METRIC_GROUPS)}")
    require(groups or names == ["shortdep_cloze"], "task.metrics is empty: give bleu, rouge and/or meteor for the QA and summary tasks")
    if "meteor" in groups:
        why = meteor_refusal(task_cfg.get("nltk_data"))
        require(why is None, f"task.metrics=[..., meteor]: {why}")
    for key in ("limit", "max_questions", "max_new_tokens", "max_length"):
        v = task_cfg.get(key)
        require(v is None or (isinstance(v, int) and v > 0), f"task.{key}={v!r} must be a positive count or null")
    for n in names:
        load_rows(task_cfg, n)


class LooGLE(GenerationTask):
    log_name, key_fields, noun = "loogle", ("task", "index"), "documents"
    csv_columns = ("task", "index", "question_index", "score", "score_error", "protocol", "prompt_tokens", "question_start",
                   "truncated", "new_tokens", "stopped_by", "prediction")

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        self.multi_question = True
        self.names = task_names(self.task)
        loaded_rows = {n: load_rows(self.task, n) for n in self.names}
        self.rows = {n: r for n, (r, _) in loaded_rows.items()}
        self.origin = next(iter(loaded_rows.values()))[1]
        self.scorer, self.metrics = str(self.task.get("scorer", "official")), metric_names(self.task)
        own, asked = loaded.prompt_max_length, self.task.get("max_length")
        require(asked or own, "task.max_length is null and the model has no prompt_max_length: give the truncation budget")
        self.budget = self.capped_budget(asked) if asked else int(own)  # the authors' --max_length is set per model
        self.cap = self.task.get("max_new_tokens")
        self.decode.update(eos_token_ids=loaded.eos_token_ids)

    def new_tokens(self, name: str) -> int:
        official = int(config()[1][name])
        return min(official, int(self.cap)) if self.cap else official

    def items(self) -> list[tuple]:
        return [(n, i) for n in self.names for i in range(len(self.rows[n]))]

    def questions(self, key) -> int:
        return len(self.rows[key[0]][key[1]]["questions"])

    def build(self, item) -> Built:
        name, index = item
        row, tok = self.rows[name][index], self.loaded.tokenizer
        head, tail = config()[0][name].split("{input}", 1)
        context = list(tok(head.format() + row["input"])["input_ids"])  # special tokens as the authors' tokenizer(prompt)
        asked = [list(tok(tail.format(Q=p["Q"]) if p["Q"] is not None else tail.format(), add_special_tokens=False)["input_ids"])
                 for p in row["questions"]]
        longest, half = max(len(q) for q in asked), self.budget // 2
        require(longest < half, f"LooGLE {name} document {index}: a question of {longest} tokens does not fit half the "
                                f"truncation budget ({self.budget} tokens)")
        kept = context
        if len(context) + longest > self.budget:
            kept = context[:half] + context[len(context) - (half - longest):]
        questions = [Question(q, {"question": (len(kept), len(kept) + len(q))}) for q in asked]
        return Built(Prompt(kept, questions=questions), decode={"max_new_tokens": self.new_tokens(name)},
                     data={"raw_prompt_tokens": len(context) + longest, "truncated": len(kept) < len(context)})

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        name, index = item
        row = self.rows[name][index]
        reference = row["questions"][i]["A"]
        values = score_answer(name, text, reference, task_metrics(name) if name == "shortdep_cloze" else self.metrics, self.scorer)
        errors = [f"{DISPLAY[k]}: {v['error']}" for k, v in values.items() if isinstance(v, dict)]
        primary = values.get("exact" if name == "shortdep_cloze" else "rougeL" if "rougeL" in values else self.metrics[0])
        return {"task": name, "index": index, "title": row.get("title"), "prediction": text, "ground_truth": reference,
                "metrics": values, "score": None if primary is None or isinstance(primary, dict) else
                (primary[0] / primary[1] if isinstance(primary, list) else primary),
                "score_error": "; ".join(errors) or None, "raw_prompt_tokens": built.data["raw_prompt_tokens"],
                "truncated": built.data["truncated"], "max_new_tokens": self.new_tokens(name)}

    def columns(self, name: str) -> list[str]:
        return list(task_metrics(name) if name == "shortdep_cloze" else self.metrics)

    def summarize(self, rows: list[dict]) -> dict:
        """Per task, each metric as the authors aggregate it (x 100, 4 places as their cloze rounding gives); None
        where the official code raised on an answer (`scorer_errors` says where)."""
        scores, errors = {}, {}
        for n in self.names:
            mine = [r for r in rows if r["task"] == n]
            scores[n] = {m: (None if (v := aggregate(n, [r["metrics"][m] for r in mine])) is None else round(100 * v, 4))
                         for m in self.columns(n)} if mine else {}
            bad = [r for r in mine if r["score_error"]]
            if bad:
                errors[n] = f"{len(bad)} answer(s): {bad[0]['score_error']}"
                log.warning("loogle %s: the official scorer raises on %s (task.scorer=corrected scores it)", n, errors[n])
        return {"score_name": "loogle", "main_score": None, "scores": scores, "scorer_errors": errors, "scorer": self.scorer,
                "metrics": list(self.metrics), "meteor_hash_seed": hash_seed() if "meteor" in self.metrics else None,
                "documents": {n: sum(1 for r in rows if r["task"] == n and r["question_index"] == 0) for n in self.names},
                "questions": {n: sum(r["task"] == n for r in rows) for n in self.names}, "data": self.origin,
                "truncation_budget": self.budget, "max_length": self.task.get("max_length"), "max_new_tokens_cap": self.cap, "chat": False,
                "truncated_answers": sum(bool(r["truncated"]) for r in rows),
                "sampling": "greedy, repetition_penalty as task.repetition_penalty (pred_opensource_models.py: 2.0)",
                "not_computed": "bertscore (roberta-large is a download)"}


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    """Every document of every task for every setting (contract.run); `loogle_table.md`: per task, the metrics."""
    task = LooGLE(cfg, loaded)
    results = contract.run(task, settings, progress=progress)
    reference = field_tables.full_tag(settings)
    sections = []
    for name in task.names:
        columns = [DISPLAY[m] for m in task.columns(name)]
        rows = {tag: [r for r in res["rows"] if r["task"] == name] for tag, res in results.items()}
        scores = {tag: {DISPLAY[m]: v for m, v in res["summary"]["scores"].get(name, {}).items()} for tag, res in results.items()}
        deltas = (field_tables.paired(rows, reference, lambda r: (r["task"], r["index"], r["question_index"]), lambda r: r["score"],
                                      lambda r: columns, columns, value=value) if reference else {})
        for s in settings:
            results[s.tag]["summary"].setdefault("paired_vs_full", {})[name] = deltas.get(s.tag, {})
        sections.append(field_tables.markdown(f"LooGLE · {name}", columns, scores, deltas, reference, [], digits=2))
    if settings:
        note = (f"{loaded.name}, {task.protocol}, scorer={task.scorer}, raw prompts, greedy with repetition_penalty="
                f"{task.decode.get('repetition_penalty', 1.0)}, truncation budget {task.budget} tokens"
                + (f", new tokens capped at {task.cap}" if task.cap else ", official new tokens per task")
                + ". Scores x 100 as the authors aggregate them (means; cloze: matched masks over all masks); ROUGE is recall; "
                "BERTScore not computed; '–': the official scorer raised (the summary's scorer_errors). Paired differences "
                "per question (a cloze question: its own share of masks).")
        text = "\n".join(sections) + "\n" + note + "\n"
        log.info("LooGLE table: %s", field_tables.write(Path(settings[0].run_dir.path).parent, "loogle", text))
    return results
