"""RULER in the report: one table per model, protocol and length (settings x RULER tasks, the average,
the paired difference to `full` with its bootstrap interval), and the leaderboard's picture (the
RULER average vs the compression ratio, one line per method).

`python -m harness.report` calls `tables(runs, out, options)` (`ruler_sections`); the section owns `ruler.md`, `ruler.csv`,
`ruler_paired.csv` and `ruler/` in the table set and removes them before writing. Pairing follows
harness/results.py: runs pair when `pair_key` is equal (same model, task settings, protocol, seed: the
two protocols never merge); samples are matched by (task, length, index); a task's difference is the
mean over its paired samples of (setting - full) in RULER points, the average's is the unweighted
mean of the task differences, its interval resampling samples within each task (harness.stats).
"""

from __future__ import annotations

import re
from pathlib import Path

from harness.page_blocks import removed_fraction
from harness.results import Pairing, method_name, pair_key
from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, MIN_INTERVAL_ITEMS, stratified_bootstrap_ci
from harness.tables import Tables, _protocol_label, _safe, clean, markdown_table, method_setting, write_csv

RULER_FILES = ("ruler.md", "ruler.csv", "ruler_paired.csv")
RULER_DIR = "ruler"
OUTPUT_FILES, OUTPUT_DIRS = RULER_FILES, (RULER_DIR,)
TASK_ORDER = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
              "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
SHORT = {"niah_single_1": "S1", "niah_single_2": "S2", "niah_single_3": "S3", "niah_multikey_1": "MK1",
         "niah_multikey_2": "MK2", "niah_multikey_3": "MK3", "niah_multivalue": "MV", "niah_multiquery": "MQ",
         "vt": "VT", "cwe": "CWE", "fwe": "FWE", "qa_1": "QA1", "qa_2": "QA2"}


# The leaderboard export's `dataset`: kvpress's name for its own RULER data (its leaderboard rows), another for the
# samples generated here (same rules, the model's own tokenizer: not kvpress's samples)
DATASETS = {"kvpress": "ruler", "harness": "ruler_harness"}


def source(run) -> str:
    """Whose samples the run scored: summary.source, else task.source of its config, else harness (runs made before it)."""
    summary = run.data.get("summary") or {}
    task = (run.config or {}).get("task") if isinstance(run.config, dict) else None
    value = summary.get("source") or ((task or {}).get("source") if isinstance(task, dict) else None)
    return str(value or "harness")


def _items(run) -> dict[tuple, float]:
    """(task, length, index) -> the sample's RULER score (0-100)."""
    return {(r["task"], int(r["length"]), int(r["index"])): float(r["score"])
            for r in run.data.get("rows") or [] if isinstance(r, dict) and "score" in r and "task" in r}


def paired(run, full, length: int, tasks: list[str], resamples: int, seed: int) -> dict:
    """{task or "average": (delta, low, high, n)} of `run` minus `full` at one length."""
    mine, theirs = _items(run), _items(full)
    groups, out = [], {}
    for name in tasks:
        keys = sorted(k for k in mine if k[0] == name and k[1] == length and k in theirs)
        if not keys:
            continue
        diffs = [mine[k] - theirs[k] for k in keys]
        groups.append(diffs)
        ci = stratified_bootstrap_ci([diffs], n_resamples=resamples, seed=seed) if len(diffs) >= MIN_INTERVAL_ITEMS else None
        out[name] = (sum(diffs) / len(diffs), ci.low if ci else None, ci.high if ci else None, len(diffs))
    if groups:
        enough = all(len(g) >= MIN_INTERVAL_ITEMS for g in groups)
        ci = stratified_bootstrap_ci(groups, n_resamples=resamples, seed=seed) if enough else None
        est = sum(sum(g) / len(g) for g in groups) / len(groups)
        out["average"] = (est, ci.low if ci else None, ci.high if ci else None, sum(len(g) for g in groups))
    return out


def ruler_strata(run) -> tuple[dict, list[str]]:
    """Per-item scores for the paired reports (PAIRING): one stratum per RULER task, items (length, index, question)."""
    out: dict[str, dict] = {}
    for r in run.data.get("rows") or []:
        if isinstance(r, dict) and "score" in r and "task" in r and r.get("score") is not None:
            key = (int(r["length"]), int(r["index"]), int(r.get("question_index") or 0))
            out.setdefault(str(r["task"]), {})[key] = float(r["score"])
    return out, []


def _task_order(name: str) -> tuple:
    return (TASK_ORDER.index(name), name) if name in TASK_ORDER else (len(TASK_ORDER), name)


# the paired difference to full and the reuse gap (harness/report/paired.py, reuse.py): per task, and the mean of
# the task means (RULER's average)
PAIRING = Pairing(items=ruler_strata, order=_task_order, average=True, digits=2, unmatched="{stratum}: no sample in common")


def _delta_text(d) -> str:
    if d is None:
        return "–"
    est, lo, hi, n = d
    return f"{est:+.2f} [{lo:+.2f}, {hi:+.2f}]" if lo is not None else f"{est:+.2f} (n={n})"


def ruler_rows(runs, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> tuple[list[dict], list[dict]]:
    """(table rows: one per run and length; paired rows: one per run, length and task/average)."""
    mine = [r for r in runs if r.task == "ruler" and isinstance((r.data.get("summary") or {}).get("by_length"), dict)]
    groups: dict[str, list] = {}
    for run in mine:
        groups.setdefault(pair_key(run), []).append(run)
        run.used_in.append("ruler")
    rows, paired_rows = [], []
    for run in mine:
        summary = run.data["summary"]
        fulls = sorted((f for f in groups[pair_key(run)] if method_name(f) == "full"),
                       key=lambda f: (Path(f.rel).parent != Path(run.rel).parent, f.rel))
        full = fulls[0] if fulls and method_name(run) != "full" else None
        label = method_setting(run.data.get("method") or {})[0]
        for length, entry in sorted(summary["by_length"].items(), key=lambda kv: int(kv[0])):
            tasks = [t for t in TASK_ORDER if t in (entry.get("tasks") or {})]
            deltas = paired(run, full, int(length), tasks, resamples, seed) if full is not None else {}
            row = {"model": str(run.model.get("name", "?")), "protocol": run.protocol, "length": int(length), "source": source(run),
                   "setting": label,
                   "method": method_name(run), "method_tag": run.data.get("method_tag"), "removed": removed_fraction(run),
                   **{t: entry["tasks"].get(t) for t in tasks}, "average": entry.get("average"),
                   "complete": entry.get("complete"), "delta_average": deltas.get("average"), "full_run": full.rel if full else None,
                   "run": run.rel}
            rows.append(row)
            for name, d in deltas.items():
                paired_rows.append({"setting": run.rel, "task": name, "length": int(length), "delta": round(d[0], 6),
                                    "ci_low": None if d[1] is None else round(d[1], 6),
                                    "ci_high": None if d[2] is None else round(d[2], 6), "n": d[3], "full_run": full.rel})
    return rows, paired_rows


def _line_name(row: dict) -> str:
    """One line per method and options: the tag without its budget or ratio part (snapkv_r0.5_w32_... -> snapkv_w32_...)."""
    return re.sub(r"_(?:r[0-9.]+|c[0-9]+)(?=_|$)", "", str(row.get("method_tag") or row["method"]))


def ratio_figure(rows: list[dict], path: Path, title: str) -> None:
    """The leaderboard's view: RULER average vs the compression ratio, one line per method (full at 0). Up to
    20 methods get their own colour, markers repeat in another order, and the legend sits outside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = [r for r in rows if r["method"] == "full" and r["average"] is not None]
    by_method: dict[str, list] = {}
    for r in rows:
        if r["method"] != "full" and r["removed"] is not None and r["average"] is not None:
            by_method.setdefault(_line_name(r), []).append((r["removed"], r["average"]))
    fig, ax = plt.subplots(figsize=(6 + 3.5 * bool(by_method), 4))
    pairs = plt.get_cmap("tab20").colors  # 10 hues, each dark then light: all the dark ones first
    colours, markers = pairs[0::2] + pairs[1::2], "osD^vP*Xh<>p"
    start = [(0.0, full[0]["average"])] if full else []
    for i, (name, points) in enumerate(sorted(by_method.items())):
        xs, ys = zip(*sorted(start + points))
        ax.plot(xs, ys, marker=markers[i % len(markers)], color=colours[i % len(colours)], label=name)
    if full:
        ax.axhline(full[0]["average"], color="black", linestyle="--", linewidth=1, label="full")
    ax.set_xlabel("compression ratio (fraction of the compressed part's KV removed)")
    ax.set_ylabel("RULER average (0-100)")
    ax.set_xlim(-0.02, 1.0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def ruler_sections(runs, out: Path, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> list[tuple[str, str]]:
    """[("ruler.md", Markdown)] when there are RULER runs (else []); writes ruler.md|csv, ruler_paired.csv, ruler/*.png."""
    out = Path(out)
    clean(out, RULER_FILES, (RULER_DIR,))
    rows, paired_rows = ruler_rows(runs, resamples, seed)
    if not rows:
        return []
    (out / RULER_DIR).mkdir(parents=True, exist_ok=True)
    tasks = [t for t in TASK_ORDER if any(t in r for r in rows)]
    fields = ["model", "protocol", "length", "source", "setting", "method_tag", "removed", *tasks, "average", "delta_average", "complete",
              "full_run", "run"]
    write_csv(out / "ruler.csv", [{**r, "delta_average": _delta_text(r["delta_average"]) if r["delta_average"] else None}
                                  for r in rows], fields)
    write_csv(out / "ruler_paired.csv", paired_rows, ["setting", "task", "length", "delta", "ci_low", "ci_high", "n", "full_run"])
    md = ["## RULER", "",
          "RULER's tasks generated offline by its rules (or kvpress's pre-generated RULER, task.source=kvpress: said in the "
          "heading), scored by its metrics (string_match_all; qa: string_match_part), "
          "0-100; Avg. = the mean of the task scores (RULER's per-length number). Δ vs full: the paired difference of the "
          "average to the full-cache run on the same samples, with its 95% bootstrap interval (samples resampled within "
          "each task; no interval under 5 samples per task). Removed: kvpress's compression ratio, the fraction of the "
          "compressed part's KV removed. Query-aware and query-agnostic runs are never merged. Lengths are tokens of the "
          "model's own tokenizer (docs/ruler.md).", ""]
    keyed: dict[tuple, list] = {}
    for r in rows:
        keyed.setdefault((r["model"], r["protocol"], r["length"], r["source"]), []).append(r)
    for (model, protocol, length, data), group in sorted(keyed.items()):
        group.sort(key=lambda r: (r["method"] != "full", str(r["method"]), r["removed"] or 0, str(r["setting"])))
        cols = [t for t in tasks if any(r.get(t) is not None for r in group)]
        headers = ["Setting", "Removed", *[SHORT[t] for t in cols], "Avg.", "Δ vs full [95% CI]"]
        body = [[r["setting"], "–" if r["removed"] is None else f"{r['removed']:.3f}",
                 *["–" if r.get(t) is None else f"{r[t]:.2f}" for t in cols],
                 "–" if r["average"] is None else f"{r['average']:.2f}" + ("" if r["complete"] else "*"),
                 _delta_text(r["delta_average"])] for r in group]
        picture = f"{RULER_DIR}/{_safe(model)}_{protocol}_{length}{'' if data == 'harness' else '_' + data}.png"
        ratio_figure(group, out / picture, f"{model} · RULER {length} · {protocol}")
        md += [f"### {model} · {length} tokens · {protocol}" + (" · kvpress's RULER data (simonjegou/ruler)" if data == "kvpress" else ""), "",
               markdown_table(headers, body, ["l", "r", *["r"] * len(cols), "r", "l"]), "",
               f"![RULER average vs compression ratio]({picture})", ""]
    md += ["- Columns: " + ", ".join(f"{SHORT[t]} = {t}" for t in tasks) + ". `*`: some task had no finished sample.",
           "- Per-task paired differences: ruler_paired.csv; every row names its run (ruler.csv `run`)."]
    text = "\n".join(md) + "\n"
    (out / "ruler.md").write_text(text, encoding="utf-8")
    return [("ruler.md", text)]


def tables(runs, out: Path, options) -> Tables:
    return Tables(ruler_sections(runs, out, resamples=options.resamples, seed=options.seed))


# ------------------------------------------------------------------------------------------ report.html

def html_section(runs, page) -> dict | None:
    """report.html's RULER section (harness/page_blocks.py): per model and length, the score against kvpress's
    compression ratio (every line starts at the full cache, x = 0; a select draws one task instead of the average),
    and the per-task table with the paired difference to full; each task column's samples are items."""
    from harness.page_blocks import chart, interval, item_group, method_line, rounded, strata_interval

    mine = [r for r in runs if isinstance((r.data.get("summary") or {}).get("by_length"), dict)]
    if not mine:
        return None
    rows, _ = ruler_rows(mine, page.resamples, page.seed)
    by_rel = {r.rel: r for r in mine}
    blocks = []
    keyed: dict[tuple, list] = {}
    for row in rows:
        keyed.setdefault((row["model"], row["length"], row["source"]), []).append(row)
    for (model, length, data), group in sorted(keyed.items()):
        named = "" if data == "harness" else " · kvpress's data"
        tasks = [t for t in TASK_ORDER if any(r.get(t) is not None for r in group)]
        points, variants, col_items, table = [], {t: [] for t in tasks}, {}, []
        for row in sorted(group, key=lambda r: (r["protocol"], r["method"] != "full", str(r["method"]), r["removed"] or 0)):
            run = by_rel[row["run"]]
            scores = _items(run)
            per_task = {t: [s for (name, n, _), s in scores.items() if name == t and n == length] for t in tasks}
            lo, hi = strata_interval([v for v in per_task.values() if v], page.resamples, page.seed)
            full = row["method"] == "full"
            base = {"line": method_line(run), "protocol": run.protocol, "run": page.run_ids[run.rel], "full": full,
                    "x": 0.0 if full else row["removed"]}
            points.append({**base, "y": row["average"], "lo": rounded(lo), "hi": rounded(hi)})
            for t in tasks:
                tlo, thi = interval(per_task[t], page.resamples, page.seed)
                variants[t].append({**base, "y": row.get(t), "lo": rounded(tlo), "hi": rounded(thi)})
            delta = row["delta_average"]
            table.append({"run": page.run_ids[run.rel],
                          "cells": [row["setting"], _protocol_label(row["protocol"]), rounded(row["removed"], 3),
                                    *[rounded(row.get(t), 2) for t in tasks], rounded(row["average"], 2),
                                    *([rounded(d, 2) for d in delta[:3]] + [delta[3]] if delta else [None] * 4)]})
            page.board.append({"dataset": DATASETS.get(source(run), source(run)), "data_dir": str(length), "model": model, "run": run, "compression_ratio": row["removed"],
                               "score": row["average"], "ci_low": lo, "ci_high": hi, "n": sum(len(v) for v in per_task.values())})
            group_key = item_group(run)
            for rec in run.data.get("rows") or []:
                if not isinstance(rec, dict) or "score" not in rec or int(rec.get("length", -1)) != length:
                    continue
                q, refs = int(rec.get("question_index") or 0), rec.get("references") or []
                key = page.items.add(f"{group_key}|ruler|{rec['task']}|{length}|{rec['index']}|{q}",
                                     f"RULER · {model} · {rec['task']} · {length} tokens · sample {rec['index']}" + (f" · key {q}" if q else ""),
                                     page.run_ids[run.rel], rec, response=str(rec.get("response", "")), score=rounded(rec.get("score"), 2),
                                     reference=" | ".join(map(str, refs)), targets=[str(x) for x in refs])
                if rec["task"] in tasks and key not in col_items.setdefault(3 + tasks.index(rec["task"]), []):
                    col_items[3 + tasks.index(rec["task"])].append(key)
        per_task_charts = {f"{t} ({SHORT.get(t, t)})": chart("", "", "", _from_full(v)) for t, v in variants.items()}
        blocks.append(chart(f"RULER · {model} · {length} tokens{named}: score against the compression ratio",
                            "compression ratio (fraction of the compressed part's KV removed)", "RULER score (0-100)", _from_full(points),
                            xmin=0.0, variants={"average": None, **{k: {"series": c["series"], "hlines": c["hlines"]}
                                                                    for k, c in per_task_charts.items()}}))
        blocks.append({"kind": "table", "id": f"ruler-{length}{'' if data == 'harness' else '-' + data}",
                       "title": f"RULER per task · {model} · {length} tokens{named} "
                       "(click a task's score for its samples, a setting for all its items)",
                       "columns": [{"name": "Setting"}, {"name": "Protocol"}, {"name": "Removed", "num": True},
                                   *[{"name": SHORT.get(t, t), "num": True, "title": t} for t in tasks],
                                   {"name": "Avg.", "num": True}, {"name": "Δ vs full", "num": True}, {"name": "CI low", "num": True},
                                   {"name": "CI high", "num": True}, {"name": "n", "num": True}],
                       "rows": table, "colItems": {str(k): v for k, v in col_items.items()}})
    return {"id": "ruler", "title": "RULER", "blocks": blocks,
            "intro": "RULER's synthetic tasks, scored by its metrics (0-100); the average is the mean of the task scores. Δ vs full: "
                     "the paired difference of the average on the same samples with its 95% bootstrap interval (samples resampled "
                     f"within each task; none under {MIN_INTERVAL_ITEMS} samples a task). The chart's select shows one task instead "
                     "of the average. Compression ratio: kvpress's, the fraction of the compressed part's KV removed."}


def _from_full(points: list[dict]) -> list[dict]:
    """Each method line starts at the full cache (x = 0) of its protocol, as the leaderboard draws it."""
    fulls = {p["protocol"]: p for p in points if p["full"]}
    lines = {(p["line"], p["protocol"]) for p in points if not p["full"]}
    return points + [{**fulls[proto], "line": line, "full": False, "x": 0.0} for line, proto in lines if proto in fulls]
