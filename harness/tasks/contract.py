"""The task contract: a task builds items and scores them; one runner does everything else.

A generation task (needle, ruler, lines, longbench) is a `GenerationTask`. It says:
  - `items()`: the item keys, in run order (tuples of the record fields named by `key_fields`);
  - `build(item)` -> `Built`: the item's prompt as segments (`Prompt`: the context, the text after it or
    several `questions`; named spans such as needles and the question, whose retention is reported) and
    the item's own decoding options;
  - `record(item, built, i, text, answer)`: the fields of question i's record the task owns (what the item
    is, the response in the task's form, its score);
  - `summarize(rows)` and `finish(setting, rows, summary)` (pictures, tables).
The runner (`run`, `run_settings`) owns what must be the same for every task: the methods list (every
setting from one prefill per item), the protocol (`task.query_aware`: where the compressed part ends is the
prompt's `question_start`), chunked prefill (`model.prefill_chunk_size`), decoding the settings together,
resume per setting (one log per setting), progress, failures, the CSV, and the fields every record carries
(`protocol`, `prompt_tokens`, `question_start`, `question_index` for items of several questions, generation
length, stop reason, timings, compression diagnostics) and every summary carries (`protocol`,
`prefill_chunk_size`, `failed_<noun>`). A task cannot ignore a protocol option: the runner applies both to
every item, and harness.app refuses, in one line, an option a module does not list in PROTOCOL_OPTIONS.

A task that generates nothing (observation: it measures the full cache's attention) keeps the same item
loop (common.run_items: resume, progress, failures) and the same module signature
`run(cfg, loaded, settings, progress)`; it lists no protocol options and refuses compressing settings.
"""

from __future__ import annotations

import gc
import logging
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from harness.errors import HarnessError, is_out_of_memory, require
from harness.generation.generate import ITEM_ERRORS, generate_settings
from harness.generation.prompt import Prompt, question_outcomes
from harness.models import LoadedModel
from harness.rundir import JsonlLog, write_json
from harness.tables import write_csv

log = logging.getLogger(__name__)


def protocol_name(query_aware: bool) -> str:
    return "query_aware" if query_aware else "query_agnostic"


@dataclass
class Built:
    """One item, built: its prompt, its own decoding options (over the task's `decode`), and whatever the
    task's records need of it (`data`)."""

    prompt: Prompt
    decode: dict = field(default_factory=dict)
    data: Any = None


class GenerationTask:
    """Base of the generation tasks: subclasses set the class attributes and implement items/build/record/summarize."""

    log_name: str = ""                    # <setting dir>/<log_name>.jsonl (its records) and .csv (the table)
    key_fields: tuple[str, ...] = ()      # the record fields that key an item in the log (resume)
    noun: str = "items"                   # "cells", "samples": the progress bar and the summary's failed_<noun>
    csv_columns: tuple[str, ...] = ()     # the CSV's columns (records hold more)

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        self.cfg, self.task, self.loaded = cfg, cfg.task, loaded
        self.query_aware = bool(self.task.get("query_aware", True))
        self.protocol = protocol_name(self.query_aware)
        self.chunk_size = cfg.model.get("prefill_chunk_size")
        self.decode: dict = {}             # decoding options of every item (generate_settings keywords)
        penalty = self.task.get("repetition_penalty")  # off unless the task asks (LooGLE: 2.0, as its authors)
        if penalty not in (None, 1, 1.0):
            require(isinstance(penalty, (int, float)) and penalty > 0, f"task.repetition_penalty={penalty!r} must be a positive number")
            self.decode["repetition_penalty"] = float(penalty)
        self.multi_question = False        # items of several questions: one record per (item, question_index)
        self.batch_size = 1                # items prefilled and decoded together (those with one batch_key)
        self.batch_key: Callable | None = None

    def capped_budget(self, official: int) -> int:
        """The authors' input budget in tokens, capped by the model's own limit (model.prompt_max_length) where that is
        smaller, said once in the log; tasks record both (official_budget, budget)."""
        self.official_budget = int(official)
        budget = min(self.official_budget, int(self.loaded.prompt_max_length or self.official_budget))
        if budget < self.official_budget:
            logging.getLogger(type(self).__module__).warning(
                "%s: truncating to %d tokens (model.prompt_max_length of %s), not the official %d", self.task.name, budget,
                self.loaded.name, self.official_budget)
        return budget

    # ---- what a task says
    def items(self) -> list[tuple]:
        raise NotImplementedError

    def questions(self, key: tuple) -> int:
        """How many questions the item of this key asks (multi_question tasks)."""
        return 1

    def build(self, item: tuple) -> Built:
        raise NotImplementedError

    def record(self, item: tuple, built: Built, i: int, text: str, answer) -> dict:
        raise NotImplementedError

    def summarize(self, rows: list[dict]) -> dict:
        raise NotImplementedError

    def finish(self, setting, rows: list[dict], summary: dict) -> None:
        """Pictures and tables of one setting (nothing by default)."""

    def log_file(self, setting) -> str:
        return f"{self.log_name}.jsonl"

    # ---- what the runner does with it
    def open_log(self, setting):
        if self.multi_question:  # an item is done once all its questions are
            return QuestionLog(setting.run_dir.log(self.log_file(setting), key=(*self.key_fields, "question_index")), self.questions)
        return setting.run_dir.log(self.log_file(setting), key=self.key_fields)

    def common_fields(self, built: Built, i: int, answer) -> dict:
        """What every record says, whatever the task: the protocol, the prompt's size and split, the generation."""
        prompt, gen = built.prompt, answer.generation
        out = {"protocol": self.protocol,
               "prompt_tokens": len(prompt.ids) + (len(prompt.questions[i].ids) if prompt.questions else 0),
               "question_start": prompt.question_start}
        if self.multi_question:
            out["question_index"] = i
        out.update(new_tokens=len(gen.tokens[0]), stopped_by=gen.stopped_by[0],
                   prefill_seconds=round(gen.prefill_seconds, 4), decode_seconds=round(gen.decode_seconds, 4))
        return out

    def item_records(self, item: tuple, built: Built, outcomes: dict, logs: dict) -> dict:
        """{tag: record (a list of them for multi_question tasks), or the error that failed it}."""
        tok = self.loaded.tokenizer

        def make(i, answer):
            text = tok.decode(answer.generation.tokens[0], skip_special_tokens=True)
            return {**self.record(item, built, i, text, answer), **self.common_fields(built, i, answer), **answer.diagnostics}

        out = question_records(outcomes, len(built.prompt.questions) or 1, logs, make)
        return out if self.multi_question else {tag: v[0] if isinstance(v, list) else v for tag, v in out.items()}


def run_settings(task: GenerationTask, settings, logs: dict, *, progress: bool = True, failures_paths: dict | None = None,
                 desc: str | None = None) -> dict:
    """Every item of `task` for every setting whose log lacks it, one prefill per item (per batch of items)."""
    loaded, by_tag = task.loaded, {s.tag: s for s in settings}
    single = [s.tag for s in settings if not getattr(s.method, "supports_batches", True)]
    require(task.batch_size == 1 or not single,
            f"task.batch_size={task.batch_size}: {', '.join(single)} scores one sequence at a time; use task.batch_size=1 "
            "or run those methods separately")
    together = bool(task.cfg.get("decode_together", True))

    def work_batch(items, tags) -> list[dict]:
        built = [task.build(item) for item in items]
        prompts = [b.prompt for b in built]
        options = {**task.decode, **built[0].decode}  # items batched together share their decoding (batch_key)
        outcomes = generate_settings(loaded, [(t, by_tag[t].method) for t in tags], prompts if len(prompts) > 1 else prompts[0],
                                     query_aware=task.query_aware, chunk_size=task.chunk_size, decode_together=together, **options)
        outcomes = outcomes if len(prompts) > 1 else [outcomes]
        return [task.item_records(item, b, o, logs) for item, b, o in zip(items, built, outcomes)]

    return run_shared_items(task.items(), logs=logs, key=lambda item: item, work=lambda item, tags: work_batch([item], tags)[0],
                            desc=desc or f"{task.task.name} {task.noun}", batch_size=task.batch_size, batch_key=task.batch_key,
                            work_batch=work_batch, failures_paths=failures_paths, progress=progress)


def run(task: GenerationTask, settings, *, progress: bool = True) -> dict:
    """The whole task for every setting: {tag: {"summary", "rows", "failures"}}; per setting its log, CSV, summary."""
    logs = {s.tag: task.open_log(s) for s in settings}
    outcome = run_settings(task, settings, logs, progress=progress,
                           failures_paths={s.tag: s.run_dir.path / "failures.json" for s in settings})
    order = {item: n for n, item in enumerate(task.items())}
    width = len(task.key_fields)
    results = {}
    for s in settings:
        rows = sorted((r for k, r in logs[s.tag].records.items() if tuple(k[:width]) in order),
                      key=lambda r: (order[tuple(r[f] for f in task.key_fields)], r.get("question_index", 0)))
        write_csv(s.run_dir.path / f"{task.log_name}.csv", rows, task.csv_columns, lineterminator="\r\n")  # csv's default
        summary = task.summarize(rows)
        summary.update({f"failed_{task.noun}": len(outcome[s.tag].failures), "protocol": task.protocol,
                        "prefill_chunk_size": task.chunk_size})
        if "repetition_penalty" in task.decode:  # a decoding option only the tasks that ask for it record
            summary["repetition_penalty"] = task.decode["repetition_penalty"]
        warn_evicted_questions(rows, s.tag)
        task.finish(s, rows, summary)
        results[s.tag] = {"summary": summary, "rows": rows, "failures": outcome[s.tag].failures}
    return results


def warn_evicted_questions(rows: list[dict], tag: str) -> None:
    """One warning line when compression evicted part of the question somewhere (query-aware runs)."""
    hit = [r for r in rows if r.get("question_kept") is not None and r["question_kept"] < 1]
    if hit:
        log.warning("%s: the question was partly evicted from the cache in %d of %d items (question_kept < 1; "
                    "see question_kept_by_layer in the item records)", tag, len(hit), len(rows))


# ------------------------------------------------------------------------------------------ the item loop (resume)

def question_records(outcomes: dict, questions: int, logs: dict, make: Callable) -> dict:
    """Per setting, one record per question (`make(i, answer)`, in question order): {tag: [records]}, or the
    first error that failed one of its questions (the answered ones are appended to that tag's log here, so
    a rerun asks only the missing ones)."""
    out = {}
    for tag, outcome in outcomes.items():
        records, error = [], None
        for i, answer in enumerate(question_outcomes(outcome, questions)):
            if answer.error is not None:
                error = error or answer.error
            else:
                records.append(make(i, answer))
        if error is not None and records:
            logs[tag].append(records)
        out[tag] = records if error is None else error
    return out


class QuestionLog:
    """A task's log seen per item of K questions, for `run_shared_items`: records are keyed by the item's key
    plus `question_index`; an item is in it once all K question records are, and `append` takes the item's
    list of question records (those already there are skipped by the log). A partly done item (a question
    failed, or the run stopped between records) is asked again and only its missing records are added."""

    def __init__(self, log: JsonlLog, questions):
        """questions: K for every item, or a function of the item's key giving its K."""
        self.log = log
        self.questions = questions if callable(questions) else (lambda key, k=int(questions): k)

    def __contains__(self, key) -> bool:
        return all((*key, i) in self.log for i in range(self.questions(key)))

    def append(self, records: list[dict]) -> None:
        for record in records:
            self.log.append(record)

    @property
    def records(self) -> dict:
        return self.log.records


@dataclass
class ItemResult:
    done: int = 0
    skipped: int = 0
    failures: list | None = None


def _failure(desc: str, key, exc: BaseException, tb: str) -> dict:
    text = str(exc).strip()
    return {"desc": desc, "key": list(key), "error": f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}",
            "oom": is_out_of_memory(exc), "traceback": tb}


def run_shared_items(items: Iterable, *, logs: dict[str, JsonlLog], key: Callable, work: Callable, desc: str,
                     failures_paths: dict | None = None, progress: bool = True, batch_size: int = 1,
                     batch_key: Callable | None = None, work_batch: Callable | None = None) -> dict[str, ItemResult]:
    """Run every item for every setting (tag) whose log does not hold it yet, one `work` call per item.

    `work(item, tags)` gets the tags still missing that item and returns {tag: record, or the
    exception that failed that tag}. Records are appended as they come; an out-of-memory or runtime
    error is recorded (key, error, short traceback) in that tag's failures file as soon as it
    happens, and the loop goes on; an error raised by `work` itself fails the item for every tag
    asked. Failed items are not in the logs, so the next run retries exactly them (and only for the
    settings that failed). A HarnessError (a user error) ends the run.

    Batched items (`batch_size` > 1 with `work_batch(items, tags)`, which returns one such dict per item):
    consecutive items with the same `batch_key` and the same missing tags go together, up to `batch_size`.
    """
    items = list(items)
    results = {tag: ItemResult(failures=[]) for tag in logs}
    todo = []
    for it in items:
        missing = [tag for tag, lg in logs.items() if key(it) not in lg]
        for tag in logs:
            if tag not in missing:
                results[tag].skipped += 1
        if missing:
            todo.append((it, missing))
    done_before = sum(r.skipped for r in results.values())
    if done_before:
        log.info("%s: %d of %d item records already done, resuming", desc, done_before, len(items) * len(logs))
    paths = failures_paths or {}
    batches: list[list] = []
    for item, missing in todo:
        same = bool(batches) and batch_size > 1 and work_batch is not None and len(batches[-1]) < batch_size and (
            batches[-1][0][1] == missing and (batch_key is None or batch_key(batches[-1][0][0]) == batch_key(item)))
        if same:
            batches[-1].append((item, missing))
        else:
            batches.append([(item, missing)])
    bar = tqdm(total=len(todo), desc=desc, unit="item", disable=not progress, dynamic_ncols=True)
    for batch in batches:
        missing = batch[0][1]
        try:
            outs = work_batch([it for it, _ in batch], missing) if len(batch) > 1 else [work(batch[0][0], missing)]
        except HarnessError:
            raise
        except ITEM_ERRORS as exc:
            outs = [{tag: exc for tag in missing} for _ in batch]
            tb = traceback.format_exc(limit=-3)
        else:
            tb = None
        oom = False
        for (item, _), out in zip(batch, outs):
            for tag in missing:
                record = out.get(tag)
                if isinstance(record, BaseException):
                    failure = _failure(desc, key(item), record, tb or "".join(traceback.format_exception(record, limit=-3)))
                    log.warning("%s [%s]: item %s failed: %s", desc, tag, key(item), failure["error"])
                    results[tag].failures.append(failure)
                    oom = oom or failure["oom"]
                    if paths.get(tag) is not None:
                        write_json(paths[tag], results[tag].failures)
                elif record is not None:
                    logs[tag].append(record)
                    results[tag].done += 1
        bar.update(len(batch))
        del outs
        if oom:  # outside the except block: the failed item's frames and tensors are already released
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    bar.close()
    for tag, path in paths.items():
        if path is not None:
            write_json(path, results[tag].failures)
    return results


def run_items(items: Iterable, *, log_file: JsonlLog, key: Callable, work: Callable[[object], dict], desc: str,
              failures_path=None, progress: bool = True) -> ItemResult:
    """`run_shared_items` for one log: `work(item)` returns the item's record."""
    results = run_shared_items(items, logs={"_": log_file}, key=key, work=lambda item, tags: {"_": work(item)}, desc=desc,
                               failures_paths={"_": failures_path}, progress=progress)
    return results["_"]
