"""`task=plan`: plan a GPU run's memory on this CPU, through the code a real run executes.

For every setting (a method config; `methods=[...]` gives several), prompt length and batch size, the model is
built from its config with random weights under fake tensors (`harness.memory_plan`: no weights, no compute)
and `generate_settings` runs as a task would run it: the prefill (one shot, or `model.prefill_chunk_size`
chunks), each layer's compression, the query-agnostic protocol's question prefill (`task.query_aware=false`),
`task.new_tokens` decode steps. Every live storage is counted; a point's record holds the peak, the phase it
happened in and what was live then. With `task.gpu_memory_gb`, a point fits when its peak plus
`task.reserve_gb` (what a tracker cannot see: CUDA context, workspaces, fragmentation) is at most the GPU's
memory, and `task.search=true` finds each setting's longest prompt that fits (doubling, then bisection at
`task.length_step` tokens).

Attention: `task.attn_implementations` plans each listed implementation (default: the model's own). eager
materialises the scores (B, H, L, L); sdpa runs torch's flash-style kernel on the fake CPU device (output and
log-sum-exp, no scores); flash_attention_2 is planned as that same memory-efficient path (its kernel keeps the
same output and log-sum-exp; its small workspaces are in the reserve), and the records say so.
"""

from __future__ import annotations

import logging
import time

from omegaconf import DictConfig, OmegaConf, open_dict

from harness.errors import HarnessError, require
from harness.rundir import RunDir, provenance, write_json, write_text

log = logging.getLogger(__name__)
GIB = 1 << 30
IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
PLANNED_AS = {"flash_attention_2": "sdpa"}
TAKES_METHODS = True  # harness.app hands prepare_and_run the settings of `methods=[...]` (or method=)  # what the fake CPU device runs for an implementation it lacks


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]


def validate(task: DictConfig) -> None:
    lengths = [int(n) for n in _as_list(task.get("lengths"))]
    require(lengths or task.get("search"), "task.lengths is empty and task.search=false: nothing to plan; e.g. 'task.lengths=[16384,131072]'")
    require(all(n > 0 for n in lengths), f"task.lengths: {lengths} must be positive token counts")
    batches = [int(b) for b in _as_list(task.batch_size)]
    require(batches and all(b >= 1 for b in batches), f"task.batch_size={task.batch_size}: one or more sizes >= 1")
    require(int(task.new_tokens) >= 1, f"task.new_tokens={task.new_tokens} must be >= 1 (decode steps planned)")
    require(int(task.question_tokens) >= 0, f"task.question_tokens={task.question_tokens} must be >= 0")
    require(float(task.reserve_gb) >= 0, f"task.reserve_gb={task.reserve_gb} must be >= 0")
    require(int(task.length_step) >= 1, f"task.length_step={task.length_step} must be >= 1")
    require(task.target in ("cuda", "cpu"), f"task.target={task.target!r} is not cuda or cpu")
    for impl in _as_list(task.get("attn_implementations")):
        require(impl in IMPLEMENTATIONS, f"task.attn_implementations: {impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if task.get("search"):
        require(task.get("gpu_memory_gb") is not None, "task.search=true needs task.gpu_memory_gb (e.g. 80)")
    if task.get("gpu_memory_gb") is not None:
        require(float(task.gpu_memory_gb) > 0, f"task.gpu_memory_gb={task.gpu_memory_gb} must be > 0")


def capacity_bytes(task) -> int | None:
    """What a point may use: the GPU's memory (GiB, as nvidia-smi's MiB / 1024) less the reserve."""
    if task.get("gpu_memory_gb") is None:
        return None
    return int((float(task.gpu_memory_gb) - float(task.reserve_gb)) * GIB)


def load_fake(model_cfg: DictConfig, implementation: str | None, target: str):
    """The model of `model_cfg` built from its architecture with random weights under a fresh fake mode."""
    from harness.memory_plan import fake_mode, planning
    from harness.models import load_model

    require(model_cfg.get("architecture") is not None,
            f"model {model_cfg.name} has no `architecture`: task=plan builds the model from it (conf/model/*.yaml)")
    cfg = OmegaConf.create(OmegaConf.to_container(model_cfg, resolve=True))
    with open_dict(cfg):
        cfg.random_weights = True
        cfg.device = "cpu"
        cfg.device_map = None
        if implementation:
            cfg.attn_implementation = PLANNED_AS.get(implementation, implementation)
    mode = fake_mode()
    with planning(mode, target):
        loaded = load_model(cfg)
    return loaded, mode


def full_logits_peak(row: dict, vocab: int, dtype_bytes: int) -> int | None:
    """The peak had the prefill computed logits at every prompt position in the model dtype and upcast them to
    float32 (transformers <= 4.44's LlamaForCausalLM, the SnapKV paper's 4.37): what was live at the prefill's
    logits + B x L x vocab x (dtype + 4) bytes, or the planned peak if larger."""
    if row.get("prefill_logits_bytes") is None:
        return None
    extra = row["batch_size"] * row["length"] * vocab * (dtype_bytes + 4)
    return max(row["peak_bytes"], row["prefill_logits_bytes"] + extra)


def fake_twin(loaded, target: str = "cuda"):
    """A loaded model's fake twin (same config, dtype and attention; random fake weights) sharing its tokenizer:
    for models without an `architecture` in their config (GGUF, hub), e.g. to check a plan against their real run."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from harness.memory_plan import fake_mode, planning

    config = loaded.model.config
    mode = fake_mode()
    with planning(mode, target):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation,
                                                 dtype=next(loaded.model.parameters()).dtype).eval()
        model.requires_grad_(False)
    return dataclasses.replace(loaded, model=model), mode


def plan_point(loaded, mode, methods, length: int, batch: int, task, chunk_size, seed: int) -> dict:
    from harness.tasks.plan.trace import trace_generation

    resolved_questions = min(int(task.question_tokens), max(length - 1, 0))
    return trace_generation(loaded, methods, length, batch_size=batch, query_aware=bool(task.query_aware),
                            question_tokens=resolved_questions, new_tokens=int(task.new_tokens), chunk_size=chunk_size,
                            mode=mode, target=str(task.target), seed=seed)


def search_longest(fits, task, limit: int = 0) -> dict:
    """The longest prompt (a multiple of task.length_step) that fits: doubling from task.search_start, then bisection."""
    from harness.tasks.bench.search import search_max_length

    step = int(task.length_step)
    out = search_max_length(lambda k: fits(k * step), start=max(1, int(task.search_start) // step), resolution=1,
                            upper=max(1, min(int(task.search_max), limit or int(task.search_max)) // step))
    return {"max_length": out["max_length"] * step, "first_failure": out["first_failure"] and out["first_failure"] * step,
            "reached_upper": out["reached_upper"], "probes": [(n * step, ok) for n, ok in out["probes"]]}


def prepare_and_run(cfg: DictConfig, run_dir: RunDir, settings: list | None = None) -> dict:
    from harness.methods import build_method
    from harness.methods.engine import attention_modules

    task = cfg.task
    run_dir.prepare(cfg, resume=bool(cfg.resume), clear=("plan_table.md", "plan_table.csv", "plan_peak.png"))
    started = time.time()
    settings = settings or [(str(cfg.method.tag), cfg)]
    methods = [(tag, build_method(scfg.method)) for tag, scfg in settings]
    lengths = sorted({int(n) for n in _as_list(task.get("lengths"))})
    batches = [int(b) for b in _as_list(task.batch_size)]
    chunk = cfg.model.get("prefill_chunk_size")
    implementations = [str(i) for i in _as_list(task.get("attn_implementations"))] or [str(cfg.model.attn_implementation)]
    capacity = capacity_bytes(task)
    gpus = [float(g) for g in _as_list(task.get("compare_gpus"))]
    rows_log = run_dir.log("plan_rows.jsonl", key=("setting", "attn_implementation", "batch_size", "length"))
    rows, search = [], {}
    groups = [[m] for m in methods] + ([methods] if task.get("shared") and len(methods) > 1 else [])
    for impl in implementations:
        loaded, mode = load_fake(cfg.model, impl, str(task.target))
        layers = len(attention_modules(loaded.model))
        for _, method in methods:
            method.validate(layers, loaded.max_positions)

        vocab, dtype_bytes = int(loaded.model.config.vocab_size), loaded.model.get_input_embeddings().weight.element_size()

        def point(group, n, b):
            name = "+".join(tag for tag, _ in group)
            key = (name, impl, b, n)
            if key in rows_log:
                return rows_log.records[key]
            twin = (name, PLANNED_AS.get(impl, impl), b, n)  # flash_attention_2 is planned as sdpa: one plan for both
            if twin != key and twin in rows_log:
                row = {**rows_log.records[twin], "attn_implementation": impl, "planned_as": twin[1]}
                rows_log.append(row)
                return row
            t0 = time.perf_counter()
            try:
                got = plan_point(loaded, mode, group, n, b, task, chunk, int(cfg.seed))
            except HarnessError:
                raise
            except Exception as exc:  # noqa: BLE001  (a method this plan cannot follow: recorded, the others go on)
                got = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"}
            if task.full_logits and "error" not in got:
                got["peak_bytes_planned"] = got["peak_bytes"]
                got["peak_bytes"] = full_logits_peak({**got, "length": n, "batch_size": b}, vocab, dtype_bytes)
            row = {"setting": name, "attn_implementation": impl, "planned_as": PLANNED_AS.get(impl, impl), "length": n,
                   "batch_size": b, "query_aware": bool(task.query_aware), "prefill_chunk_size": chunk,
                   "new_tokens": int(task.new_tokens), "dtype": str(cfg.model.dtype), **got,
                   "reserve_bytes": int(float(task.reserve_gb) * GIB), "full_logits": bool(task.full_logits),
                   "fits": None if capacity is None or "error" in got else got["peak_bytes"] <= capacity,
                   **({"fits_on": {str(g): got["peak_bytes"] <= int((float(g) - float(task.reserve_gb)) * GIB) for g in gpus}}
                      if gpus and "error" not in got else {}),
                   "plan_seconds": round(time.perf_counter() - t0, 2)}
            rows_log.append(row)
            log.info("plan %s %s batch %d, %d tokens: %s", name, impl, b, n,
                     row.get("error") or f"peak {row['peak_bytes'] / GIB:.2f} GiB at {row['peak_phase']}"
                     + ("" if row["fits"] is None else (" (fits)" if row["fits"] else " (does not fit)")))
            return row

        limit = int(loaded.max_positions or 0)
        planned_lengths = [n for n in lengths if not limit or n <= limit]
        if len(planned_lengths) < len(lengths):
            log.warning("plan: %s holds %d positions; lengths %s are not planned", cfg.model.name, limit,
                        [n for n in lengths if n not in planned_lengths])
        for b in batches:
            for group in groups:
                for n in planned_lengths:
                    rows.append(point(group, n, b))
                if task.get("search") and len(group) == 1:
                    name = group[0][0]
                    found = search_longest(lambda n, g=group: bool(point(g, n, b).get("fits")), task, limit)
                    search[f"{name}|{impl}|{b}"] = {"setting": name, "attn_implementation": impl, "batch_size": b, **found}
                    log.info("plan %s %s batch %d: longest prompt that fits %d tokens", name, impl, b, found["max_length"])
        del loaded, mode
    from harness.tasks.plan.tables import write_outputs

    summary = write_outputs(run_dir.path, rows, search, cfg, capacity)
    results = {"schema": 1, "task": "plan", "model": {"name": cfg.model.name, "random_weights": True, "fake_tensors": True},
               "methods": {tag: OmegaConf.to_container(scfg.method, resolve=True) for tag, scfg in settings},
               "status": "complete" if not any("error" in r for r in rows) else "items_failed",
               "summary": summary, "rows": rows, "search": list(search.values()),
               "config": OmegaConf.to_container(cfg, resolve=True),
               "provenance": {**provenance(int(cfg.seed), "cpu (fake tensors)"), "wall_seconds": round(time.time() - started, 2)}}
    run_dir.write_results(results)
    write_json(run_dir.path / "plan_summary.json", summary)
    print(summary_text(summary))
    return results


def summary_text(summary: dict) -> str:
    lines = []
    for entry in summary.get("max_length", []):
        lines.append(f"{entry['setting']} ({entry['attn_implementation']}, batch {entry['batch_size']}): longest prompt that fits "
                     f"{entry['max_length']:,} tokens")
    for entry in summary.get("points", []):
        verdict = "" if entry["fits"] is None else (" fits" if entry["fits"] else " does NOT fit")
        lines.append(f"{entry['setting']} ({entry['attn_implementation']}, batch {entry['batch_size']}) at {entry['length']:,} tokens: "
                     f"peak {entry['peak_gib']} GiB at {entry['peak_phase']}{verdict}" if not entry.get("error") else
                     f"{entry['setting']} at {entry['length']:,} tokens: {entry['error']}")
    return "\n".join(lines)
