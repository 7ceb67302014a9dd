"""The LongEval-Lines report section (SnapKV Figure 8: the pooling ablation) and its heatmap.

The task calls `lines_heatmap` for each run directory; `python -m harness.report` calls `tables(runs, out, options)`
(`lines_section`), which redraws the heatmaps from each run's results.json (no torch, no model) and writes
`lines.md|csv` and `lines/` into the table set. The section owns those names only and removes them before writing.
"""

from __future__ import annotations

from pathlib import Path

from harness.results import finished
from harness.tables import Tables, _fmt, _safe, clean, markdown_table, write_csv

LINES_FILES = ("lines.md", "lines.csv")
OUTPUT_FILES, OUTPUT_DIRS = LINES_FILES, ("lines",)


def _fmt3(v) -> str:  # these tables show 3 decimals
    return _fmt(v, 3)


def lines_heatmap(rows: list[dict], path: Path, *, title: str) -> Path | None:
    """Ground-truth position x prompt length, exact-match accuracy, the needle heatmap's colours."""
    from harness.plots import grid_heatmap

    return grid_heatmap(rows, Path(path), title=title, y_key="position", xlabel="prompt length (tokens)",
                        ylabel="ground-truth line position (%)", what="LongEval-Lines exact match")


def _lines_setting(method: dict) -> str:
    name = method.get("name", "?")
    if name == "full":
        return "All KV"
    budget = method.get("budget")
    if budget is None and method.get("ratio") is not None:
        budget = f"ratio {method['ratio']:g}" if isinstance(method["ratio"], (int, float)) else f"ratio {method['ratio']}"
    if name == "snapkv":
        k = method.get("kernel_size")
        pool = "no pooling" if k == 1 else f"{method.get('pooling')} k{k}"
        return f"SnapKV {budget} (W{method.get('window_size')}, {pool})"
    return f"{name} {budget if budget is not None else ''}".strip()


def lines_section(runs, out: Path) -> str:
    """lines.md|csv and lines/<run>.png for every task=lines run, with the pooling ablation (SnapKV runs that
    differ only in kernel_size 1 vs more) side by side; the Markdown (empty when there is none)."""
    out = Path(out)
    clean(out, LINES_FILES, ("lines",))
    rows = []
    for run in finished(runs, "lines"):
        cells = [r for r in (run.data.get("rows") or []) if "length" in r and "score" in r]
        if not cells:
            continue
        s = run.data.get("summary") or {}
        method = run.data.get("method") or {}
        (out / "lines").mkdir(parents=True, exist_ok=True)
        setting = _lines_setting(method)
        png = lines_heatmap(cells, out / "lines" / f"{_safe(run.rel)}.png", title=f"{run.model.get('name', '?')} · {setting}")
        lengths = sorted({int(c["length"]) for c in cells})
        rows.append({"model": run.model.get("name"), "setting": setting, "method_tag": run.data.get("method_tag"),
                     "kernel_size": method.get("kernel_size"), "cells": len(cells), "accuracy": s.get("accuracy"),
                     "contains_rate": s.get("contains_rate"), "lengths": f"{lengths[0]}-{lengths[-1]}",
                     "by_length": s.get("by_length"), "device": run.device,
                     "heatmap": str(png.relative_to(out)) if png else None, "run": run.rel, "_method": method})
        run.used_in.append("lines")
    if not rows:
        return ""
    write_csv(out / "lines.csv", rows, ["model", "setting", "method_tag", "kernel_size", "cells", "accuracy", "contains_rate",
                                         "lengths", "device", "heatmap", "run"])
    all_lengths = sorted({int(n) for r in rows for n in (r["by_length"] or {})})
    headers = ["Model", "Setting", "Records", "Exact match", *[str(n) for n in all_lengths]]
    body = [[r["model"], r["setting"], r["cells"], _fmt3(r["accuracy"]),
             *[_fmt3((r["by_length"] or {}).get(str(n))) for n in all_lengths]] for r in rows]
    lines = ["## LongEval-Lines (SnapKV Figure 8: pooling ablation)", "", markdown_table(headers, body), "",
             "- Exact match: the last number of the response equals the asked line's value (LongEval's rule); per prompt "
             "length in tokens, averaged over ground-truth positions."]
    ablation = []
    for a in rows:
        ma = a["_method"]
        if ma.get("name") != "snapkv" or (ma.get("kernel_size") or 0) <= 1:
            continue
        for b in rows:
            mb = b["_method"]
            same = {k: v for k, v in ma.items() if k not in ("kernel_size", "tag")} == {k: v for k, v in mb.items() if k not in ("kernel_size", "tag")}
            if b is not a and mb.get("kernel_size") == 1 and same and a["model"] == b["model"]:
                ablation.append([a["model"], f"W{ma.get('window_size')} C{ma.get('budget')}", f"{ma.get('pooling')} k{ma.get('kernel_size')}",
                                 _fmt3(a["accuracy"]), _fmt3(b["accuracy"]),
                                 _fmt3(None if a["accuracy"] is None or b["accuracy"] is None else round(a["accuracy"] - b["accuracy"], 4))])
    if ablation:
        lines += ["", "Pooling ablation (same model and SnapKV settings, kernel > 1 vs kernel 1):", "",
                  markdown_table(["Model", "SnapKV", "Pooling", "With pooling", "Without", "Difference"], ablation)]
    lines += [""] + [f"- `{r['run']}`: ![heatmap]({r['heatmap']})" for r in rows if r["heatmap"]]
    md = "\n".join(lines) + "\n"
    (out / "lines.md").write_text(md, encoding="utf-8")
    return md


def tables(runs, out: Path, options) -> Tables:
    md = lines_section(runs, out)
    return Tables([("lines.md", md)] if md else [])
