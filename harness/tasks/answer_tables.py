"""The tables of the tasks whose answers are long (reasoning: GSM8K, MATH500, AIME25; long_answers): per task, model and
protocol, every setting's accuracy, mean output length (new tokens), mean decode seconds and mean peak cache bytes, with
its compression mode (none, prefill only, prefill + decode-time), and each setting minus `full` on the same items (paired
95% bootstrap intervals, harness/stats.py) for accuracy and output length. A run writes `<task>_table.md` beside its
settings (`markdown`); `python -m harness.report` writes `<name>.md` in the table set from every collected run (`report`,
runs grouped by harness.results.pair_key), report.html its section (`html_section`, through field_tables' builder) and
the paired reports their strata (`pairing`)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_mean_ci
from harness.tasks import field_tables

MIB = 1024 * 1024
INTRO = ("Accuracy (%) per setting and compression mode (prefill only, or prefill + decode-time eviction), against the "
         "prefill budget; beside it the mean output length, decode seconds and the cache's peak while the answer was "
         "written. Band and CI: 95% bootstrap interval; Δ: paired difference of the accuracy to full on the same items.")


def mode(rows: list[dict], is_full: bool) -> str:
    if is_full:
        return "none (full cache)"
    return "prefill + decode-time" if any(r.get("decode_rule") for r in rows) else "prefill only"


def _mean(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def by_index(r: dict):
    return r["index"]


def paired_vs_full(rows: dict[str, list[dict]], reference: str, *, key: Callable[[dict], object] = by_index,
                   n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> dict[str, dict[str, dict]]:
    """{tag: {"accuracy" (points), "new_tokens": {"delta", "low", "high", "n"}}}: per item, the setting minus the full
    cache on the items both answered."""
    ref = {key(r): r for r in rows[reference]}
    out = {}
    for tag, recs in rows.items():
        if tag == reference:
            continue
        both = [(r, ref[key(r)]) for r in recs if key(r) in ref]
        out[tag] = {}
        for name, value in (("accuracy", lambda r: 100.0 * r["score"]), ("new_tokens", lambda r: float(r["new_tokens"]))):
            if both:
                ci = bootstrap_mean_ci([value(a) - value(b) for a, b in both], n_resamples=n_resamples, seed=seed)
                out[tag][name] = {"delta": round(ci.estimate, 2), "low": round(ci.low, 2), "high": round(ci.high, 2), "n": ci.n}
    return out


def _delta(d: dict | None, digits: int) -> str:
    return "–" if not d else f"{d['delta']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]"


def _cell(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def markdown(title: str, rows: dict[str, list[dict]], reference: str | None, notes: list[str], deltas: dict | None = None,
             noun: str = "Problems") -> str:
    deltas = deltas if deltas is not None else (paired_vs_full(rows, reference) if reference else {})
    lines = [f"## {title}", "",
             f"| Setting | Compression | Accuracy % | minus full [95% CI] | New tokens | minus full [95% CI] | Decode s | Peak cache MiB | {noun} |",
             "|---|---|---:|---|---:|---|---:|---:|---:|"]
    for tag, recs in rows.items():
        acc, peak = _mean(recs, "score"), _mean(recs, "peak_cache_bytes")
        d = deltas.get(tag, {})
        lines.append(f"| {tag} | {mode(recs, tag == reference)} | {_cell(None if acc is None else 100 * acc, '.1f')} | "
                     f"{_delta(d.get('accuracy'), 1)} | {_cell(_mean(recs, 'new_tokens'), '.1f')} | {_delta(d.get('new_tokens'), 1)} | "
                     f"{_cell(_mean(recs, 'decode_seconds'), '.2f')} | {_cell(None if peak is None else peak / MIB, '.2f')} | {len(recs)} |")
    if not reference:
        lines += ["", "No `full` setting in this run: no paired differences (add `full` to methods=[...])."]
    lines += ["", f"Means per {noun.lower()[:-1]}; peak cache: the largest cache while the answer was written (measured each step "
              "under decode-time compression; otherwise the bytes after prefill plus each generated token's)."] + notes + [""]
    return "\n".join(lines)


def report(runs, out, options, *, name: str, titles: dict[str, str], key: Callable[[dict], object] = by_index,
           noun: str = "Problems"):
    """The table set's `<name>.md`: per task and group of comparable runs (model, protocol, task settings), `markdown`."""
    from harness.results import method_name, pair_key
    from harness.tables import Tables

    groups: dict[tuple, list] = {}
    for run in runs:
        groups.setdefault((run.task, pair_key(run)), []).append(run)
    parts = []
    for (task, _), members in sorted(groups.items(), key=lambda kv: kv[0][0]):
        members.sort(key=lambda r: (method_name(r) != "full", r.rel))
        tag = {r.rel: str(r.data.get("method_tag") or r.rel) for r in members}
        rows = {tag[r.rel]: [x for x in r.data.get("rows") or [] if isinstance(x, dict)] for r in members}
        full = next((r for r in members if method_name(r) == "full"), None)
        reference = tag[full.rel] if full else None
        deltas = paired_vs_full(rows, reference, key=key, n_resamples=options.resamples, seed=options.seed) if reference else {}
        model = members[0].model.get("name", "?")
        parts.append(markdown(f"{titles.get(task, task)} · {model} · {members[0].protocol}", rows, reference,
                              [f"Runs: {', '.join(r.rel for r in members)}."], deltas, noun))
        for r in members:
            r.used_in.append(name)
    if not parts:
        return Tables()
    text = "\n".join(parts)
    (Path(out) / f"{name}.md").write_text(text, encoding="utf-8")
    return Tables([(f"{name}.md", text)])


def pairing(key: Callable[[dict], tuple], stratum: Callable[[dict], str] = lambda r: "accuracy", *, average: bool = False):
    """paired_deltas.md and the reuse gap: the items' accuracy (x 100), paired by item key, per stratum."""
    return field_tables.pairing(key, stratum, strict=False, average=average, digits=1)


def _mib(run, recs):
    peak = _mean(recs, "peak_cache_bytes")
    return None if peak is None else round(peak / MIB, 2)


def _rounded(name: str, digits: int):
    return lambda run, recs: None if (v := _mean(recs, name)) is None else round(v, digits)


def extra_columns():
    from harness.results import method_name

    return (({"name": "Compression"}, lambda run, recs: mode(recs, method_name(run) == "full")),
            ({"name": "New tokens", "num": True}, _rounded("new_tokens", 1)),
            ({"name": "Decode s", "num": True}, _rounded("decode_seconds", 2)),
            ({"name": "Peak cache MiB", "num": True}, _mib))


def html_section(runs, page, *, sid: str, title: str, titles: dict[str, str], key: Callable[[dict], tuple],
                 item_label: Callable[[dict], str], item_view: Callable[[dict], dict], columns: Callable[[list], list[str]] = lambda runs: [],
                 groups: Callable[[dict], tuple] = lambda r: ()) -> dict | None:
    """report.html's section: per task (a dataset), field_tables' chart (accuracy against the prefill budget, one line per
    method and compression mode, full as a horizontal line), its table with `extra_columns` and its per-item drill-down."""
    blocks = []
    for task in sorted({run.task for run in runs}):
        mine = [run for run in runs if run.task == task]
        part = field_tables.html_section(mine, page, sid=f"{sid}-{task}", title=titles.get(task, task),
                                         views=[("", lambda r: True, columns(mine), groups)], key=key, digits=1, strict=False,
                                         item_label=item_label, item_view=item_view, extra_columns=extra_columns(),
                                         ylabel="accuracy (%)", intro="")
        if part:
            blocks += part["blocks"]
    return {"id": sid, "title": title, "blocks": blocks, "intro": INTRO} if blocks else None
