"""Reproduce the SnapKV paper (arXiv 2404.14469) in one command, then build the tables.

    python scripts/reproduce_paper.py                       # LongBench Table 1, needle, speed + max length
    python scripts/reproduce_paper.py --dry-run             # every run, its overrides and run directory; no model
    python scripts/reproduce_paper.py --only needle,speed --launcher submitit_slurm
    python scripts/reproduce_paper.py --only modern         # Llama-3.1 / Qwen2.5 x 5 methods x budgets 128, 2048
    python scripts/reproduce_paper.py --only observation,lines   # Figures 2-5 (hit rates) and 8 (pooling ablation)
    python scripts/reproduce_paper.py --only plan           # the memory claims as predictions, on a CPU (minutes)
    python scripts/reproduce_paper.py --only ruler          # kvpress's RULER leaderboard setting (ruler_cpu: on a CPU)
    python scripts/reproduce_paper.py --smoke               # the whole plan in miniature on a CPU (a few minutes)

Each part is one or more Hydra experiments (conf/experiment/*.yaml), each run as a multirun
`python -m harness -m +experiment=<name> hydra.sweep.dir=<out>/<part> hydra/launcher=<launcher>`.
Run directories are deterministic (`<out>/<part>/<model>/<method tag>`), so running the same command
again resumes: finished runs (results.json complete, same config) are skipped without loading a model,
unfinished ones are relaunched and the harness skips the items they already hold. A run directory that
holds a run with a different config is refused before anything starts. Then
`python -m harness.report <out> --name <results-name>` writes the tables into `results/<results-name>/`.

Extra Hydra overrides for every run go after `--` (e.g. `-- model.attn_implementation=flash_attention_2`).
`python -m harness.reproduce` is the same command (scripts/reproduce_paper.py is a thin entry over this module).
See docs/reproducing.md for hardware and expected wall time per part.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import CONF_DIR, REPO_ROOT as REPO


@dataclass(frozen=True)
class Part:
    title: str
    experiments: tuple[str, ...]
    hardware: str
    longbench: bool = False  # takes --longbench-data


PARTS: dict[str, Part] = {
    "longbench": Part("SnapKV Table 1: LongBench, 4 models x {All KV, SnapKV 1024/2048/4096, H2O 4096}", ("paper_longbench",),
                      "one 80 GB GPU per 7B model; Mixtral-8x7B about 2 x 80 GB (device_map=auto)", longbench=True),
    "needle": Part("SnapKV needle figure: LWM-Text-Chat-1M, SnapKV C=1024, 45 lengths (1K-380K) x 10 depths", ("paper_needle",),
                   "one 80 GB GPU (the paper: one A100-80GB)"),
    "speed": Part("SnapKV decoding-speed (16K, batch 2) and maximum-length (80 GB cap) figures, LWM-7B random weights",
                  ("paper_speed", "paper_maxlen"), "one 80 GB GPU (random weights: no download)"),
    "modern": Part("Modern models as PyramidKV reports them: Llama-3.1-8B / Qwen2.5-7B x {full, SnapKV, PyramidKV, "
                   "StreamingLLM, H2O} x budgets 128, 2048",
                   ("modern_full", "modern_snapkv", "modern_pyramidkv", "modern_streamingllm", "modern_h2o"),
                   "one 40-80 GB GPU (Llama-3.1 is gated: HF_TOKEN)", longbench=True),
    "observation": Part("SnapKV Figures 2-5: observation-window hit rates, Mistral-7B-Instruct-v0.2, full cache, LongBench "
                        "qmsum (stand-in for QMSum) + needle haystack with 3 questions, instruction at the end and beginning",
                        ("paper_observation",), "one 24-80 GB GPU", longbench=True),
    "lines": Part("SnapKV Figure 8: LongEval-Lines pooling ablation, Mistral-7B-Instruct-v0.2, SnapKV W=16 max pooling k=5 "
                  "vs none, 5K-30K tokens x 11 positions", ("paper_lines",), "one 40-80 GB GPU"),
    "ruler": Part("kvpress's RULER leaderboard setting: Llama-3.1-8B-Instruct, Qwen3-8B, RULER 4K (11 synthetic tasks x 500), "
                  "query-agnostic, full + SnapKV/PyramidKV/StreamingLLM/H2O at compression ratios 0.25/0.5/0.75/0.875",
                  ("ruler_leaderboard",), "one 40-80 GB GPU (Llama-3.1 is gated: HF_TOKEN)"),
    "ruler_cpu": Part("RULER on a CPU: SmolLM2-135M, RULER 4K (11 synthetic tasks x 10), both protocols, full + "
                      "SnapKV/PyramidKV/StreamingLLM/H2O at compression ratios 0.25/0.5/0.75", ("ruler_cpu",), "CPU (hours)"),
    "ruler_gemma_cpu": Part("RULER on a CPU at three lengths: Gemma 3 270M, RULER 4K/8K/16K (11 synthetic tasks x 10), both "
                            "protocols, full + SnapKV at compression ratios 0.25/0.5/0.75", ("ruler_gemma_cpu",), "CPU (hours)"),
    "ruler_methods_cpu": Part("Every method on RULER on a CPU: SmolLM2-135M, RULER 4K (11 synthetic tasks x 10), both "
                              "protocols, full + the 15 methods at compression ratios 0.25/0.5/0.75",
                              ("ruler_methods_cpu",), "CPU (hours)"),
    "field": Part("The field's benchmarks for the leaderboard models: Llama-3.1-8B-Instruct, Qwen3-8B x LongBench-v2 (503), "
                  "InfiniteBench (12 tasks), LooGLE (4 tasks), ZeroSCROLLS (10 tasks, validation; the official scorer from a local "
                  "copy), both protocols, and SCBench (9 tasks, multi-request and multi-turn), full + "
                  "SnapKV/PyramidKV/StreamingLLM/H2O at compression ratios 0.25/0.5/0.75/0.875 (docs/field_benchmarks.md)",
                  ("field_longbench_v2", "field_infinitebench", "field_scbench", "field_zeroscrolls", "field_loogle"),
                  "one 80 GB GPU (128K contexts; Llama-3.1 is gated: HF_TOKEN); hub data or task.data_dir"),
    "field_cpu": Part("The field's benchmarks on a CPU: SmolLM2-135M, LongBench-v2 (20 short questions) and InfiniteBench "
                      "(6 tasks x 5), ZeroSCROLLS (5 tasks x 5) and LooGLE (4 tasks x 2 documents x 3 questions) in both "
                      "protocols, SCBench (4 tasks x 2, 3 turns, both modes), truncated to 7500 tokens, "
                      "full + SnapKV/StreamingLLM at ratios 0.5/0.75",
                      ("field_longbench_v2_cpu", "field_infinitebench_cpu", "field_scbench_cpu", "field_zeroscrolls_cpu",
                       "field_loogle_cpu"), "CPU (hours); hub data or task.data_dir"),
    "plan": Part("The paper's memory claims as predictions, planned on a CPU (task=plan, fake tensors): LWM-Text-Chat-1M "
                 "fp16 on 80 GB, batch 1/2, full (eager, sdpa, FlashAttention-2, 4.37 logits) vs SnapKV 1024/2048; "
                 "Llama-3.1-8B, Qwen3-8B, Mixtral 8x7B, Gemma 3 12B at 32K-128K on 24/48/80/140 GB",
                 ("paper_plan", "paper_plan_hf437", "paper_plan_eager", "paper_plan_modern"), "CPU (no GPU, no weights)"),
}
DEFAULT_PARTS = ("longbench", "needle", "speed")
SMOKE_PARTS: dict[str, Part] = {
    "longbench": Part("smoke LongBench: tiny-random, fixture data (1 item per task), full/SnapKV/H2O", ("smoke_longbench",),
                      "CPU", longbench=True),
    "needle": Part("smoke needle: SmolLM2-135M, 2 lengths x 1 depth, full/SnapKV", ("smoke_needle",), "CPU"),
    "speed": Part("smoke speed + maximum length: tiny-random, batch 2, full/SnapKV C=128", ("smoke_speed", "smoke_maxlen"), "CPU"),
    "observation": Part("smoke observation: SmolLM2-135M, windows of 16, haystack + fixture qmsum", ("smoke_observation",), "CPU"),
    "lines": Part("smoke lines: SmolLM2-135M, 2 lengths x 2 positions, SnapKV C=128 max pooling k=5 vs none", ("smoke_lines",), "CPU"),
    "ruler": Part("smoke RULER: SmolLM2-135M, 1024 tokens, niah_single_1 + vt x 2 samples, full/SnapKV ratio 0.5", ("ruler_smoke",), "CPU"),
}
LAUNCHERS = ("basic", "joblib", "submitit_local", "submitit_slurm")


# ------------------------------------------------------------------------------------------ planning

@dataclass
class Job:
    part: str
    experiment: str
    sweep: dict[str, str]          # this run's sweep overrides, e.g. {"model": "...", "method": "..."}
    run_dir: Path
    config: dict                   # the resolved config the run will have (no hydra node)
    state: str = "todo"            # todo | resume | done | conflict
    detail: str = ""


@dataclass
class Experiment:
    part: str
    name: str
    sweep_dir: Path
    params: dict[str, list[str]]   # the experiment's sweep (after --models), in Hydra's order
    full_params: dict[str, list[str]]
    extra: list[str]
    jobs: list[Job] = field(default_factory=list)
    skipped: str = ""


def _sweep_values(key: str, value) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    override = OverridesParser.create().parse_override(f"{key}={value}")
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    return [override.get_value_element_as_str()]


def _job_config(cfg) -> dict:
    from omegaconf import OmegaConf

    if cfg.get("model") is not None and cfg.model.get("dtype") == "auto":  # as harness.app records it (imports torch)
        from harness.models import resolve_config_dtype

        resolve_config_dtype(cfg)
    out = {}
    for key in cfg.keys():
        if key == "hydra":
            continue
        node = cfg[key]
        out[key] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    return out


def plan(parts: dict[str, Part], selected: list[str], out: Path, *, models: list[str] | None, extra: list[str],
         longbench_data: str | None) -> list[Experiment]:
    """Every run of the selected parts: its sweep overrides, run directory, resolved config and state."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.settings import compose_settings, method_entries, setting_dir  # also registers the kv.* resolvers

    experiments: list[Experiment] = []
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for part_name in selected:
            part = parts[part_name]
            for name in part.experiments:
                sweep_dir = out / part_name
                part_extra = list(extra)
                if part.longbench and longbench_data:
                    part_extra.append(f"task.data_dir={longbench_data}")
                base = [f"+experiment={name}", f"hydra.sweep.dir={sweep_dir}", *part_extra]
                cfg = compose(config_name="config", overrides=base, return_hydra_config=True)
                full = {str(k): _sweep_values(str(k), v) for k, v in (cfg.hydra.sweeper.params or {}).items()}
                params = dict(full)
                exp = Experiment(part_name, name, sweep_dir, params, full, part_extra)
                if models is not None and "model" in params:
                    params["model"] = [m for m in params["model"] if m in models]
                    if not params["model"]:
                        exp.skipped = f"none of --models runs in it (its models: {', '.join(full['model'])})"
                experiments.append(exp)
                if exp.skipped:
                    continue
                keys = list(params)
                for values in itertools.product(*(params[k] for k in keys)):
                    sweep = dict(zip(keys, values))
                    overrides = [*base, *(f"{k}={v}" for k, v in sweep.items())]
                    job_cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
                    job_dir = Path(str(job_cfg.hydra.sweep.dir)) / str(job_cfg.hydra.sweep.subdir)
                    # A job with a `methods` list runs every setting from one prefill per item: one run
                    # (and run directory) per setting, as the harness writes them.
                    entries = method_entries(job_cfg, overrides)
                    settings = [job_cfg] if entries is None else [c for _, c in compose_settings(entries, overrides)]
                    for setting in settings:
                        job = Job(part_name, name, sweep, setting_dir(setting, job_dir), _job_config(setting))
                        job.state, job.detail = job_state(job)
                        exp.jobs.append(job)
    return experiments


def job_state(job: Job) -> tuple[str, str]:
    """done (finished, same config) | resume (started, same config) | conflict (another config) | todo."""
    from omegaconf import OmegaConf

    from harness.rundir import describe_differences, result_key_differences

    results, stored = job.run_dir / "results.json", job.run_dir / "config.yaml"
    old = None
    data: dict = {}
    if results.exists():
        try:
            data = json.loads(results.read_text(encoding="utf-8"))
            old = data.get("config")
        except (OSError, ValueError):
            data = {}
    if old is None and stored.exists():
        try:
            old = OmegaConf.to_container(OmegaConf.load(stored), resolve=False)
        except Exception:  # noqa: BLE001  (unreadable: the harness reports it)
            return "resume", "config.yaml unreadable"
    if old is None:
        return "todo", ""
    diff = result_key_differences(old, job.config)
    if diff:
        return "conflict", describe_differences(old, job.config, diff)
    if data:
        status = data.get("status") or (data.get("summary") or {}).get("status") or "complete"
        failures = int(data.get("failures") or 0)
        if status == "complete" and not failures:
            return "done", ""
        return "resume", f"status {status}, {failures} failed item(s)"
    return "resume", "started, no results.json yet"


def describe(config: dict) -> str:
    """One line: what this run is."""
    task, model, method = config.get("task", {}), config.get("model", {}), config.get("method", {})
    bits = [f"model={model.get('name')}" + (" (random weights)" if model.get("random_weights") else "")]
    name = task.get("name")
    if name in ("longbench", "longbench_e"):
        ds = task.get("datasets")
        bits += [f"method={method.get('tag')}", f"task={name}",
                 f"datasets={'the 16 EN tasks' if not ds else ','.join(ds)}", f"limit={task.get('limit')}",
                 f"min_new_tokens={task.get('min_new_tokens')}", f"chat_format={model.get('chat_format')}",
                 f"code_sim={task.get('code_sim_backend')}"]
    elif name == "needle":
        lengths = task.get("lengths") or []
        bits += [f"method={method.get('tag')}", "task=needle",
                 f"lengths={len(lengths)} ({min(lengths)}..{max(lengths)})" if lengths else "lengths=?",
                 f"depths={task.get('depths')}", f"prompt_style={task.get('prompt_style')}"]
    elif name == "observation":
        p = task
        bits += ["task=observation", f"source={p.get('source')}" + (f":{p.get('dataset')}" if p.get("source") == "longbench" else ""),
                 f"windows={p.get('prompt_windows')}x{p.get('window_tokens')}",
                 f"generation={p.get('generation_windows')}x{p.get('generation_window_tokens')}",
                 f"theta={p.get('theta')}", f"p={p.get('rate')}", f"positions={p.get('positions')}"]
    elif name == "lines":
        lengths = task.get("lengths") or []
        bits += [f"method={method.get('tag')}", "task=lines",
                 f"lengths={len(lengths)} ({min(lengths)}..{max(lengths)})" if lengths else "lengths=?",
                 f"positions={task.get('positions')}", f"samples={task.get('samples')}"]
    elif name == "ruler":
        bits += [f"method={method.get('tag')}", "task=ruler", f"tasks={len(task.get('tasks') or [])}",
                 f"lengths={task.get('lengths')}", f"samples={task.get('samples')}",
                 f"protocol={'query_aware' if task.get('query_aware', True) else 'query_agnostic'}",
                 f"template={task.get('template')}"]
    elif name == "bench":
        labels = [m.get("label") for m in task.get("methods") or []]
        bits += ["task=bench", f"methods={','.join(map(str, labels))}", f"batch={task.get('batch_size')}",
                 f"lengths={task.get('context_lengths')}"]
        if task.get("max_length_search"):
            bits += [f"max_length_search (cap {task.get('memory_cap_gb')} GB, up to {task.get('search_max')})"]
    else:
        bits += [f"method={method.get('tag')}", f"task={name}"]
    return " ".join(bits)


# ------------------------------------------------------------------------------------------ launching

def launches(exp: Experiment) -> list[dict[str, list[str]]]:
    """Sweeps covering exactly the runs still to do: the whole sweep when nothing is done yet; otherwise one
    sweep per value of the leading keys, over the remaining values of the last key (grouped when equal)."""
    todo = [j for j in exp.jobs if j.state in ("todo", "resume")]
    if not todo:
        return []
    keys = list(exp.params)
    if len(todo) == len(exp.jobs):
        return [dict(exp.params)]
    if len(keys) == 1:  # (a job with a methods list is several runs of one sweep value: listed once)
        return [{keys[0]: list(dict.fromkeys(j.sweep[keys[0]] for j in todo))}]
    last = keys[-1]
    by_prefix: dict[tuple, list[str]] = {}
    for j in todo:
        values = by_prefix.setdefault(tuple(j.sweep[k] for k in keys[:-1]), [])
        if j.sweep[last] not in values:
            values.append(j.sweep[last])
    if len(keys) == 2:  # merge prefixes that miss the same values: model=a,b method=x,y
        by_values: dict[tuple, list[str]] = {}
        for prefix, values in by_prefix.items():
            by_values.setdefault(tuple(values), []).append(prefix[0])
        return [{keys[0]: firsts, last: list(values)} for values, firsts in by_values.items()]
    return [{**{k: [v] for k, v in zip(keys[:-1], prefix)}, last: values} for prefix, values in by_prefix.items()]


def command(exp: Experiment, sweep: dict[str, list[str]], launcher: str) -> list[str]:
    args = [sys.executable, "-m", "harness", "-m", f"+experiment={exp.name}", f"hydra.sweep.dir={exp.sweep_dir}",
            f"hydra/launcher={launcher}", *exp.extra]
    if sweep != exp.full_params:
        args += [f"{k}={','.join(v)}" for k, v in sweep.items()]
    return args


def show_command(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["python", *args[1:]])


# ------------------------------------------------------------------------------------------ main

def parse_args(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="scripts/reproduce_paper.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--only", action="append", default=None, metavar="PART",
                   help=f"part(s) to run, repeatable or comma-separated: {', '.join(PARTS)} or all "
                        f"(default: {','.join(DEFAULT_PARTS)})")
    p.add_argument("--models", default=None, help="only these models (comma-separated conf/model names)")
    p.add_argument("--launcher", default="basic", choices=LAUNCHERS, help="Hydra launcher, passed as hydra/launcher=<name>")
    p.add_argument("--out", type=Path, default=None, help="where the runs go (default: runs/paper, with --smoke runs/smoke)")
    p.add_argument("--results-name", default=None, help="table set name: results/<name>/ (default: paper, with --smoke smoke)")
    p.add_argument("--results-root", type=Path, default=REPO / "results", help="parent folder of the table sets (default: results/)")
    p.add_argument("--longbench-data", default=None, metavar="DIR",
                   help="folder of the official LongBench jsonl files (or data.zip); default: the hub's data.zip")
    p.add_argument("--dry-run", action="store_true", help="print every run (overrides, config, run directory, state); run nothing")
    p.add_argument("--smoke", action="store_true", help="the plan in miniature on this CPU (tiny-random, SmolLM2, fixture data)")
    p.add_argument("--verbose", action="store_true", help="with --dry-run: each run's resolved config as well")
    p.add_argument("--no-report", action="store_true", help="run, but do not build the tables")
    p.add_argument("--report-only", action="store_true", help="only (re)build the tables from what --out holds")
    args = p.parse_args(argv)
    args.extra = extra
    return args, p


def main(argv: list[str] | None = None) -> int:
    args, parser = parse_args(argv)
    parts = SMOKE_PARTS if args.smoke else PARTS
    wanted: list[str] = []
    # --smoke without --only: the miniature of the default plan (the other smoke parts run with --only)
    for item in args.only or [",".join(DEFAULT_PARTS if not args.smoke else [p for p in SMOKE_PARTS if p in DEFAULT_PARTS])]:
        for name in filter(None, (s.strip() for s in item.split(","))):
            names = list(parts) if name == "all" else [name]
            for n in names:
                if n not in parts:
                    known = ", ".join(parts)
                    parser.error(f"--only {n}: unknown part{' for --smoke' if args.smoke and n in PARTS else ''}; choose from {known}, all")
                if n not in wanted:
                    wanted.append(n)
    models = None
    if args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        available = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        unknown = [m for m in models if m not in available]
        if unknown:
            parser.error(f"--models: unknown model(s) {', '.join(unknown)}; available: {', '.join(available)}")
    out = (args.out or (REPO / "runs" / ("smoke" if args.smoke else "paper"))).expanduser().resolve()
    results_name = args.results_name or ("smoke" if args.smoke else "paper")
    results_dir = (args.results_root.expanduser().resolve() / results_name)

    if args.report_only:
        return build_report(out, results_dir)

    try:
        experiments = plan(parts, wanted, out, models=models, extra=args.extra, longbench_data=args.longbench_data)
    except Exception as exc:  # noqa: BLE001  (a bad override or experiment: Hydra's message, one line)
        print(f"error: could not compose the plan: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    print_plan(experiments, parts, wanted, out, results_dir, args)
    conflicts = [j for e in experiments for j in e.jobs if j.state == "conflict"]
    if args.dry_run:
        return 0
    if conflicts:
        print(f"error: {len(conflicts)} run directorie(s) hold a run with a different config (listed above as CONFLICT); "
              f"use another --out, or delete them", file=sys.stderr)
        return 2

    failed: list[str] = []
    started = time.time()
    for exp in experiments:
        for sweep in launches(exp):
            cmd = command(exp, sweep, args.launcher)
            print(f"\n[{exp.part}] $ {show_command(cmd)}", flush=True)
            t0 = time.time()
            rc = subprocess.run(cmd, cwd=REPO).returncode
            print(f"[{exp.part}] {exp.name}: exit status {rc} after {time.time() - t0:.0f} s", flush=True)
            if rc != 0:
                swept = ", ".join(f"{k}={','.join(v)}" for k, v in sweep.items())
                failed.append(f"{exp.name} ({swept}): exit status {rc}")
    print(f"\nruns finished in {time.time() - started:.0f} s")
    status = 0
    if failed:
        print("error: some sweeps failed (their finished items are kept; rerun the same command to resume):", file=sys.stderr)
        for f in failed:
            print(f"  {f}", file=sys.stderr)
        status = 1
    if not args.no_report:
        rc = build_report(out, results_dir)
        status = status or rc
    return status


def print_plan(experiments: list[Experiment], parts: dict[str, Part], wanted: list[str], out: Path, results_dir: Path, args) -> None:
    kind = "smoke miniature of the SnapKV reproduction" if args.smoke else "SnapKV paper reproduction"
    print(f"Plan: {kind}; parts: {', '.join(wanted)}; launcher: {args.launcher}")
    print(f"runs under {out}; tables into {results_dir}")
    counts: dict[str, int] = {}
    states: dict[str, int] = {}
    for part_name in wanted:
        part = parts[part_name]
        exps = [e for e in experiments if e.part == part_name]
        n = sum(len(e.jobs) for e in exps)
        counts[part_name] = n
        print(f"\n[{part_name}] {part.title}: {n} run(s); hardware: {part.hardware}")
        for exp in exps:
            if exp.skipped:
                print(f"  {exp.name}: skipped, {exp.skipped}")
                continue
            todo = launches(exp)
            if not todo:
                print(f"  {exp.name}: all {len(exp.jobs)} run(s) done")
            for sweep in todo:
                print(f"  $ {show_command(command(exp, sweep, args.launcher))}")
            for job in exp.jobs:
                states[job.state] = states.get(job.state, 0) + 1
                sweep = " ".join(f"{k}={v}" for k, v in job.sweep.items())
                print(f"    {job.state.upper():8} {job.run_dir}")
                print(f"             overrides: +experiment={job.experiment} {sweep}{' ' + ' '.join(exp.extra) if exp.extra else ''}")
                print(f"             {describe(job.config)}")
                if job.detail:
                    print(f"             {job.detail}")
                if args.verbose:
                    from omegaconf import OmegaConf

                    print("\n".join("             | " + line for line in OmegaConf.to_yaml(job.config).splitlines()))
    total = sum(counts.values())
    per_part = ", ".join(f"{k} {v}" for k, v in counts.items())
    state_text = ", ".join(f"{v} {k}" for k, v in sorted(states.items()))
    print(f"\nTotal: {total} run(s) ({per_part}){'; ' + state_text if state_text else ''}")


def build_report(out: Path, results_dir: Path) -> int:
    from harness.report import build

    if not out.is_dir():
        print(f"error: {out} holds no runs yet", file=sys.stderr)
        return 2
    written = build(out, results_dir)
    if (out / "plan").is_dir():  # the plan part: the paper's claims beside the predictions
        from harness.tasks.plan.predictions import main as predictions

        predictions([str(out / "plan"), str(results_dir.parent / "plan")])
    print(f"tables: {results_dir} ({', '.join(written['sections']) or 'no tables'}; {written['runs']} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
