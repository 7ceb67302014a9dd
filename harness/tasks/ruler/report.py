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

from harness.results import method_name, pair_key
from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, MIN_INTERVAL_ITEMS, stratified_bootstrap_ci
from harness.tables import Tables, _safe, clean, markdown_table, method_setting, write_csv

RULER_FILES = ("ruler.md", "ruler.csv", "ruler_paired.csv")
RULER_DIR = "ruler"
OUTPUT_FILES, OUTPUT_DIRS = RULER_FILES, (RULER_DIR,)
TASK_ORDER = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
              "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
SHORT = {"niah_single_1": "S1", "niah_single_2": "S2", "niah_single_3": "S3", "niah_multikey_1": "MK1",
         "niah_multikey_2": "MK2", "niah_multikey_3": "MK3", "niah_multivalue": "MV", "niah_multiquery": "MQ",
         "vt": "VT", "cwe": "CWE", "fwe": "FWE", "qa_1": "QA1", "qa_2": "QA2"}


def _items(run) -> dict[tuple, float]:
    """(task, length, index) -> the sample's RULER score (0-100)."""
    return {(r["task"], int(r["length"]), int(r["index"])): float(r["score"])
            for r in run.data.get("rows") or [] if isinstance(r, dict) and "score" in r and "task" in r}


def removed_fraction(run) -> float | None:
    """kvpress's compression ratio: the fraction of the compressed part's KV entries removed (0 for full),
    from each sample's resolved budget and its compressed length (the whole prompt query-aware, the
    context query-agnostic). A method with one budget over every layer and head (KVzip) records no
    per-head budget; its `ratio` is by construction the fraction of all the compressed part's entries
    kept, so 1 - ratio. None when neither says."""
    if method_name(run) == "full":
        return 0.0
    shares = []
    for r in run.data.get("rows") or []:
        budget = r.get("budget_tokens")
        end = r.get("prompt_tokens") if run.protocol == "query_aware" else r.get("question_start")
        if isinstance(budget, (int, float)) and end:
            shares.append(min(1.0, budget / end))
    if shares:
        return round(1 - sum(shares) / len(shares), 4)
    from harness.methods import METHODS

    method = run.data.get("method") or {}
    one_budget = getattr(METHODS.get(method.get("name")), "GLOBAL_BUDGET", False)
    if one_budget and isinstance(method.get("ratio"), (int, float)):
        return round(1 - float(method["ratio"]), 4)
    return None


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
            row = {"model": str(run.model.get("name", "?")), "protocol": run.protocol, "length": int(length), "setting": label,
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
    fields = ["model", "protocol", "length", "setting", "method_tag", "removed", *tasks, "average", "delta_average", "complete",
              "full_run", "run"]
    write_csv(out / "ruler.csv", [{**r, "delta_average": _delta_text(r["delta_average"]) if r["delta_average"] else None}
                                  for r in rows], fields)
    write_csv(out / "ruler_paired.csv", paired_rows, ["setting", "task", "length", "delta", "ci_low", "ci_high", "n", "full_run"])
    md = ["## RULER", "",
          "RULER's tasks generated offline by its rules, scored by its metrics (string_match_all; qa: string_match_part), "
          "0-100; Avg. = the mean of the task scores (RULER's per-length number). Δ vs full: the paired difference of the "
          "average to the full-cache run on the same samples, with its 95% bootstrap interval (samples resampled within "
          "each task; no interval under 5 samples per task). Removed: kvpress's compression ratio, the fraction of the "
          "compressed part's KV removed. Query-aware and query-agnostic runs are never merged. Lengths are tokens of the "
          "model's own tokenizer (docs/ruler.md).", ""]
    keyed: dict[tuple, list] = {}
    for r in rows:
        keyed.setdefault((r["model"], r["protocol"], r["length"]), []).append(r)
    for (model, protocol, length), group in sorted(keyed.items()):
        group.sort(key=lambda r: (r["method"] != "full", str(r["method"]), r["removed"] or 0, str(r["setting"])))
        cols = [t for t in tasks if any(r.get(t) is not None for r in group)]
        headers = ["Setting", "Removed", *[SHORT[t] for t in cols], "Avg.", "Δ vs full [95% CI]"]
        body = [[r["setting"], "–" if r["removed"] is None else f"{r['removed']:.3f}",
                 *["–" if r.get(t) is None else f"{r[t]:.2f}" for t in cols],
                 "–" if r["average"] is None else f"{r['average']:.2f}" + ("" if r["complete"] else "*"),
                 _delta_text(r["delta_average"])] for r in group]
        picture = f"{RULER_DIR}/{_safe(model)}_{protocol}_{length}.png"
        ratio_figure(group, out / picture, f"{model} · RULER {length} · {protocol}")
        md += [f"### {model} · {length} tokens · {protocol}", "",
               markdown_table(headers, body, ["l", "r", *["r"] * len(cols), "r", "l"]), "",
               f"![RULER average vs compression ratio]({picture})", ""]
    md += ["- Columns: " + ", ".join(f"{SHORT[t]} = {t}" for t in tasks) + ". `*`: some task had no finished sample.",
           "- Per-task paired differences: ruler_paired.csv; every row names its run (ruler.csv `run`)."]
    text = "\n".join(md) + "\n"
    (out / "ruler.md").write_text(text, encoding="utf-8")
    return [("ruler.md", text)]


def tables(runs, out: Path, options) -> Tables:
    return Tables(ruler_sections(runs, out, resamples=options.resamples, seed=options.seed))
