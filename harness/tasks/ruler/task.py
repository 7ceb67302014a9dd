"""RULER (NVIDIA/RULER): its 13 tasks generated offline by its rules (ruler_data.py), scored by its
metrics (metrics/ruler.py), every method of `methods=[...]` from one prefill per sample.

The model input is RULER's: the task template inside the model's chat wrapper (`task.template=model`,
the model's `chat_format`; or `base`: no wrapper, RULER's and kvpress's `base`), then the answer
prefix after the wrapper, tokenized as one text. Lengths count that input's tokens plus the task's
tokens_to_generate, in the model's own tokenizer. Decoding is greedy, at most tokens_to_generate
tokens, stopped at EOS only (RULER has no stop words; the model's `stop_strings` are not used).

Data (`task.source`): null/`harness`: generated here by RULER's rules; `kvpress`: kvpress's pre-generated RULER
(`simonjegou/ruler`, its leaderboard's samples, harness/tasks/ruler/kvpress_data.py) read from the hub or
`task.data_dir`, run through kvpress's split and scored after kvpress's clean-up (control characters deleted).

Protocols: `task.query_aware=true` compresses the whole prompt (RULER as the KV papers run it);
`false` is kvpress's split: the compressed part is everything before the LAST match of the task's
question pattern (niah "What is/are all the special magic", vt/cwe/fwe "Question: ...", qa the second
"Answer the question based on the given documents."), so RULER's task preamble (and vt's and cwe's
one-shot example) is compressed with the context; the question, the chat wrapper's closing tokens and
the answer prefix are prefilled on top, uncompressed.

One key at a time (`task.one_key_at_a_time=true`, a named departure from RULER): the niah tasks with several
keys (niah_multikey_1: 4 keys, one asked; niah_multiquery: 4 keys, all asked in one question) ask each inserted
key alone, in RULER's one-key wording, over one context: K questions per sample, one record each
(`question_index`), each scored by the task's metric against that key's values. Query-agnostic, the context is
prefilled and compressed once and every question asked on it (how a compressed context is reused); query-aware,
each question is compressed with the context. Other tasks keep their one question.
"""

from __future__ import annotations

import bisect
import logging
import re

from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.models import LoadedModel
from harness.tasks import contract
from harness.generation.prompt import Prompt, Question
from harness.tables import _mean
from harness.tasks.contract import Built, GenerationTask
from harness.tasks.ruler.data import (ALL_TASKS, ANSWER_PATTERNS, QA_FILES, SYNTHETIC, TASKS, Sample, TaskGenerator, Wrapper,
                                     qa_files)
from metrics.ruler import kvpress_postprocess, metric_for, postprocess_pred, sample_score

log = logging.getLogger(__name__)

PROTOCOL_OPTIONS = ("query_aware", "prefill_chunk_size")  # both applied (harness.app.check_protocol)
GRID_KEYS = ("tasks", "lengths", "samples")  # which items run: a run directory takes another grid (rundir)
TEMPLATES = ("model", "base")
SPLITS = ("ruler", "kvpress")
SOURCES = ("harness", "kvpress")  # who made the samples: RULER's rules run here, or kvpress's hub dataset
POSTPROCESS = {"harness": postprocess_pred, "kvpress": kvpress_postprocess}  # each source scored as its authors score it
TABLE_FILE = "ruler_table.md"  # per setting: tasks x lengths and the average (the report compares settings)
SENTINEL = "\x00RULER\x00"
ESSAY_TASKS = tuple(t for t, (fam, a) in TASKS.items() if fam == "niah" and a["haystack"] == "essay")


def task_names(task: DictConfig) -> list[str]:
    """task.tasks; null: the 11 synthetic tasks."""
    return list(SYNTHETIC) if task.get("tasks") is None else [str(t) for t in task.tasks]


def source_of(task: DictConfig) -> str:
    return str(task.get("source") or "harness")


def validate(task: DictConfig) -> None:
    names = task_names(task)
    source = source_of(task)
    require(source in SOURCES, f"task.source={task.get('source')!r} is not one of {', '.join(SOURCES)} (or null: harness)")
    require(names, "task.tasks is empty; give RULER task names, e.g. task.tasks=[niah_single_1,vt]")
    for name in names:
        require(name in TASKS, f"task.tasks: unknown RULER task {name!r}; known: {', '.join(ALL_TASKS)}")
    require(len(set(names)) == len(names), "task.tasks lists a task twice")
    require(len(task.lengths) > 0, "task.lengths is empty; give at least one length in tokens, e.g. task.lengths=[4096]")
    for n in task.lengths:
        require(int(n) > 0, f"task.lengths: {n} is not a positive token count")
    require(int(task.samples) > 0, f"task.samples={task.samples}: give at least one sample per task and length")
    require(str(task.template) in TEMPLATES, f"task.template={task.template!r} is not one of {', '.join(TEMPLATES)}")
    if source == "kvpress":  # the samples are kvpress's files: nothing to generate, its split only
        require(task.get("split") in (None, "kvpress"), f"task.source=kvpress runs kvpress's split; task.split={task.get('split')!r} "
                "cannot re-cut its samples (leave task.split null or kvpress)")
        require(not task.get("one_key_at_a_time"), "task.one_key_at_a_time needs the samples generated here (task.source=harness)")
        return
    for name in names:
        if name.startswith("qa_"):
            dataset = TASKS[name][1]["dataset"]
            require(qa_files(task.get("qa_data_dir"), dataset) is not None,
                    f"RULER {name} needs {' or '.join(QA_FILES[dataset])} in task.qa_data_dir (now {task.get('qa_data_dir')!r}); "
                    "download it or leave qa_1/qa_2 out of task.tasks")
    split = task.get("split")
    require(split is None or str(split) in SPLITS, f"task.split={split!r} is not one of {', '.join(SPLITS)} (or null: ruler)")
    one_key = task.get("one_key_at_a_time")
    require(one_key in (None, True, False), f"task.one_key_at_a_time={one_key!r}: give true or false")
    if any(n in ESSAY_TASKS for n in names):
        essay_text(task)


def questions_per_sample(name: str, one_key: bool) -> int:
    """Questions asked per sample: each key of a niah task with several (niah sets nk = max(nk, nq)) under
    one key at a time, else RULER's one."""
    family, args = TASKS[name]
    keys = max(args.get("nk", 1), args.get("nq", 1)) if family == "niah" else 1
    return keys if one_key and keys > 1 else 1


def essay_text(task: DictConfig) -> str:
    """The essays in sorted file order, no separator (as harness/tasks/needle/task.py reads them)."""
    from harness.tasks.needle.task import haystack_files

    return "".join(p.read_text(encoding="utf-8", errors="replace") for p in haystack_files(task))


class Tokenized:
    """The model input of a sample: token ids and the character -> token mapping for the split and the needle
    spans. `split="ruler"`: RULER's input (wrapper, template, answer prefix) tokenized as one text.
    `split="kvpress"`: kvpress's RULER dataset and pipeline (create_huggingface_dataset.py,
    KVPressTextGenerationPipeline.preprocess): the samples are RULER's `base` ones (no wrapper: its data),
    cut into context (before the last question-pattern match), question (up to the answer pattern, so it
    keeps RULER's trailing space) and answer prefix (no leading space); the model input is
    [chat-template prefix + context] then [question + the template's suffix + answer prefix], the two
    tokenized apart; without a chat template (model.chat_format other than `template`) the prefix is the
    BOS text and the suffix "\n"."""

    def __init__(self, loaded: LoadedModel, template: str, split: str = "ruler"):
        self.tok = loaded.tokenizer
        self.kvpress = split == "kvpress"
        if template == "base" or self.kvpress:
            self.wrapper, self.add_special = Wrapper(), True
        else:
            before, after = loaded.format_chat([{"role": "user", "content": SENTINEL}]).split(SENTINEL)
            self.wrapper, self.add_special = Wrapper(before, after), loaded.chat_format != "template"
        if self.kvpress:
            if loaded.chat_format == "template":
                self.context_prefix, self.question_suffix = loaded.format_chat([{"role": "user", "content": SENTINEL}]).split(SENTINEL)
            else:
                self.context_prefix, self.question_suffix = getattr(self.tok, "bos_token", None) or "", "\n"

    def measure(self, text: str) -> int:
        """RULER's count (`text_to_tokens`: `tokenizer.tokenize(text)`): no BOS or other special token added,
        whatever the model input adds, so that the fit, its retries and the random stream are RULER's."""
        return len(self.tok.tokenize(text))

    def prompt(self, s: Sample) -> Prompt:
        family = TASKS[s.task][0]
        prompt = self._one(s.text, s.question_start, s.needle_chars, family)
        if not s.questions:
            return prompt
        # several keys asked one at a time: the context's tokens (those before the question) are the same in each
        start, questions = prompt.question_start, []
        for text, _ in s.questions:
            ids = self._one(text, s.question_start, [], family).ids
            if ids[:start] != prompt.ids[:start]:
                raise HarnessError(f"RULER {s.task}: the one-key questions tokenize the context differently; "
                                   "run it with task.one_key_at_a_time=false")
            questions.append(Question(ids[start:], {"question": (start, len(ids))}))
        spans = {k: v for k, v in prompt.spans.items() if k != "question"}
        return Prompt(prompt.ids[:start], spans=spans, questions=questions)

    def _one(self, text: str, question_char: int, needle_chars, family: str = "niah") -> Prompt:
        tail: list[int] = []
        if self.kvpress:  # [prefix + context] and [question + suffix + answer prefix], tokenized apart
            rest = text[question_char:]
            cut = re.search(ANSWER_PATTERNS[family], rest).start()
            tail = self.tok(rest[:cut] + self.question_suffix + rest[cut:], add_special_tokens=False)["input_ids"]
            shift = len(self.context_prefix)
            text, question_char = self.context_prefix + text[:question_char], question_char + shift
            needle_chars = [(a + shift, b + shift) for a, b in needle_chars]
        try:
            enc = self.tok(text, add_special_tokens=self.add_special and not self.kvpress, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError) as exc:
            raise HarnessError(f"task=ruler needs a tokenizer with character offsets (a fast tokenizer) to place the "
                               f"needle spans and the question split; {type(self.tok).__name__} has none ({exc})") from None
        ids, ends = list(enc["input_ids"]) + list(tail), [int(b) for _, b in enc["offset_mapping"]]
        if self.kvpress:
            ends += [ends[-1] if ends else 0] * len(tail)  # the question's tokens: after the context, past question_char

        def token_at(c: int) -> int:  # the token holding character c (the first token ending after it)
            return bisect.bisect_right(ends, c)

        question = len(ids) - len(tail) if self.kvpress else token_at(question_char)
        spans = {f"needle_{i}": (token_at(a), min(len(ids), bisect.bisect_left(ends, b) + 1)) for i, (a, b) in enumerate(needle_chars)}
        spans["question"] = (question, len(ids))
        return Prompt(ids, question, spans)


class RulerTask(GenerationTask):
    """A sample is (task name, length, index); under one key at a time, one question per inserted key."""

    log_name, key_fields, noun = "ruler_samples", ("task", "length", "index"), "samples"

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        super().__init__(cfg, loaded)
        task = self.task
        self.names, self.lengths = task_names(task), [int(n) for n in task.lengths]
        self.samples, self.seed = int(task.samples), int(task.seed)
        self.one_key = self.multi_question = bool(task.get("one_key_at_a_time") or False)
        if loaded.max_positions:
            require(max(self.lengths) <= loaded.max_positions,
                    f"task.lengths: {max(self.lengths)} exceeds {loaded.name}'s {loaded.max_positions} positions")
        self.source = source_of(task)
        self.split = "kvpress" if self.source == "kvpress" else str(task.get("split") or "ruler")
        self.postprocess = POSTPROCESS[self.source]
        self.origin: str | None = None  # where kvpress's files came from (task.data_dir or hub:<repo>/<length>)
        self.tokenized = Tokenized(loaded, str(task.template), self.split)
        self.essay = essay_text(task) if self.source == "harness" and any(n in ESSAY_TASKS for n in self.names) else None
        self.generated: dict[tuple[str, int], list[Sample]] = {}
        self.csv_columns = ("task", "length", "index", *(("question_index",) if self.one_key else ()), "protocol", "score",
                            "prompt_tokens", "question_start", "needle_kept", "question_kept", "budget_tokens", "new_tokens",
                            "stopped_by", "prefill_seconds", "decode_seconds", "references", "response")
        log.info("ruler: %d task(s) x %d length(s) x %d sample(s), %s, %s", len(self.names), len(self.lengths), self.samples,
                 self.protocol, f"template={task.template}" if self.source == "harness" else "kvpress's data and split")

    def items(self) -> list[tuple]:
        return [(name, n, i) for n in self.lengths for name in self.names for i in range(self.samples)]

    def questions(self, key) -> int:
        return questions_per_sample(key[0], self.one_key)

    def sample(self, name: str, length: int, index: int) -> Sample:
        if self.source == "kvpress":
            return self.kvpress_sample(name, length, index)
        if (name, length) not in self.generated:  # RULER's first `samples` samples of this task and length, in order
            gen = TaskGenerator(name, length, seed=self.seed, measure=self.tokenized.measure,
                                wrapper=self.tokenized.wrapper, essay=self.essay, qa_data_dir=self.task.get("qa_data_dir"),
                                one_key_at_a_time=self.one_key)
            self.generated[(name, length)] = gen.samples(self.samples)
        s = self.generated[(name, length)][index]
        if index == self.samples - 1:  # the items run in (length, task, index) order: this task and length are done
            self.generated.pop((name, length), None)
        return s

    def kvpress_sample(self, name: str, length: int, index: int) -> Sample:
        """The index-th row of the task in kvpress's file of this length (the file read once per length)."""
        from harness.tasks.ruler.kvpress_data import read_rows, sample_from_row

        if self.generated.get(("kvpress", length)) is None:
            self.generated = {}  # the items run length by length: one length's rows in memory
            rows, self.origin = read_rows(self.task, length, self.names, self.samples)
            self.generated[("kvpress", length)] = rows
        return sample_from_row(name, index, self.generated[("kvpress", length)][name][index])

    def build(self, item) -> Built:
        s = self.sample(*item)
        prompt = self.tokenized.prompt(s)
        return Built(prompt, decode={"max_new_tokens": s.tokens_to_generate}, data=s)

    def record(self, item, built: Built, i: int, text: str, answer) -> dict:
        name, length, index = item
        s = built.data
        asked, references = (s.questions or [(s.text, s.references)])[i]
        # token-weighted mean over the inserted needles (None: the task inserts none, or nothing compressed)
        kept = [(answer.diagnostics.get(f"{k}_kept"), b - a) for k, (a, b) in built.prompt.spans.items() if k.startswith("needle_")]
        weight = sum(n for _, n in kept)
        out = {"task": name, "length": length, "index": index, "references": references, "response": text,
               "score": sample_score(name, text, references, self.postprocess), "answer_prefix": s.answer_prefix,
               "source": self.source,
               "tokens_to_generate": s.tokens_to_generate,
               "needle_kept": round(sum(k * n for k, n in kept) / weight, 4) if kept and weight and all(k is not None for k, _ in kept) else None}
        if self.one_key:
            out.update(questions=len(s.questions), one_key_at_a_time=True)
        if self.task.get("log_prompts"):
            out["prompt"] = asked
        return out

    def summarize(self, rows: list[dict]) -> dict:
        summary = summarize(rows, self.names, self.lengths, self.postprocess)
        template = str(self.task.template) if self.source == "harness" else "base"  # kvpress's data: RULER's base template
        summary.update(template=template, split=self.split, source=self.source, data_origin=self.origin, seed=self.seed, samples_per_task=self.samples,
                       one_key_at_a_time=self.one_key, tokenizer=getattr(self.loaded.tokenizer, "name_or_path", None))
        return summary


    def finish(self, setting, rows: list[dict], summary: dict) -> None:
        path = setting.run_dir.path / TABLE_FILE
        path.write_text(ruler_table(summary, f"{self.loaded.name} · {setting.tag} · {self.protocol}"), encoding="utf-8")
        log.info("%s: RULER average %s (%s)", setting.tag, summary["average"], path)


def ruler_table(summary: dict, title: str) -> str:
    """The setting's RULER table: one row per length, each task's score (0-100) and RULER's average."""
    from harness.tasks.ruler.report import SHORT

    names = list(summary["tasks"])
    head = f"| Length | {' | '.join(SHORT.get(n, n) for n in names)} | Avg. |"
    lines = [f"## RULER · {title}", "", head, "|---:|" + "---:|" * (len(names) + 1)]
    cell = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    for length, part in summary["by_length"].items():
        star = "" if part["complete"] else "*"
        lines.append(f"| {length}{star} | {' | '.join(cell(part['tasks'][n]) for n in names)} | {cell(part['average'])} |")
    lines += ["", f"{summary['samples']} records, {summary['samples_per_task']} sample(s) per task and length, "
              f"{summary['protocol']}, template={summary['template']}, seed={summary['seed']}"
              + (", kvpress's RULER data (task.source=kvpress)" if summary.get("source") == "kvpress" else "")
              + (", one key at a time" if summary["one_key_at_a_time"] else "")
              + ". Columns: " + ", ".join(f"{SHORT.get(n, n)} = {n}" for n in names) + "; `*`: a task with no finished sample.", ""]
    return "\n".join(lines)


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    """Every (task, length, sample) for every setting, one prefill per sample (contract.run)."""
    return contract.run(RulerTask(cfg, loaded), settings, progress=progress)


def task_score(name: str, rows: list[dict], postprocess=postprocess_pred) -> float | None:
    """RULER's score of one task at one length: its metric over all samples' post-processed predictions
    (kvpress's data: kvpress's clean-up, `kvpress_postprocess`)."""
    if not rows:
        return None
    return metric_for(name)([postprocess(r["response"]) for r in rows], [r["references"] for r in rows])


def summarize(rows: list[dict], names: list[str], lengths: list[int], postprocess=postprocess_pred) -> dict:
    """Per length: each task's RULER score and their mean (RULER's per-length number); `tasks`: each task's
    mean over lengths; `average` (the headline): the mean of the per-length averages (one length: that
    length's average, the leaderboard's number). Averages use the already-rounded task scores, as RULER."""
    by_length = {}
    for n in lengths:
        scores = {name: task_score(name, [r for r in rows if r["task"] == name and r["length"] == n], postprocess) for name in names}
        done = [v for v in scores.values() if v is not None]
        by_length[str(n)] = {"tasks": scores, "average": round(sum(done) / len(done), 2) if done else None,
                             "complete": len(done) == len(names)}
    tasks = {name: _round2(_mean(by_length[str(n)]["tasks"][name] for n in lengths)) for name in names}
    averages = [v["average"] for v in by_length.values() if v["average"] is not None]
    return {
        "score_name": "ruler_average",
        "main_score": round(sum(averages) / len(averages), 2) if averages else None,
        "average": round(sum(averages) / len(averages), 2) if averages else None,
        "tasks": tasks,
        "by_length": by_length,
        "samples": len(rows),
        "mean_needle_kept": _mean(r.get("needle_kept") for r in rows),
        "mean_question_kept": _mean(r.get("question_kept") for r in rows),
        "needle_kept_by_task": {name: _mean(r.get("needle_kept") for r in rows if r["task"] == name) for name in names},
    }


def _round2(v):
    return None if v is None else round(v, 2)
