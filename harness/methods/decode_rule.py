"""The decode-time rule a method carries (`method.decode`): when and to what size it re-compresses while decoding.

Built by registry.build_method from the `decode_*` options; applied by harness/methods/decode_time.py. Kept apart
from the evictor so that building a method never imports the scoring code (the registry stays below it).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import require

DEFAULT_QUERIES = 256  # kvpress's hidden_states_buffer_size


@dataclass(frozen=True)
class DecodeRule:
    """When and to what size a method re-compresses while decoding (see the module docstring)."""

    interval: int
    budget: int | None = None
    ratio: float | None = None
    queries: int = DEFAULT_QUERIES
    rerotate: bool = False

    @classmethod
    def from_options(cls, method, options: dict) -> "DecodeRule":
        """From the method's `decode_*` options (registry.DECODE_OPTIONS); refuses, in one line, what cannot run."""
        from harness.methods.base import ScoredMethod

        name = method.name
        interval = options.get("decode_interval")
        require(interval is not None, f"method {name}: decode-time options need method.decode_interval (tokens between compressions)")
        require(isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1,
                f"method.decode_interval={interval!r} must be a positive integer")
        require(isinstance(method, ScoredMethod) and not method.across_layers and getattr(method, "EXACT_BUDGET", True),
                f"method {name} cannot compress while decoding: its budget is not one count per layer and head "
                "(decode-time compression re-runs a per-head scorer: snapkv, h2o, tova, streamingllm, knorm, rkv, ...)")
        budget, ratio = options.get("decode_budget"), options.get("decode_ratio")
        require(budget is None or ratio is None, f"method.decode_budget={budget} and method.decode_ratio={ratio} are exclusive: give one")
        if budget is None and ratio is None:
            require(isinstance(method.budget, int) and method.ratio is None,
                    f"method {name}: give method.decode_budget (tokens kept per head per layer while decoding) or method.decode_ratio")
            budget = method.budget
        if ratio is not None:
            require(isinstance(ratio, (int, float)) and 0 < float(ratio) <= 1, f"method.decode_ratio={ratio!r} must be in (0, 1]")
        else:
            require(isinstance(budget, int) and budget > method.window_size,
                    f"method.decode_budget={budget!r} must be an integer larger than method.window_size={method.window_size}")
        queries = options.get("decode_queries")
        queries = DEFAULT_QUERIES if queries is None else queries
        window = method.query_window
        require(isinstance(queries, int) and queries >= max(1, window or 1),
                f"method.decode_queries={queries!r} must be at least the {window or 1} queries method {name} scores with")
        return cls(int(interval), budget, None if ratio is None else float(ratio), int(queries), bool(options.get("rerotate")))


def describe(rule: DecodeRule) -> dict:
    return {"interval": rule.interval, "budget": rule.budget, "ratio": rule.ratio, "queries": rule.queries, "rerotate": rule.rerotate}
