"""The official LongBench config files (THUDM/LongBench, LongBench/config/), shipped as package data.

`metrics/data/longbench/*.json` are byte-for-byte copies (see SOURCE.md there). Load the prompt
templates from here; never retype them (trailing spaces and the "asconcisely" typo matter).
Each loader returns a fresh dict.
"""

from __future__ import annotations

import json
from importlib import resources

__all__ = [
    "LONGBENCH_CONFIG_FILES",
    "read_config_text",
    "load_dataset2prompt",
    "load_dataset2maxlen",
    "load_model2maxlen",
]

LONGBENCH_CONFIG_FILES: tuple[str, ...] = (
    "dataset2prompt.json",
    "dataset2maxlen.json",
    "model2maxlen.json",
)


def read_config_text(name: str) -> str:
    """The text of one of the shipped config files (e.g. "dataset2prompt.json")."""
    if name not in LONGBENCH_CONFIG_FILES:
        raise ValueError(f"unknown LongBench config file {name!r}; expected one of {LONGBENCH_CONFIG_FILES}")
    return (
        resources.files("metrics").joinpath("data", "longbench", name).read_text(encoding="utf-8")
    )


def _load(name: str) -> dict:
    return json.loads(read_config_text(name))


def load_dataset2prompt() -> dict[str, str]:
    """Task name -> prompt template (``template.format(**row)``), all 21 datasets."""
    return _load("dataset2prompt.json")


def load_dataset2maxlen() -> dict[str, int]:
    """Task name -> max_new_tokens, all 21 datasets."""
    return _load("dataset2maxlen.json")


def load_model2maxlen() -> dict[str, int]:
    """Official model name -> prompt budget in tokens (middle truncation keeps half each side)."""
    return _load("model2maxlen.json")
