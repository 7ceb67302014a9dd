"""Everything a run writes lives in its run directory; this module owns how it is written.

- `config.yaml`: the resolved config. A rerun in the same directory compares against it and refuses
  when a key that changes results differs (unless `resume=false`, which starts the run afresh). The
  task's grid (`GRID_KEYS` of its module: lengths, depths, datasets, samples, ...) only chooses which
  items run: records are per item, so a rerun with another grid reuses the items the directory holds,
  computes the others, and summarises the grid it was asked; config.yaml then holds the latest grid.
- `provenance.json`: versions, git commit, seed, device, command line of this session, and of the
  earlier sessions a resumed run was made of (`earlier_sessions`).
- `*.jsonl`: per-item records, appended one line at a time and fsync'ed. On reopen a torn last line
  (a crash mid-write) is cut off, so resume finds exactly the items that were finished.
- `results.json` and tables: written atomically (temporary file + rename) at the end.
- `.lock`: held (fcntl.flock) by the process running the directory; a second process waits for it,
  then resumes (finding the first one's items done).

Code versions: every record carries `_code` (`code_version()`: a fingerprint of the harness and
metrics files, source and data, plus the torch and transformers versions). A rerun refuses to resume
records written by other code or library versions, naming what changed, unless `resume=force`.

A run that stops on a user error before it finished any item leaves nothing behind: `rollback()`
removes what `prepare()` wrote (and the directory, when that leaves it empty).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import signal
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from harness import REPO_ROOT, __version__
from harness.errors import HarnessError
from harness.methods.registry import noop_options  # also registers the kv.* resolvers of the method tags

log = logging.getLogger(__name__)

# Config keys that never change a run's results (paths, bookkeeping, launch settings). Everything else,
# a key that only one of the two configs has included, must match for a rerun to resume a run directory.
NON_RESULT_KEYS = (
    "resume", "hydra", "progress", "methods", "task.log_prompts", "task.shard", "model.device_map", "task.data_dir",
    "method.block_size",  # H2O: query rows per block while accumulating; the scores are exact for any size
    "task.prompt_style_by_chat_format",  # needle: how the default prompt_style is chosen; the resolved style is compared
    "task.qa_data_dir",  # RULER qa: where the dev files are read from (as task.data_dir for LongBench)
    "decode_together",  # batched or one-by-one decoding of a methods list: the same tokens (records say `decoded_with`)
    "task.batch_size",  # needle cells of one length batched: the same answers (records say `items_batched`)
)
SESSION_ID = uuid.uuid4().hex  # one per process: tells this session's provenance from earlier ones
# Provenance fields that, when they change between the sessions of one resumed run, may change results.
SESSION_KEYS = ("torch", "transformers", "python", "device", "cuda", "git")
# What `code_version()` hashes: everything under these folders of the repository (source and data),
# except caches and editor files. Libraries whose versions are recorded with it.
CODE_FOLDERS = ("harness", "metrics")
CODE_LIBRARIES = ("torch", "transformers")
CODE_FIELD = "_code"
LOCK_FILE = ".lock"
# Fault injection for the crash tests: "after:N" SIGKILLs this process right after its N-th appended
# record, "mid:N" in the middle of writing it (half a line on disk).
KILL_ENV = "KV_HARNESS_TEST_KILL"
_appended = 0


def resume_mode(value) -> bool | str:
    """`resume`: true (skip finished items), false (start afresh) or "force" (resume even records
    written by other code or library versions)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    if text == "force":
        return "force"
    raise HarnessError(f"resume={value!r} is not one of true, false, force")


@functools.lru_cache(maxsize=None)
def code_version() -> dict:
    """What produced a record: `fingerprint`, the first 12 hex digits of a SHA-256 over every file under
    harness/ and metrics/ (relative path and bytes, sorted; source and data), and the torch and
    transformers versions. Computed once per process."""
    from importlib import metadata

    digest = hashlib.sha256()
    for folder in CODE_FOLDERS:
        base = REPO_ROOT / folder
        files = [p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                 and not p.name.startswith(".") and not p.name.endswith(("~", ".pyc"))]
        for p in sorted(files, key=lambda q: q.relative_to(REPO_ROOT).as_posix()):
            digest.update(p.relative_to(REPO_ROOT).as_posix().encode() + b"\0")
            digest.update(p.read_bytes() + b"\0")
    out = {"fingerprint": digest.hexdigest()[:12]}
    for name in CODE_LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def code_changes(records: Iterable[dict | None]) -> list[str]:
    """What differs between the code versions of `records` (their `_code`) and this process's, as
    `code changed (fingerprint abc -> def)`, `transformers 5.24.0 -> 5.25.0`; [] when all match."""
    current = code_version()
    changes: list[str] = []
    missing = 0
    seen: set[str] = set()
    for code in records:
        if not isinstance(code, dict):
            missing += 1
            continue
        key = json.dumps(code, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        if code.get("fingerprint") != current["fingerprint"]:
            changes.append(f"code changed (fingerprint {code.get('fingerprint')} -> {current['fingerprint']})")
        for name in CODE_LIBRARIES:
            if code.get(name) != current.get(name):
                changes.append(f"{name} {code.get(name)} -> {current.get(name)}")
    if missing:
        changes.append(f"{missing} record(s) without a code fingerprint (written before fingerprints were recorded)")
    return list(dict.fromkeys(changes))


def record_codes(folder: Path) -> list:
    """The `_code` of every complete record in `folder`'s .jsonl files (None where absent)."""
    codes: list = []
    for path in sorted(Path(folder).rglob("*.jsonl")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for line in data[: data.rfind(b"\n") + 1].splitlines():  # a torn last line is cut by JsonlLog
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:  # JsonlLog refuses it, with its line number
                continue
            codes.append(record.get(CODE_FIELD) if isinstance(record, dict) else None)
    return codes


def _maybe_kill(stage: str) -> None:
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    mode, _, count = spec.partition(":")
    if mode == stage and count.isdigit() and int(count) == _appended:
        os.kill(os.getpid(), signal.SIGKILL)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically: readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    """Write text atomically (temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class JsonlLog:
    """Append-only JSONL of finished items, keyed for resume. One line per item, never duplicated."""

    def __init__(self, path: Path, key: str | tuple[str, ...]):
        self.path = Path(path)
        self.key_fields = (key,) if isinstance(key, str) else tuple(key)
        self.records: dict[Any, dict] = {}
        self._repair_and_load()

    def key(self, record: dict):
        return tuple(record[k] for k in self.key_fields)

    def _repair_and_load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):  # torn last line from a crash: drop it, the item will be redone
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        for number, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = self.key(record)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise HarnessError(f"{self.path}:{number} is not valid JSON; delete that line or rerun with resume=false") from None
            except (KeyError, TypeError):
                raise HarnessError(f"{self.path}:{number} is not a record with {', '.join(self.key_fields)}; "
                                   "delete that line or rerun with resume=false") from None
            self.records.setdefault(key, record)

    def __contains__(self, key) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def append(self, record: dict) -> None:
        """Append one finished item, with this process's code version (`_code`) added."""
        global _appended
        key = self.key(record)
        if key in self.records:
            return
        if CODE_FIELD not in record:
            record = {**record, CODE_FIELD: code_version()}
        line = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        _appended += 1
        with open(self.path, "ab") as f:  # one write of the whole line; a crash mid-write leaves no newline
            if os.environ.get(KILL_ENV, "").startswith("mid:"):
                f.write(line[: len(line) // 2])
                f.flush()
                os.fsync(f.fileno())
                _maybe_kill("mid")
                line = line[len(line) // 2:]
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[key] = record
        _maybe_kill("after")


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _versions(*names: str) -> dict:
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance(seed: int, device: str | None = None) -> dict:
    import torch
    import transformers

    info = {
        "harness_version": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "seed": seed,
        "device": device,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda_runtime": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "packages": _versions("numpy", "hydra-core", "omegaconf", "accelerate", "kv-harness"),
        "argv": sys.argv,
        "pid": os.getpid(),
        "session": SESSION_ID,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_commit(),
        "code": code_version(),
    }
    return info


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def result_key_differences(old: dict, new: dict, grid: Iterable[str] = ()) -> list[str]:
    """Keys whose values differ between two resolved configs, ignoring keys that don't change results
    (NON_RESULT_KEYS, the options the method ignores: `full`'s budget, window_size, ratio, and `grid`:
    the task options, e.g. "lengths", that only choose which items run)."""
    a, b = _flatten(old), _flatten(new)
    keys = sorted(set(a) | set(b))
    skip = [*NON_RESULT_KEYS, *(f"task.{k}" for k in grid)]
    if a.get("method.name") == b.get("method.name"):
        skip += [f"method.{k}" for k in noop_options(a.get("method.name"))]
    ignored = lambda k: any(k == n or k.startswith(n + ".") for n in skip)  # noqa: E731
    # absent in one config and null in the other: the same (an option added since, at its null default)
    return [k for k in keys if not ignored(k) and a.get(k) != b.get(k)]


def describe_differences(old: dict, new: dict, keys: list[str], limit: int = 6) -> str:
    """`key: old -> new` for the first `limit` keys, on one line."""
    a, b = _flatten(old), _flatten(new)

    def short(value) -> str:
        text = json.dumps(value, default=str) if value != "<absent>" else value
        return text if len(text) <= 40 else text[:37] + "..."

    parts = [f"{k}: {short(a.get(k, '<absent>'))} -> {short(b.get(k, '<absent>'))}" for k in keys[:limit]]
    more = f"; and {len(keys) - limit} more: {', '.join(keys[limit:limit + 10])}" if len(keys) > limit else ""
    return "; ".join(parts) + more


def check_writable(path: Path) -> None:
    """Create `path` (and parents) and prove a file can be written there; a HarnessError otherwise."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise HarnessError(f"output folder {path} is not writable ({reason}); choose another with hydra.run.dir=<folder>") from None


class RunLock:
    """An exclusive lock on a folder: fcntl.flock on `<folder>/<name>`, held until `release()` (or the
    process ends: the kernel drops it, so a killed run never leaves a stale lock). `acquire()` waits for
    another holder, logging who it is. The file stays (deleting a lock file races with waiters) except
    when a rolled-back run removes its directory; a waiter then finds the file gone and locks afresh."""

    def __init__(self, folder: Path, name: str = LOCK_FILE):
        self.path = Path(folder) / name
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, quiet: bool = False) -> "RunLock":
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not quiet:
                    holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
                    log.info("waiting for %s: %s is running it (lock %s)", self.path.parent, holder, self.path.name)
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed the file while we waited: lock the current one
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            self._fd = fd
            return self

    def release(self, *, remove: bool = False) -> None:
        if self._fd is None:
            return
        if remove:
            try:
                self.path.unlink()
            except OSError:
                pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


class RunDir:
    """A run directory: validated config, provenance, resumable logs, final results."""

    def __init__(self, path: Path, grid: Iterable[str] = ()):
        self.path = Path(path)
        self.grid = tuple(grid)  # the task's GRID_KEYS: another grid resumes this directory
        self._existed: set[str] | None = None  # names present before prepare(); None until then
        self._created_config = False
        self._lock: RunLock | None = None
        self.forced: list[str] = []  # what resume=force resumed over (recorded in provenance.json)
        self.provenance: dict = {}  # this session's, once prepare() wrote it

    def lock(self) -> None:
        """Hold this directory's lock until `unlock()` (waits while another process runs it)."""
        if self._lock is None:
            check_writable(self.path)
            self._lock = RunLock(self.path).acquire()

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def check(self, cfg: DictConfig, *, resume: bool | str) -> None:
        """Everything `prepare` would refuse, without writing anything: the folder is writable and does
        not hold a run with a different config, nor records of other code or library versions (unless
        resume=force). Cheap; called before the model is loaded."""
        check_writable(self.path)
        mode = resume_mode(resume)
        if mode is True and resume_mode(cfg.get("resume", True)) == "force":  # a caller that passed bool(cfg.resume)
            mode = "force"
        if not mode:
            return
        stored = self.path / "config.yaml"
        if stored.exists():
            resolved = OmegaConf.to_container(cfg, resolve=True)
            try:
                old = OmegaConf.to_container(OmegaConf.load(stored), resolve=False)
            except Exception as exc:  # noqa: BLE001  (a hand-edited or truncated file)
                raise HarnessError(f"{stored} is not a readable config ({type(exc).__name__}); delete it or rerun with resume=false") from None
            diff = result_key_differences(old, resolved, self.grid)
            if diff:
                raise HarnessError(
                    f"{self.path} holds a run with a different config ({describe_differences(old, resolved, diff)}); "
                    "use another run directory (hydra.run.dir=<folder>), or resume=false to start this one afresh"
                )
        changes = code_changes(record_codes(self.path))
        if changes and mode != "force":
            raise HarnessError(
                f"{self.path} holds records written by other code or libraries ({'; '.join(changes)}); resuming would mix "
                "them: resume=force adds to them anyway, resume=false starts afresh (or use another hydra.run.dir)"
            )
        if changes and changes != self.forced:
            log.warning("resume=force: %s holds records of other code or libraries (%s); the new records mix with them",
                        self.path, "; ".join(changes))
        self.forced = changes

    def prepare(self, cfg: DictConfig, *, resume: bool | str, clear: Iterable[str] = (), device: str | None = None) -> None:
        """Create the directory, refuse a conflicting earlier config, record config and provenance.

        With `resume=false` the earlier run's records (`*.jsonl`, results, failures and `clear`) are deleted.
        """
        self.check(cfg, resume=resume)
        resolved = OmegaConf.to_container(cfg, resolve=True)
        stored = self.path / "config.yaml"
        self._existed = {p.name for p in self.path.iterdir()}
        self._created_config = not stored.exists()
        if not resume:
            for pattern in ("*.jsonl", "results.json", "failures.json", *clear):
                for f in self.path.glob(pattern):
                    if f.is_file():
                        f.unlink()
        write_text(stored, OmegaConf.to_yaml(resolved))
        info = provenance(int(cfg.get("seed", 0)), device or _configured_device(cfg))
        if self.forced:
            info["forced_resume"] = self.forced
        self.write_provenance(info, resume=bool(resume))

    def write_provenance(self, info: dict, *, resume: bool = True) -> Path:
        """`provenance.json`: this session, plus the earlier sessions of a resumed run (warns when they
        ran other versions or on another device: the resumed records then mix them)."""
        path = self.path / "provenance.json"
        earlier: list[dict] = []
        if resume and path.exists():
            try:
                old = json.loads(path.read_text(encoding="utf-8"))
                earlier = [*old.pop("earlier_sessions", []), old]
            except (OSError, ValueError, AttributeError):
                earlier = []
        # The same process writing twice keeps one entry: its latest.
        earlier = [e for e in earlier if e.get("session") != info.get("session")]
        if earlier:
            last = earlier[-1]
            changed = [k for k in SESSION_KEYS if k in last and last.get(k) != info.get(k)]
            if changed and self.has_records():
                log.warning("resuming %s with a different %s than its previous session: its records mix both; "
                            "see provenance.json (resume=false starts afresh)", self.path, ", ".join(changed))
        write_json(path, {**info, "earlier_sessions": earlier[-20:]})
        self.provenance = info
        return path

    def has_records(self) -> bool:
        """Whether any per-item record (a non-empty .jsonl anywhere in the run directory) exists."""
        try:
            return any(p.is_file() and p.stat().st_size > 0 for p in self.path.rglob("*.jsonl"))
        except OSError:
            return False

    def rollback(self) -> None:
        """Undo `prepare()` after a user error, when this run started the directory and finished no
        item: remove what it wrote, and the directory itself when that leaves it empty."""
        if self._existed is not None and self._created_config and not self.has_records():
            for entry in list(self.path.iterdir()):
                if entry.name in self._existed or entry.name == LOCK_FILE:
                    continue
                try:
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
                except OSError:
                    pass
        if self._lock is not None:
            try:
                alone = [p.name for p in self.path.iterdir()] == [LOCK_FILE]
            except OSError:
                alone = False
            self._lock.release(remove=alone)  # the lock file alone: this run created nothing to keep
            self._lock = None
        remove_if_empty(self.path)

    def log(self, name: str, key) -> JsonlLog:
        return JsonlLog(self.path / name, key)

    def write_results(self, results: dict) -> Path:
        path = self.path / "results.json"
        write_json(path, results)
        return path


def _configured_device(cfg: DictConfig) -> str | None:
    model = cfg.get("model")
    return str(model.get("device")) if model is not None and model.get("device") is not None else None


def remove_if_empty(path: Path) -> None:
    try:
        if Path(path).is_dir() and not any(Path(path).iterdir()):
            Path(path).rmdir()
    except OSError:
        pass
