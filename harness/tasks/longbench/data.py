"""LongBench (v1) data and prompts, as THUDM/LongBench `pred.py` builds them.

Data: a folder of the official `<name>.jsonl` files (`task.data_dir`; a copy of `data.zip` is
accepted too), or, when `task.data_dir` is null, the hub's `data.zip` (`task.hub_repo`, default
THUDM/LongBench) downloaded once by huggingface_hub and read straight from the zip (members
`data/<name>.jsonl`). No loading script, no `datasets`. Every row is checked against what the
official scorer needs to score it (see `_row_problem`); a row it cannot score is a HarnessError
naming file:line.

Prompt: the official template (`dataset2prompt[name].format(**row)`), middle truncation on the
tokens of that raw prompt (special tokens counted, as pred.py tokenizes it), then the model's chat
formatting, except for the six tasks pred.py leaves raw.
"""

from __future__ import annotations

import json
import re
import string
import unicodedata
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig, ListConfig

from harness.errors import HarnessError, require
from metrics.longbench import CODE_SIM_BACKENDS
from metrics.longbench_config import load_dataset2maxlen, load_dataset2prompt
from metrics.longbench_tasks import LONGBENCH_ALL_TASKS, LONGBENCH_E_TASKS, LONGBENCH_EN_TASKS

# Column headers of the papers' LongBench tables (SnapKV, PyramidKV, ...).
SHORT_NAMES = {
    "narrativeqa": "NrtvQA", "qasper": "Qasper", "multifieldqa_en": "MF-en", "hotpotqa": "HotpotQA",
    "2wikimqa": "2WikiMQA", "musique": "Musique", "gov_report": "GovReport", "qmsum": "QMSum",
    "multi_news": "MultiNews", "trec": "TREC", "triviaqa": "TriviaQA", "samsum": "SAMSum",
    "passage_count": "PCount", "passage_retrieval_en": "PRe", "lcc": "Lcc", "repobench-p": "RB-P",
    "multifieldqa_zh": "MF-zh", "dureader": "DuReader", "vcsum": "VCSum", "lsht": "LSHT",
    "passage_retrieval_zh": "PRe-zh",
}

# pred.py: "chat models are better off without build prompts on these tasks".
RAW_TASKS: tuple[str, ...] = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")

# The official row schema (the hub loading script's features).
ROW_FIELDS: tuple[str, ...] = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")

VARIANTS = {"longbench": "", "longbench_e": "_e"}


def variant_suffix(task_name: str) -> str:
    require(task_name in VARIANTS, f"task.name={task_name!r} is not a LongBench task ({', '.join(VARIANTS)})")
    return VARIANTS[task_name]


def default_datasets(task_name: str) -> tuple[str, ...]:
    return LONGBENCH_E_TASKS if variant_suffix(task_name) else LONGBENCH_EN_TASKS


def valid_datasets(task_name: str) -> tuple[str, ...]:
    return LONGBENCH_E_TASKS if variant_suffix(task_name) else LONGBENCH_ALL_TASKS


def selected_datasets(task: DictConfig) -> list[str]:
    """The datasets to run, in the canonical (paper) order; `_e` names accepted for longbench_e."""
    suffix = variant_suffix(task.name)
    valid = valid_datasets(task.name)
    chosen = task.get("datasets")
    if chosen is None:
        return list(default_datasets(task.name))
    if isinstance(chosen, str):
        chosen = [chosen]
    require(isinstance(chosen, (list, tuple, ListConfig)), f"task.datasets must be a list of names or null, got {chosen!r}")
    names = []
    for raw in chosen:
        name = str(raw)
        if suffix and name.endswith(suffix) and name[: -len(suffix)] in valid:
            name = name[: -len(suffix)]
        if name not in valid:
            raise HarnessError(f"task.datasets: unknown {task.name} dataset {name!r}; valid: {', '.join(valid)}")
        names.append(name)
    require(names, f"task.datasets is empty; give at least one of: {', '.join(valid)} (or null for the default set)")
    return [n for n in valid if n in set(names)]


# --------------------------------------------------------------------------------------------
# Where the files come from
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSource:
    """A folder of `<name>.jsonl` files, or a zip holding `data/<name>.jsonl`."""

    kind: str  # "dir" | "zip"
    path: Path
    origin: str  # for results: "task.data_dir" or "hub:<repo>"

    def label(self, stem: str) -> str:
        return str(self.path / f"{stem}.jsonl") if self.kind == "dir" else f"{self.path}!{self._member(stem) or f'data/{stem}.jsonl'}"

    def _member(self, stem: str) -> str | None:
        names = _zip_members(str(self.path), self.path.stat().st_mtime_ns)
        for candidate in (f"data/{stem}.jsonl", f"{stem}.jsonl"):
            if candidate in names:
                return candidate
        return next((n for n in names if n.endswith(f"/{stem}.jsonl")), None)

    def read(self, stem: str) -> bytes:
        if self.kind == "dir":
            path = self.path / f"{stem}.jsonl"
            if not path.is_file():
                raise HarnessError(f"LongBench file {path} is missing; task.data_dir must hold the official <name>.jsonl files")
            return path.read_bytes()
        member = self._member(stem)
        if member is None:
            raise HarnessError(f"LongBench file data/{stem}.jsonl is missing from {self.path}")
        with zipfile.ZipFile(self.path) as zf:
            return zf.read(member)

    def version(self, stem: str) -> tuple:
        """What the cached rows depend on (file identity)."""
        target = self.path / f"{stem}.jsonl" if self.kind == "dir" else self.path
        try:
            st = target.stat()
        except OSError:
            return (None, None)
        return (st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _zip_members(path: str, _mtime: int) -> frozenset[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            return frozenset(zf.namelist())
    except (OSError, zipfile.BadZipFile) as exc:
        raise HarnessError(f"{path} is not a readable zip file ({exc}); delete it or point task.data_dir at the unzipped folder") from None


def data_source(task: DictConfig) -> DataSource:
    if task.get("data_dir"):
        path = Path(str(task.data_dir)).expanduser()
        if path.is_dir():
            return DataSource("dir", path, "task.data_dir")
        if path.is_file() and path.suffix == ".zip":
            _zip_members(str(path), path.stat().st_mtime_ns)
            return DataSource("zip", path, "task.data_dir")
        raise HarnessError(f"task.data_dir={path} is neither a folder of LongBench <name>.jsonl files nor a data.zip")
    repo = str(task.get("hub_repo") or "THUDM/LongBench")
    return DataSource("zip", hub_zip(repo), f"hub:{repo}/data.zip")


@lru_cache(maxsize=4)
def hub_zip(repo: str) -> Path:
    """The hub's data.zip, downloaded once into the huggingface_hub cache."""
    import huggingface_hub

    try:
        path = Path(huggingface_hub.hf_hub_download(repo_id=repo, filename="data.zip", repo_type="dataset"))
    except Exception as exc:  # offline, no such repo, HTTP error: all end the same way
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise HarnessError(
            f"LongBench data.zip could not be downloaded from the hub dataset {repo} ({type(exc).__name__}: {reason}); "
            f"download https://huggingface.co/datasets/{repo}/resolve/main/data.zip where the network allows, "
            f"unzip it and pass task.data_dir=<the folder holding the <name>.jsonl files>"
        ) from None
    _zip_members(str(path), path.stat().st_mtime_ns)
    return path


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


# What a row must hold: exactly what the official pipeline needs to score it (THUDM/LongBench pred.py,
# eval.py, metrics.py), nothing stricter. A row it scores is accepted; a row it cannot score is a
# HarnessError naming file:line.
#
# - pred.py formats the template with `template.format(**row)`: every field the template names must be
#   present (input, context); str.format takes any JSON value. It then copies `answers`, `all_classes`
#   and `length` into its output (`json_obj[...]`), so those three must be present, with any value
#   except where eval.py needs more (below).
# - eval.py: `for ground_truth in answers`: `answers` must be iterable: a list (the official data), a
#   string (eval.py scores each character as an answer) or an object (its keys). An empty list scores 0.
#   Each ground truth must go through the task's metric for ANY prediction:
#     qa_f1_score (normalize_answer calls .lower()), qa_f1_zh_score and rouge_zh_score (jieba.cut
#       decodes non-strings and fails): a string;
#     rouge_score: anything (its bare `except` scores a failure 0.0);
#     count_score: anything (it compares str(number) == str(ground_truth), so 3 and "3" both work);
#     retrieval_score / retrieval_zh_score: a string holding "Paragraph <n>" / "段落<n>" (re.findall(...)[0]);
#     classification_score: `class in ground_truth` once a class occurs in the prediction: a string, list
#       or object; and `all_classes` must yield strings when iterated (`class in prediction`): a list of
#       strings (the official data), an object or a string; null fails.
#       eval.py takes the file's last all_classes, but a limited or sharded run can end on any row, so
#       every row of trec / lsht needs its own;
#     code_sim_score: fuzz.ratio returns 0 for None and otherwise takes len() of it: None, a string, list
#       or object (a number fails).
#   `length` is read only by the LongBench-E buckets (`length < 4000`): a number in `_e` files, anything
#   elsewhere. `dataset` and `language` are read by neither script: not required.
# - `_id` is read by neither script either, but the harness keys resumed predictions by it: required.
_STRING = ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
           "dureader", "vcsum", "triviaqa")  # qa_f1_score, qa_f1_zh_score, rouge_zh_score
_RETRIEVAL = {"passage_retrieval_en": (re.compile(r"Paragraph (\d+)"), "Paragraph <n>"),
              "passage_retrieval_zh": (re.compile(r"段落(\d+)"), "段落<n>")}
_CLASSIFICATION = ("trec", "lsht")
_CODE = ("lcc", "repobench-p")


def _kind(value) -> str:
    return "null" if value is None else {"str": "string", "dict": "object", "list": "list", "bool": "boolean"}.get(
        type(value).__name__, "number")


def _ground_truth_problem(dataset: str, gt) -> str | None:
    """Why the official metric of `dataset` cannot score the ground truth `gt`, or None."""
    if dataset in _STRING and not isinstance(gt, str):
        return f"is a {_kind(gt)}, but {dataset}'s metric needs a string"
    if dataset in _RETRIEVAL:
        pattern, label = _RETRIEVAL[dataset]
        if not isinstance(gt, str):
            return f"is a {_kind(gt)}, but {dataset}'s retrieval_score needs a string holding '{label}'"
        if not pattern.search(gt):
            return f"{gt[:60]!r} holds no '{label}' id, which {dataset}'s retrieval_score reads"
    if dataset in _CLASSIFICATION and not isinstance(gt, (str, list, dict)):
        return f"is a {_kind(gt)}, but {dataset}'s classification_score needs a string"
    if dataset in _CODE and gt is not None and not isinstance(gt, (str, list, dict)):
        return f"is a {_kind(gt)}, but {dataset}'s code_sim_score needs a string"
    return None


@lru_cache(maxsize=64)
def _template_fields(dataset: str) -> tuple[str, ...]:
    template = load_dataset2prompt().get(dataset)
    if template is None:
        return ("input", "context")
    return tuple(dict.fromkeys(name for _, name, _, _ in string.Formatter().parse(template) if name))


def _row_problem(obj, dataset: str | None = None, longbench_e: bool = False) -> str | None:
    """Why the official pipeline cannot score this row of `dataset` (None: unknown, generic checks)."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got a {_kind(obj)}"
    fields = _template_fields(dataset) if dataset else ("input", "context")
    missing = [f for f in (*fields, "answers", "all_classes", "length", "_id") if f not in obj]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    answers = obj["answers"]
    if not isinstance(answers, (list, str, dict)):
        return f"field 'answers' is a {_kind(answers)}; eval.py iterates over it: give a list of answers"
    if dataset:
        for i, gt in enumerate(answers):
            problem = _ground_truth_problem(dataset, gt)
            if problem:
                where = f"answers[{i}]" if isinstance(answers, list) else f"answer {gt!r} of the {_kind(answers)} 'answers'"
                return f"{where} {problem}"
    if dataset in _CLASSIFICATION:
        classes = obj["all_classes"]
        if not isinstance(classes, (str, dict)) and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            return (f"field 'all_classes' must be the list of class names (strings) that {dataset}'s classification_score "
                    f"looks for, got {json.dumps(classes)[:60]}")
    if longbench_e and not isinstance(obj["length"], (int, float)):  # Python compares true/false as 1/0
        return f"field 'length' is a {_kind(obj['length'])}; LongBench-E buckets items by it (length < 4000): give a number"
    return None


def _dataset_of(stem: str) -> tuple[str | None, bool]:
    """(dataset, is LongBench-E) of a file stem; (None, False) for a name that is neither."""
    if stem in LONGBENCH_ALL_TASKS:
        return stem, False
    if stem.endswith("_e") and stem[:-2] in LONGBENCH_E_TASKS:
        return stem[:-2], True
    return None, False


def parse_rows(data: bytes, label: str, stem: str | None = None) -> list[dict]:
    """The rows of one jsonl file; `stem` (e.g. "trec", "qasper_e") selects its dataset's checks."""
    dataset, longbench_e = _dataset_of(stem) if stem else (None, False)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HarnessError(f"{label} is not UTF-8 text (byte {exc.start}); replace it with the official file") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HarnessError(f"{label}:{number}: not valid JSON ({exc.msg}); fix or remove that line") from None
        problem = _row_problem(obj, dataset, longbench_e)
        if problem:
            raise HarnessError(f"{label}:{number}: {problem}; fix or remove that line")
        rows.append(obj)
    require(rows, f"{label} has no rows")
    return rows


@lru_cache(maxsize=64)
def _cached_rows(source: DataSource, stem: str, _version: tuple) -> tuple[dict, ...]:
    return tuple(parse_rows(source.read(stem), source.label(stem), stem))


def load_rows(source: DataSource, stem: str) -> list[dict]:
    """The validated rows of `<stem>.jsonl`, in file order (cached per file version)."""
    return list(_cached_rows(source, stem, source.version(stem)))


def file_stem(task_name: str, dataset: str) -> str:
    return dataset + variant_suffix(task_name)


# --------------------------------------------------------------------------------------------
# Task options
# --------------------------------------------------------------------------------------------


def check_options(task: DictConfig) -> None:
    limit = task.get("limit")
    require(limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit > 0),
            f"task.limit={limit!r} must be a positive number of items per task, or null for all")
    shard = task.get("shard") or {}
    index, count = shard.get("index", 0), shard.get("count", 1)
    require(isinstance(count, int) and count >= 1, f"task.shard.count={count!r} must be an integer >= 1")
    require(isinstance(index, int) and 0 <= index < count, f"task.shard.index={index!r} must be in 0..{count - 1} (task.shard.count={count})")
    require(isinstance(task.get("min_new_tokens", False), bool),
            f"task.min_new_tokens={task.get('min_new_tokens')!r} must be true (SnapKV pred_snap.py guard) or false (official pred.py)")
    backend = task.get("code_sim_backend", "difflib")
    require(backend in CODE_SIM_BACKENDS, f"task.code_sim_backend={backend!r} is not one of {', '.join(CODE_SIM_BACKENDS)}")
    if backend == "levenshtein":
        import importlib.util

        require(importlib.util.find_spec("Levenshtein") is not None,
                "task.code_sim_backend=levenshtein needs python-Levenshtein (pip install python-Levenshtein); difflib is LongBench's reference")


# --------------------------------------------------------------------------------------------
# Prompts (pred.py)
# --------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    text: str  # the official prompt after middle truncation, before chat formatting
    raw_tokens: int  # tokens of the untruncated raw prompt, special tokens included
    truncated: bool


def official_prompt(dataset: str, row: dict, templates: dict | None = None) -> str:
    templates = templates or load_dataset2prompt()
    return templates[dataset].format(**row)


def truncate_middle(prompt: str, tokenizer, max_length: int) -> Prompt:
    """pred.py: tokenize the raw prompt (with special tokens); if longer than `max_length`, keep the
    first and last int(max_length/2) tokens, decode each half without special tokens, join the text."""
    ids = tokenizer(prompt, truncation=False)["input_ids"]
    if len(ids) <= max_length:
        return Prompt(prompt, len(ids), False)
    half = int(max_length / 2)
    text = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return Prompt(text, len(ids), True)


def build_prompt(dataset: str, row: dict, tokenizer, max_length: int, templates: dict | None = None) -> Prompt:
    return truncate_middle(official_prompt(dataset, row, templates), tokenizer, max_length)


def is_raw(dataset: str) -> bool:
    return dataset in RAW_TASKS


def render(dataset: str, prompt: str, loaded) -> tuple[str, list[int]]:
    """The model input, text and ids. Chat formatting (by `model.chat_format`) after truncation,
    except for the raw tasks, which pred.py tokenizes as plain text with the tokenizer's special tokens."""
    if is_raw(dataset):
        return prompt, list(loaded.tokenizer(prompt, truncation=False)["input_ids"])
    text = loaded.format_chat([{"role": "user", "content": prompt}])
    return text, list(loaded.encode(text))


# --------------------------------------------------------------------------------------------
# The question's position in the prompt (query-agnostic evaluation)
# --------------------------------------------------------------------------------------------

# Tasks whose official template has nothing after {context}: none. Every one of the 21 templates has
# text after it (for trec and lsht only "\n{input}"). Such a task's question_start is len(ids).
NOTHING_AFTER_CONTEXT: tuple[str, ...] = ()
# Tasks whose template names no {input}: what follows the context is a fixed instruction, no question.
NO_QUESTION_TASKS: tuple[str, ...] = ("gov_report", "multi_news", "vcsum", "passage_count", "lcc")


def template_suffix(dataset: str, row: dict, templates: dict | None = None) -> str:
    """The official template's text after {context}, formatted with the row (the question part)."""
    templates = templates or load_dataset2prompt()
    tail = templates[dataset].split("{context}", 1)[1] if "{context}" in templates[dataset] else ""
    return tail.format(**row)


def _squash(text: str) -> str:
    return "".join(unicodedata.normalize("NFC", text).split())


def question_start(dataset: str, row: dict, ids: list[int], tokenizer, templates: dict | None = None) -> int:
    """Index in `ids` (a rendered prompt's final ids: middle truncation and chat formatting done, as
    `render` returns them) where the template's text after {context} begins: `ids[question_start:]`
    hold the question and everything after it (the chat format's closing text included), the part a
    query-agnostic evaluation prefills after compression; `ids[:question_start]` hold the
    instructions and the context. len(ids) when the template has nothing after {context}.

    Found on the ids themselves, which are not changed: the largest i such that `decode(ids[i:])`
    still holds every non-whitespace character of the suffix (whitespace and Unicode NFC ignored,
    so a chat template's trimming, SentencePiece's dropped leading space and decode's clean-up of
    spaces do not matter), then moved left over whitespace-only tokens that belong to the suffix's
    leading whitespace. A token that carries both the context's last characters and the suffix's
    first non-blank ones stays on the question side; one that ends the context and starts the
    suffix with whitespace only (Llama-3's ".\n\n") stays on the context side. If middle truncation
    cut into the suffix (a suffix longer than half the budget), the surviving end of it is used.
    """
    return suffix_start(ids, tokenizer, template_suffix(dataset, row, templates))


def suffix_start(ids: list[int], tokenizer, suffix: str) -> int:
    """Index in `ids` where the text `suffix` (the prompt's text after its context) begins; the rule of
    `question_start`, for any prompt whose question part is a known text (LongBench-v2 and the other field
    benchmarks use it too)."""
    n = len(ids)
    target = _squash(suffix)
    if not target:
        return n

    def holds(i: int, text: str) -> bool:
        return text in _squash(tokenizer.decode(ids[i:]))

    full = _squash(tokenizer.decode(ids))
    if target not in full:  # truncation cut into the suffix: find the longest end of it that survived
        lo, hi = 0, len(target)
        while lo < hi:
            mid = (lo + hi) // 2
            if target[mid:] in full:
                hi = mid
            else:
                lo = mid + 1
        target = target[lo:]
        if not target:
            return n
    good, bad, step = 0, n, 1  # holds(good) and not holds(bad)
    while n - step > good:
        if holds(n - step, target):
            good = n - step
            break
        bad = n - step
        step *= 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if holds(mid, target):
            good = mid
        else:
            bad = mid
    lead = len(suffix) - len(suffix.lstrip())
    while good > 0 and lead > 0:
        piece = tokenizer.decode(ids[good - 1 : good])
        if not piece or piece.strip() or len(piece) > lead:
            break
        lead -= len(piece)
        good -= 1
    return good


def newline_token_id(tokenizer) -> int:
    """pred.py's samsum stop token: `tokenizer.encode("\\n", add_special_tokens=False)[-1]`."""
    return int(tokenizer.encode("\n", add_special_tokens=False)[-1])


def max_new_tokens(dataset: str) -> int:
    return int(load_dataset2maxlen()[dataset])
