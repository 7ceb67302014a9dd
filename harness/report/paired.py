"""Paired differences between each compressed setting and the full cache run on the same items.

Used by `python -m harness.report` (paired_deltas.md|csv). A compressed run is paired with a `full` run
when both ran the same items under the same rules: same task, same protocol (query-aware or
query-agnostic, never merged), the same model config and the same task config (grid, lengths, depths,
datasets, prompt style, limit, chat and decoding rules...), ignoring only keys that never change an
item's score (harness.results.pair_key). Items are matched by identity within a stratum; only items present
in both runs are paired.

Which benchmarks pair, and how their per-item scores are read, each benchmark's report module says
(`PAIRING`, a harness.results.Pairing: needle cells as one stratum; LongBench items per task, with the average
over tasks): this module knows no benchmark by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from harness.results import Pairing, method_name, pair_key, protocol_rank
from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, MIN_INTERVAL_ITEMS, Interval, bootstrap_mean_ci, stratified_bootstrap_ci
from harness.tables import _model_sort, _protocol_label, _setting_sort, markdown_table, method_setting

AVERAGE = "average"  # the `task` of the average row (mean of the strata means)


def pairings() -> dict[str, Pairing]:
    """{task name: its Pairing} for every registered benchmark whose report declares PAIRING."""
    from harness.tasks import task_reports

    return {name: module.PAIRING for names, module in task_reports() if getattr(module, "PAIRING", None) for name in names}


def grouped(runs, key: Callable) -> list[list]:
    """Runs with equal `key(run)`, each group in path order, the groups in the order of their first path."""
    groups: dict[str, list] = {}
    for run in runs:
        groups.setdefault(key(run), []).append(run)
    return [sorted(groups[k], key=lambda r: r.rel) for k in sorted(groups, key=lambda k: min(r.rel for r in groups[k]))]


def stratum_pairs(mine: dict, theirs: dict, order: Callable) -> Iterator[tuple[str, list[tuple[float, float]]]]:
    """(stratum, [(my score, their score) of every item both hold]) for each stratum both hold, in `order`."""
    for name in sorted(set(mine) & set(theirs), key=order):
        yield name, [(mine[name][k], theirs[name][k]) for k in sorted(k for k in mine[name] if k in theirs[name])]


# ------------------------------------------------------------------------------------------ pairing

@dataclass
class PairedRow:
    setting: str        # the compressed run's directory, relative to the collected folder
    task: str           # a stratum (a LongBench task, the needle mean) or AVERAGE
    delta: float        # mean of (setting - full) over the paired items
    ci_low: float | None   # None: fewer than MIN_INTERVAL_ITEMS paired items, no interval
    ci_high: float | None
    n: int
    benchmark: str      # the run's task: longbench, longbench_e, needle
    model: str = ""
    method: dict = field(default_factory=dict)
    method_tag: str = ""
    protocol: str = ""
    full_run: str = ""
    tasks_averaged: int = 0
    digits: int = 2     # decimals in the table (the benchmark's Pairing)
    label: str = ""     # the stratum's name in the table

    @property
    def has_interval(self) -> bool:
        return self.ci_low is not None and self.ci_high is not None

    @property
    def noise(self) -> bool:
        return self.has_interval and self.ci_low <= 0.0 <= self.ci_high

    def csv_row(self) -> dict:
        def rounded(v):
            return "" if v is None else round(v, 6)

        return {"setting": self.setting, "task": self.task, "delta": round(self.delta, 6), "ci_low": rounded(self.ci_low),
                "ci_high": rounded(self.ci_high), "n": self.n}


CSV_FIELDS = ["setting", "task", "delta", "ci_low", "ci_high", "n"]


def pair_runs(runs: list, *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> tuple[list[PairedRow], list[str]]:
    """Paired rows for every compressed run with a full run on the same items; and notes (unpaired runs, items
    left out). Runs: harness.results.Run (rel, path, data, task, model, config, protocol)."""
    by_task = pairings()
    items_cache: dict[str, tuple[Any, list[str]]] = {}

    def items(run):
        if run.rel not in items_cache:
            items_cache[run.rel] = by_task[run.task].items(run)
        return items_cache[run.rel]

    def scored(run) -> bool:
        return any(items(run)[0].values())

    rows: list[PairedRow] = []
    notes: list[str] = []
    for group in grouped([r for r in runs if r.task in by_task and method_name(r) is not None], pair_key):
        fulls = [r for r in group if method_name(r) == "full"]
        others = [r for r in group if method_name(r) != "full"]
        if not others:
            continue
        if not fulls:
            notes.extend(f"`{r.rel}`: no full-cache run of the same model, task, protocol and task settings" for r in others)
            continue
        for run in others:
            pairing = by_task[run.task]
            mine, my_notes = items(run)
            if not scored(run):  # not scored, or no finished cell: said in its own table and runs.csv
                continue
            parent = Path(run.rel).parent
            # a sibling first (the settings of one methods run), then in path order; one with scores
            ranked = sorted(fulls, key=lambda f: (Path(f.rel).parent != parent, f.rel))
            full = next((f for f in ranked if scored(f)), None)
            if full is None:
                names = ", ".join(f"`{f.rel}`" for f in fulls)
                notes.append(f"`{run.rel}`: no scores in its full-cache run{'s' if len(fulls) > 1 else ''} ({names})")
                continue
            if len(fulls) > 1:
                notes.append(f"`{run.rel}`: {len(fulls)} full-cache runs match; paired with `{full.rel}`")
            common = dict(setting=run.rel, benchmark=run.task, model=str(run.model.get("name", "?")), method=run.data.get("method") or {},
                          method_tag=str(run.data.get("method_tag") or ""), protocol=run.protocol, full_run=full.rel,
                          digits=pairing.digits)
            theirs, their_notes = items(full)
            notes.extend(f"`{run.rel}`: {n}" for n in my_notes)
            notes.extend(f"`{full.rel}` (full): {n}" for n in their_notes)
            per_task = []
            for name, pairs in stratum_pairs(mine, theirs, pairing.order):
                if not pairs:
                    notes.append(f"`{run.rel}`: {pairing.unmatched.format(stratum=name)} with `{full.rel}`")
                    continue
                diffs = [a - b for a, b in pairs]
                per_task.append(diffs)
                rows.append(_row(bootstrap_mean_ci(diffs, n_resamples=n_resamples, seed=seed), name, label=pairing.label(name), **common))
            if per_task and pairing.average:
                ci = stratified_bootstrap_ci(per_task, n_resamples=n_resamples, seed=seed)
                rows.append(_row(ci, AVERAGE, tasks_averaged=len(per_task), **common))
    return rows, notes


def _row(ci: Interval, task: str, **kw) -> PairedRow:
    enough = ci.n >= MIN_INTERVAL_ITEMS
    return PairedRow(task=task, delta=ci.estimate, ci_low=ci.low if enough else None, ci_high=ci.high if enough else None,
                     n=ci.n, **kw)


# ------------------------------------------------------------------------------------------ the table

def paired_table(rows: list[PairedRow], notes: list[str], n_resamples: int, seed: int) -> str:
    """Markdown: each compressed setting minus its full-cache run, per task, with the bootstrap interval."""
    if not rows:
        return ""
    order = {}
    for r in rows:  # runs grouped by model, protocol, setting; within a run the task order of pair_runs
        order.setdefault(r.setting, (_model_sort(r.model), protocol_rank(r.protocol), _setting_sort(method_setting(r.method)[0]),
                                     r.setting))
    ranked = sorted(enumerate(rows), key=lambda ir: (order[ir[1].setting], ir[0]))
    headers = ["Model", "Setting", "Protocol", "Task", "Δ vs full", "95% CI", "n", "", "Run", "Full run"]
    body = []
    for _, r in ranked:
        digits = r.digits
        task = (f"Avg. ({r.tasks_averaged} task{'s' if r.tasks_averaged != 1 else ''})" if r.task == AVERAGE
                else r.label or r.task)
        body.append([r.model, method_setting(r.method)[0], _protocol_label(r.protocol), task, f"{r.delta:+.{digits}f}",
                     f"[{r.ci_low:+.{digits}f}, {r.ci_high:+.{digits}f}]" if r.has_interval else f"n/a (n < {MIN_INTERVAL_ITEMS})",
                     r.n, "~ noise" if r.noise else "",
                     f"`{r.setting}`", f"`{r.full_run}`"])
    lines = ["## Paired differences to the full cache", "",
             markdown_table(headers, body, ["l"] * 4 + ["r"] * 3 + ["l"] * 3), "",
             "- Δ vs full: mean over the items both runs finished of (setting − full cache), same model, task, protocol and "
             "task settings; LongBench in points (official metric x 100), needle in score units. n: paired items.",
             f"- 95% CI: percentile interval of {n_resamples} paired bootstrap resamples (items with replacement, seed {seed}); "
             "Avg.: the mean of the task means, items resampled within each task. `~ noise`: the interval contains 0. "
             f"Fewer than {MIN_INTERVAL_ITEMS} paired items give no interval (n/a): their bootstrap has too few distinct "
             "resampled means to mean anything.",
             "- Also as paired_deltas.csv (`setting` = the run directory, `task` = a LongBench task, `average` or `needle`)."]
    lines += [f"- {n}." for n in dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"
