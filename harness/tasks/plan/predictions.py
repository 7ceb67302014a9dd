"""The SnapKV paper's memory claims beside the plan's predictions (results/plan/README.md's tables).

    python -m harness.tasks.plan.predictions runs/paper/plan results/plan

Reads the plan runs of conf/experiment/paper_plan*.yaml under a sweep directory and writes `predictions.md` and
`predictions.json`: for LWM-Text-Chat-1M on 80 GB, the paper's longest prompt per (setting, batch) beside the planned
one under today's harness (sdpa / FlashAttention-2, logits of the last position only), eager attention, and
transformers 4.37's full-vocabulary logits; and, for the models of paper_plan_modern, which methods fit which GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 1 << 30
# (setting tag prefix, batch, the paper's statement, the longest prompt it implies fits, the shortest it says fails)
PAPER = [
    ("full", 1, "out of memory at ~33K (needle, batch 1)", None, 33_000),
    ("full", 2, "out of memory beyond 16K (batch 2)", 16_384, 32_768),
    ("snapkv_c2048", 2, "131K (batch 2, C=2048)", 131_072, None),
    ("snapkv_c1024", 1, "380K (379,538 tokens, batch 1, C=1024, W16, k5)", 379_538, None),
]
VARIANTS = [("plan", "today's harness (flash_attention_2 = sdpa path)", "flash_attention_2"),
            ("plan_hf437", "transformers 4.37: full-vocabulary logits, fp16 + fp32 upcast", "flash_attention_2"),
            ("plan_eager", "eager attention (scores materialised)", "eager")]


def _results(folder: Path) -> dict | None:
    path = folder / "results.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _longest(results: dict | None, prefix: str, batch: int, impl: str) -> int | None:
    if results is None:
        return None
    for s in results.get("search", []):
        if s["setting"].startswith(prefix) and s["batch_size"] == batch and s["attn_implementation"] == impl:
            return s["max_length"]
    return None


def _peak(results: dict | None, prefix: str, batch: int, impl: str, length: int) -> tuple[float | None, str | None]:
    for r in (results or {}).get("rows", []):
        if r["setting"].startswith(prefix) and r["batch_size"] == batch and r["attn_implementation"] == impl and r["length"] == length:
            return (round(r["peak_bytes"] / GIB, 2) if r.get("peak_bytes") else None), r.get("peak_phase")
    return None, None


def lwm_table(sweep: Path) -> tuple[list[str], list[dict]]:
    runs = {name: _results(sweep / "lwm-text-chat-1m" / name) for name, _, _ in VARIANTS}
    lines = ["| setting | batch | the paper | " + " | ".join(f"longest that fits: {label}" for _, label, _ in VARIANTS) + " |",
             "|---|---|---|" + "---|" * len(VARIANTS)]
    records = []
    for prefix, batch, claim, fits, fails in PAPER:
        found = {name: _longest(runs[name], prefix, batch, impl) for name, _, impl in VARIANTS}
        cells = [("n/a" if v is None else f"{v:,}") for v in found.values()]
        lines.append(f"| {prefix} | {batch} | {claim} | " + " | ".join(cells) + " |")
        records.append({"setting": prefix, "batch_size": batch, "paper": claim, "paper_fits": fits, "paper_fails": fails,
                        **{f"max_length_{k}": v for k, v in found.items()}})
    return lines, records


def modern_table(sweep: Path) -> tuple[list[str], list[dict]]:
    lines = ["| model | setting | length | planned peak (GiB) | fits on 24 / 48 / 80 / 140 GiB | peak phase |", "|---|---|---|---|---|---|"]
    records = []
    for folder in sorted(sweep.glob("*/plan_modern")):
        results = _results(folder)
        for r in sorted((results or {}).get("rows", []), key=lambda r: (r["setting"], r["length"])):
            if r.get("error"):
                lines.append(f"| {folder.parent.name} | {r['setting']} | {r['length']:,} | error: {r['error'][:80]} | | |")
                continue
            fits = r.get("fits_on") or {}
            marks = " / ".join("yes" if fits.get(k) else "no" for k in sorted(fits, key=float))
            lines.append(f"| {folder.parent.name} | {r['setting']} | {r['length']:,} | {r['peak_bytes'] / GIB:.2f} | {marks} | {r['peak_phase']} |")
            records.append({"model": folder.parent.name, "setting": r["setting"], "length": r["length"],
                            "peak_bytes": r["peak_bytes"], "fits_on": fits, "peak_phase": r["peak_phase"]})
    return lines, records


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m harness.tasks.plan.predictions <sweep dir of the paper_plan runs> <output dir>", file=sys.stderr)
        return 2
    sweep, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    lwm_lines, lwm = lwm_table(sweep)
    modern_lines, modern = modern_table(sweep)
    text = ["# The paper's memory claims as predictions (task=plan)", "",
            "Planned on a CPU under fake tensors (docs/planning.md): LWM-Text-Chat-1M's architecture in fp16, an 80 GiB card "
            "less a 2 GiB reserve, doubling from 16K then bisection at 2,048 tokens, one decode step.", "", *lwm_lines, "",
            "## Models people run today: which methods fit which GPU (batch 1, bf16, sdpa, budget 1024)", "", *modern_lines, ""]
    (out / "predictions.md").write_text("\n".join(text), encoding="utf-8")
    (out / "predictions.json").write_text(json.dumps({"lwm": lwm, "modern": modern}, indent=1), encoding="utf-8")
    print(f"wrote {out / 'predictions.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
