"""Compression methods: one module per method, registered by name in `registry.METHODS`.

Adding a method: write `harness/methods/<name>.py` (a dataclass registered with `@register`),
add `conf/method/<name>.yaml`, import the module below, and add it to the method tests' table.
"""

from harness.methods import full, h2o, pyramidkv, snapkv, streamingllm  # noqa: F401  (registration side effect)
from harness.methods.base import CompressionMethod, ScoredMethod
from harness.methods.registry import METHODS, build_method

__all__ = ["CompressionMethod", "ScoredMethod", "METHODS", "build_method", "compression"]


def __getattr__(name):
    # The engine imports transformers; loading it lazily keeps config checks (build_method) fast.
    if name == "compression":
        from harness.methods.engine import compression

        return compression
    raise AttributeError(name)
