"""Everything a run writes lives in its run directory; this module owns how it is written.

- `config.yaml`: the resolved config. A rerun in the same directory compares against it and refuses
  when a key that changes results differs (unless `resume=false`, which starts the run afresh).
- `provenance.json`: versions, git commit, seed, device, command line.
- `*.jsonl`: per-item records, appended one line at a time and fsync'ed. On reopen a torn last line
  (a crash mid-write) is cut off, so resume finds exactly the items that were finished.
- `results.json` and tables: written atomically (temporary file + rename) at the end.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from harness import REPO_ROOT, __version__
from harness.errors import HarnessError

# Config keys that never change a run's results (paths, bookkeeping, launch settings).
NON_RESULT_KEYS = ("resume", "hydra", "progress", "task.log_prompts", "task.shard", "model.device_map", "task.data_dir")


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
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
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
            except json.JSONDecodeError:
                raise HarnessError(f"{self.path}:{number} is not valid JSON; delete that line or rerun with resume=false") from None
            self.records.setdefault(self.key(record), record)

    def __contains__(self, key) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def append(self, record: dict) -> None:
        key = self.key(record)
        if key in self.records:
            return
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[key] = record


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


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
        "torch_threads": torch.get_num_threads(),
        "argv": sys.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_commit(),
    }
    return info


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def result_key_differences(old: dict, new: dict) -> list[str]:
    """Keys whose values differ between two resolved configs, ignoring keys that don't change results."""
    a, b = _flatten(old), _flatten(new)
    keys = sorted(set(a) | set(b))
    ignored = lambda k: any(k == n or k.startswith(n + ".") for n in NON_RESULT_KEYS)  # noqa: E731
    return [k for k in keys if not ignored(k) and a.get(k, "<absent>") != b.get(k, "<absent>")]


class RunDir:
    """A run directory: validated config, provenance, resumable logs, final results."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def prepare(self, cfg: DictConfig, *, resume: bool, clear: Iterable[str] = ()) -> None:
        """Create the directory, refuse a conflicting earlier config, record config and provenance."""
        resolved = OmegaConf.to_container(cfg, resolve=True)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise HarnessError(f"output folder {self.path} is not writable ({exc.strerror}); choose another with hydra.run.dir=<folder>") from None
        stored = self.path / "config.yaml"
        if stored.exists() and resume:
            old = OmegaConf.to_container(OmegaConf.load(stored), resolve=False)
            diff = result_key_differences(old, resolved)
            if diff:
                raise HarnessError(
                    f"{self.path} holds a run with a different config ({', '.join(diff[:8])}{' ...' if len(diff) > 8 else ''}); "
                    "use another run directory, or resume=false to start this one afresh"
                )
        if not resume:
            for pattern in ("*.jsonl", "results.json", *clear):
                for f in self.path.glob(pattern):
                    f.unlink()
        write_text(stored, OmegaConf.to_yaml(resolved))

    def log(self, name: str, key) -> JsonlLog:
        return JsonlLog(self.path / name, key)

    def write_results(self, results: dict) -> Path:
        path = self.path / "results.json"
        write_json(path, results)
        return path
