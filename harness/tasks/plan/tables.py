"""The plan's table (markdown and CSV), summary and picture: peak against prompt length, one line per setting."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

log = logging.getLogger(__name__)

GIB = 1 << 30
COLUMNS = ("setting", "attn_implementation", "planned_as", "batch_size", "length", "peak_gib", "fits", "peak_phase", "weights_gib",
           "kv_cache_gib", "other_gib", "largest_temporary", "bound", "plan_seconds", "error")


def _gib(n) -> float | None:
    return None if n is None else round(n / GIB, 3)


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in sorted(rows, key=lambda r: (str(r.get("attn_implementation")), r.get("batch_size", 1), r["setting"], r["length"])):
        largest = (r.get("largest_temporaries") or [{}])[0]
        out.append({"setting": r["setting"], "attn_implementation": r.get("attn_implementation"), "planned_as": r.get("planned_as"),
                    "batch_size": r.get("batch_size", 1), "length": r["length"], "peak_gib": _gib(r.get("peak_bytes")), "fits": r.get("fits"),
                    "peak_phase": r.get("peak_phase"), "weights_gib": _gib(r.get("weights_bytes")),
                    "kv_cache_gib": _gib(r.get("kv_cache_bytes")), "other_gib": _gib(r.get("other_bytes")),
                    "largest_temporary": f"{largest.get('tensor')} {_gib(largest.get('bytes'))} GiB" if largest else None,
                    "bound": r.get("bound"), "plan_seconds": r.get("plan_seconds"), "error": r.get("error"),
                    **{f"fits_{g}gib": ok for g, ok in (r.get("fits_on") or {}).items()}})
    return out


def write_outputs(folder: Path, rows: list[dict], search: dict, cfg, capacity: int | None) -> dict:
    folder = Path(folder)
    table = table_rows(rows)
    columns = list(COLUMNS) + sorted({k for r in table for k in r if k.startswith("fits_")}, key=lambda k: float(k[5:-3]))
    with open(folder / "plan_table.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(table)
    task = cfg.task
    head = (f"# Memory plan: {cfg.model.name} ({cfg.model.dtype}), {'query-aware' if task.query_aware else 'query-agnostic'}, "
            f"{task.new_tokens} new tokens, prefill chunk {cfg.model.get('prefill_chunk_size') or 'none (one shot)'}\n\n"
            f"Peak = live tensor bytes (fake tensors, docs/planning.md). "
            + (f"Fits: peak <= {task.gpu_memory_gb} GiB - reserve {task.reserve_gb} GiB = {capacity / GIB:.2f} GiB.\n\n" if capacity else "\n\n"))
    cols = [c for c in columns if any(r.get(c) not in (None, "") for r in table)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r.get(c) is None else f"{r[c]:,}" if isinstance(r[c], int) and not isinstance(r[c], bool)
                                else str(r[c]) for c in cols) + " |" for r in table]
    found = sorted(search.values(), key=lambda s: (s["attn_implementation"], s["batch_size"], s["setting"]))
    if found:
        lines += ["", "## Longest prompt that fits", "", "| setting | attention | batch | max_length | first failure |", "|---|---|---|---|---|"]
        lines += [f"| {s['setting']} | {s['attn_implementation']} | {s['batch_size']} | {s['max_length']:,} | "
                  f"{'' if s['first_failure'] is None else format(s['first_failure'], ',')} |" for s in found]
    (folder / "plan_table.md").write_text(head + "\n".join(lines) + "\n", encoding="utf-8")
    if task.get("plots", True) and rows:
        try:
            picture(folder / "plan_peak.png", rows, capacity, cfg)
        except ImportError as exc:  # the tables are the result; a missing plotting library must not lose them
            log.warning("plan: no picture (%s)", exc)
    return {"points": table, "max_length": [{k: s[k] for k in ("setting", "attn_implementation", "batch_size", "max_length", "first_failure")}
                                            for s in found],
            "capacity_bytes": capacity, "reserve_gb": float(task.reserve_gb), "gpu_memory_gb": task.get("gpu_memory_gb")}


def picture(path: Path, rows: list[dict], capacity: int | None, cfg) -> None:
    from harness.plots import plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lines: dict = {}
    for r in rows:
        if r.get("peak_bytes") is not None:
            lines.setdefault((r["setting"], r["attn_implementation"], r["batch_size"]), []).append((r["length"], r["peak_bytes"] / GIB))
    for (setting, impl, batch), points in sorted(lines.items()):
        points = sorted(set(points))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{setting} · {impl} · batch {batch}")
    if cfg.task.get("gpu_memory_gb") is not None:
        ax.axhline(float(cfg.task.gpu_memory_gb), color="black", linestyle="--", linewidth=1, label=f"GPU {cfg.task.gpu_memory_gb} GiB")
        if capacity:
            ax.axhline(capacity / GIB, color="grey", linestyle=":", linewidth=1, label=f"less reserve {cfg.task.reserve_gb} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("planned peak (GiB of live tensors)")
    ax.set_title(f"{cfg.model.name} ({cfg.model.dtype}): planned peak memory", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
