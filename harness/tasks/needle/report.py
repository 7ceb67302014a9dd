"""The needle in the report: `needle.md|csv` (mean score per run and prompt-length bucket, strict accuracy, where
cells ran out of memory), `needle/*.png` (each run's heatmap and retention picture), `needle_by_length.png`; the
paper's needle claims measured (`claim`); and the per-cell scores the paired reports pair (PAIRING: cells by
(length, depth, question_index), one stratum). Nothing here imports torch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from harness.results import Pairing, Run, number as _number, protocol_rank as _protocol_rank
from harness.tables import (Tables, _fmt, _mean, _protocol_label, _safe, _setting_sort, flag_duplicates, markdown_table,
                            method_setting, write_csv)

OUTPUT_FILES = ("needle.md", "needle.csv", "needle_by_length.png")
OUTPUT_DIRS = ("needle",)
# SnapKV's needle preset (the needle claims are matched against runs of exactly this method).
PAPER_NEEDLE = {"name": "snapkv", "budget": 1024, "window_size": 16, "kernel_size": 5, "pooling": "maxpool"}
NEEDLE = "needle"  # the one stratum of the paired reports: the needle mean


def length_bucket(n: int) -> tuple[int, str]:
    """Doubling buckets of 1K tokens: (upper edge, label): <=1K, 1K-2K, 2K-4K, ..."""
    upper = 1024
    while n > upper:
        upper *= 2
    return upper, ("≤1K" if upper == 1024 else f"{_k(upper // 2)}-{_k(upper)}")


def _k(n: int) -> str:
    return f"{n // 1024}K"


def needle_rows(runs: list[Run]) -> list[dict]:
    rows = []
    for run in runs:
        cells = [r for r in (run.data.get("rows") or []) if "length" in r and "score" in r]
        failed = run.data.get("failed_items") or []
        if not cells and not failed:
            run.note = "needle run without cells"
            continue
        method = run.data.get("method") or {}
        label, _ = method_setting(method)
        task_cfg = run.config.get("task") or {}
        lengths = sorted({int(c["length"]) for c in cells})
        oom = sorted(int(f["key"][0]) for f in failed if f.get("oom") and isinstance(f.get("key"), list) and f["key"])
        fail_lengths = sorted(int(f["key"][0]) for f in failed if isinstance(f.get("key"), list) and f["key"])
        by_bucket: dict[str, list[float]] = {}
        edges: dict[str, int] = {}
        for c in cells:
            edge, name = length_bucket(int(c["length"]))
            by_bucket.setdefault(name, []).append(float(c["score"]))
            edges[name] = edge
        longest_ok = None
        for n in lengths:
            at = [c for c in cells if int(c["length"]) == n]
            if n in fail_lengths or not all(bool(c.get("strict")) for c in at):
                break
            longest_ok = n
        s = run.data.get("summary") or {}
        rows.append({
            "model": run.model.get("name", "?"), "setting": label, "protocol": run.protocol,
            "method_tag": run.data.get("method_tag"), "prompt_style": (run.data.get("summary") or {}).get("prompt_style") or task_cfg.get("prompt_style"),
            "chat_format": run.model.get("chat_format"), "grid": _grid(cells),
            "score_name": s.get("score_name", "score"), "device": run.device,
            "cells": len(cells), "failed_cells": len(failed), "first_failed_length": fail_lengths[0] if fail_lengths else None,
            "first_oom_length": oom[0] if oom else None,
            "max_length_done": max(lengths) if lengths else None,
            "longest_all_strict": longest_ok,
            "mean_score": _mean(float(c["score"]) for c in cells),
            "strict_accuracy": _mean(float(bool(c.get("strict"))) for c in cells),
            "buckets": {k: _mean(v) for k, v in by_bucket.items()}, "_edges": edges,
            "run": run.rel, "note": "", "_cells": cells, "_run": run, "_method": method,
        })
        run.used_in.append("needle")
    rows.sort(key=lambda r: (r["model"], _protocol_rank(r["protocol"]), _setting_sort(r["setting"]), r["run"]))
    flag_duplicates(rows, ("model", "protocol", "method_tag", "prompt_style", "chat_format", "device"))
    return rows


def _grid(cells: list[dict]) -> str:
    """The cells a needle run's mean covers, e.g. `1K-4K x 5` (lengths x depths): means of other grids differ."""
    lengths = sorted({int(c["length"]) for c in cells})
    depths = {c.get("depth") for c in cells}
    if not lengths:
        return "–"
    span = _k_or_n(lengths[0]) if len(lengths) == 1 else f"{_k_or_n(lengths[0])}-{_k_or_n(lengths[-1])} ({len(lengths)})"
    return f"{span} x {len(depths)}"


def _k_or_n(n: int) -> str:
    return f"{n / 1024:g}K" if n % 256 == 0 and n >= 1024 else str(n)


def needle_table(rows: list[dict], out: Path) -> str:
    if not rows:
        return ""
    edges: dict[str, int] = {}
    for r in rows:
        edges.update(r["_edges"])
    buckets = sorted(edges, key=lambda b: edges[b])
    for r in rows:
        for b in buckets:
            r[f"bucket {b}"] = r["buckets"].get(b)
    heat_dir = out / "needle"
    heat_dir.mkdir(parents=True, exist_ok=True)
    used_names: set[str] = set()
    for r in rows:
        name = _safe(f"{r['model']}__{r['method_tag']}__{r['prompt_style']}"
                     + ("" if r["protocol"] == "query_aware" else f"__{r['protocol']}"))
        base, i = name, 2
        while name in used_names:
            name, i = f"{base}_{i}", i + 1
        used_names.add(name)
        target = heat_dir / f"{name}.png"
        source = r["_run"].path.parent / "needle_heatmap.png"
        if source.exists():
            shutil.copyfile(source, target)
        elif r["_cells"]:
            from harness.plots import needle_heatmap

            needle_heatmap(r["_cells"], target, title=f"{r['model']} · {r['method_tag']}", score_key="score")
        r["heatmap"] = f"needle/{target.name}" if target.exists() else None
        retention = r["_run"].path.parent / "needle_retention.png"  # the fraction of the needle each method kept
        if retention.exists():
            shutil.copyfile(retention, heat_dir / f"{name}__retention.png")
    styles = {r["prompt_style"] for r in rows}
    series: dict[str, list] = {}
    for r in rows:  # one line per row: a label shared by two rows (other prompt, device, run) gets the run's path
        label = (f"{r['model']} · {r['setting']}" + ("" if r["protocol"] == "query_aware" else f" · {_protocol_label(r['protocol'])}")
                 + (f" · {r['prompt_style']}" if len(styles) > 1 else ""))
        if label in series:
            label = f"{label} ({r['run']})"
        series[label] = sorted(_by_length(r["_cells"]).items())
    if any(series.values()):
        from harness.plots import line_plot

        line_plot(series, out / "needle_by_length.png", title="Needle: mean score per prompt length",
                  xlabel="prompt tokens", ylabel=rows[0]["score_name"], logx=True)
    headers = ["Model", "Setting", "Protocol", "Prompt", "Chat", "Device", "Grid", "Cells", *buckets, "Mean", "Strict acc.",
               "All depths correct up to", "Failed cells (first at)", "Needle kept", "Heatmap"]

    def kept(r):  # mean fraction of the needle's tokens still cached after compression (needle_retention.png)
        value = (r["_run"].data.get("summary") or {}).get("mean_needle_kept")
        return _fmt(value, 3) if value is not None and r["method_tag"] != "full" else "–"

    def pictures(r):
        links = [f"[png]({r['heatmap']})"] if r.get("heatmap") else []
        retention = Path(r["heatmap"] or "").stem + "__retention.png"
        if r.get("heatmap") and (heat_dir / retention).exists():
            links.append(f"[kept]({'needle/' + retention})")
        return " ".join(links) or "–"

    body = [[r["model"], r["setting"], _protocol_label(r["protocol"]), r["prompt_style"], r["chat_format"], r["device"], r["grid"], r["cells"],
             *[_fmt(r["buckets"].get(b), 3) for b in buckets], _fmt(r["mean_score"], 3), _fmt(r["strict_accuracy"], 3),
             _fmt(r["longest_all_strict"]), f"{r['failed_cells']}" + (f" ({r['first_failed_length']}{', OOM' if r['first_oom_length'] else ''})" if r["failed_cells"] else ""),
             kept(r), pictures(r)] for r in rows]
    lines = ["## Needle in a haystack", "", markdown_table(headers, body, ["l"] * 7 + ["r"] * (len(buckets) + 6) + ["l"]), "",
             f"- Score: {rows[0]['score_name']} of the needle's answer in the response (judge-free), mean per prompt-length "
             "bucket (tokens, template included); Strict acc.: share of cells with every key fact of the needle.",
             "- Grid: the prompt lengths (how many) x the depths a run's cells cover. Mean and Strict acc. average a run's "
             "own cells: compare them only between rows of the same grid, prompt and protocol (the length buckets and "
             "paired_deltas.md compare on common cells).",
             "- All depths correct up to: the longest prompt length L such that every cell at every length <= L is strictly "
             "correct. Failed cells: cells with an error (OOM: out of memory), which have no score.",
             "- Needle kept: the mean fraction of the needle's tokens still in the cache after compression (over cells, "
             "compressed layers and heads; `kept` links the per-cell picture): it tells \"the method evicted the needle\" "
             "from \"the model failed with the needle in cache\"."]
    for r in rows:
        if r.get("note"):
            lines.append(f"- {r['model']} · {r['setting']} (`{r['run']}`): {r['note']}.")
    return "\n".join(lines) + "\n"


def _by_length(cells: list[dict]) -> dict[int, float]:
    out: dict[int, list[float]] = {}
    for c in cells:
        out.setdefault(int(c["length"]), []).append(float(c["score"]))
    return {n: sum(v) / len(v) for n, v in out.items()}

def tables(runs: list[Run], out: Path, options) -> Tables:
    """needle.md|csv and the pictures of every needle run; the paper's needle claims measured on them."""
    n_rows = needle_rows(runs)
    sections = []
    if n_rows:
        n_md = needle_table(n_rows, out)
        buckets = [k for k in n_rows[0] if k.startswith("bucket ")]
        fields = ["model", "setting", "protocol", "method_tag", "prompt_style", "chat_format", "score_name", "device", "grid", "cells", *buckets,
                  "mean_score", "strict_accuracy", "longest_all_strict", "max_length_done", "failed_cells", "first_failed_length",
                  "first_oom_length", "heatmap", "note", "run"]
        write_csv(out / "needle.csv", n_rows, fields)
        (out / "needle.md").write_text(n_md, encoding="utf-8")
        sections.append(("needle.md", n_md))
    return Tables(sections, {"needle": n_rows}, claim=lambda c: claim(c, n_rows))


def claim(c: dict, needle: list[dict]) -> tuple[str, str] | None:
    """(ours, run) for the paper's needle claims (results/paper/paper_claims.csv), None for the others or unmeasured."""
    cid, model = c.get("id"), c.get("our_model")
    if cid in ("needle_max_length", "needle_retrieval"):
        hits = [r for r in needle if r["model"] == model and r["protocol"] == "query_aware"
                and all(r["_method"].get(k) == v for k, v in PAPER_NEEDLE.items())]
        if hits:
            h = hits[-1]
            return (f"longest prompt done {h['max_length_done']} tokens" if cid == "needle_max_length"
                    else f"all depths correct up to {h['longest_all_strict']}; mean {h['score_name']} {h['mean_score']}"), h["run"]
    elif cid == "needle_full_oom":
        hits = [r for r in needle if r["model"] == model and r["setting"] == "All KV" and r["protocol"] == "query_aware"]
        if hits:
            h = hits[-1]
            return (f"first out-of-memory cell at {h['first_oom_length']} tokens" if h["first_oom_length"]
                    else f"no out-of-memory cell up to {h['max_length_done']} tokens"), h["run"]
    return None


# ------------------------------------------------------------------------------------------ per-cell scores (PAIRING)

def needle_items(run) -> dict[tuple[int, float, int], float]:
    """{(length, depth, question): score} of the run's finished cells, one per question of a cell with
    several needles (question 0 for one-needle records); the first record of a (cell, question) wins."""
    out: dict[tuple[int, float, int], float] = {}
    for r in run.data.get("rows") or []:
        if isinstance(r, dict) and "length" in r and "depth" in r and _number(r.get("score")):
            try:
                out.setdefault((int(r["length"]), float(r["depth"]), int(r.get("question_index") or 0)), float(r["score"]))
            except (TypeError, ValueError):
                continue
    return out


def needle_strata(run) -> tuple[dict, list[str]]:
    return {NEEDLE: needle_items(run)}, []


PAIRING = Pairing(items=needle_strata, average=False, digits=3, label=lambda _: "needle mean", unmatched="no needle cell in common")


# ------------------------------------------------------------------------------------------ report.html

def _fact(run, question: int) -> tuple[str, str]:
    """(needle text, answer) of the run's question `question` (task.needle/answer, then task.more_needles)."""
    task = run.config.get("task") or {}
    if question == 0:
        return str(task.get("needle") or ""), str(task.get("answer") or "")
    more = task.get("more_needles") or []
    fact = more[question - 1] if question - 1 < len(more) and isinstance(more[question - 1], dict) else {}
    return str(fact.get("needle") or ""), str(fact.get("answer") or "")


def html_section(runs: list[Run], page) -> dict | None:
    """report.html's needle section (harness/page_blocks.py): mean score against the budget per model (bands: 95%
    bootstrap interval over the run's cells), score and needle-kept heatmaps per run, every cell an item."""
    from harness.page_blocks import (budget_of, chart, interval, item_group, method_line, model_of, removed_fraction, rounded,
                                     setting_label)
    from harness.results import method_name

    mine = [r for r in runs if needle_items(r)]
    if not mine:
        return None
    points_by_model, maps = {}, []
    for run in mine:
        values = list(needle_items(run).values())
        mean = sum(values) / len(values)
        lo, hi = interval(values, page.resamples, page.seed)
        points_by_model.setdefault(model_of(run), []).append(
            {"line": method_line(run), "protocol": run.protocol, "x": budget_of(run), "y": rounded(mean), "lo": rounded(lo),
             "hi": rounded(hi), "run": page.run_ids[run.rel], "full": method_name(run) == "full"})
        page.board.append({"dataset": NEEDLE, "data_dir": (run.data.get("summary") or {}).get("prompt_style"), "model": model_of(run),
                           "run": run, "compression_ratio": removed_fraction(run), "score": 100 * mean,
                           "ci_low": None if lo is None else 100 * lo, "ci_high": None if hi is None else 100 * hi, "n": len(values)})
        group = item_group(run)
        cells: dict[tuple, dict] = {}
        for rec in run.data.get("rows") or []:
            if not isinstance(rec, dict) or "score" not in rec:
                continue
            length, depth, q = int(rec["length"]), float(rec["depth"]), int(rec.get("question_index") or 0)
            needle, answer = _fact(run, q)
            key = page.items.add(f"{group}|needle|{length}|{depth:g}|{q}",
                                 f"needle · {model_of(run)} · {length} tokens · depth {depth:g}%" + (f" · question {q}" if rec.get("needles") else ""),
                                 page.run_ids[run.rel], rec, response=str(rec.get("response", "")), score=rounded(rec.get("score")),
                                 reference=answer, targets=[needle.strip()])
            cell = cells.setdefault((length, depth), {"scores": [], "kept": [], "keys": []})
            cell["scores"].append(float(rec["score"]))
            if rec.get("needle_kept") is not None:
                cell["kept"].append(float(rec["needle_kept"]))
            cell["keys"].append(key)
        maps.append({"run": page.run_ids[run.rel], "label": setting_label(run), "protocol": _protocol_label(run.protocol),
                     "model": model_of(run),
                     "cells": [{"y": n, "x": d, "score": rounded(sum(c["scores"]) / len(c["scores"]), 3),
                                "kept": rounded(sum(c["kept"]) / len(c["kept"]), 3) if c["kept"] else None, "keys": c["keys"]}
                               for (n, d), c in sorted(cells.items())]})
    blocks = [chart(f"Needle · {model}: mean score against the budget", "budget (tokens kept per head)", "mean score (keyword recall)",
                    points, logx=True) for model, points in points_by_model.items()]
    blocks.append({"kind": "heatmaps", "title": "Score and needle kept per cell (length × depth): click a cell for its item",
                   "xlabel": "depth %", "ylabel": "prompt tokens", "maps": maps})
    return {"id": "needle", "title": "Needle in a haystack", "blocks": blocks,
            "intro": "Score: keyword recall of the needle's answer (judge-free). Band: 95% bootstrap interval of the mean over "
                     "the run's cells. Needle kept: the fraction of the needle's tokens still cached after compression "
                     "(mean over compressed layers and heads)."}
