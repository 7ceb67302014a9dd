"""Shared test helpers: composing the real Hydra config, tiny random models, SmolLM2, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import CONF_DIR  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
BACKENDS = ("eager", "sdpa")


def compose(*overrides: str):
    """The config `python -m harness <overrides>` would run with (hydra node excluded)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def tiny_model(family: str = "llama", attn: str = "sdpa", *, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               vocab: int = 1000, seed: int = 0):
    """A random-weight decoder of the given family (GQA heads:kv_heads), built in milliseconds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=4096)
    if family == "qwen3":
        kwargs["head_dim"] = 64 // heads
    if family == "mistral":  # Mistral-7B-v0.2 and later: full attention (v0.1's sliding window: see the hybrid tests)
        kwargs["sliding_window"] = None
    if family == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2)
    config = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def one_thread():
    """Small models gain nothing from intra-op threads, and on a busy machine they cost a lot."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (the embedded default model), loaded once per test session."""
    from harness.models import load_model

    return load_model(compose().model)


@pytest.fixture(scope="session")
def tiny_random():
    from harness.models import load_model

    return load_model(compose("model=tiny-random").model)


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m harness <args>` in a subprocess, as a user runs it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
