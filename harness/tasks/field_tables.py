"""The field benchmarks' tables (longbench_v2, infinitebench, scbench, loogle): every setting's scores in the authors' layout,
and each compressed setting against the full cache on the same items (paired 95% bootstrap interval of the per-item
difference, harness/stats.py). A run writes them to its run directory as `<name>_table.md` (`markdown`, from its own
settings); `python -m harness.report` writes `<name>.md` in the table set (`report`, from every collected run, the runs
grouped by harness.results.pair_key: same model, task settings and protocol).

A task hands over, per setting tag, its rows (each with its per-item `score`, None when the item does not count) and a
function giving each row's group(s); the columns are the benchmark's groups in the authors' order. Only items both
settings scored are paired. A benchmark with several metrics per item (LooGLE) gives `value(row, column)` instead of
the `score` field: a number, None, or (matched, out of) where the authors pool counts (a cell is then the matches over
the counts; an item's value in a pair is its own ratio).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_mean_ci

FULL = "full"


def full_tag(settings) -> str | None:
    """The tag of the run's full-cache setting (method name `full`), if one ran."""
    for s in settings:
        if getattr(s.method, "name", None) == FULL or s.tag == FULL:
            return s.tag
    return None


def _ratio(v):
    """A value as one number: (matched, out of) is its ratio."""
    return v[0] / v[1] if isinstance(v, (tuple, list)) else v


def paired(rows: dict[str, list[dict]], reference: str, key: Callable[[dict], tuple], score: Callable[[dict], float | None],
           groups: Callable[[dict], Iterable[str]], columns: list[str], *, n_resamples: int = DEFAULT_RESAMPLES,
           seed: int = DEFAULT_SEED, value: Callable[[dict, str], object] | None = None) -> dict[str, dict[str, dict]]:
    """{tag: {group: {"delta", "low", "high", "n"}}} (x 100) of every tag but `reference`: per-item score minus the
    reference's on the items both scored (score not None), per group (`value(row, group)` instead of `score` if given)."""
    ref = {key(r): r for r in rows[reference]}
    get = (lambda r, g: _ratio(value(r, g))) if value is not None else (lambda r, g: score(r))
    out: dict[str, dict[str, dict]] = {}
    for tag, recs in rows.items():
        if tag == reference:
            continue
        diffs: dict[str, list[float]] = {c: [] for c in columns}
        for r in recs:
            other = ref.get(key(r))
            if other is None:
                continue
            for g in groups(r):
                if g in diffs and get(r, g) is not None and get(other, g) is not None:
                    diffs[g].append(100.0 * (get(r, g) - get(other, g)))
        out[tag] = {}
        for g, d in diffs.items():
            if d:
                ci = bootstrap_mean_ci(d, n_resamples=n_resamples, seed=seed)
                out[tag][g] = {"delta": round(ci.estimate, 2), "low": round(ci.low, 2), "high": round(ci.high, 2), "n": ci.n}
    return out


def _cell(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def markdown(title: str, columns: list[str], scores: dict[str, dict[str, float | None]], deltas: dict[str, dict[str, dict]],
             reference: str | None, notes: list[str], digits: int = 1) -> str:
    """Scores per setting (the authors' columns), then each setting minus the full cache with its interval."""
    lines = [f"## {title}", "", "| Setting | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for tag, row in scores.items():
        lines.append(f"| {tag} | " + " | ".join(_cell(row.get(c), digits) for c in columns) + " |")
    if reference and deltas:
        lines += ["", f"Minus `{reference}` on the same items (points; paired 95% bootstrap interval, n items):", "",
                  "| Setting | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
        for tag, by_group in deltas.items():
            cells = [(f"{d['delta']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}] n={d['n']}" if (d := by_group.get(c)) else "–")
                     for c in columns]
            lines.append(f"| {tag} | " + " | ".join(cells) + " |")
    elif not reference:
        lines += ["", "No `full` setting in this run: no paired differences (add `full` to methods=[...])."]
    lines += [""] + notes + [""]
    return "\n".join(lines)


def grouped(rows: list[dict], groups: Callable[[dict], Iterable[str]], columns: list[str], digits: int,
            strict: bool, value: Callable[[dict, str], object] | None = None) -> dict[str, float | None]:
    """100 x the mean `score` (or `value(row, column)`; pooled (matched, out of) counts) per column. Items scored None
    are left out; with `strict` a column holding one is None instead (the official scorer raised there)."""
    out: dict[str, float | None] = {}
    for c in columns:
        values = [(r.get("score") if value is None else value(r, c)) for r in rows if c in groups(r)]
        kept = [v for v in values if v is not None]
        if not kept or (strict and len(kept) < len(values)):
            out[c] = None
        elif isinstance(kept[0], (tuple, list)):
            out[c] = round(100 * sum(v[0] for v in kept) / sum(v[1] for v in kept), digits)
        else:
            out[c] = round(100 * sum(kept) / len(kept), digits)
    return out


def report(runs, out: Path, options, *, name: str, title: str, views, key, digits: int, strict: bool):
    """The table set's `<name>.md`: per group of comparable runs (model, protocol, task settings), one table per view
    `(subtitle, select(row) -> bool, columns, groups(row))`, each setting's scores then its difference to `full`."""
    from harness.results import method_name, pair_key
    from harness.tables import Tables

    by_key: dict[str, list] = {}
    for run in runs:
        by_key.setdefault(pair_key(run), []).append(run)
    parts = []
    for members in by_key.values():
        members.sort(key=lambda r: (method_name(r) != FULL, r.rel))
        tag = {r.rel: str(r.data.get("method_tag") or r.rel) for r in members}
        full = next((r for r in members if method_name(r) == FULL), None)
        reference = tag[full.rel] if full else None
        model = members[0].model.get("name", "?")
        for subtitle, select, columns, groups, *value in views:  # a view may end with its value(row, column)
            value = value[0] if value else None
            rows = {tag[r.rel]: [x for x in r.data.get("rows") or [] if isinstance(x, dict) and select(x)] for r in members}
            deltas = (paired(rows, reference, key, lambda r: r.get("score"), groups, columns, n_resamples=options.resamples,
                             seed=options.seed, value=value) if reference else {})
            scores = {t: grouped(rs, groups, columns, digits, strict, value) for t, rs in rows.items()}
            parts.append(markdown(f"{title} · {model} · {members[0].protocol}{subtitle}", columns, scores, deltas, reference,
                                  [f"Runs: {', '.join(r.rel for r in members)}."], digits))
        for r in members:
            r.used_in.append(name)
    if not parts:
        return Tables()
    text = "\n".join(parts)
    (Path(out) / f"{name}.md").write_text(text, encoding="utf-8")
    return Tables([(f"{name}.md", text)])


def write(run_dir: Path, name: str, text: str) -> Path:
    path = Path(run_dir) / f"{name}_table.md"
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ paired reports and report.html

def pairing(key: Callable[[dict], tuple], stratum: Callable[[dict], str], *, strict: bool, **options):
    """The benchmark's harness.results.Pairing: per stratum (a task, a mode and task, ...), 100 x each record's score by
    item key (the first record of a key wins); items scored None are left out, and with `strict` a stratum holding one
    is left out whole (the official scorer raised there: its tables show '–')."""
    from harness.results import Pairing, number

    def items(run) -> tuple[dict, list[str]]:
        out: dict[str, dict] = {}
        broken: set[str] = set()
        for r in run.data.get("rows") or []:
            if not isinstance(r, dict) or "score" not in r:
                continue
            name = stratum(r)
            if number(r["score"]):
                out.setdefault(name, {}).setdefault(key(r), 100.0 * float(r["score"]))
            elif strict:
                broken.add(name)
        return {k: v for k, v in out.items() if k not in broken}, [f"{k}: the official scorer raised; left out" for k in sorted(broken)]

    return Pairing(items=items, **options)


def html_section(runs, page, *, sid: str, title: str, views, key: Callable[[dict], tuple], digits: int, strict: bool,
                 item_label: Callable[[dict], str], intro: str, delta_note: Callable[[str], str] = lambda subtitle: "") -> dict | None:
    """report.html's section of a field benchmark (harness/page_blocks.py), per group of comparable runs (model,
    protocol, task settings) and view (`report`'s views): the score over all scored items against the budget (or kvpress's
    compression ratio when a setting has no budget), one line per method, 95% bootstrap band, full as a horizontal line;
    a sortable table of the authors' columns, the score over all items and its paired difference to full (interval, n);
    a row opens its run's items, a column cell the column's items; every record is an item (all settings of it)."""
    from harness.page_blocks import budget_of, chart, interval, item_group, method_line, model_of, removed_fraction, rounded, setting_label
    from harness.results import method_name, pair_key

    by_key: dict[str, list] = {}
    for run in runs:
        if isinstance(run.data.get("rows"), list):
            by_key.setdefault(pair_key(run), []).append(run)
    blocks, added, charted = [], set(), set()
    for members in by_key.values():
        members.sort(key=lambda r: (method_name(r) != FULL, r.rel))
        full = next((r for r in members if method_name(r) == FULL), None)
        model, protocol = model_of(members[0]), members[0].protocol
        by_budget = all(budget_of(r) is not None for r in members if r is not full)
        for subtitle, select, columns, groups, *value in views:  # a view may end with its value(row, column)
            value = value[0] if value else None
            rows = {r.rel: [x for x in r.data["rows"] if isinstance(x, dict) and select(x)] for r in members}
            if not any(rows.values()):
                continue
            every = lambda r: ("all",)  # noqa: E731 - the score over all scored items, one paired group
            deltas = (paired(rows, full.rel, key, lambda r: r.get("score"), every, ["all"], n_resamples=page.resamples,
                             seed=page.seed) if full else {})
            points, table, col_items = [], [], {}
            for run in members:
                recs, run_id = rows[run.rel], page.run_ids[run.rel]
                values = [100.0 * r["score"] for r in recs if r.get("score") is not None]
                overall = round(sum(values) / len(values), digits) if values else None
                lo, hi = interval(values, page.resamples, page.seed)
                is_full = run is full
                x = budget_of(run) if by_budget else (0.0 if is_full else removed_fraction(run))
                points.append({"line": method_line(run), "protocol": run.protocol, "x": x, "y": overall, "lo": rounded(lo, 2),
                               "hi": rounded(hi, 2), "run": run_id, "full": is_full})
                d = (deltas.get(run.rel) or {}).get("all")
                table.append({"run": run_id, "cells": [setting_label(run), *[grouped(recs, groups, columns, digits, strict, value).get(c) for c in columns],
                                                       overall, *([d["delta"], d["low"], d["high"], d["n"]] if d else [None] * 4)]})
                page.board.append({"dataset": run.task, "data_dir": subtitle.strip(" ·") or None, "model": model, "run": run,
                                   "compression_ratio": removed_fraction(run), "score": overall, "ci_low": lo, "ci_high": hi, "n": len(values)})
                group = item_group(run)
                for r in recs:
                    # one item per record whatever view lists it (SCBench's multi-turn turns are in two views)
                    k = f"{group}|{run.task}|{r.get('mode', '')}|{'|'.join(map(str, key(r)))}"
                    if (k, run_id) not in added:
                        added.add((k, run_id))
                        page.items.add(k, f"{title} · {model} · {item_label(r)}", run_id, r,
                                       response=str(r.get("response", r.get("prediction", ""))),
                                       score=rounded(None if r.get("score") is None else 100.0 * r["score"], 2),
                                       reference=str(r.get("answer", r.get("ground_truth", ""))))
                    for c in groups(r):
                        if c in columns and k not in col_items.setdefault(1 + columns.index(c), []):
                            col_items[1 + columns.index(c)].append(k)
            name = f"{title} · {model} · {protocol}{subtitle}"
            same = tuple(id(x) for recs in rows.values() for x in recs)  # a view over the records already drawn: no chart
            if same not in charted:
                charted.add(same)
                blocks.append(chart(f"{name}: score over all items against the {'budget' if by_budget else 'compression ratio'}",
                                    "budget (tokens kept per head)" if by_budget else "compression ratio (fraction of the context's KV removed)",
                                    "score (%)", points, logx=by_budget, xmin=None if by_budget else 0.0))
            blocks.append({"kind": "table", "id": f"{sid}-{len(blocks)}",
                           "title": f"{name} (click a setting for its items, a score for that column's items){delta_note(subtitle)}",
                           "columns": [{"name": "Setting"}, *[{"name": c, "num": True} for c in columns], {"name": "All items", "num": True},
                                       {"name": "Δ vs full", "num": True}, {"name": "CI low", "num": True}, {"name": "CI high", "num": True},
                                       {"name": "n", "num": True}],
                           "rows": table, "colItems": {str(k): v for k, v in col_items.items()}})
    if not blocks:
        return None
    return {"id": sid, "title": title, "blocks": blocks, "intro": intro}
