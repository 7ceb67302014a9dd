"""Language-model perplexity from per-token negative log-likelihoods (natural log), pure functions.

perplexity = exp(mean NLL) over the scored tokens (StreamingLLM, arXiv 2309.17453, Figure 3 and Table 1: the
NLL of every next token of a long text, teacher-forced); by position bucket: the same over the tokens whose
target sits in [k * width, (k + 1) * width).
"""

from __future__ import annotations

import math


def perplexity(nlls) -> float | None:
    values = [float(v) for v in nlls]
    return math.exp(sum(values) / len(values)) if values else None


def bucket_perplexity(nlls, width: int) -> list[tuple[int, float]]:
    """[(bucket start, perplexity of the tokens in it)], the NLL of list index i being the token at position i + 1
    (the first token has no prediction)."""
    out = []
    for lo in range(0, len(nlls), width):
        out.append((lo + 1, perplexity(nlls[lo:lo + width])))
    return out


def mean_nll(nlls) -> float | None:
    values = [float(v) for v in nlls]
    return sum(values) / len(values) if values else None
