"""task=perplexity in the report (`python -m harness.report`): `perplexity.md`, per model and text (runs grouped by
harness.results.pair_key) the run's own table (`table`, also the run folder's perplexity_table.md): perplexity overall,
after the first compression and per position bucket, the ratio to full with its paired interval, peak cache, seconds.
Every number is the run's summary (task.py `summarize` and `paired_against_full`), read, never recomputed.
report.html's section: the curve (perplexity per position bucket, one line per setting; mean NLL as a variant) and the
same table, sortable. Nothing here imports torch."""

from __future__ import annotations

import math
from pathlib import Path

OUTPUT_FILES, OUTPUT_DIRS = ("perplexity.md",), ()
MIB = 2 ** 20


def _buckets(results: dict) -> list[str]:
    starts = {int(p) for res in results.values() for p in (res["summary"].get("by_position") or {})}
    return [str(p) for p in sorted(starts)]


def table(results: dict, model: str, chunk: int) -> str:
    """The settings side by side (markdown): perplexity overall and after the first compression, the ratio to
    full with its paired interval, the peak cache bytes, the seconds the reading took; then perplexity per
    position bucket (the bucket's first token)."""
    lines = [f"{model}, chunks of {chunk} tokens. Ratio: exp of the paired mean log-perplexity difference to full over "
             "(document, bucket) units, 95% bootstrap interval.", "",
             "| setting | tokens | perplexity | after first compression (from token) | ratio to full [95% CI] | peak cache MiB | seconds |",
             "|---|---:|---:|---:|---|---:|---:|"]
    done = {tag: res for tag, res in results.items() if res["summary"].get("main_score") is not None}
    for tag, res in done.items():
        s = res["summary"]
        vs = s.get("against_full")
        ratio = f"{vs['ppl_ratio']:.3f} [{math.exp(vs['low']):.3f}, {math.exp(vs['high']):.3f}]" if vs else "–"
        after = "–" if s.get("first_compression_at") is None else f"{s['perplexity_after_first_compression']:.3f} ({s['first_compression_at']})"
        lines.append(f"| {tag} | {s['tokens_scored']} | {s['perplexity']:.3f} | {after} | {ratio} | "
                     f"{s['peak_cache_bytes'] / MIB:.1f} | {s['seconds']:.0f} |")
    buckets = _buckets(done)
    if buckets:
        lines += ["", "Perplexity per position bucket (from token):", "", "| setting | " + " | ".join(buckets) + " |",
                  "|---|" + "---:|" * len(buckets)]
        for tag, res in done.items():
            by = res["summary"].get("by_position") or {}
            lines.append(f"| {tag} | " + " | ".join("–" if by.get(b) is None else f"{by[b]:.2f}" for b in buckets) + " |")
    return "\n".join(lines) + "\n"


def _groups(runs) -> list[list]:
    from harness.results import method_name, pair_key

    by_key: dict[str, list] = {}
    for run in runs:
        if isinstance(run.data.get("summary"), dict):
            by_key.setdefault(pair_key(run), []).append(run)
    out = []
    for members in by_key.values():
        members.sort(key=lambda r: (method_name(r) != "full", r.rel))
        out.append(members)
    return out


def _tag(run) -> str:
    return str(run.data.get("method_tag") or run.rel)


def _chunk(members) -> object:
    return members[0].data["summary"].get("chunk_size", (members[0].config.get("task") or {}).get("chunk_size", "?"))


def tables(runs, out, options):
    from harness.tables import Tables

    parts = []
    for members in _groups(runs):
        results = {_tag(r): {"summary": r.data["summary"]} for r in members}
        model = members[0].model.get("name", "?")
        parts.append(f"## Perplexity · {model} · {members[0].data['summary'].get('dataset', '?')}\n\n"
                     f"{table(results, model, _chunk(members))}\nRuns: {', '.join(r.rel for r in members)}.\n")
        for r in members:
            r.used_in.append("perplexity")
    if not parts:
        return Tables()
    text = "\n".join(parts)
    (Path(out) / "perplexity.md").write_text(text, encoding="utf-8")
    return Tables([("perplexity.md", text)])


def html_section(runs, page):
    from harness.page_blocks import chart, model_of, rounded, setting_label

    blocks = []
    for members in _groups(runs):
        model, summary = model_of(members[0]), members[0].data["summary"]
        results = {_tag(r): {"summary": r.data["summary"]} for r in members}
        buckets = _buckets(results)
        points, nll, rows = [], [], []
        for run in members:
            s, run_id = run.data["summary"], page.run_ids[run.rel]
            for b, v in (s.get("by_position") or {}).items():
                if v is not None:
                    base = {"line": _tag(run), "protocol": run.protocol, "x": int(b), "lo": None, "hi": None, "run": run_id, "full": False}
                    points.append({**base, "y": v})
                    nll.append({**base, "y": round(math.log(v), 4)})
            vs = s.get("against_full") or {}
            by = s.get("by_position") or {}
            rows.append({"run": run_id, "cells": [
                setting_label(run), s.get("perplexity"), s.get("perplexity_after_first_compression"), s.get("first_compression_at"),
                vs.get("ppl_ratio"), *(rounded(math.exp(vs[k]), 4) if k in vs else None for k in ("low", "high")), vs.get("units"),
                rounded((s.get("peak_cache_bytes") or 0) / MIB, 1), s.get("seconds"), *(by.get(b) for b in buckets)]})
        name = f"Perplexity · {model} · {summary.get('dataset', '?')} · chunks of {_chunk(members)}"
        ppl_chart = chart(f"{name}: perplexity per position bucket", "token position (the bucket's first token)", "perplexity", points)
        nll_chart = chart("", "", "", nll)
        ppl_chart["variants"] = {"perplexity": None, "mean NLL (nats)": {"series": nll_chart["series"], "hlines": nll_chart["hlines"]}}
        blocks.append(ppl_chart)
        blocks.append({"kind": "table", "id": f"perplexity-{len(blocks)}", "title": f"{name} (the runs' summaries)", "rows": rows,
                       "columns": [{"name": "Setting"}, *({"name": n, "num": True} for n in (
                           "Perplexity", "After first compression", "From token", "Ratio to full", "CI low", "CI high", "Units",
                           "Peak cache MiB", "Seconds")), *({"name": f"from {b}", "num": True} for b in buckets)]})
    if not blocks:
        return None
    return {"id": "perplexity", "title": "Perplexity under a bounded cache", "blocks": blocks,
            "intro": "Teacher-forced long text read through each setting's cache (StreamingLLM's evaluation): perplexity per "
                     "position bucket, one line per setting (the variant menu shows the mean NLL, its log). Ratio to full: exp of "
                     "the paired mean log-perplexity difference over (document, bucket) units, 95% bootstrap interval."}
