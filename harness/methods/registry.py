"""The one list of compression methods: configs, README and tests all read it."""

from __future__ import annotations

from harness.errors import HarnessError

METHODS: dict[str, type] = {}


def register(cls):
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


def build_method(cfg):
    """Build a method from its config node (`name` plus the method's own options)."""
    options = {k: v for k, v in dict(cfg).items() if k not in ("name", "tag")}
    name = cfg["name"] if "name" in cfg else None
    if name not in METHODS:
        raise HarnessError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    for key, value in options.items():  # OmegaConf containers -> plain Python
        if hasattr(value, "__iter__") and not isinstance(value, str):
            options[key] = list(value)
    return METHODS[name].from_config(options)
