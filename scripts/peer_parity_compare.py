"""Peer parity, the comparison: our kept positions and tokens against kvpress's, as a markdown report.

Run with the harness's venv after both sides (`scripts/peer_parity.sh` does it all):

    .venv/bin/python scripts/peer_parity_compare.py --work DIR [DIR ...] --out results/cpu/peer_parity.md

Reads DIR/cells.pt (cells, method table), DIR/ours.pt and DIR/theirs.pt of every work folder given (the
runs of several folders are merged: e.g. one folder per batch of methods). For every run (cell x protocol
x method x ratio) it says whether the kept prompt positions are identical in every compressed layer and
KV head, or the first difference (layer, head, position, and which side kept it), and whether the
generated tokens are identical, or the first index where they differ. It prints one line per method and
writes the report.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from metrics.needle import score_needle_response  # noqa: E402

PROTOCOLS = ("query_aware", "query_agnostic")
PROTOCOL_SHORT = {"query_aware": "aware", "query_agnostic": "agnostic"}


def load(work: Path, name: str) -> dict:
    path = work / name
    return torch.load(path, weights_only=True) if path.exists() else {}


def kept_difference(ours: dict, theirs: dict, compressed_only: bool = False) -> str | None:
    """None when every layer holds the same positions per head in both; else the first difference (lowest
    layer, then head, then position). `compressed_only`: only the layers ours compressed (kvpress as
    shipped also cuts Gemma's sliding-window layers, which ours keeps whole by design)."""
    for layer in sorted(ours):
        a, b = ours[layer], theirs.get(layer)
        if a is None and (b is None or compressed_only):
            continue
        if a is None or b is None:
            return f"layer {layer}: kept whole by {'ours' if a is None else 'kvpress'}"
        if len(a) != len(b):
            return f"layer {layer}: ours {len(a)} heads, kvpress {len(b)}"
        for head, (x, y) in enumerate(zip(a, b)):
            x, y = x[x >= 0], y[y >= 0]  # -1: padding of a per-head budget (ragged layers)
            if torch.equal(x, y):
                continue
            sx, sy = set(x.tolist()), set(y.tolist())
            only = sorted(sx ^ sy)
            if not only:
                return f"layer {layer} head {head}: same set, different order"
            pos = only[0]
            side = "ours only" if pos in sx else "kvpress only"
            return f"layer {layer} head {head} position {pos} ({side}; kept: ours {len(x)}, kvpress {len(y)})"
    return None


def token_difference(a: list[int], b: list[int]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i}: ours {x}, kvpress {y}"
    if len(a) != len(b):
        return f"token {min(len(a), len(b))}: {'ours' if len(a) < len(b) else 'kvpress'} stopped (ours {len(a)}, kvpress {len(b)} tokens)"
    return None


class Report:
    def __init__(self, works: list[Path]):
        self.cells, self.pairs, self.models = {}, {}, {}
        self.ours, self.theirs = {}, {}
        self.meta = {"max_new_tokens": None, "ratios": set(), "kvpress": {}}
        self.kvzip_tokenizer = {}  # model -> KVzipPress's tokenizer check (peer_parity_kvpress.py)
        for work in works:
            cells = load(work, "cells.pt")
            if not cells:
                raise SystemExit(f"error: {work}/cells.pt is missing; run scripts/peer_parity.sh")
            self.cells.update(cells["cells"])
            self.models.update(cells["models"])
            for name, pair in cells["pairs"].items():
                if name not in self.pairs or "status" in self.pairs[name]:
                    self.pairs[name] = pair
            self.meta["max_new_tokens"] = cells["max_new_tokens"]
            self.meta["ratios"].update(cells["ratios"])
            self.meta["kvpress_ratio"] = {**self.meta.get("kvpress_ratio", {}), **cells["kvpress_ratio"]}
            self.ours.update(load(work, "ours.pt").get("runs", {}))
            theirs = load(work, "theirs.pt")
            self.theirs.update(theirs.get("runs", {}))
            self.kvzip_tokenizer.update(theirs.get("kvzip_tokenizer", {}))
            self.meta["kvpress"].update({k: theirs[k] for k in ("kvpress_version", "transformers_version", "torch_version") if k in theirs})
        self.ratios = sorted(self.meta["ratios"], reverse=True)
        self._tokenizers = {}

    def tokens_by_limit(self) -> dict:
        """max_new_tokens -> the cells decoded with it."""
        out = defaultdict(list)
        for key, cell in self.cells.items():
            out[cell.get("max_new_tokens", self.meta["max_new_tokens"])].append(f"`{key}`")
        return dict(out)

    def compare(self, key: str, variant: str) -> tuple[str, str] | None:
        """(kept verdict, token verdict) for one run; None when a side has no record of it."""
        ours, theirs = self.ours.get(key), self.theirs.get(f"{key}|{variant}")
        if ours is None or theirs is None:
            return None
        if "error" in ours and "error" in theirs:
            return f"both refuse: ours {ours['error']}; kvpress {theirs['error']}", "both refuse"
        if "error" in ours:
            return f"ours failed: {ours['error']}", "ours failed"
        if "error" in theirs:
            return f"kvpress failed: {theirs['error']}", "kvpress failed"
        kept = kept_difference(ours["kept"], theirs["kept"], compressed_only=variant == "kvpress_shipped") or "="
        if "decode_error" in theirs:
            return kept, f"kvpress failed: {theirs['decode_error']}"
        return kept, token_difference(ours["tokens"], theirs["tokens"]) or "="

    def run_keys(self, name: str, model_prefix: str = "") -> list[tuple[str, str, str, float]]:
        keys = []
        for cell in self.cells:
            if not cell.startswith(model_prefix):
                continue
            for protocol in PROTOCOLS:
                for ratio in self.ratios:
                    keys.append((f"{cell}|{protocol}|{name}|{float(ratio)}", cell, protocol, ratio))
        return keys

    def answer(self, cell: str, tokens) -> str:
        model = self.cells[cell]["model"]
        if model not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[model] = AutoTokenizer.from_pretrained(self.models[model]["folder"])
        return self._tokenizers[model].decode(tokens, skip_special_tokens=True).strip()

    def score(self, cell: str, tokens) -> float:
        return score_needle_response(self.answer(cell, tokens), self.cells[cell]["answer"])["score"]


def note_of(name: str, pair: dict) -> str:
    """The method table's current note (scripts/peer_parity_ours.py PAIRS), else the one recorded in cells.pt."""
    try:
        from peer_parity_ours import PAIRS
    except ImportError:
        return pair.get("note", "")
    return PAIRS[name].note if name in PAIRS else pair.get("note", "")


def no_counterpart_line() -> str:
    """One line: our registered methods without a kvpress counterpart (scripts/peer_parity_ours.py NO_COUNTERPART)."""
    try:
        from peer_parity_ours import NO_COUNTERPART
    except ImportError:
        return ""
    return "; ".join(f"`{name}` ({why})" for name, why in NO_COUNTERPART.items()) + "."


def setting_text(pair: dict) -> str:
    options = " ".join(f"{k}={v}" for k, v in pair["ours"].items())
    tags = sorted(set(pair.get("tags", {}).values()))
    return f"`ratio=<r> {options}`".replace("  ", " ") + (f" (tags {', '.join(f'`{t}`' for t in tags)})" if tags else "")


def default_differences(name: str, options: dict) -> str:
    """Our config's defaults (conf/method/<name>.yaml) where they differ from the kvpress-equal options."""
    from harness.settings import compose_settings
    from harness.errors import HarnessError

    try:
        (_, cfg), = compose_settings([{"name": name}], [])
    except HarnessError as exc:
        return f"({exc})"
    diff = [f"{k}={cfg.method[k]}" for k, v in options.items() if k in cfg.method and cfg.method[k] != v]
    return "`" + " ".join(diff) + "`" if diff else "same"


def press_text(spec: dict) -> str:
    kwargs = ", ".join(f"{k}={v}" for k, v in spec.get("kwargs", {}).items())
    inner = press_text(spec["press"]) if "press" in spec else ""
    args = ", ".join(a for a in (inner, kwargs) if a)
    return f"{spec['class']}({args})"


def verdict(results: list[tuple[str, tuple[str, str] | None]], column: int, what: str, detail: str = "") -> str:
    """`<what> identical (n/n runs)`, or how many runs differ (with the first difference) and failed."""
    done = [(k, r[column]) for k, r in results if r is not None]
    if not done:
        return "not run"
    failed = [(k, v) for k, v in done if v.startswith(("ours failed", "kvpress failed", "both refuse"))]
    bad = [(k, v) for k, v in done if v != "=" and (k, v) not in failed]
    if not bad and not failed:
        return f"{what} identical ({detail}{len(done)}/{len(done)} runs)"

    def where(key: str) -> str:
        cell, protocol, _, ratio = key.split("|")
        return f"{cell} {PROTOCOL_SHORT[protocol]} ratio {ratio}"

    parts = [f"identical in {len(done) - len(bad) - len(failed)}/{len(done)} runs"]
    if bad:
        parts.append(f"differ in {len(bad)}; first: {where(bad[0][0])}: {bad[0][1]}")
    if failed:
        parts.append(f"not compared in {len(failed)} (first: {where(failed[0][0])}: {failed[0][1]})")
    return "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, nargs="+", required=True)
    ap.add_argument("--out", type=Path, default=None, help="markdown report (default: print the summary only)")
    ap.add_argument("--command", nargs="+", default=["bash scripts/peer_parity.sh"], help="the command(s) recorded in the report")
    ap.add_argument("--note", default="", help="a paragraph printed under the header (e.g. what of the grid did not run)")
    args = ap.parse_args(argv)
    rep = Report(args.work)

    lines = ["# Peer parity: our methods against kvpress 0.5.5 on identical token ids", ""]
    kv = rep.meta["kvpress"]
    import transformers

    lines += [
        f"Written by {' + '.join(f'`{c}`' for c in args.command)} on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. "
        f"Ours: torch {torch.__version__}, "
        f"transformers {transformers.__version__}. kvpress {kv.get('kvpress_version', '?')} with its own transformers "
        f"{kv.get('transformers_version', '?')} and torch {kv.get('torch_version', '?')} (a separate venv, `.venv-kvpress`). CPU, float32, sdpa "
        "(eager for presses that read attention weights, on both sides).",
        "",
        "- **Ids**: our needle prompt code (`harness/tasks/needle/prompt.py`) builds every cell once; both sides run exactly "
        "those ids. Cells: " + ", ".join(f"`{c}`" for c in rep.cells) + " (model/length/depth; SmolLM2 with its chat "
        "template, Gemma 3 270M with the completion prompt).",
        "- **Protocols**: query-aware (the whole prompt is compressed) and query-agnostic (the context is compressed, the "
        "question is prefilled after it at its true positions, as kvpress's pipeline does).",
        "- **Budgets**: our `ratio` (fraction kept) " + ", ".join(f"{r:g}" for r in rep.ratios) + " = kvpress `compression_ratio` "
        + ", ".join(f"{rep.meta['kvpress_ratio'][str(r)]:g}" for r in rep.ratios) + ".",
        "- **Decoding**: greedy, stopping at the model's EOS ids, on both sides, at most "
        + ", ".join(f"{n} tokens ({', '.join(cs)})" for n, cs in rep.tokens_by_limit().items()) + ".",
        "- **Kept positions**: ours from the engine (`Outcome.kept`, per layer and head); kvpress's recovered from the cache "
        "each press leaves (its compressed keys matched bit for bit against the layer's full keys, per KV head; a masked "
        "press's masked entries removed). Compared in every layer our method compressed, head by head.",
        "- **Driving kvpress**: one prefill per cell and protocol; on every hooked layer each press's own `forward_hook` "
        "runs in turn on the full layer (docs/peer_parity.md). Checked against each press run alone as shipped "
        "(`with press(model):`): see the last section.",
        "",
        *([args.note, ""] if args.note else []),
        "A cell of the per-run tables reads `kept / tokens`: `=` identical; otherwise the first difference.",
        "",
        "## Summary",
        "",
        "| method | our setting equal to kvpress's | our default, where it differs | kvpress press | kept positions (every layer, every KV head) | generated tokens | note |",
        "|---|---|---|---|---|---|---|",
    ]
    printed = []
    for name, pair in rep.pairs.items():
        if "status" in pair:
            lines.append(f"| {name} | {pair['status']} | - | {press_text(pair['kvpress'])} | - | - | {note_of(name, pair)} |")
            printed.append(f"{name}: {pair['status']}")
            continue
        results = [(k, rep.compare(k, "kvpress")) for k, *_ in rep.run_keys(name)]
        kept_v, tok_v = verdict(results, 0, "kept positions", "per layer and head, "), verdict(results, 1, "generated tokens")
        lines.append(f"| {name} | {setting_text(pair)} | {default_differences(name, pair['ours'])} | {press_text(pair['kvpress'])} | "
                     f"{kept_v} | {tok_v} | {note_of(name, pair)} |")
        printed.append(f"{name}: {kept_v}; {tok_v}")

    lines += ["", f"Not compared: {no_counterpart_line()}"] if no_counterpart_line() else []
    for model, check in rep.kvzip_tokenizer.items():
        if "error" in check:
            verdict_text = f"could not be loaded ({check['error']})"
        else:
            same = all(check["same"].values())
            verdict_text = ("gives the same chat-template prefix, suffix and replay prompts as ours" if same else
                            "differs from ours in " + ", ".join(k for k, v in check["same"].items() if not v))
        lines += ["", f"KVzipPress's tokenizer on {model} (loaded from `model.config.name_or_path`, the weight folder "
                      f"`{check['folder']}`, which holds the harness's tokenizer files): {verdict_text}."]

    lines += ["", "## Per run", ""]
    header = "| method | cell | " + " | ".join(f"{PROTOCOL_SHORT[p]} r{r:g}" for p in PROTOCOLS for r in rep.ratios) + " |"
    lines += [header, "|---|---|" + "---|" * (len(PROTOCOLS) * len(rep.ratios))]
    for name, pair in rep.pairs.items():
        if "status" in pair:
            continue
        by_cell = defaultdict(list)
        for key, cell, protocol, ratio in rep.run_keys(name):
            r = rep.compare(key, "kvpress")
            by_cell[cell].append("not run" if r is None else f"{r[0]} / {r[1]}")
        for cell, entries in by_cell.items():
            if cell.count("/") > 2 and set(entries) == {"not run"}:  # a labelled cell (--system-prompt) other methods skipped
                continue
            lines.append(f"| {name} | {cell} | " + " | ".join(entries) + " |")

    gemma_cells = [c for c in rep.cells if rep.cells[c]["model"].startswith("gemma")]
    if gemma_cells:
        lines += [
            "", "## Gemma 3 270M: kvpress's Gemma 3 rule vs kvpress as shipped", "",
            "kvpress compresses only the full-attention layers of `Gemma3ForConditionalGeneration`; on the text-only "
            "`Gemma3ForCausalLM` it hooks every layer and also cuts the sliding-window ones. The tables above compare ours "
            "with kvpress's own rule extended to the text-only class (hooks on the full-attention layers only). Here kvpress "
            "as shipped runs beside it: kept positions on the full-attention layers, tokens, and the needle score "
            "(keyword recall, metrics/needle.py) of each answer.", "",
            "| method | cell | protocol | ratio | ours vs kvpress rule (kept / tokens) | kvpress as shipped vs ours (kept on full layers / tokens) | layers kvpress as shipped cut | needle score: ours / kvpress rule / as shipped |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, pair in rep.pairs.items():
            if "status" in pair:
                continue
            for cell in gemma_cells:
                for protocol in PROTOCOLS:
                    for ratio in rep.ratios:
                        key = f"{cell}|{protocol}|{name}|{float(ratio)}"
                        rule, shipped = rep.compare(key, "kvpress"), rep.compare(key, "kvpress_shipped")
                        ship_rec = rep.theirs.get(f"{key}|kvpress_shipped", {})
                        cut = sum(1 for v in ship_rec.get("kept", {}).values() if v is not None)
                        scores = []
                        for rec in (rep.ours.get(key, {}), rep.theirs.get(f"{key}|kvpress", {}), ship_rec):
                            scores.append(f"{rep.score(cell, rec['tokens']):.2f}" if rec.get("tokens") is not None else "-")
                        fmt = lambda r: "not run" if r is None else f"{r[0]} / {r[1]}"  # noqa: E731
                        lines.append(f"| {name} | {cell} | {PROTOCOL_SHORT[protocol]} | {ratio:g} | {fmt(rule)} | {fmt(shipped)} | "
                                     f"{cut if ship_rec else '-'} | {' / '.join(scores)} |")

    hooks = [k.rsplit("|", 1)[0] for k in rep.theirs if k.endswith("|kvpress_hooks")]
    if hooks:
        same = sum(1 for k in hooks if _same_record(rep.theirs[f"{k}|kvpress_hooks"], rep.theirs.get(f"{k}|kvpress")))
        cells = sorted({f"{k.split('|')[0]} {PROTOCOL_SHORT[k.split('|')[1]]}" for k in hooks})
        lines += ["", "## The shared kvpress prefill against each press as shipped", "",
                  f"On {', '.join(f'`{c}`' for c in cells)}, every press also ran alone through its own context manager "
                  f"(`with press(model):` around its own prefill, as kvpress ships it): kept positions and tokens equal "
                  f"the shared prefill's in {same} of {len(hooks)} runs."]
        for k in hooks:
            if not _same_record(rep.theirs[f"{k}|kvpress_hooks"], rep.theirs.get(f"{k}|kvpress")):
                lines.append(f"- differs: `{k}`")
    lines.append("")
    text = "\n".join(lines)
    for line in printed:
        print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"report -> {args.out}")
    return 0


def _same_record(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None or set(a) != set(b):
        return False
    if a.get("tokens") != b.get("tokens") or a.get("error") != b.get("error") or a.get("decode_error") != b.get("decode_error"):
        return False
    if "kept" not in a:
        return True
    return kept_difference(a["kept"], b["kept"]) is None and kept_difference(b["kept"], a["kept"]) is None


if __name__ == "__main__":
    sys.exit(main())
