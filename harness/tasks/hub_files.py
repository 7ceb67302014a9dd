"""The official data files of a hub dataset: from `task.data_dir` (offline) or downloaded by id (huggingface_hub).

Every field benchmark (longbench_v2, infinitebench, ...) names its files as they are on the hub; a folder given
as `task.data_dir` holds those files under the same names. A download that fails (offline, no such repository)
ends in one line saying what to download and where to put it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig

from harness.errors import HarnessError


def data_file(task: DictConfig, filename: str, what: str, hub_filename: str | None = None) -> tuple[Path, str]:
    """(path of `filename`, its origin for the results: "task.data_dir" or "hub:<repo>/<filename>"). `hub_filename`:
    the file's name on the hub where it differs from the one looked for in task.data_dir (GSM8K: the hub's parquet,
    the authors' test.jsonl); a folder holding the hub file under its own name (no `filename`) is read too."""
    if task.get("data_dir"):
        folder = Path(str(task.data_dir)).expanduser()
        if not folder.is_dir():
            raise HarnessError(f"task.data_dir={folder} is not a folder; give the folder holding {what}'s {filename}")
        path = folder / filename
        if not path.is_file() and hub_filename and (folder / Path(hub_filename).name).is_file():
            path = folder / Path(hub_filename).name  # the downloaded hub file, put there as it is
        if not path.is_file():
            raise HarnessError(f"{path} is missing; task.data_dir must hold {what}'s official files ({filename})")
        return path, "task.data_dir"
    repo, filename = str(task.hub_repo), hub_filename or filename
    return hub_file(repo, filename), f"hub:{repo}/{filename}"


@lru_cache(maxsize=64)
def hub_file(repo: str, filename: str) -> Path:
    """One file of a hub dataset, downloaded once into the huggingface_hub cache."""
    import huggingface_hub

    try:
        return Path(huggingface_hub.hf_hub_download(repo_id=repo, filename=filename, repo_type="dataset"))
    except Exception as exc:  # offline, no such repo or file, HTTP error: all end the same way
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise HarnessError(
            f"{filename} could not be downloaded from the hub dataset {repo} ({type(exc).__name__}: {reason}); download "
            f"https://huggingface.co/datasets/{repo}/resolve/main/{filename} where the network allows and pass "
            f"task.data_dir=<the folder holding it>") from None


def data_files(task: DictConfig, folder: str, prefix: str, suffix: str, what: str) -> tuple[list[Path], str]:
    """Every file `<folder>/<prefix>*<suffix>` of the dataset, in name order (a hub config's parquet shards:
    `4096/test-00000-of-00002.parquet`, ...): from `task.data_dir` (the same layout) or listed on the hub and
    downloaded. Returns (paths, origin); none found ends in one line."""
    def wanted(name: str) -> bool:
        head, _, tail = name.rpartition("/")
        return head == folder and tail.startswith(prefix) and tail.endswith(suffix)

    if task.get("data_dir"):
        root = Path(str(task.data_dir)).expanduser()
        if not root.is_dir():
            raise HarnessError(f"task.data_dir={root} is not a folder; give the folder holding {what}'s {folder}/ files")
        paths = sorted(p for p in (root / folder).glob(f"{prefix}*{suffix}") if p.is_file()) if (root / folder).is_dir() else []
        if not paths:
            raise HarnessError(f"{root / folder} holds no {prefix}*{suffix}; task.data_dir must hold {what}'s files as the hub "
                               f"stores them ({folder}/{prefix}00000-of-00001{suffix})")
        return paths, "task.data_dir"
    repo = str(task.hub_repo)
    try:
        import huggingface_hub

        names = sorted(n for n in huggingface_hub.list_repo_files(repo, repo_type="dataset") if wanted(n))
    except Exception as exc:  # offline, no such repo: the same one line as a failed download
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise HarnessError(f"the files of {repo} could not be listed on the hub ({type(exc).__name__}: {reason}); download "
                           f"https://huggingface.co/datasets/{repo}/tree/main/{folder} where the network allows and pass "
                           "task.data_dir=<the folder holding it>") from None
    if not names:
        raise HarnessError(f"the hub dataset {repo} has no {folder}/{prefix}*{suffix}; check the length (its configs)")
    return [hub_file(repo, n) for n in names], f"hub:{repo}/{folder}"


def jsonl_rows(task: DictConfig, filename: str, what: str, check, *args) -> tuple[list[dict], str]:
    """The rows of a benchmark's `filename` (JSON lines, from task.data_dir or the hub), each passed through
    `check(row, where, *args)` (a module-level function: it refuses a bad row in one line and may return it completed),
    the first `task.limit`: (rows, origin). Read once per file version."""
    path, origin = data_file(task, filename, what)
    return file_rows(path, check, *args)[: task.get("limit") or None], origin


def file_rows(path: Path, check, *args) -> list[dict]:
    """Every row of a JSON-lines or parquet file (a hub dataset's converted split), each through
    `check(row, where, *args)`; read once per file version (modification time and size)."""
    st = Path(path).stat()
    return list(_rows(str(path), check, args, (st.st_mtime_ns, st.st_size)))


@lru_cache(maxsize=32)
def _rows(path: str, check, args: tuple, _version: tuple) -> tuple[dict, ...]:
    import json

    from harness.errors import require

    if path.endswith(".parquet"):
        import pandas as pd

        records = json.loads(pd.read_parquet(path).to_json(orient="records", force_ascii=False))
        rows = [check(r, f"{path} row {i}", *args) for i, r in enumerate(records)]
    else:
        rows = []
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(check(json.loads(line), f"{path}:{number}", *args))
            except json.JSONDecodeError as exc:
                raise HarnessError(f"{path}:{number}: not valid JSON ({exc.msg}); one object per line") from None
    require(rows, f"{path} has no rows")
    return tuple(rows)
