"""The support matrix: every registered method on every model family's tiny random config, as the engine answers.

For each family (conf/model/tiny-<family>.yaml, loaded as `model=tiny-<family>` loads it, SmolLM2's tokenizer)
and each registered method (its own conf/method/<name>.yaml, budget 48 tokens, window at most 8), one item of
160 random tokens is compressed and answered through `generate_settings`, the path every task takes. A cell
says what happened: "compressed (layers ...)", or "refused: <the engine's one line>". Nothing is written by
hand except kvpress 0.5.5's column (read from its base_press.py, not run: it does not install beside
transformers 5.25). The tests that hold each family to the masked full-cache reference are
tests/methods/test_families.py.

    python scripts/support_matrix.py            # prints the tables
    python scripts/support_matrix.py --write    # and replaces the generated block in docs/methods.md and README.md
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = {"gpt-oss": "tiny-gpt-oss", "Gemma 2": "tiny-gemma2", "Llama 4": "tiny-llama4", "SmolLM3": "tiny-smollm3",
            "Qwen3.5": "tiny-qwen3.5", "Gemma 4": "tiny-gemma4", "DeepSeek V3": "tiny-deepseek-v3"}
# What kvpress 0.5.5 does with each family: kvpress/presses/base_press.py hooks `layer.self_attn` of every layer of
# `model.model.layers` (skipping sliding layers for Gemma3ForConditionalGeneration only), warns "not tested" for any
# class outside Llama, Mistral, Phi3, Qwen2, Qwen3 and multimodal Gemma 3, and scores with its own attention
# recomputation (scale 1/sqrt(d), no soft-cap, no sinks). Read from the code, not run.
KVPRESS = {
    "gpt-oss": "warns 'not tested'; cuts the sliding layers too; window scores omit the sinks",
    "Gemma 2": "warns 'not tested'; cuts the sliding layers too; window scores omit the soft-cap",
    "Llama 4": "warns 'not tested'; cuts the chunked layers too; NoPE temperature read from the compressed length",
    "SmolLM3": "warns 'not tested'; ExpectedAttention un-rotates NoPE layers' queries as if rotated",
    "Qwen3.5": "fails: linear-attention layers have no `self_attn` to hook",
    "Gemma 4": "warns 'not tested'; the shared layers' cache is empty (DummyLayer): no keys to compress",
    "DeepSeek V3": "warns 'not tested'; scores the cached latent as if it were per-head keys",
}
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def method_of(name: str):
    from harness.methods import build_method  # (its registry registers the configs' kv.* resolvers)

    cfg = compose(f"method={name}").method
    options = {k: v for k, v in dict(cfg).items() if k != "tag"}
    if "budget" in options:
        options.update(budget=48, ratio=None)
    if isinstance(options.get("window_size"), int) and options["window_size"] > 8:
        options["window_size"] = 8
    return build_method(options)


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from harness import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def cell(loaded, name: str, prompt) -> tuple[str, str | None]:
    """(short cell, the engine's full line where it refused)."""
    import torch

    from harness.errors import HarnessError
    from harness.generation.generate import generate_settings

    method = method_of(name)
    try:
        with torch.inference_mode():
            out = generate_settings(loaded, [(name, method)], prompt, max_new_tokens=2)[name]
    except HarnessError as exc:
        return "refused", str(exc)
    if out.error is not None:
        return f"FAILED: {type(out.error).__name__}", str(out.error)
    if not method.compresses:
        return "runs (no compression)", None
    layers = out.diagnostics.get("compressed_layers") or []
    return f"compressed ({', '.join(map(str, layers))})", None


def layout_line(loaded) -> str:
    from harness.methods.engine import attention_modules
    from harness.methods.layout import model_layout, refusal

    why = refusal(loaded.model)
    if why:
        return "multi-head latent attention" if "latent" in why else why
    kinds: dict = {}
    for layer in model_layout(loaded.model, attention_modules(loaded.model)):
        label = layer.kind + ("" if layer.rotary else " NoPE") + (" soft-capped" if layer.softcap else "") + \
            (" sinks" if layer.sinks is not None else "")
        kinds.setdefault(label, []).append(str(layer.idx))
    return "; ".join(f"{k} {','.join(v)}" for k, v in kinds.items())


def build() -> str:
    from harness.methods import METHODS
    from harness.models import load_model
    from harness.generation.prompt import Prompt

    import torch

    names = sorted(METHODS)
    ids = torch.randint(100, 20000, (160,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = Prompt(ids, 140)
    cells, layouts, reasons = {}, {}, {}
    for family, config in FAMILIES.items():
        loaded = load_model(compose(f"model={config}").model)
        layouts[family] = layout_line(loaded)
        for name in names:
            short, line = cell(loaded, name, prompt)
            if line is not None and short == "refused":
                key = reasons.setdefault(line, chr(ord("a") + len(reasons)))
                short = f"refused ({key})"
            cells[(family, name)] = short
        print(f"{family}: done", file=sys.stderr)
    head = "| method | " + " | ".join(f"{f} (`model={c}`)" for f, c in FAMILIES.items()) + " |"
    rows = [head, "|" + "---|" * (len(FAMILIES) + 1),
            "| *layers (index)* | " + " | ".join(layouts[f] for f in FAMILIES) + " |"]
    rows += [f"| {name} | " + " | ".join(cells[(f, name)] for f in FAMILIES) + " |" for name in names]
    rows.append("| *kvpress 0.5.5* | " + " | ".join(KVPRESS[f] for f in FAMILIES) + " |")
    notes = [f"- ({key}) {line}" for line, key in reasons.items()]
    return "\n".join(["Generated by `python scripts/support_matrix.py --write` (every registered method on each family's tiny "
                      "config; \"compressed (i, j)\": the layers it compressed).", "", *rows, "", "Refusals, as the engine "
                      "words them (before any prefill):", "", *notes])


def replace_block(path: Path, table: str) -> None:
    text = path.read_text()
    block = f"{START}\n{table}\n{END}"
    if START in text:
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        raise SystemExit(f"{path}: no {START} ... {END} block to replace")
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the generated block in docs/methods.md and README.md")
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)
    table = build()
    print(table)
    if args.write:
        for path in (ROOT / "docs" / "methods.md", ROOT / "README.md"):
            replace_block(path, table)


if __name__ == "__main__":
    main()
