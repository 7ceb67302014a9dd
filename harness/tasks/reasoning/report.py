"""GSM8K, MATH500 and AIME25 tables: per dataset, model and protocol, every setting's accuracy, mean output length (new
tokens), mean decode seconds and mean peak cache bytes, with its compression mode (none, prefill only, prefill +
decode-time), and each setting minus `full` on the same problems (paired 95% bootstrap intervals, harness/stats.py) for
accuracy and output length. A run writes `<task>_table.md` beside its settings; `python -m harness.report` writes
`reasoning.md` in the table set from every collected run (runs grouped by harness.results.pair_key)."""

from __future__ import annotations

from pathlib import Path

from harness.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_mean_ci

OUTPUT_FILES, OUTPUT_DIRS = ("reasoning.md",), ()
TITLES = {"gsm8k": "GSM8K", "math500": "MATH500", "aime25": "AIME25"}
MIB = 1024 * 1024


def mode(rows: list[dict], is_full: bool) -> str:
    if is_full:
        return "none (full cache)"
    return "prefill + decode-time" if any(r.get("decode_rule") for r in rows) else "prefill only"


def _mean(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def paired_vs_full(rows: dict[str, list[dict]], reference: str, *, n_resamples: int = DEFAULT_RESAMPLES,
                   seed: int = DEFAULT_SEED) -> dict[str, dict[str, dict]]:
    """{tag: {"accuracy" (points), "new_tokens": {"delta", "low", "high", "n"}}}: per problem, the setting minus the full
    cache on the problems both answered."""
    ref = {r["index"]: r for r in rows[reference]}
    out = {}
    for tag, recs in rows.items():
        if tag == reference:
            continue
        both = [(r, ref[r["index"]]) for r in recs if r["index"] in ref]
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


def markdown(title: str, rows: dict[str, list[dict]], reference: str | None, notes: list[str], deltas: dict | None = None) -> str:
    deltas = deltas if deltas is not None else (paired_vs_full(rows, reference) if reference else {})
    lines = [f"## {title}", "",
             "| Setting | Compression | Accuracy % | minus full [95% CI] | New tokens | minus full [95% CI] | Decode s | Peak cache MiB | Problems |",
             "|---|---|---:|---|---:|---|---:|---:|---:|"]
    for tag, recs in rows.items():
        acc, peak = _mean(recs, "score"), _mean(recs, "peak_cache_bytes")
        d = deltas.get(tag, {})
        lines.append(f"| {tag} | {mode(recs, tag == reference)} | {_cell(None if acc is None else 100 * acc, '.1f')} | "
                     f"{_delta(d.get('accuracy'), 1)} | {_cell(_mean(recs, 'new_tokens'), '.1f')} | {_delta(d.get('new_tokens'), 1)} | "
                     f"{_cell(_mean(recs, 'decode_seconds'), '.2f')} | {_cell(None if peak is None else peak / MIB, '.2f')} | {len(recs)} |")
    if not reference:
        lines += ["", "No `full` setting in this run: no paired differences (add `full` to methods=[...])."]
    lines += ["", "Means per problem; peak cache: the largest cache while the answer was written (measured each step under "
              "decode-time compression; otherwise the bytes after prefill plus each generated token's)."] + notes + [""]
    return "\n".join(lines)


def tables(runs, out, options):
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
        deltas = paired_vs_full(rows, reference, n_resamples=options.resamples, seed=options.seed) if reference else {}
        model = members[0].model.get("name", "?")
        parts.append(markdown(f"{TITLES.get(task, task)} · {model} · {members[0].protocol}", rows, reference,
                              [f"Runs: {', '.join(r.rel for r in members)}."], deltas))
        for r in members:
            r.used_in.append("reasoning")
    if not parts:
        return Tables()
    text = "\n".join(parts)
    (Path(out) / "reasoning.md").write_text(text, encoding="utf-8")
    return Tables([("reasoning.md", text)])
