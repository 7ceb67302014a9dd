"""`method=full`: the uncompressed cache (All-KV in the paper's tables)."""

from dataclasses import dataclass

from harness.methods.base import CompressionMethod
from harness.methods.registry import register


@register
@dataclass
class FullCache(CompressionMethod):
    name = "full"
