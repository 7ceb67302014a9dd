"""How much attention a model gives its first tokens (StreamingLLM's attention sinks), per layer.

Feeds the first N tokens of the Paul Graham essays (the perplexity task's text) through the full cache in one
forward and, through the engine's attention probe, takes the softmax attention of the last Q queries of every
layer over all keys: the mean mass on the first `sinks` positions (mean over heads and queries), next to what a
uniform spread would give them. Explains a window-only perplexity that does or does not explode
(docs/decoding.md):
    python scripts/attention_sinks.py --tokens 2048 --queries 64 --sinks 4
"""

from __future__ import annotations

import argparse
import math

import torch

from harness.app import _compose
from harness.methods.engine import attention_probe
from harness.models import load_model
from harness.tasks.perplexity.task import load_documents


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    args = ap.parse_args()
    cfg = _compose("config", [f"model={args.model}", "task=perplexity", f"task.tokens={args.tokens}"])
    loaded = load_model(cfg.model)
    ids = torch.tensor([load_documents(cfg.task, loaded.tokenizer)[0]], device=loaded.device)
    mass: dict[int, float] = {}

    def probe(module, query, key):
        q = query[:, :, -args.queries:].float()
        groups = q.shape[1] // key.shape[1]
        k = key.float().repeat_interleave(groups, dim=1)
        scale = getattr(module, "scaling", None) or 1 / math.sqrt(q.shape[-1])
        logits = q @ k.transpose(-1, -2) * scale
        n = k.shape[2]
        rows = torch.arange(n - q.shape[2], n, device=q.device)
        logits = logits.masked_fill(torch.arange(n, device=q.device)[None, :] > rows[:, None], float("-inf"))
        mass[module.layer_idx] = float(torch.softmax(logits, dim=-1)[..., : args.sinks].sum(-1).mean())

    with torch.inference_mode(), attention_probe(loaded.model, probe):
        loaded.model(input_ids=ids, logits_to_keep=1)
    uniform = args.sinks / args.tokens
    print(f"{loaded.name}: attention mass of the last {args.queries} queries on the first {args.sinks} of {args.tokens} "
          f"positions (uniform: {uniform:.4f})")
    print("| layer | mass on the first tokens |\n|---:|---:|")
    for layer, value in sorted(mass.items()):
        print(f"| {layer} | {value:.3f} |")
    print(f"| mean | {sum(mass.values()) / len(mass):.3f} |")


if __name__ == "__main__":
    main()
