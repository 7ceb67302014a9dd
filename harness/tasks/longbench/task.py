"""LongBench (v1) and LongBench-E, with the official prompts, generation rules and scorers.

`task=longbench`: the 16 English tasks by default, in the paper's column order (`task.datasets`
selects, the 5 Chinese tasks included); `task=longbench_e`: the 13 LongBench-E tasks
(`<name>_e.jsonl`), scored by length bucket. Rules (pred.py / eval.py, shared/reference/longbench.md):
official template, middle truncation to the model's budget (`model.prompt_max_length`), chat
formatting after truncation except trec/triviaqa/samsum/lsht/lcc/repobench-p, greedy decoding with
`dataset2maxlen` new tokens and every EOS id, samsum also stops at "\\n" and may not stop on its first
token; `task.min_new_tokens=true` applies that first-token guard to every task (SnapKV's pred_snap.py).

Predictions stream to `pred/<task>.jsonl` (or `pred/<task>.shard<k>of<n>.jsonl` for shard k of n:
item i of a task belongs to shard i % n), one line per item as it finishes; a rerun skips finished
items. Scoring merges every shard file of the run directory, in item order, and refuses an
incomplete set: the last shard to finish scores (see conf/task/longbench.yaml).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.models import LoadedModel
from harness.rundir import write_json, write_text
from harness.tasks import contract
from harness.generation.prompt import Prompt
from harness.tables import _mean
from harness.tasks.contract import Built, GenerationTask, protocol_name, warn_evicted_questions
from harness.tasks.longbench.data import (
    NO_QUESTION_TASKS,
    NOTHING_AFTER_CONTEXT,
    RAW_TASKS,
    SHORT_NAMES,
    build_prompt,
    check_options,
    data_source,
    file_stem,
    is_raw,
    load_rows,
    max_new_tokens,
    newline_token_id,
    question_start,
    render,
    selected_datasets,
    variant_suffix,
)
from metrics.longbench_config import load_dataset2prompt
from metrics.longbench_tasks import LONGBENCH_E_BUCKETS, LONGBENCH_EN_TASKS, TASK_CATEGORIES, average_scores, task_category

log = logging.getLogger(__name__)
# Protocol options this task applies (harness.app refuses them for a task that does not list them).
PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")
# Options that only choose which items run (a prediction is keyed by task and row index, in file order):
# a run directory takes another selection and reuses the predictions it holds.
GRID_KEYS = ("datasets", "limit")

PRED_DIR = "pred"
TABLE_FILE = "longbench_table.md"


# --------------------------------------------------------------------------------------------
# Validation (no model)
# --------------------------------------------------------------------------------------------


def validate(task: DictConfig) -> None:
    """Options, dataset names, and every selected file read and checked row by row."""
    variant_suffix(task.name)
    check_options(task)
    names = selected_datasets(task)
    source = data_source(task)
    for name in names:
        load_rows(source, file_stem(task.name, name))


@dataclass
class Plan:
    task_name: str
    names: list[str]
    rows: dict[str, list[dict]]  # selected rows per dataset (after task.limit), file order
    shard_index: int
    shard_count: int
    source: str

    @property
    def benchmark(self) -> str:
        return "LongBench-E" if variant_suffix(self.task_name) else "LongBench"


def make_plan(task: DictConfig) -> Plan:
    check_options(task)
    names = selected_datasets(task)
    source = data_source(task)
    limit = task.get("limit")
    rows = {n: load_rows(source, file_stem(task.name, n))[: limit or None] for n in names}
    shard = task.get("shard") or {}
    return Plan(task.name, names, rows, int(shard.get("index", 0)), int(shard.get("count", 1)), source.origin)


def samsum_eos_ids(tokenizer) -> list[int]:
    """pred.py's EOS list for samsum is [tokenizer.eos_token_id, newline]; the newline is the stop token."""
    return [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []


def shard_items(n_items: int, index: int, count: int) -> list[int]:
    """Item i of a task goes to shard i % count."""
    return [i for i in range(n_items) if i % count == index]


def pred_file(run_path: Path, name: str, index: int, count: int) -> Path:
    suffix = "" if count == 1 else f".shard{index}of{count}"
    return Path(run_path) / PRED_DIR / f"{name}{suffix}.jsonl"


def failures_file(run_path: Path, index: int, count: int) -> Path:
    return Path(run_path) / ("failures.json" if count == 1 else f"failures.shard{index}of{count}.json")


# --------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------


class LongBenchDataset(GenerationTask):
    """One LongBench dataset's items of this shard, as pred.py runs them: an item is (index,) in the dataset; its
    record is pred.py's prediction line (`pred` not stripped, `answers`, `all_classes`, `length`) in the shard's
    prediction file, scored once every shard is in (`score`)."""

    key_fields, noun = ("index",), "items"

    def __init__(self, cfg: DictConfig, loaded: LoadedModel, name: str, rows: list[dict], shard: tuple[int, int], *,
                 templates: dict, guard_all: bool, newline: int):
        super().__init__(cfg, loaded)
        self.name, self.rows, self.shard, self.templates = name, rows, shard, templates
        self.indices = shard_items(len(rows), *shard)
        self.budget = loaded.prompt_max_length
        self.new_tokens = max_new_tokens(name)
        # pred.py replaces the EOS list for samsum with [tokenizer.eos_token_id, "\n"]: the model's other
        # EOS ids (e.g. Llama-3's <|eot_id|> besides <|end_of_text|>) do not stop it there.
        self.decode = dict(max_new_tokens=self.new_tokens, stop_token_ids=[newline] if name == "samsum" else [],
                           min_new_tokens=1 if (name == "samsum" or guard_all) else 0,
                           eos_token_ids=samsum_eos_ids(loaded.tokenizer) if name == "samsum" else loaded.eos_token_ids)
        self.warned = False

    def log_file(self, setting) -> str:
        k, n = self.shard
        return str(pred_file(setting.run_dir.path, self.name, k, n).relative_to(setting.run_dir.path))

    def items(self) -> list[tuple]:
        return [(i,) for i in self.indices]

    def build(self, item) -> Built:
        loaded, (i,) = self.loaded, item
        row = self.rows[i]
        prompt = build_prompt(self.name, row, loaded.tokenizer, self.budget, self.templates)
        text, ids = render(self.name, prompt.text, loaded)
        if loaded.max_positions and len(ids) + self.new_tokens > loaded.max_positions and not self.warned:
            self.warned = True
            log.warning("%s: a prompt of %d tokens + %d new tokens exceeds %s's %d positions (model.prompt_max_length=%d)",
                        self.name, len(ids), self.new_tokens, loaded.name, loaded.max_positions, self.budget)
        split = question_start(self.name, row, ids, loaded.tokenizer, self.templates)
        return Built(Prompt(ids, split, {"question": (split, len(ids))} if split < len(ids) else {}), data=(prompt, text))

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        (index,), row, (prompt, prompt_text) = item, self.rows[item[0]], built.data
        out = {"index": index, "_id": row["_id"], "pred": text,  # not stripped, as pred.py
               "answers": row["answers"], "all_classes": row["all_classes"], "length": row["length"],
               "raw_prompt_tokens": prompt.raw_tokens, "truncated": prompt.truncated, "chat_formatted": not is_raw(self.name)}
        if self.task.get("log_prompts"):
            out["prompt"] = prompt_text
        return out


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    """Every selected item for every setting (harness.generation.prompt.Setting), one prefill per item.

    Returns {tag: {"summary", "rows", "failures"}}."""
    task = cfg.task
    plan = make_plan(task)
    budget = loaded.prompt_max_length
    require(isinstance(budget, int) and budget > 1,
            f"model.prompt_max_length={budget!r}: LongBench needs the model's prompt budget in tokens (model2maxlen, e.g. 31500)")
    protocol = protocol_name(bool(task.get("query_aware", True)))
    k, n = plan.shard_index, plan.shard_count
    for s in settings:
        (s.run_dir.path / PRED_DIR).mkdir(parents=True, exist_ok=True)
        if not bool(s.cfg.get("resume", True)):  # a fresh start clears every shard's predictions
            for f in (s.run_dir.path / PRED_DIR).glob("*.jsonl"):
                f.unlink()

    tok = loaded.tokenizer
    templates = load_dataset2prompt()
    guard_all = bool(task.get("min_new_tokens", False))
    newline = newline_token_id(tok)
    failures: dict[str, list[dict]] = {s.tag: [] for s in settings}
    for name in plan.names:
        dataset = LongBenchDataset(cfg, loaded, name, plan.rows[name], (k, n), templates=templates, guard_all=guard_all, newline=newline)
        logs = {s.tag: s.run_dir.log(dataset.log_file(s), key=dataset.key_fields) for s in settings}
        desc = f"{name}" + (f" [shard {k}/{n}]" if n > 1 else "")
        outcome = contract.run_settings(dataset, settings, logs, progress=progress, desc=desc)
        for s in settings:
            failures[s.tag] += [{"task": name, **f} for f in outcome[s.tag].failures]
            write_json(failures_file(s.run_dir.path, k, n), failures[s.tag])  # this shard's failures so far, all tasks

    rules = describe_rules(plan, loaded, budget, guard_all, newline)
    rules["protocol"] = protocol
    rules["samsum_eos_token_ids"] = samsum_eos_ids(tok) + [newline]  # pred.py's list for samsum
    # Query-agnostic: what is prefilled after compression is the template's text after {context}; these
    # tasks have none (everything is compressed), these others only a fixed instruction (no question).
    rules["nothing_after_context"] = sorted(set(plan.names) & set(NOTHING_AFTER_CONTEXT))
    rules["instruction_only_after_context"] = sorted(set(plan.names) & set(NO_QUESTION_TASKS))
    results = {}
    for s in settings:
        merged, missing = collect(s.run_dir.path, plan)
        if missing:
            summary = incomplete_summary(plan, missing, rules, failures[s.tag])
            log.warning("%s: %s", s.tag, summary["message"])
            results[s.tag] = {"summary": summary, "rows": [], "failures": failures[s.tag]}
            continue
        summary, rows = score(plan, merged, task, rules)
        summary.update(protocol=protocol, prefill_chunk_size=cfg.model.get("prefill_chunk_size"))  # as contract.run
        warn_evicted_questions([r for recs in merged.values() for r in recs], s.tag)
        write_text(s.run_dir.path / TABLE_FILE, markdown_table(summary, loaded.name, s.tag))
        results[s.tag] = {"summary": summary, "rows": rows, "failures": failures[s.tag]}
    return results


# --------------------------------------------------------------------------------------------
# Merging shards
# --------------------------------------------------------------------------------------------


def read_predictions(path: Path) -> list[dict]:
    """Complete lines of a predictions file, read-only (another shard may be appending to it:
    a torn last line is ignored here and repaired by its own shard's rerun)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    data = data[: data.rfind(b"\n") + 1]
    records = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise HarnessError(f"{path}:{number} is not valid JSON; delete that line and rerun that shard") from None
    return records


def collect(run_path: Path, plan: Plan) -> tuple[dict[str, list[dict]], dict[str, dict[int, list[int]]]]:
    """Every shard's predictions merged in item order; and the missing items, per task and shard."""
    merged: dict[str, list[dict]] = {}
    missing: dict[str, dict[int, list[int]]] = {}
    for name in plan.names:
        rows = plan.rows[name]
        found: dict[int, dict] = {}
        for s in range(plan.shard_count):
            path = pred_file(run_path, name, s, plan.shard_count)
            for rec in read_predictions(path):
                i = rec.get("index")
                if not isinstance(i, int) or not 0 <= i < len(rows) or i % plan.shard_count != s:
                    continue  # an item beyond task.limit (or misplaced): not part of this set
                if rec.get("_id") != rows[i]["_id"]:
                    raise HarnessError(
                        f"{path}: item {i} has _id {rec.get('_id')!r} but the data has {rows[i]['_id']!r}: these predictions "
                        "were made on other data; use another run directory or resume=false")
                found.setdefault(i, rec)
        gaps = [i for i in range(len(rows)) if i not in found]
        if gaps:
            by_shard: dict[int, list[int]] = {}
            for i in gaps:
                by_shard.setdefault(i % plan.shard_count, []).append(i)
            missing[name] = by_shard
        else:
            merged[name] = [found[i] for i in range(len(rows))]
    return merged, missing


def incomplete_summary(plan: Plan, missing: dict, rules: dict, failures: list) -> dict:
    k, n = plan.shard_index, plan.shard_count
    parts = []
    for name, by_shard in missing.items():
        for s, items in sorted(by_shard.items()):
            head = ", ".join(map(str, items[:5])) + (" ..." if len(items) > 5 else "")
            parts.append(f"{name} shard {s}/{n}: {len(items)} item(s) missing ({head})")
    pending = sorted({s for by in missing.values() for s in by})
    own_failed = k in pending
    if n > 1 and not own_failed:
        message = (f"shard {k}/{n} done; not scored yet: shard(s) {', '.join(map(str, pending))} of {n} unfinished. "
                   f"The last shard to finish scores the merged set: run the missing shard(s) into this run directory "
                   f"(same command with task.shard.index=<k> task.shard.count={n}); rerunning any finished shard "
                   f"skips its items and scores")
    else:
        message = (f"{len(failures)} item(s) failed (see {failures_file(Path('.'), k, n).name}); not scored. "
                   f"Rerun the same command: finished items are skipped, failed ones retried, then the set is scored")
    return {
        "benchmark": plan.benchmark,
        "status": "incomplete",
        "message": message,
        "missing": parts,
        "shard": {"index": k, "count": n},
        "tasks": plan.names,
        "rules": rules,
    }


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def describe_rules(plan: Plan, loaded: LoadedModel, budget: int, guard_all: bool, newline: int) -> dict:
    half = int(budget / 2)
    return {
        "chat_format": loaded.chat_format,
        "chat_tasks": [t for t in plan.names if not is_raw(t)],
        "raw_tasks": [t for t in plan.names if is_raw(t)],
        "raw_task_rule": f"never chat-formatted (pred.py): {', '.join(RAW_TASKS)}",
        "truncation": {"mode": "middle", "budget_tokens": budget, "keep_head_tokens": half, "keep_tail_tokens": half,
                       "counted": "raw prompt tokens, special tokens included"},
        "min_new_tokens": "all tasks (SnapKV pred_snap.py)" if guard_all else "samsum only (official pred.py)",
        "min_new_tokens_all_tasks": guard_all,
        "decoding": "greedy",
        "max_new_tokens": {t: max_new_tokens(t) for t in plan.names},
        "eos_token_ids": list(loaded.eos_token_ids),
        "samsum_stop_token_id": newline,
        "prompt_source": "metrics/data/longbench/dataset2prompt.json",
        "data_source": plan.source,
    }


def _nan_to_none(x: float):
    return None if isinstance(x, float) and math.isnan(x) else x


def score(plan: Plan, merged: dict[str, list[dict]], task: DictConfig, rules: dict) -> tuple[dict, list[dict]]:
    from metrics.longbench import scorer, scorer_e

    backend = str(task.get("code_sim_backend", "difflib"))
    scores, buckets, rows = {}, {}, []
    for name in plan.names:
        recs = merged[name]
        preds = [r["pred"] for r in recs]
        answers = [r["answers"] for r in recs]
        all_classes = recs[-1]["all_classes"]  # eval.py keeps the last line's
        scores[name] = scorer(name, preds, answers, all_classes, code_sim_backend=backend)
        row = {
            "task": name,
            "category": task_category(name),
            "score": scores[name],
            "items": len(recs),
            "truncated": sum(bool(r.get("truncated")) for r in recs),
            "chat_formatted": not is_raw(name),
            "mean_prompt_tokens": _mean(r["prompt_tokens"] for r in recs),
            "mean_new_tokens": _mean(r["new_tokens"] for r in recs),
            "prefill_seconds": round(sum(r["prefill_seconds"] for r in recs), 3),
            "decode_seconds": round(sum(r["decode_seconds"] for r in recs), 3),
        }
        if plan.benchmark == "LongBench-E":
            by_bucket = scorer_e(name, preds, answers, [r["length"] for r in recs], all_classes, code_sim_backend=backend)
            buckets[name] = {b: _nan_to_none(v) for b, v in by_bucket.items()}
            row["buckets"] = buckets[name]
            row["bucket_items"] = {b: sum(1 for r in recs if _bucket(r["length"]) == b) for b in LONGBENCH_E_BUCKETS}
        rows.append(row)

    averages = average_scores(scores)
    en16 = [t for t in LONGBENCH_EN_TASKS if t in scores]
    is_paper_set = plan.benchmark == "LongBench" and plan.names == list(LONGBENCH_EN_TASKS)
    if is_paper_set:
        note = "unweighted mean over the paper's 16 English tasks"
    else:
        note = (f"unweighted mean over the {len(scores)} task(s) run; NOT the papers' 16-task average"
                + (f" ({len(en16)} of the 16 English tasks)" if plan.benchmark == "LongBench" else ""))
    total = sum(r["items"] for r in rows)
    seconds = sum(r["prefill_seconds"] + r["decode_seconds"] for r in rows)
    summary = {
        "benchmark": plan.benchmark,
        "status": "complete",
        "tasks": plan.names,
        "scores": scores,
        "average": averages["average"],
        "n_tasks": averages["n_tasks"],
        "all_16_en_tasks": is_paper_set,
        "average_note": note,
        "categories": averages["categories"],
        "items": {r["task"]: r["items"] for r in rows},
        "total_items": total,
        "limit": task.get("limit"),
        "code_sim_backend": backend,
        "rules": rules,
        "truncated_items": {r["task"]: r["truncated"] for r in rows},
        "shards_merged": plan.shard_count,
        "model_seconds_per_item": round(seconds / total, 4) if total else None,
    }
    if plan.benchmark == "LongBench-E":
        summary["bucket_scores"] = buckets
        summary["bucket_average"] = {
            b: (round(sum(v) / len(v), 2) if (v := [buckets[t][b] for t in plan.names if buckets[t][b] is not None]) else None)
            for b in LONGBENCH_E_BUCKETS
        }
        summary["scores_note"] = "scores: one score per task over all its items (scorer); bucket_scores: the official LongBench-E numbers (scorer_e)"
    return summary, rows


def _bucket(length: int) -> str:
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def _cell(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown_table(summary: dict, model: str, method_tag: str) -> str:
    names = summary["tasks"]
    rules = summary["rules"]
    lines = [f"# {summary['benchmark']}: {model} · {method_tag}", ""]
    if summary["benchmark"] == "LongBench-E":
        lines += ["| Task | " + " | ".join(LONGBENCH_E_BUCKETS) + " | All |", "|---|" + "---:|" * (len(LONGBENCH_E_BUCKETS) + 1)]
        for t in names:
            b = summary["bucket_scores"][t]
            lines.append(f"| {SHORT_NAMES.get(t, t)} | " + " | ".join(_cell(b[k]) for k in LONGBENCH_E_BUCKETS) + f" | {_cell(summary['scores'][t])} |")
        avg = summary["bucket_average"]
        lines.append("| **Avg.** | " + " | ".join(_cell(avg[k]) for k in LONGBENCH_E_BUCKETS) + f" | {_cell(summary['average'])} |")
    else:
        lines += ["| Method | " + " | ".join(SHORT_NAMES.get(t, t) for t in names) + " | Avg. |",
                  "|---|" + "---:|" * (len(names) + 1),
                  f"| {method_tag} | " + " | ".join(_cell(summary["scores"][t]) for t in names) + f" | {_cell(summary['average'])} |"]
    cats = summary["categories"]
    lines += ["", "| " + " | ".join(c for c in TASK_CATEGORIES if c in cats) + " |", "|" + "---:|" * len(cats),
              "| " + " | ".join(_cell(cats[c]) for c in TASK_CATEGORIES if c in cats) + " |", ""]
    lines += [
        f"- Avg.: {summary['average_note']}.",
        f"- Items: {summary['total_items']} ({', '.join(f'{t} {c}' for t, c in summary['items'].items())})"
        + (f"; task.limit={summary['limit']}" if summary.get("limit") else "") + ".",
        f"- Chat format: {rules['chat_format']} on {len(rules['chat_tasks'])} task(s); raw: {', '.join(rules['raw_tasks']) or 'none'}.",
        f"- Middle truncation budget: {rules['truncation']['budget_tokens']} tokens; first-token guard: {rules['min_new_tokens']}.",
        f"- code_sim backend: {summary['code_sim_backend']}.",
    ]
    return "\n".join(lines) + "\n"
