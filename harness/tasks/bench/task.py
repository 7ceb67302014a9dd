"""Efficiency benchmark (`task=bench`): prefill time, compression overhead, decode latency, KV bytes and
peak memory for several methods and prompt lengths in one run, plus an optional maximum-length search.

Measurements are interleaved (for each repeat: for each length: for each method, the method order
rotated by one each repeat) so that drift of the machine hits every method alike. Prompts are random
token ids, the same for every method at a length. One measurement = one prefill plus
`decode_tokens` timed decode steps with EOS disabled (see `bench_worker.measure`).

Where measurements run (`task.isolation`):
- `method`: one persistent worker process per method (`python -m harness.tasks.bench.worker`),
  loaded and warmed up once; the per-measurement CPU peak comes from resetting the resident
  high-water mark before each measurement (/proc/self/clear_refs). The CPU default: a fresh
  process costs ~11 s here (imports + SmolLM2 load), 48 of them would add ~9 min to a ~10 min run.
- `measurement`: a fresh worker per measurement; the peak is plain `ru_maxrss` minus the RSS after
  load. Slow, but needs nothing from the kernel; `auto` falls back to it where clear_refs is missing.
- `none`: in this process, one model for all methods (the CUDA default: `max_memory_allocated`
  after a reset is per-measurement already, summed over every GPU of a `device_map=auto` model;
  also used by the tests).

Decode latency is reported per step (`decode_median_ms`: one forward of the whole batch, i.e. each
sequence's per-token latency) and per generated token (`decode_ms_per_token` = per step / batch).

Resume: finished (method label, length, repeat) rows are kept in `bench_rows.jsonl`; search probes
in `bench_search.jsonl`. A rerun of the same run directory only measures what is missing.

On CPU every row also carries the process CPU time of the prefill and of each decode step (see
`bench_worker._cpu_time_hooks`), and the 1-minute load average before it: on a machine shared with
other work, wall-clock ratios are only as good as the quiet the machine had, and the table's
CPU-time view and load column say how much to trust them. Peak RSS is the process's resident
high-water mark, which includes what glibc keeps of freed memory: it varies by ~±100 MB between
repeats of the same measurement at 8K tokens here, so the table reports the median over repeats.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness import REPO_ROOT
from harness.errors import HarnessError, require
from harness.tasks.bench.search import search_max_length  # noqa: F401  (the search logic, shared with task=plan)
from harness.rundir import RunDir, provenance, write_json, write_text
from harness.tables import _safe

log = logging.getLogger(__name__)
ISOLATIONS = ("auto", "method", "measurement", "none")
MB = 1024 * 1024


# ------------------------------------------------------------------------------------------ validation

def method_configs(task: DictConfig) -> list[dict]:
    """The task's method configs as plain dicts, each with a `label` (derived when not given)."""
    out = []
    for m in task.methods:
        cfg = OmegaConf.to_container(m, resolve=True) if isinstance(m, DictConfig) else dict(m)
        if not cfg.get("label"):
            parts = [str(cfg.get("name"))]
            if "budget" in cfg:
                parts.append(f"c{cfg['budget']}")
            if "gqa" in cfg:
                parts.append(str(cfg["gqa"]))
            cfg["label"] = "-".join(parts)
        cfg.pop("tag", None)
        out.append(cfg)
    return out


def method_options(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "label"}


def validate(task: DictConfig) -> None:
    from harness.methods import build_method

    require(task.get("methods") and len(task.methods) > 0,
            "task.methods is empty; give a list such as [{label: full, name: full}, {label: snapkv, name: snapkv, budget: 1024}]")
    methods = method_configs(task)
    labels = [m["label"] for m in methods]
    require(len(set(labels)) == len(labels), f"task.methods: labels must be unique, got {labels}")
    for m in methods:
        require("name" in m, f"task.methods: entry {m} has no `name`")
        build_method(method_options(m))  # unknown method or option: fails here, before any model is loaded
    lengths = list(task.context_lengths)
    require(lengths, "task.context_lengths is empty; e.g. task.context_lengths=[1024,2048]")
    for n in lengths:
        require(int(n) > 0, f"task.context_lengths: {n} is not a positive token count")
    require(len(set(int(n) for n in lengths)) == len(lengths), f"task.context_lengths has duplicates: {lengths}")
    for key, low in (("decode_tokens", 1), ("repeats", 0), ("warmup", 0), ("batch_size", 1)):
        require(int(task[key]) >= low, f"task.{key}={task[key]} must be >= {low}")
    require(int(task.repeats) > 0 or task.max_length_search,
            "task.repeats=0 measures nothing; it is only meaningful with task.max_length_search=true (search only)")
    require(task.isolation in ISOLATIONS, f"task.isolation={task.isolation!r} is not one of {', '.join(ISOLATIONS)}")
    if task.max_length_search:
        require(task.memory_cap_gb is not None and float(task.memory_cap_gb) > 0,
                "task.max_length_search=true needs task.memory_cap_gb (e.g. 80 to emulate an 80 GB card)")
        require(int(task.search_start) > 0, "task.search_start must be > 0")
        require(int(task.search_resolution) > 0, "task.search_resolution must be > 0")
        require(int(task.search_max) >= int(task.search_start), "task.search_max must be >= task.search_start")


# ------------------------------------------------------------------------------------ the search logic


# --------------------------------------------------------------------------------------------- runners

class WorkerDied(RuntimeError):
    pass


class WorkerProcess:
    """A `bench_worker` subprocess: one JSON line per request, one per answer; its stderr goes to a log file."""

    def __init__(self, init: dict, log_path: Path):
        self.init, self.log_path = init, log_path
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self) -> "WorkerProcess":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as err:
            err.write(f"\n--- worker start {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
            err.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", "harness.tasks.bench.worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(REPO_ROOT), env=env)
        self.proc.stdin.write(json.dumps(self.init) + "\n")
        self.proc.stdin.flush()
        return self

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerDied(f"worker exited with status {code}{' (killed by signal %d)' % -code if code < 0 else ''}; see {self.log_path}")
        return json.loads(line)

    def wait_ready(self) -> dict:
        self.info = self._read()
        if not self.info.get("ready"):
            self.close()
            message = f"bench worker failed to start: {self.info.get('error')} (log: {self.log_path})"
            if self.info.get("user_error"):
                raise HarnessError(message)
            raise RuntimeError(message + "\n" + str(self.info.get("traceback", "")))
        return self.info

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def request(self, req: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # _read reports how it died
        return self._read()

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Runner:
    """Answers `request(label, req)` with a worker reply ({"ok", "result"|"error", "oom"})."""

    isolation = "none"

    def __init__(self, base_init: dict, methods: dict[str, dict], run_path: Path):
        self.base_init, self.methods, self.run_path = base_init, methods, run_path
        self.infos: dict[str, dict] = {}

    def init_for(self, labels: list[str]) -> dict:
        return {**self.base_init, "methods": [method_options(self.methods[label]) for label in labels]}

    def request(self, label: str, req: dict) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        pass


class InProcessRunner(Runner):
    isolation = "none"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import torch

        from harness.tasks.bench.worker import WorkerCore

        self.threads_before = torch.get_num_threads()
        self.core = WorkerCore(self.init_for(list(self.methods)))
        info = self.core.ready()
        self.infos = {label: info for label in self.methods}

    def request(self, label, req):
        return self.core.handle(req)

    def close(self) -> None:
        import torch

        if self.core is None:
            return
        if self.core.device.type == "cuda" and self.base_init.get("memory_cap_bytes"):
            from harness.tasks.bench.worker import disarm_memory_cap

            disarm_memory_cap(self.core.devices)
        torch.set_num_threads(self.threads_before)  # the harness process keeps its own setting
        import gc

        gc.unfreeze()
        self.core = None


class PerMethodRunner(Runner):
    """One persistent worker per method label, all started at once; a dead worker is restarted on its next request."""

    isolation = "method"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.workers: dict[str, WorkerProcess] = {}
        started = [self._start(label) for label in self.methods]
        try:
            for label, worker in zip(self.methods, started):
                self.infos[label] = worker.wait_ready()
                self.workers[label] = worker
        except BaseException:
            for w in started:
                w.close()
            raise

    def _start(self, label: str) -> WorkerProcess:
        name = self.base_init.get("log_name", "worker")
        return WorkerProcess(self.init_for([label]), self.run_path / "workers" / f"{name}-{_safe(label)}.log").start()

    def request(self, label, req):
        worker = self.workers.get(label)
        if worker is None or not worker.alive():
            if worker is not None:
                worker.close()
            worker = self._start(label)
            self.infos[label] = worker.wait_ready()
            self.workers[label] = worker
        try:
            return worker.request(req)
        except WorkerDied as exc:
            worker.close()
            self.workers.pop(label, None)
            return {"ok": False, "oom": True, "killed": True, "error": str(exc)}

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
        self.workers.clear()


class PerMeasurementRunner(Runner):
    """A fresh worker for every measurement: `ru_maxrss` is then that measurement's peak."""

    isolation = "measurement"

    def request(self, label, req):
        name = self.base_init.get("log_name", "worker")
        worker = WorkerProcess(self.init_for([label]), self.run_path / "workers" / f"{name}-{_safe(label)}.log").start()
        try:
            self.infos[label] = worker.wait_ready()
            return worker.request(req)
        except WorkerDied as exc:
            return {"ok": False, "oom": True, "killed": True, "error": str(exc)}
        finally:
            worker.close()


def choose_isolation(requested: str, device_type: str) -> str:
    if requested != "auto":
        return requested
    if device_type == "cuda":
        return "none"
    from harness.tasks.bench.worker import reset_peak_rss

    return "method" if reset_peak_rss() else "measurement"


RUNNERS = {"none": InProcessRunner, "method": PerMethodRunner, "measurement": PerMeasurementRunner}


# ----------------------------------------------------------------------------------------- the run

def plan(lengths: list[int], labels: list[str], repeats: int) -> list[tuple[str, int, int]]:
    """(label, length, repeat) in run order: repeat-major, then length, then method (rotated per repeat)."""
    order = []
    for r in range(repeats):
        rotated = labels[r % len(labels):] + labels[: r % len(labels)]
        for n in lengths:
            for label in rotated:
                order.append((label, n, r))
    return order


def prepare_and_run(cfg: DictConfig, run_dir: RunDir) -> dict:
    from tqdm import tqdm

    from harness.models import resolve_device

    task = cfg.task
    run_dir.prepare(cfg, resume=bool(cfg.resume), clear=("bench_table.md", "bench_*.png", "failures.json"))
    started = time.time()
    methods = {m["label"]: m for m in method_configs(task)}
    labels = list(methods)
    lengths = [int(n) for n in task.context_lengths]
    device = resolve_device(cfg.model.get("device", "auto"))
    isolation = choose_isolation(str(task.isolation), device.type)
    base_init = {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "seed": int(cfg.seed),
        "threads": task.get("threads"),
        "warmup": int(task.warmup),
        "warmup_length": int(task.warmup_length or min(lengths)),
        "decode_tokens": int(task.decode_tokens),
        "batch_size": int(task.batch_size),
        "prefill_mmap_threshold": task.get("cpu_prefill_mmap_threshold"),
        "log_name": "bench",
    }
    rows_log = run_dir.log("bench_rows.jsonl", key=("label", "length", "repeat"))
    order = plan(lengths, labels, int(task.repeats))
    todo = [k for k in order if k not in rows_log]
    if len(todo) < len(order):
        log.info("bench: %d of %d measurements already done in %s, resuming", len(order) - len(todo), len(order), run_dir.path)
    failures: list[dict] = []
    infos: dict = {}
    if todo:
        runner = RUNNERS[isolation](base_init, {label: methods[label] for label in dict.fromkeys(k[0] for k in todo)}, run_dir.path)
        try:
            bar = tqdm(todo, desc="bench", unit="meas", disable=not bool(cfg.progress), dynamic_ncols=True)
            for label, length, repeat in bar:
                req = {"method": method_options(methods[label]), "length": length, "batch_size": int(task.batch_size),
                       "decode_tokens": int(task.decode_tokens), "seed": int(cfg.seed)}
                load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
                reply = runner.request(label, req)
                if not reply.get("ok"):
                    log.warning("bench: %s at %d tokens (repeat %d) failed: %s", label, length, repeat, reply.get("error"))
                    failures.append({"key": [label, length, repeat], "oom": bool(reply.get("oom")), "error": reply.get("error"),
                                     "traceback": reply.get("traceback")})
                    continue
                res = reply["result"]
                row = {"label": label, "length": length, "repeat": repeat, "method": method_options(methods[label]),
                       "isolation": runner.isolation, "loadavg_1m": round(load, 2) if load is not None else None,
                       "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **res}
                rows_log.append(row)
                log.info("bench r%d %6d %-24s prefill %.2f s (compress %.3f s: capture %.3f + select %.3f) decode %.1f ms/step, "
                         "KV %.1f MB, peak +%.1f MB", repeat, length, label, res["prefill_s"], res["compress_s"],
                         res.get("compress_capture_s") or 0.0, res.get("compress_select_s") or 0.0, res["decode_median_ms"] or float("nan"),
                         res["kv_bytes"] / MB, res["peak_increase_bytes"] / MB)
            bar.close()
            infos = runner.infos
        finally:
            runner.close()
    rows = [rows_log.records[k] for k in order if k in rows_log]
    table = aggregate(rows, labels, lengths)
    if task.get("planned_columns", True) and table:  # the plan beside the measured KV bytes and peak (docs/planning.md)
        from harness.tasks.plan.planner import planned_columns

        planned_columns(table, methods, cfg.model, batch_size=int(task.batch_size), decode_tokens=int(task.decode_tokens),
                        target=device.type)
    search = None
    if task.max_length_search and device.type != "cuda" and task.get("search_by", "auto") in ("auto", "plan"):
        from harness.tasks.plan.planner import planned_search  # no GPU here: the search is planned, not measured

        search = planned_search(cfg, methods, reserve_gb=float(task.get("plan_reserve_gb", 2.0)))
        full = next((s["max_length"] for label, s in search["methods"].items() if methods[label].get("name") == "full"), None)
        for s in search["methods"].values():
            s["vs_full"] = _ratio(s["max_length"], full)
    elif task.max_length_search:
        search = run_search(cfg, run_dir, methods, base_init, isolation, device.type, failures)
    summary = summarize(table, labels, lengths, isolation, rows, search)
    summary["failed_measurements"] = len(failures)
    write_json(run_dir.path / "failures.json", failures)
    write_text(run_dir.path / "bench_table.md", markdown(table, summary, search, cfg, isolation))
    if task.get("plots", True) and table:
        write_plots(table, run_dir.path, title=f"{cfg.model.name} · batch {task.batch_size} · {isolation}")
    results = {
        "schema": 1,
        "task": "bench",
        "model": {"name": cfg.model.name, "random_weights": bool(cfg.model.get("random_weights")) or cfg.model.source == "random"},
        "methods": list(methods.values()),
        "status": "items_failed" if failures else "complete",
        "summary": summary,
        "failures": len(failures),
        "failed_items": [{k: v for k, v in f.items() if k != "traceback"} for f in failures],
        "rows": rows,
        "search": search,
        "workers": infos,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "provenance": {**provenance(int(cfg.seed), str(device)), "wall_seconds": round(time.time() - started, 2),
                       "isolation": isolation},
    }
    run_dir.write_results(results)
    return results


# ------------------------------------------------------------------------------------ aggregation

def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _pct(values, q):
    from harness.tasks.bench.worker import _percentile

    return _percentile([v for v in values if v is not None], q)


def aggregate(rows: list[dict], labels: list[str], lengths: list[int]) -> list[dict]:
    """One entry per (method, length): medians over repeats, decode stats over all repeats' steps, ratios vs full."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["label"], r["length"]), []).append(r)
    table = []
    for label in labels:
        for n in lengths:
            rs = groups.get((label, n))
            if not rs:
                continue
            steps = [s for r in rs for s in r["step_ms"]]
            per_repeat = [r["decode_median_ms"] for r in rs]
            first = rs[0]
            table.append({
                "label": label, "method": first["method"].get("name"), "length": n, "batch_size": first["batch_size"],
                "budget": first["method"].get("budget") if isinstance(first["method"].get("budget"), int) else None,
                "repeats": len(rs),
                "prefill_s": _median(r["prefill_s"] for r in rs),
                "compress_s": _median(r["compress_s"] for r in rs),  # capture + select (bench_worker.CompressTimer)
                "compress_capture_s": _median(r.get("compress_capture_s") for r in rs),
                "compress_select_s": _median(r.get("compress_select_s") for r in rs),
                # per decode step (one forward of the batch); per token = per step / batch size
                "decode_median_ms": _pct(steps, 50),
                "decode_p90_ms": _pct(steps, 90),
                "decode_ms_per_token": _pct(steps, 50) / first["batch_size"] if steps else None,
                "decode_repeat_medians_ms": per_repeat,
                "decode_tokens_per_s": first["batch_size"] * len(steps) * 1000 / sum(steps) if steps else None,
                "kv_bytes": first["kv_bytes"],
                "kv_bytes_analytic": first["kv_bytes_analytic"],
                "kv_matches_analytic": all(r["kv_bytes"] == r["kv_bytes_analytic"] for r in rs),
                "cache_heads": first["cache_heads"], "kept_tokens": first["kept_tokens"],
                "peak_increase_bytes": _median(r["peak_increase_bytes"] for r in rs),
                "peak_bytes": _median(r["peak_bytes"] for r in rs),
                "peak_source": first["peak_source"],
                "loadavg_1m_max": max((r.get("loadavg_1m") or 0) for r in rs),
                "threads": first.get("threads"),
                "prefill_mmap_threshold": first.get("prefill_mmap_threshold"),
                # CPU-time view (CPU only): the same quantities in this process's CPU seconds.
                "prefill_cpu_s": _median(r.get("prefill_cpu_s") for r in rs),
                "compress_cpu_s": _median(r.get("compress_cpu_s") for r in rs),
                "decode_cpu_median_ms": _pct([s for r in rs for s in r.get("step_cpu_ms") or []], 50),
            })
    full = {e["length"]: e for e in table if e["method"] == "full"}
    for e in table:
        f = full.get(e["length"])
        e["decode_vs_full"] = _ratio(e["decode_median_ms"], f and f["decode_median_ms"])
        e["kv_full_over_this"] = _ratio(f and f["kv_bytes"], e["kv_bytes"])
        e["peak_vs_full"] = _ratio(e["peak_increase_bytes"], f and f["peak_increase_bytes"])
        e["prefill_overhead_pct"] = _pct_of(e["prefill_s"] - f["prefill_s"], f["prefill_s"]) if f else None
        e["compress_pct_of_full_prefill"] = _pct_of(e["compress_s"], f["prefill_s"]) if f else None
        fb = full.get(e["budget"]) if e["budget"] else None
        e["decode_vs_full_at_budget_length"] = _ratio(e["decode_median_ms"], fb and fb["decode_median_ms"])
        e["decode_cpu_vs_full"] = _ratio(e["decode_cpu_median_ms"], f and f["decode_cpu_median_ms"])
        e["decode_cpu_vs_full_at_budget_length"] = _ratio(e["decode_cpu_median_ms"], fb and fb["decode_cpu_median_ms"])
        e["compress_cpu_pct_of_full_prefill"] = _pct_of(e["compress_cpu_s"], f and f["prefill_cpu_s"])
        e["prefill_cpu_overhead_pct"] = (_pct_of(e["prefill_cpu_s"] - f["prefill_cpu_s"], f["prefill_cpu_s"])
                                         if f and e["prefill_cpu_s"] is not None and f["prefill_cpu_s"] is not None else None)
    return table


def _ratio(a, b):
    return round(a / b, 4) if a is not None and b not in (None, 0) else None


def _pct_of(a, b):
    return round(100 * a / b, 3) if a is not None and b not in (None, 0) else None


def summarize(table: list[dict], labels: list[str], lengths: list[int], isolation: str, rows: list[dict], search) -> dict:
    """Scalars for the log line, then per-method details: everything at the longest length measured."""
    summary: dict = {"isolation": isolation, "measurements": len(rows), "methods": len(labels), "lengths": len(lengths),
                     "kv_bytes_match_analytic": all(e["kv_matches_analytic"] for e in table) if table else None}
    by_label: dict = {}
    for e in table:
        by_label.setdefault(e["label"], {})[str(e["length"])] = {
            k: e.get(k) for k in ("prefill_s", "compress_s", "compress_capture_s", "compress_select_s", "compress_pct_of_full_prefill", "prefill_overhead_pct", "decode_median_ms",
                              "decode_p90_ms", "decode_ms_per_token", "decode_tokens_per_s", "decode_vs_full", "decode_vs_full_at_budget_length",
                              "kv_bytes", "kv_bytes_analytic", "kv_full_over_this", "peak_increase_bytes", "peak_vs_full",
                              "kv_bytes_planned", "peak_bytes_planned", "peak_increase_bytes_planned",
                              "prefill_cpu_s", "compress_cpu_s", "compress_cpu_pct_of_full_prefill", "prefill_cpu_overhead_pct",
                              "decode_cpu_median_ms", "decode_cpu_vs_full", "decode_cpu_vs_full_at_budget_length")}
    summary["by_method"] = by_label
    longest = max((e["length"] for e in table), default=None)
    summary["at_longest_length"] = {
        e["label"]: {"length": e["length"], "decode_vs_full": e["decode_vs_full"],
                     "decode_vs_full_at_budget_length": e["decode_vs_full_at_budget_length"],
                     "kv_full_over_this": e["kv_full_over_this"], "compress_pct_of_full_prefill": e["compress_pct_of_full_prefill"],
                     "peak_vs_full": e["peak_vs_full"], "decode_cpu_vs_full": e["decode_cpu_vs_full"],
                     "decode_cpu_vs_full_at_budget_length": e["decode_cpu_vs_full_at_budget_length"],
                     "compress_cpu_pct_of_full_prefill": e["compress_cpu_pct_of_full_prefill"]}
        for e in table if e["length"] == longest and e["method"] != "full"
    }
    load = [r.get("loadavg_1m") for r in rows if r.get("loadavg_1m") is not None]
    if load:
        summary["loadavg_1m_max"] = max(load)
    if search is not None:
        summary["max_length"] = {label: s["max_length"] for label, s in search["methods"].items()}
        summary["max_length_vs_full"] = {label: s.get("vs_full") for label, s in search["methods"].items()}
    return summary


# ------------------------------------------------------------------------------------------ search

def run_search(cfg: DictConfig, run_dir: RunDir, methods: dict[str, dict], base_init: dict, isolation: str, device_type: str,
               failures: list[dict]) -> dict:
    """Per method, the longest prompt that fits in task.memory_cap_gb (see `search_max_length`).

    A probe is one measurement with `search_decode_tokens` decode steps at the bench's batch size.
    It fails on out-of-memory in any form (torch.OutOfMemoryError, a RuntimeError saying so, a
    MemoryError, a killed worker) or, on CPU, when its measured peak RSS exceeds the cap. The cap
    is enforced in the worker: CUDA memory fraction, CPU RLIMIT_AS (`bench_worker.arm_memory_cap`);
    with isolation=none on CPU only the peak check applies (an address-space limit on the harness
    process itself would be unsafe).
    """
    task = cfg.task
    cap = int(float(task.memory_cap_gb) * 1024**3)
    init = {**base_init, "memory_cap_bytes": cap if not (isolation == "none" and device_type == "cpu") else None,
            "log_name": "search", "decode_tokens": int(task.search_decode_tokens)}
    probes_log = run_dir.log("bench_search.jsonl", key=("label", "length"))
    runner: Runner | None = None
    out: dict = {"memory_cap_gb": float(task.memory_cap_gb), "cap_bytes": cap, "start": int(task.search_start),
                 "resolution": int(task.search_resolution), "upper": int(task.search_max), "methods": {}}

    def fits_for(label: str):
        def fits(n: int) -> bool:
            nonlocal runner
            if (label, n) not in probes_log:
                if runner is None:
                    runner = RUNNERS[isolation](init, methods, run_dir.path)
                req = {"method": method_options(methods[label]), "length": n, "batch_size": int(task.batch_size),
                       "decode_tokens": int(task.search_decode_tokens), "seed": int(cfg.seed)}
                reply = runner.request(label, req)
                record = {"label": label, "length": n, "ok": bool(reply.get("ok"))}
                if reply.get("ok"):
                    res = reply["result"]
                    over = device_type != "cuda" and res["peak_bytes"] > cap
                    record.update(fits=not over, peak_bytes=res["peak_bytes"], peak_increase_bytes=res["peak_increase_bytes"],
                                  kv_bytes=res["kv_bytes"], prefill_s=res["prefill_s"], reason="peak over cap" if over else None)
                else:
                    record.update(fits=False, oom=bool(reply.get("oom")), killed=bool(reply.get("killed")), reason=reply.get("error"))
                    if not reply.get("oom"):
                        failures.append({"key": [label, n, "search"], "oom": False, "error": reply.get("error"),
                                         "traceback": reply.get("traceback")})
                probes_log.append(record)
                log.info("search %-24s %7d tokens: %s%s", label, n, "fits" if record["fits"] else "does not fit",
                         f" ({record['reason']})" if record.get("reason") else "")
            return probes_log.records[(label, n)]["fits"]

        return fits

    try:
        for label in methods:
            result = search_max_length(fits_for(label), start=int(task.search_start), resolution=int(task.search_resolution),
                                       upper=int(task.search_max))
            out["methods"][label] = result
    finally:
        if runner is not None:
            runner.close()
    full = next((s["max_length"] for label, s in out["methods"].items() if methods[label].get("name") == "full"), None)
    for s in out["methods"].values():
        s["vs_full"] = _ratio(s["max_length"], full)
    return out


# ------------------------------------------------------------------------------------------ outputs

def _f(v, fmt="{:.2f}", none="–"):
    return none if v is None else fmt.format(v)


def markdown(table: list[dict], summary: dict, search, cfg: DictConfig, isolation: str) -> str:
    task = cfg.task
    source = table[0]["peak_source"] if table else "?"
    lines = [
        f"# Efficiency benchmark: {cfg.model.name}",
        "",
        f"batch {task.batch_size}, {task.decode_tokens} timed decode steps per measurement (EOS disabled), "
        f"{task.repeats} repeats (+{task.warmup} warm-up per worker), isolation `{isolation}`, peak memory from `{source}`.",
        "Random-token prompts, the same for every method at a length. Decode ms/step: median and p90 over all repeats' steps; "
        f"one step is one forward of the whole batch and yields {task.batch_size} token(s), one per sequence, so ms/step is also "
        "each sequence's per-token latency; ms/token = ms/step ÷ batch (the cost per generated token); tok/s over the batch. "
        "Compress: the observer's capture during the prompt's attention (the query window; H2O's attention column sums, "
        "its main cost) plus the method's selection, summed over layers, as capture + select (% of the full cache's "
        "prefill at that length); timed without synchronising inside the prefill (CUDA events on GPU). "
        "Prefill vs full: paired prefill-time difference (noisier). KV: bytes of the cache tensors after prefill "
        "(measured = analytic layers x heads x kept x head_dim x 2 x dtype bytes, ✓). Peak: the measurement's peak "
        "memory above what was resident/allocated just before it." + (
            f" CPU peaks: glibc M_MMAP_THRESHOLD = {table[0]['prefill_mmap_threshold']} bytes during the prefill, so freed "
            "tensors leave the resident set at once (see harness/tasks/bench/worker.py)." if table and table[0].get("prefill_mmap_threshold") else ""),
        "",
        "| method | prompt | prefill s | compress s: capture + select (% full prefill) | prefill vs full | decode ms/step median | p90 | ms/token "
        "| tok/s | decode × full | decode × full@budget | KV MB | heads × kept | KV full ÷ this | peak +MB | peak × full "
        "| planned: KV MB / peak +MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in table:
        kv = f"{e['kv_bytes'] / MB:.1f} {'✓' if e['kv_matches_analytic'] else '≠ ' + _f(e['kv_bytes_analytic'] / MB, '{:.1f}')}"
        heads_kept = f"{'/'.join(map(str, e['cache_heads']))} × {'/'.join(map(str, e['kept_tokens']))}"
        lines.append(
            f"| {e['label']} | {e['length']} | {_f(e['prefill_s'])} | {_compress_cell(e)} "
            f"| {_f(e['prefill_overhead_pct'], '{:+.1f}%')} | {_f(e['decode_median_ms'], '{:.1f}')} | {_f(e['decode_p90_ms'], '{:.1f}')} "
            f"| {_f(e.get('decode_ms_per_token'), '{:.1f}')} | {_f(e['decode_tokens_per_s'], '{:.1f}')} | {_f(e['decode_vs_full'], '{:.2f}x')} | {_f(e['decode_vs_full_at_budget_length'], '{:.2f}x')} "
            f"| {kv} | {heads_kept} | {_f(e['kv_full_over_this'], '{:.2f}x')} | {_f(e['peak_increase_bytes'] and e['peak_increase_bytes'] / MB, '{:.1f}')} "
            f"| {_f(e['peak_vs_full'], '{:.2f}x')} | {_planned_cell(e)} |"
        )
    if any(e["decode_cpu_median_ms"] is not None for e in table):
        lines += ["", "CPU time of the measuring process (all its threads) for the same measurements: unlike wall-clock it does "
                      "not count time spent waiting for a core while other work shares the machine. A check on the wall-clock "
                      "figures, not a replacement (threads spinning in a parallel region count as busy).", "",
                  "| method | prompt | threads | prefill CPU s | compress CPU s (% full prefill) | prefill vs full | decode CPU ms/step "
                  "| decode × full | decode × full@budget |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in table:
            lines.append(
                f"| {e['label']} | {e['length']} | {_f(e['threads'], '{}')} | {_f(e['prefill_cpu_s'])} | {_f(e['compress_cpu_s'], '{:.3f}')} "
                f"({_f(e['compress_cpu_pct_of_full_prefill'], '{:.1f}%')}) | {_f(e['prefill_cpu_overhead_pct'], '{:+.1f}%')} "
                f"| {_f(e['decode_cpu_median_ms'], '{:.1f}')} | {_f(e['decode_cpu_vs_full'], '{:.2f}x')} "
                f"| {_f(e['decode_cpu_vs_full_at_budget_length'], '{:.2f}x')} |")
    if summary.get("loadavg_1m_max") is not None:
        lines += ["", f"Highest 1-minute load average seen before a measurement: {summary['loadavg_1m_max']} "
                      f"({os.cpu_count()} CPUs here); a load above the CPU count means other work shared the machine."]
    if search is not None:
        lines += ["", f"## Maximum prompt length within {search['memory_cap_gb']:g} GB (batch {task.batch_size})"
                  + (f": planned (no GPU here; task=plan's peak, reserve {search['reserve_gb']:g} GiB)" if search.get("planned") else ""), "",
                  f"Doubling from {search['start']}, then bisection to {search['resolution']} tokens, at most {search['upper']}.", "",
                  "| method | max prompt tokens | × full | first failure | probes |", "|---|---:|---:|---:|---|"]
        for label, s in search["methods"].items():
            probes = ", ".join(f"{n}{'✓' if ok else '✗'}" for n, ok in s["probes"])
            lines.append(f"| {label} | {s['max_length']}{' (upper bound reached)' if s['reached_upper'] else ''} | "
                         f"{_f(s.get('vs_full'), '{:.2f}x')} | {_f(s['first_failure'], '{}')} | {probes} |")
    return "\n".join(lines) + "\n"


def _planned_cell(e: dict) -> str:
    """The plan's KV bytes and peak above the weights (task=plan's tracker; ≥: a value-dependent split planned at its largest)."""
    if e.get("peak_bytes_planned") is None:
        return "–"
    return (f"{_f(e.get('kv_bytes_planned') and e['kv_bytes_planned'] / MB, '{:.1f}')} / "
            f"{'≤ ' if e.get('plan_bound') else ''}{e['peak_increase_bytes_planned'] / MB:.1f}")


def _compress_cell(e: dict) -> str:
    """`total (pct)`, or `total: capture + select (pct)` where the rows have the parts."""
    parts = ""
    if e.get("compress_capture_s") is not None and e.get("compress_select_s") is not None:
        parts = f": {_f(e['compress_capture_s'], '{:.3f}')} + {_f(e['compress_select_s'], '{:.3f}')}"
    return f"{_f(e['compress_s'], '{:.3f}')}{parts} ({_f(e['compress_pct_of_full_prefill'], '{:.1f}%')})"


def write_plots(table: list[dict], path: Path, *, title: str) -> None:
    from harness.plots import line_plot

    def series(key, scale=1.0):
        out: dict[str, list] = {}
        for e in table:
            v = e[key]
            out.setdefault(e["label"], []).append((e["length"], None if v is None else v * scale))
        return out

    line_plot(series("decode_median_ms"), path / "bench_decode_latency.png", title=f"Decode latency per step (median)\n{title}",
              xlabel="prompt tokens", ylabel="ms / decode step (whole batch)", logx=True)
    line_plot(series("peak_increase_bytes", 1 / MB), path / "bench_peak_memory.png", title=f"Peak memory per measurement\n{title}",
              xlabel="prompt tokens", ylabel="MB above the memory before it", logx=True)
    line_plot(series("kv_bytes", 1 / MB), path / "bench_kv_bytes.png", title=f"KV cache after prefill\n{title}",
              xlabel="prompt tokens", ylabel="MB", logx=True)
