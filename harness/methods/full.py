"""`method=full`: the uncompressed cache (All-KV in the paper's tables).

It accepts the options every method config shares (`budget`, `window_size`, `ratio`) and ignores them,
so one override can be swept across methods (`-m method=full,snapkv method.budget=512`): they are
recorded as given (config.yaml, results.json's `method`), are not in the tag (`full`), and the run
directory's config comparison skips them (`NOOP_OPTIONS`), so every `full` job of a budget sweep is
one run directory, computed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from harness.methods.base import CompressionMethod
from harness.methods.registry import register


@register
@dataclass
class FullCache(CompressionMethod):
    name = "full"
    NOOP_OPTIONS: ClassVar[tuple[str, ...]] = ("budget", "window_size", "ratio")

    budget: int | list[int] | None = None  # no-op (recorded)
    window_size: int | None = None  # no-op (recorded)
    ratio: float | None = None  # no-op (recorded)
