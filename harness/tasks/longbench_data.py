"""LongBench (v1) data and prompts, as THUDM/LongBench `pred.py` builds them.

Data: a folder of the official `<name>.jsonl` files (`task.data_dir`; a copy of `data.zip` is
accepted too), or, when `task.data_dir` is null, the hub's `data.zip` (`task.hub_repo`, default
THUDM/LongBench) downloaded once by huggingface_hub and read straight from the zip (members
`data/<name>.jsonl`). No loading script, no `datasets`. Every row is checked (fields present,
types right); a bad row is a HarnessError naming file:line.

Prompt: the official template (`dataset2prompt[name].format(**row)`), middle truncation on the
tokens of that raw prompt (special tokens counted, as pred.py tokenizes it), then the model's chat
formatting, except for the six tasks pred.py leaves raw.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig, ListConfig

from harness.errors import HarnessError, require
from metrics.longbench import CODE_SIM_BACKENDS
from metrics.longbench_config import load_dataset2maxlen, load_dataset2prompt
from metrics.longbench_tasks import LONGBENCH_ALL_TASKS, LONGBENCH_E_TASKS, LONGBENCH_EN_TASKS

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


def _row_problem(obj) -> str | None:
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    missing = [f for f in ROW_FIELDS if f not in obj]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    for name in ("input", "context", "dataset", "language", "_id"):
        if not isinstance(obj[name], str):
            return f"field {name!r} must be a string, got {type(obj[name]).__name__}"
    if not isinstance(obj["answers"], list) or not all(isinstance(a, str) for a in obj["answers"]):
        return "field 'answers' must be a list of strings"
    if not isinstance(obj["length"], int) or isinstance(obj["length"], bool):
        return f"field 'length' must be an integer, got {type(obj['length']).__name__}"
    classes = obj["all_classes"]
    if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)):
        return "field 'all_classes' must be a list of strings or null"
    return None


def parse_rows(data: bytes, label: str) -> list[dict]:
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
        problem = _row_problem(obj)
        if problem:
            raise HarnessError(f"{label}:{number}: {problem}; fix or remove that line")
        rows.append(obj)
    require(rows, f"{label} has no rows")
    return rows


@lru_cache(maxsize=64)
def _cached_rows(source: DataSource, stem: str, _version: tuple) -> tuple[dict, ...]:
    return tuple(parse_rows(source.read(stem), source.label(stem)))


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


def newline_token_id(tokenizer) -> int:
    """pred.py's samsum stop token: `tokenizer.encode("\\n", add_special_tokens=False)[-1]`."""
    return int(tokenizer.encode("\n", add_special_tokens=False)[-1])


def max_new_tokens(dataset: str) -> int:
    return int(load_dataset2maxlen()[dataset])
