"""The reuse gap: what asking a compressed context a question it did not see costs each method.

A method setting run under both protocols on the same items (same model, task, task settings and method
options; `harness.results.pair_key` without the protocol) gives, per (item, question), the score with the
question inside the compressed prompt (query-aware) and asked after compression (query-agnostic). The gap is
the mean of (aware - agnostic) over the items both runs finished, with the paired bootstrap interval of
harness/stats.py (the one paired_deltas uses). `python -m harness.report` writes, through
`reuse_gap_section`:

- `reuse_gap.csv`: `setting, task, delta, ci_low, ci_high, n` (setting = the method tag), then model, method
  label, turns, both mean scores and both run directories;
- `reuse_gap.md`: the same as a table;
- `reuse_gap/<model>__<task>.png`: one bar pair per setting (aware, agnostic), the gap's interval drawn on the
  agnostic bar (aware mean minus the interval: where the agnostic score lies by the paired gap).

Items: needle rows by (length, depth, question_index) (0 when absent: one needle per cell); LongBench and
LongBench-E items by (index, _id) per task (one question each; also the average over tasks, items resampled
within each task). A query-agnostic run with `task.keep_answers=true` (multi-turn) is its own row
(turns = multi-turn), never merged with independent questions. Nothing here imports torch.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

from harness.report.paired import grouped, pairings, stratum_pairs
from harness.results import method_name, pair_key
from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_mean_ci, stratified_bootstrap_ci
from harness.tables import _safe, clean, markdown_table, method_setting, write_csv

FILES = ("reuse_gap.md", "reuse_gap.csv")
FOLDER = "reuse_gap"
CSV_FIELDS = ["setting", "task", "delta", "ci_low", "ci_high", "n", "model", "method", "turns", "aware_score",
              "agnostic_score", "aware_run", "agnostic_run"]
AVERAGE = "average"


@dataclass
class GapRow:
    setting: str          # the method tag (every option that changes results)
    task: str             # needle, a LongBench task, or average
    delta: float          # mean of (query-aware - query-agnostic) over the paired (item, question)s
    ci_low: float
    ci_high: float
    n: int
    model: str
    method: str           # the tables' label (harness.report.method_setting)
    turns: str            # independent (each question on the compressed context alone) or multi-turn
    aware_score: float    # mean scores over the same paired items
    agnostic_score: float
    aware_run: str
    agnostic_run: str
    digits: int = 2       # decimals in the table (the benchmark's Pairing)

    def csv_row(self) -> dict:
        out = dict(self.__dict__)
        for k in ("delta", "ci_low", "ci_high", "aware_score", "agnostic_score"):
            out[k] = round(out[k], 6)
        return out


def _keep_answers(run) -> bool:
    task = (run.config or {}).get("task") if isinstance(run.config, dict) else None
    summary = run.data.get("summary") if isinstance(run.data.get("summary"), dict) else {}
    flag = summary.get("keep_answers", (task or {}).get("keep_answers", False) if isinstance(task, dict) else False)
    return flag is True or str(flag).lower() == "true"


def reuse_key(run) -> str:
    """Runs with equal keys ran the same method on the same items; only the protocol (and keep_answers) may differ."""
    key = json.loads(pair_key(run))
    key.pop("protocol", None)
    if isinstance(key.get("task_config"), dict):
        key["task_config"].pop("keep_answers", None)
    key["method"] = method_description(run)
    return json.dumps(key, sort_keys=True, default=str)


def method_description(run) -> dict | None:
    """The run's recorded method options, with the options added since (`added_options` of the method's class)
    filled in at the default that keeps the earlier behaviour: an older run pairs with a newer one of the same rule."""
    from harness.methods import METHODS

    method = run.data.get("method")
    if not isinstance(method, dict):
        return method
    name = str(method.get("name"))
    cls = METHODS[name] if name in METHODS else None
    return {**getattr(cls, "added_options", {}), **method} if cls is not None else method


def gap_rows(runs, *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> tuple[list[GapRow], list[str]]:
    """Rows for every setting with a query-aware and a query-agnostic run on the same items; and notes."""
    by_task = pairings()
    rows, notes = [], []
    for group in grouped([r for r in runs if r.task in by_task and method_name(r) is not None], reuse_key):
        pairing = by_task[group[0].task]
        aware = [r for r in group if r.protocol == "query_aware"]
        agnostic = [r for r in group if r.protocol == "query_agnostic"]
        if not aware or not agnostic:
            continue
        if len(aware) > 1:
            notes.append(f"`{agnostic[0].rel}`: {len(aware)} query-aware runs match; paired with `{aware[0].rel}`")
        ref = aware[0]
        theirs, their_notes = pairing.items(ref)
        notes.extend(f"`{ref.rel}`: {n}" for n in their_notes)
        for run in agnostic:
            mine, my_notes = pairing.items(run)
            notes.extend(f"`{run.rel}`: {n}" for n in my_notes)
            common = dict(setting=str(run.data.get("method_tag") or method_name(run)), model=str(run.model.get("name", "?")),
                          method=method_setting(run.data.get("method") or {})[0],
                          turns="multi-turn" if _keep_answers(run) else "independent", aware_run=ref.rel, agnostic_run=run.rel,
                          digits=pairing.digits)
            per_task = []
            for task, pairs in stratum_pairs(mine, theirs, pairing.order):
                if not pairs:
                    notes.append(f"`{run.rel}`: {task}: no (item, question) in common with `{ref.rel}`")
                    continue
                b = [x for x, _ in pairs]
                a = [y for _, y in pairs]
                per_task.append(([x - y for x, y in zip(a, b)], a, b))
                ci = bootstrap_mean_ci(per_task[-1][0], n_resamples=n_resamples, seed=seed)
                rows.append(GapRow(task=task, delta=ci.estimate, ci_low=ci.low, ci_high=ci.high, n=ci.n,
                                   aware_score=sum(a) / len(a), agnostic_score=sum(b) / len(b), **common))
            if len(per_task) > 1:  # LongBench: the average of the task means, items resampled within each task
                ci = stratified_bootstrap_ci([d for d, _, _ in per_task], n_resamples=n_resamples, seed=seed)
                rows.append(GapRow(task=AVERAGE, delta=ci.estimate, ci_low=ci.low, ci_high=ci.high, n=ci.n,
                                   aware_score=sum(sum(a) / len(a) for _, a, _ in per_task) / len(per_task),
                                   agnostic_score=sum(sum(b) / len(b) for _, _, b in per_task) / len(per_task), **common))
            for r in (run, ref):
                if "reuse_gap" not in r.used_in and per_task:
                    r.used_in.append("reuse_gap")
    return rows, notes


def gap_figure(rows: list[GapRow], path: Path, *, title: str) -> Path:
    """One bar pair per setting: query-aware and query-agnostic mean scores; the gap's interval on the agnostic bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(rows) + 1.5), 4.6))
    xs = range(len(rows))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r.aware_score for r in rows], width, label="query-aware", color="#4C72B0")
    low = [r.aware_score - r.ci_high for r in rows]
    high = [r.aware_score - r.ci_low for r in rows]
    agn = [r.agnostic_score for r in rows]
    ax.bar([x + width / 2 for x in xs], agn, width, label="query-agnostic", color="#DD8452",
           yerr=[[a - lo for a, lo in zip(agn, low)], [hi - a for a, hi in zip(agn, high)]], capsize=3, ecolor="black")
    top = max([r.aware_score for r in rows] + high + [1e-9])
    for x, r in zip(xs, rows):
        ax.text(x, top * 1.04, f"Δ {r.delta:+.2f}\n[{r.ci_low:+.2f}, {r.ci_high:+.2f}]", ha="center", va="bottom", fontsize=7)
    labels = ["\n".join(textwrap.wrap(r.method, 18)) + ("\nmulti-turn" if r.turns == "multi-turn" else "") for r in rows]
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylim(0, top * 1.3)
    ax.set_ylabel("mean score over paired (item, question)s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def gap_table(rows: list[GapRow], notes: list[str], n_resamples: int, seed: int, figures: list[str]) -> str:
    headers = ["Model", "Setting", "Turns", "Task", "Query-aware", "Query-agnostic", "Δ aware − agnostic", "95% CI", "n", "",
               "Agnostic run", "Aware run"]
    body = []
    for r in rows:
        digits = r.digits
        body.append([r.model, r.method, r.turns, {AVERAGE: "Avg."}.get(r.task, r.task), f"{r.aware_score:.{digits}f}",
                     f"{r.agnostic_score:.{digits}f}", f"{r.delta:+.{digits}f}", f"[{r.ci_low:+.{digits}f}, {r.ci_high:+.{digits}f}]",
                     r.n, "~ noise" if r.ci_low <= 0.0 <= r.ci_high else "", f"`{r.agnostic_run}`", f"`{r.aware_run}`"])
    lines = ["## Reuse gap: the question inside the compressed prompt vs asked after it", "",
             markdown_table(headers, body, ["l"] * 4 + ["r"] * 5 + ["l"] * 3), "",
             "- Δ: mean over the (item, question)s both runs finished of (query-aware − query-agnostic) score, same model, "
             "method options, task and task settings: what reusing one compressed context for a question it did not see "
             "costs. Needle in score units (items: length, depth, question), LongBench in points (official metric x 100).",
             f"- 95% CI: percentile interval of {n_resamples} paired bootstrap resamples (seed {seed}); Avg.: mean of the task "
             "means, items resampled within each task. `~ noise`: the interval contains 0.",
             "- Turns: independent (each question asked of the compressed context alone, the cache rolled back: kvpress's "
             "protocol) or multi-turn (task.keep_answers=true: earlier questions and answers stay in the cache).",
             "- Also as reuse_gap.csv (`setting` = the method tag)."]
    lines += [f"- Figure: `{f}`." for f in figures]
    lines += [f"- {n}." for n in dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"


def reuse_gap_section(runs, out: Path, *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> list[tuple[str, str]]:
    """Write reuse_gap.md|csv and reuse_gap/*.png into the table set `out` (removing earlier ones first);
    returns [("reuse_gap.md", markdown)] or [] when no setting ran under both protocols."""
    out = Path(out)
    clean(out, FILES, (FOLDER,))
    rows, notes = gap_rows(runs, n_resamples=n_resamples, seed=seed)
    if not rows:
        return []
    figures = []
    by_figure: dict[tuple[str, str], list[GapRow]] = {}
    for r in rows:
        by_figure.setdefault((r.model, r.task), []).append(r)
    for (model, task), group in by_figure.items():
        path = out / FOLDER / f"{_safe(model)}__{_safe(task)}.png"
        gap_figure(group, path, title=f"{model} · {task}: query-aware vs query-agnostic\nΔ = aware − agnostic, 95% paired bootstrap CI")
        figures.append(f"{FOLDER}/{path.name}")
    write_csv(out / "reuse_gap.csv", [r.csv_row() for r in rows], CSV_FIELDS)
    md = gap_table(rows, notes, n_resamples, seed, figures)
    (out / "reuse_gap.md").write_text(md, encoding="utf-8")
    return [("reuse_gap.md", md)]
