"""The efficiency benchmark in the report: `efficiency.md|csv` (decode latency, prefill, KV bytes, peak memory and
the ratios against the full cache, per run, method and prompt length), `max_length.csv` (the maximum-length
searches), the benchmark's plots under `efficiency/`; and the paper's efficiency claims measured (`claim`).
Nothing here imports torch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from harness.results import Run
from harness.tables import Tables, _fmt, _ratio, _safe, markdown_table, method_setting, write_csv

OUTPUT_FILES = ("efficiency.md", "efficiency.csv", "max_length.csv")
OUTPUT_DIRS = ("efficiency",)
MB = 1024 * 1024


def efficiency_rows(runs: list[Run]) -> tuple[list[dict], list[dict]]:
    rows, searches = [], []
    for run in runs:
        s = run.data.get("summary") or {}
        task_cfg = run.config.get("task") or {}
        methods = {m.get("label"): m for m in (run.data.get("methods") or []) if isinstance(m, dict)}
        prov = run.data.get("provenance") or {}
        common = {"model": run.model.get("name", "?"), "random_weights": bool(run.model.get("random_weights")),
                  "device": run.device, "batch": task_cfg.get("batch_size"), "isolation": s.get("isolation", prov.get("isolation")),
                  "decode_tokens": task_cfg.get("decode_tokens"), "run": run.rel}
        by_method = s.get("by_method") or {}
        for label, by_length in by_method.items():
            m = methods.get(label, {})
            setting, _ = method_setting(m) if m else (label, None)
            for length, e in sorted(by_length.items(), key=lambda kv: int(kv[0])):
                d = e.get("decode_vs_full")
                rows.append({**common, "method": label, "setting": setting, "budget": m.get("budget"), "length": int(length),
                             "prefill_s": e.get("prefill_s"), "compress_s": e.get("compress_s"),
                             "decode_ms_per_token": e.get("decode_median_ms"), "decode_p90_ms": e.get("decode_p90_ms"),
                             "decode_speedup_vs_full": round(1 / d, 3) if d else None,
                             "kv_mb": round(e["kv_bytes"] / MB, 3) if e.get("kv_bytes") is not None else None,
                             "kv_full_over_this": e.get("kv_full_over_this"),
                             "peak_mb": round(e["peak_increase_bytes"] / MB, 3) if e.get("peak_increase_bytes") is not None else None,
                             "peak_vs_full": e.get("peak_vs_full"), "decode_cpu_ms_per_token": e.get("decode_cpu_median_ms"),
                             "decode_cpu_speedup_vs_full": round(1 / e["decode_cpu_vs_full"], 3) if e.get("decode_cpu_vs_full") else None,
                             "dtype": e.get("dtype") or (run.model.get("dtype") if isinstance(run.model, dict) else None),
                             "decode_bound_ms": e.get("decode_bound_ms"), "decode_vs_bound": e.get("decode_vs_bound"),
                             "cache_cost_vs_bound": e.get("cache_cost_vs_bound"), "_method": m})
        search = run.data.get("search")
        if isinstance(search, dict):
            for label, r in (search.get("methods") or {}).items():
                m = methods.get(label, {})
                setting, _ = method_setting(m) if m else (label, None)
                searches.append({**common, "method": label, "setting": setting, "budget": m.get("budget"),
                                 "memory_cap_gb": search.get("memory_cap_gb"), "max_length": r.get("max_length"),
                                 "first_failure": r.get("first_failure"), "reached_upper": r.get("reached_upper"),
                                 "upper": search.get("upper"), "max_length_vs_full": r.get("vs_full"), "_method": m})
        if by_method or search:
            run.used_in.append("efficiency")
        else:
            run.note = "bench run without measurements"
    return rows, searches


EFF_FIELDS = ["model", "random_weights", "device", "batch", "isolation", "decode_tokens", "method", "setting", "budget", "length",
              "prefill_s", "compress_s", "decode_ms_per_token", "decode_p90_ms", "decode_speedup_vs_full", "kv_mb", "kv_full_over_this",
              "peak_mb", "peak_vs_full", "decode_cpu_ms_per_token", "decode_cpu_speedup_vs_full", "dtype", "decode_bound_ms",
              "decode_vs_bound", "cache_cost_vs_bound", "run"]
MAXLEN_FIELDS = ["model", "random_weights", "device", "batch", "method", "setting", "budget", "memory_cap_gb", "max_length",
                 "first_failure", "reached_upper", "upper", "max_length_vs_full", "run"]


def efficiency_table(rows: list[dict], searches: list[dict], runs: list[Run], out: Path) -> str:
    if not rows and not searches:
        return ""
    lines = ["## Efficiency (decode latency, KV cache, memory)", ""]
    if rows:
        headers = ["Model", "Weights", "Dtype", "Device", "Batch", "Method", "Prompt", "Prefill s", "Decode ms/tok", "Speed-up × full",
                   "× bound", "Cache cost × bound", "KV MB", "KV full ÷ this", "Peak +MB", "Peak ÷ full", "Run"]
        body = [[r["model"], "random" if r["random_weights"] else "real", r["dtype"] or "–", r["device"], r["batch"], r["method"], r["length"],
                 _fmt(r["prefill_s"], 3), _fmt(r["decode_ms_per_token"], 2), _ratio(r["decode_speedup_vs_full"]),
                 _ratio(r["decode_vs_bound"]), _ratio(r["cache_cost_vs_bound"]),
                 _fmt(r["kv_mb"], 1), _ratio(r["kv_full_over_this"]), _fmt(r["peak_mb"], 1),
                 _ratio(1 / r["peak_vs_full"] if r["peak_vs_full"] else None), f"`{r['run']}`"] for r in rows]
        lines += [markdown_table(headers, body, ["l"] * 6 + ["r"] * 10 + ["l"]), "",
                  "- Decode ms/tok: median over all timed decode steps; Speed-up × full: the full cache's decode latency at the "
                  "same prompt length ÷ this method's; × bound: the decode step over its memory bound (weights + the cache after "
                  "prefill, read once, at the copy bandwidth measured in the same run; docs/decode_speed.md); Cache cost × "
                  "bound: the step's growth from the method's shortest prompt over the cache's growth at that bandwidth "
                  "(1.00x = the cache costs only its reads); KV MB: the cache after prefill; Peak +MB: memory above the loaded "
                  "model during one measurement; Peak ÷ full: the full cache's peak ÷ this method's.", ""]
    if searches:
        headers = ["Model", "Device", "Batch", "Method", "Memory cap GB", "Max prompt tokens", "× full", "First failure"]
        body = [[r["model"], r["device"], r["batch"], r["method"], _fmt(r["memory_cap_gb"], 0),
                 f"{r['max_length']}{' (search upper bound)' if r['reached_upper'] else ''}", _ratio(r["max_length_vs_full"]),
                 _fmt(r["first_failure"])] for r in searches]
        lines += ["### Maximum prompt length", "", markdown_table(headers, body, ["l"] * 4 + ["r"] * 4), ""]
    plot_dir = out / "efficiency"
    for run in runs:
        if "efficiency" not in run.used_in:
            continue
        for png in sorted(run.path.parent.glob("bench_*.png")):
            plot_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, plot_dir / f"{_safe(run.rel)}__{png.name}")
    if plot_dir.exists():
        lines.append(f"- Plots: `efficiency/` ({len(list(plot_dir.glob('*.png')))} files, one set per benchmark run).")
    return "\n".join(lines) + "\n"


def tables(runs: list[Run], out: Path, options) -> Tables:
    """efficiency.md|csv, max_length.csv and efficiency/*.png of every benchmark run; the paper's efficiency claims."""
    eff, searches = efficiency_rows(runs)
    sections = []
    if eff or searches:
        e_md = efficiency_table(eff, searches, runs, out)
        write_csv(out / "efficiency.csv", eff, EFF_FIELDS)
        if searches:
            write_csv(out / "max_length.csv", searches, MAXLEN_FIELDS)
        (out / "efficiency.md").write_text(e_md, encoding="utf-8")
        sections.append(("efficiency.md", e_md))
    return Tables(sections, {"efficiency": eff, "max_length": searches}, claim=lambda c: claim(c, eff, searches))


def claim(c: dict, eff: list[dict], searches: list[dict]) -> tuple[str, str] | None:
    """(ours, run) for the paper's efficiency claims (results/paper/paper_claims.csv), None for the others or unmeasured."""
    cid, model = c.get("id"), c.get("our_model")
    if cid == "decode_speedup_16k":
        hits = [r for r in eff if r["model"] == model and r["batch"] == 2 and r["length"] == 16384
                and r["_method"].get("name") == "snapkv" and r["budget"] == 2048 and r["decode_speedup_vs_full"]]
        if hits:
            h = hits[-1]
            full_ms = h["decode_ms_per_token"] * h["decode_speedup_vs_full"]
            return (f"{h['decode_speedup_vs_full']:.2f}x (full {full_ms / 1000:.3f} s/tok, "
                    f"SnapKV {h['decode_ms_per_token'] / 1000:.3f} s/tok)"), h["run"]
    elif cid == "max_length_ratio":
        hits = [r for r in searches if r["model"] == model and r["batch"] == 2 and r["_method"].get("name") == "snapkv"
                and r["budget"] == 2048 and r["memory_cap_gb"] == 80]
        if hits:
            h = hits[-1]
            full = next((s for s in searches if s["run"] == h["run"] and s["_method"].get("name") == "full"), None)
            return (f"{_ratio(h['max_length_vs_full'])} (full {full['max_length'] if full else '?'}, "
                    f"SnapKV {h['max_length']}{' = search upper bound' if h['reached_upper'] else ''} tokens)"), h["run"]
    return None
