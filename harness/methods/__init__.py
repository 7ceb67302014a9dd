"""Compression methods: one module per method, registered by name in `registry.METHODS`.

Adding a method: write `harness/methods/<name>.py` (a dataclass registered with `@register`),
add `conf/method/<name>.yaml`, add the module's name to `registry._Registry.MODULES`, and add it to
the method tests' table. Importing this package loads no torch: the method modules are imported on
the registry's first lookup, the engine on first use.
"""

from harness.methods.registry import METHODS, build_method

__all__ = ["CompressionMethod", "ScoredMethod", "METHODS", "build_method", "compression"]


def __getattr__(name):
    # The engine imports transformers; loading it lazily keeps config checks (build_method) fast.
    if name == "compression":
        from harness.methods.engine import compression

        return compression
    if name in ("CompressionMethod", "ScoredMethod"):
        from harness.methods import base

        return getattr(base, name)
    raise AttributeError(name)
