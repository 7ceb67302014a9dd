"""Peer parity, our side: needle token ids from our prompt code, our methods through our engine.

Run with the harness's venv (`.venv/bin/python scripts/peer_parity_ours.py --work DIR`); the driver is
`scripts/peer_parity.sh`. It writes `DIR/ours.pt` holding everything the kvpress side needs and nothing
it has to import from us: per cell the token ids, where the question starts, the model's weight folder
(the harness's dequantized copy), the EOS ids and the number of tokens to decode; the method table
(our setting and the kvpress press of each method); and per run (cell x protocol x method x ratio) our
kept prompt positions per layer and head and our generated tokens.

The method table (`PAIRS`) is the one place that says which of our options equals which kvpress press:
one line per method. A method runs only if it is registered in `harness.methods.METHODS` when the
script runs; otherwise it is recorded as "not registered here".
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.settings import compose_settings, override_value  # noqa: E402
from harness.errors import HarnessError  # noqa: E402
from harness.methods import METHODS, build_method  # noqa: E402
from harness.methods.kvzip import FIRST_PROMPT, LATER_PROMPT, chat_prefix_and_suffix  # noqa: E402
from harness.models import load_model  # noqa: E402
from harness.generation.generate import generate_settings  # noqa: E402
from harness.generation.prompt import Outcome, Prompt
from harness.tasks.needle.task import haystack_files  # noqa: E402
from harness.tasks.needle.prompt import build_cell, prompt_parts  # noqa: E402

log = logging.getLogger("peer_parity")

# kvpress's SnapKVPress with its defaults (window 64, kernel 5; average pooling and the group mean are
# fixed in its code): the scorer of the wrapping presses below.
SNAPKV_PRESS = {"class": "SnapKVPress", "kwargs": {"window_size": 64, "kernel_size": 5}}
SNAPKV_EQUAL = {"window_size": 64, "kernel_size": 5, "pooling": "avgpool", "gqa": "mean"}
# The same scorer inside our wrapping methods (adakv, criticalkv, chunkkv name its options scorer_*).
SNAPKV_SCORER = {"scorer": "snapkv", "window_size": 64, "scorer_kernel_size": 5, "scorer_pooling": "avgpool", "gqa": "mean"}


@dataclass
class Pair:
    """Our setting that equals a kvpress press: `ours` are our method's options (besides the ratio),
    `kvpress` the press (class, constructor kwargs, the inner press of a wrapper). `eager`: the press
    reads the model's attention weights, so both sides run with attn_implementation=eager. `note`: where
    our default deliberately differs, or a known, named difference."""

    ours: dict
    kvpress: dict
    eager: bool = False
    note: str = ""


KVZIP_NOTE = ("the chat template's prefix that the replay skips: kvpress skips as many leading positions as the "
              "template's prefix for a bare user message has tokens (24 on SmolLM2, its default system prompt) whatever "
              "the prompt holds: our option template_prefix=always (shown). Our default, template_prefix=if_present, "
              "skips them only where the prompt starts with those ids (our needle prompt has its own system message, so "
              "it replays from position 0). kvpress masks the pruned keys (a fake key per head at decoding), ours removes "
              "them. Both refuse Gemma 3 (sliding-window layers)")

# our registry name -> the pair. One line per method.
PAIRS: dict[str, Pair] = {
    "snapkv": Pair(SNAPKV_EQUAL, SNAPKV_PRESS,
                   note="our default is the official SnapKV (W32, k7, max-pool, gqa=expand: one selection per query head); "
                        "kvpress's SnapKV is the option shown (mean vote = our sum / 64, pooled per query head, then the group mean)"),
    "streamingllm": Pair({"variant": "paper", "sink_tokens": 4, "gqa": "mean"}, {"class": "StreamingLLMPress", "kwargs": {"n_sink": 4}}),
    "pyramidkv": Pair({**SNAPKV_EQUAL, "beta": 20}, {"class": "PyramidKVPress", "kwargs": {"window_size": 64, "kernel_size": 5, "beta": 20}},
                      note="layer budgets: ours follow KVCache-Factory's integer rule (no compression below the budget, uniform "
                           "below 2(C-W), exact total); kvpress uses C = W + L(1-r) in floats, rounds, and falls back to SnapKV "
                           "unless L >= max >= min >= W (no kvpress-rule option in ours: a named difference). kvpress's own "
                           "decoding fails wherever several new tokens meet layers of different lengths (the question after "
                           "compression; Gemma 3's sliding layers): one mask, sized by the first layer, is shared by all"),
    "tova": Pair({"window_size": 1, "gqa": "mean"}, {"class": "TOVAPress", "kwargs": {}}),
    "knorm": Pair({"window_size": 0, "gqa": "mean"}, {"class": "KnormPress", "kwargs": {}}),
    "expected_attention": Pair({"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0,
                                "window_size": 0, "gqa": "mean"},
                               {"class": "ExpectedAttentionPress",
                                "kwargs": {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0}},
                               note="kvpress's press cannot run on Gemma 3 (it calls the rotary embedding without the layer type "
                                    "that transformers 5.x's Gemma 3 needs); ours runs there"),
    "keydiff": Pair({"window_size": 0, "gqa": "mean"}, {"class": "KeyDiffPress", "kwargs": {}}),
    "lagkv": Pair({"n_sink": 4, "lag_size": 128, "cross_scoring": False, "window_size": 0, "gqa": "mean"},
                  {"class": "LagKVPress", "kwargs": {"n_sink": 4, "lag_size": 128, "cross_scoring": False}}),
    "observed_attention": Pair({"window_size": 0, "gqa": "mean"}, {"class": "ObservedAttentionPress", "kwargs": {}}, eager=True,
                               note="kvpress's H2O-like press (mean attention received over the queries that see a position); "
                                    "not our `h2o` (the paper's heavy hitters + recent window)"),
    "criticalkv": Pair({**SNAPKV_SCORER, "epsilon": 1e-4, "first_stage_ratio": 0.5},
                       {"class": "CriticalKVPress", "kwargs": {"epsilon": 1e-4, "first_stage_ratio": 0.5}, "press": SNAPKV_PRESS}),
    "chunkkv": Pair({"chunk_length": 20, **SNAPKV_SCORER},
                    {"class": "ChunkKVPress", "kwargs": {"chunk_length": 20}, "press": SNAPKV_PRESS}),
    "adakv": Pair({**SNAPKV_SCORER, "safeguard": 0.2, "allocation": "kvpress"},
                  {"class": "AdaKVPress", "kwargs": {"alpha_safeguard": 0.2}, "press": SNAPKV_PRESS}),
    # KVzipPress scores after the prefill (its own context manager replays the context), so the kvpress side runs it
    # alone, as shipped; it builds the replay prompts with the tokenizer it loads from the model folder, which holds
    # the harness's tokenizer files (the same ids as ours: checked by peer_parity_kvpress.py before it runs).
    "kvzip": Pair({"n_sink": 4, "chunk_size": 2048, "layerwise": False, "kvzip_plus_normalization": False, "template_prefix": "always"},
                  {"class": "KVzipPress", "kwargs": {"n_sink": 4, "chunk_size": 2048, "layerwise": False,
                                                     "kvzip_plus_normalization": False}},
                  note=KVZIP_NOTE),
}

# Our registered methods that have no kvpress 0.5.5 counterpart: named in the report, not run.
NO_COUNTERPART = {
    "cake": "kvpress 0.5.5 has no CAKE press",
    "h2o": "kvpress 0.5.5 has no H2O press; its H2O-like ObservedAttentionPress is the `observed_attention` row",
    "full": "no compression",
}

# The needle prompts: SmolLM2 with its chat template, Gemma 3 270M (a base model) with the completion prompt.
MODELS = {
    "smollm2-135m": ["task=needle", "task.prompt_style=chat", "model.dtype=float32"],  # kvpress's side loads float32
    "gemma3-270m": ["task=needle", "task.prompt_style=completion", "model.dtype=float32"],
}


@dataclass
class Cell:
    model: str
    length: int
    depth: float
    label: str = ""  # a prompt that differs from the needle task's own (--system-prompt): part of the cell's key


@dataclass
class Plan:
    cells: list[Cell]
    ratios: list[float]
    methods: list[str]
    max_new_tokens: int
    protocols: list[bool] = field(default_factory=lambda: [True, False])


def kvpress_ratio(ratio: float) -> float:
    """Our kept fraction -> kvpress's compression_ratio (the fraction removed)."""
    return round(1.0 - ratio, 10)


def our_entry(name: str, ratio: float) -> dict:
    return {"name": name, "ratio": ratio, **PAIRS[name].ours}


def compose_pairs(model: str, methods: list[str], ratios: list[float], eager: bool, extra: list[str]) -> tuple[object, dict, dict]:
    """The base config of `model` and, per (method, ratio), our setting (tag, method object), composed as
    `python -m harness model=<model> method=<name> method.ratio=<r> method.<option>=...` composes it.
    Methods whose options our config lacks are returned in `problems` with the one-line reason."""
    base = [f"model={model}", *MODELS[model], *extra] + (["model.attn_implementation=eager"] if eager else [])
    settings, problems = {}, {}
    cfg = None
    for name in methods:
        for ratio in ratios:
            try:
                (tag, scfg), = compose_settings([our_entry(name, ratio)], base)
                method = build_method(scfg.method)
            except HarnessError as exc:
                problems[name] = str(exc)
                break
            cfg = scfg
            settings[(name, ratio)] = (tag, method)
    if cfg is None:
        (_, cfg), = compose_settings([{"name": "full"}], base)
    return cfg, settings, problems


def haystack_ids(task, tokenizer) -> list[int]:
    """The needle task's haystack as token ids, exactly as harness/tasks/needle/task.py builds it."""
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in haystack_files(task))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def kept_per_head(positions) -> list[torch.Tensor] | None:
    """One layer's kept prompt positions (batch row 0) as one ascending int64 tensor per head (padding
    dropped); None: kept whole."""
    if positions is None:
        return None
    if isinstance(positions, torch.Tensor):  # per-head budgets pad a head's row with -1 past its count
        return [row[row >= 0].to(torch.int64).sort().values.cpu() for row in positions[0]]
    if isinstance(positions, (list, tuple)):  # a ragged layer: one tensor per head
        return [torch.as_tensor(p).reshape(-1).to(torch.int64).sort().values.cpu() for p in positions]
    raise TypeError(f"unexpected kept-positions type {type(positions).__name__}")


def prepare_model(model: str, cells: list[Cell], plan: Plan, out: dict, extra: list[str]) -> dict:
    """Compose our settings of `model` (sdpa, and eager for the methods that read attention weights) and
    build its cells' token ids. Returns {eager: (loaded-model config, settings)}."""
    groups = {}
    for eager in (False, True):
        names = [n for n in plan.methods if PAIRS[n].eager == eager]
        if not names:
            continue
        cfg, settings, problems = compose_pairs(model, names, plan.ratios, eager, extra)
        for name, reason in problems.items():
            out["pairs"][name]["status"] = f"our options do not match the table: {reason}"
            log.warning("%s: %s", name, reason)
        for (name, ratio), (tag, _) in settings.items():
            out["pairs"][name].setdefault("tags", {})[str(ratio)] = tag
        if settings:
            groups[eager] = (cfg, settings)
    if not groups:
        return groups
    cfg = next(iter(groups.values()))[0]
    loaded = load_model(cfg.model)
    out["models"][model] = {"folder": loaded.info.get("location"), "eos_token_ids": list(loaded.eos_token_ids),
                            "num_layers": loaded.model.config.num_hidden_layers}
    if "kvzip" in plan.methods:  # our replay ids: the kvpress side checks that KVzipPress's tokenizer gives the same
        prefix, suffix = chat_prefix_and_suffix(loaded.tokenizer)
        encode = lambda text: loaded.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        out["models"][model]["kvzip_ids"] = {"prefix": prefix, "suffix": suffix, "first": encode(FIRST_PROMPT),
                                             "later": encode(LATER_PROMPT)}
    parts = prompt_parts(cfg.task, loaded)
    hay = haystack_ids(cfg.task, loaded.tokenizer)
    for cell in cells:
        passes = math.ceil(cell.length / len(hay))
        built = build_cell(hay * passes, parts, cell.length, cell.depth)
        out["cells"][cell_key(cell)] = {"model": model, "length": cell.length, "depth": cell.depth, "ids": list(built.ids),
                                        "question_start": built.question_start, "needle": [built.needle_start, built.needle_end],
                                        "answer": str(cfg.task.answer), "prompt_style": str(cfg.task.prompt_style),
                                        "system_prompt": str(cfg.task.system_prompt),
                                        "max_new_tokens": plan.max_new_tokens}
    return groups


def cell_key(cell: Cell) -> str:
    return f"{cell.model}/{cell.length}/{cell.depth:g}" + (f"/{cell.label}" if cell.label else "")


def run_model(model: str, cells: list[Cell], plan: Plan, groups: dict, out: dict, save) -> None:
    """Every cell x protocol of `model`: one prefill for all our settings (per attention implementation)."""
    for eager, (cfg, settings) in groups.items():
        loaded = load_model(cfg.model)
        attn = str(cfg.model.attn_implementation)
        for cell in cells:
            key = cell_key(cell)
            c = out["cells"][key]
            prompt = Prompt(c["ids"], c["question_start"], {"needle": tuple(c["needle"])})
            for query_aware in plan.protocols:
                protocol = "query_aware" if query_aware else "query_agnostic"
                runs = [(f"{name}@{ratio}", method) for (name, ratio), (tag, method) in settings.items()]
                start = time.perf_counter()
                try:
                    outcomes = generate_settings(loaded, runs, prompt, query_aware=query_aware,
                                                 max_new_tokens=plan.max_new_tokens, eos_token_ids=loaded.eos_token_ids)
                except HarnessError as exc:  # a method that refuses this model (kvzip: sliding-window layers)
                    outcomes = {run_key: Outcome(None, {}, exc) for run_key, _ in runs}
                log.info("ours %s %s %s: %d settings in %.1f s", key, protocol, attn, len(runs), time.perf_counter() - start)
                for run_key, outcome in outcomes.items():
                    name, ratio = run_key.split("@")
                    record = {"attn": attn}
                    if outcome.error is not None:
                        text = str(outcome.error).strip()
                        record["error"] = f"{type(outcome.error).__name__}: {text.splitlines()[0] if text else ''}"
                    else:
                        record["tokens"] = list(outcome.generation.tokens[0])
                        record["kept"] = {int(i): kept_per_head(p) for i, p in outcome.kept.items()}
                    out["runs"][f"{key}|{protocol}|{name}|{float(ratio)}"] = record
                save()
        del loaded


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="work folder (cells.pt, ours.pt are written there)")
    ap.add_argument("--stage", choices=("ids", "run"), required=True,
                    help="ids: compose our settings and build the cells' token ids (cells.pt, what the kvpress side reads); "
                         "run: run our methods on them (ours.pt)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096], help="SmolLM2 needle lengths (tokens; none: skip SmolLM2)")
    ap.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90], help="SmolLM2 needle depths (percent)")
    ap.add_argument("--gemma-cells", nargs="*", default=["2048:50"], help="Gemma 3 270M cells LENGTH:DEPTH (none: skip Gemma)")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.25], help="our kept fractions (kvpress: 1 - ratio)")
    ap.add_argument("--methods", nargs="+", default=list(PAIRS), help="our registry names (default: the whole table)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--system-prompt", default=None,
                    help="the SmolLM2 cells' system prompt instead of the needle task's (e.g. SmolLM2's default one, so that "
                         "the prompt opens with the chat-template prefix KVzipPress skips); their keys end in /system-prompt")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_grad_enabled(False)

    unknown = [m for m in args.methods if m not in PAIRS]
    if unknown:
        print(f"error: {', '.join(unknown)} not in the parity table (scripts/peer_parity_ours.py PAIRS)", file=sys.stderr)
        return 2
    out = {"max_new_tokens": args.max_new_tokens, "ratios": list(args.ratios), "pairs": {}, "models": {}, "cells": {},
           "kvpress_ratio": {str(r): kvpress_ratio(r) for r in args.ratios}, "runs": {}}
    for name in args.methods:
        p = PAIRS[name]
        out["pairs"][name] = {"ours": dict(p.ours), "kvpress": p.kvpress, "eager": p.eager, "note": p.note}
        if name not in METHODS:
            out["pairs"][name]["status"] = "not registered here"
            print(f"{name}: not registered here")
    runnable = [n for n in args.methods if "status" not in out["pairs"][n]]
    label = "" if args.system_prompt is None else "system-prompt"
    cells = [Cell("smollm2-135m", n, d, label) for n in args.lengths for d in args.depths]
    extra = {"smollm2-135m": [] if args.system_prompt is None else [f"task.system_prompt={override_value(args.system_prompt)}"]}
    for spec in args.gemma_cells:
        length, depth = spec.split(":")
        cells.append(Cell("gemma3-270m", int(length), float(depth)))
    plan = Plan(cells, args.ratios, runnable, args.max_new_tokens)
    args.work.mkdir(parents=True, exist_ok=True)
    models = list(dict.fromkeys(c.model for c in cells))
    groups = {m: prepare_model(m, [c for c in cells if c.model == m], plan, out, extra.get(m, [])) for m in models}
    if args.stage == "ids":
        torch.save(out, args.work / "cells.pt")
        print(f"ours: {len(out['cells'])} cells, methods {', '.join(n for n, p in out['pairs'].items() if 'status' not in p)} "
              f"-> {args.work / 'cells.pt'}")
        return 0

    def save():
        torch.save(out, args.work / "ours.pt")

    for m in models:
        run_model(m, [c for c in cells if c.model == m], plan, groups[m], out, save)
    save()
    print(f"ours: {len(out['runs'])} runs -> {args.work / 'ours.pt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
