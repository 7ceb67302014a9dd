"""Settings composition: what `method=<name>` or `methods=[...]` on a command line becomes, before anything runs.

`method_entries` reads a `methods` list, `compose_settings` composes each entry's config exactly as a separate
`python -m harness method=<entry>` run composes it (presets' `defaults:` included), `setting_dir` says where a setting
writes inside a run directory, `check_method` builds a setting's method and checks it against the model's config
before any model loads. The app (harness/app.py) and the scripts (reproduce, peer parity, RULER sample) all compose
settings here. Importing this module registers the `kv.*` resolvers the configs use (conf/config.yaml).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from harness import CONF_DIR
from harness.errors import HarnessError, require
from harness.methods.registry import register_resolvers

log = logging.getLogger("harness")


# --------------------------------------------------------------------------------------------------
# Overrides: which keys the command line gave, the sweep's job directory name
# --------------------------------------------------------------------------------------------------


def _parse_overrides(overrides) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([str(o) for o in overrides])


def is_method_key(key: str) -> bool:
    """`method`, `method.<option>` (also `+method.x`, `~method`) and `methods`."""
    return key in ("method", "methods") or key.startswith("method.")


def job_dirname(overrides, exclude_keys=()) -> str:
    """`hydra.sweep.subdir` (conf/config.yaml): Hydra's override_dirname without the method keys, so the
    jobs of a sweep that differ only in method keys share one run directory, each setting in <tag>/."""
    excluded = {str(k) for k in (exclude_keys or [])}
    lines = sorted(o.input_line for o in _parse_overrides(overrides or [])
                   if not is_method_key(o.key_or_group) and o.key_or_group not in excluded)
    return ",".join(lines)


def _register_resolvers() -> None:
    register_resolvers()
    if not OmegaConf.has_resolver("kv.job_dirname"):
        OmegaConf.register_new_resolver("kv.job_dirname", job_dirname)


_register_resolvers()


# --------------------------------------------------------------------------------------------------
# Settings: `method=<name>` or `methods=[...]`
# --------------------------------------------------------------------------------------------------


def _available_methods() -> list[str]:
    folder = CONF_DIR / "method"
    return sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))


def method_entries(cfg: DictConfig, overrides: list[str] | None) -> list[dict] | None:
    """The `methods` list as mappings `{name: <config name>, <option>: <value>}`, or None without one.
    Refuses `methods` together with method keys on the command line (conf/config.yaml's default
    `method: full` is not one)."""
    raw = cfg.get("methods")
    if raw is None:
        return None
    given = [o.input_line for o in _parse_overrides(overrides or []) if o.key_or_group != "methods" and is_method_key(o.key_or_group)]
    if given:
        raise HarnessError(f"methods and method are exclusive: give each setting as a methods entry "
                           f"(e.g. 'methods=[full,{{name: snapkv, budget: 512}}]') instead of {given[0]}")
    items = OmegaConf.to_container(raw, resolve=False) if OmegaConf.is_config(raw) else raw
    require(isinstance(items, list), f"methods must be a list of method configs, e.g. 'methods=[full,snapkv]'; got {items!r}")
    require(items, "methods is empty; give at least one method, e.g. 'methods=[full,snapkv]'")
    available = _available_methods()
    entries = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"name": item}
        require(isinstance(item, dict) and isinstance(item.get("name"), str),
                f"methods[{i}]: {item!r} is neither a method config name nor a mapping with name: <method config>")
        require(item["name"] in available, f"methods[{i}]: unknown method {item['name']!r}; available: {', '.join(available)}")
        entries.append(dict(item))
    return entries


_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def override_value(value) -> str:
    """A Python/YAML value as Hydra override syntax (what one would type after `method.<option>=`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in ("true", "false", "null", "none", "nan", "inf"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _compose(config_name: str, overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # inside the app (and its launcher jobs): the app's own search path
        return compose(config_name=config_name, overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def compose_config(overrides=()) -> DictConfig:
    """The config `python -m harness <overrides>` runs, composed outside the app (the scripts' studies)."""
    return _compose("config", [str(o) for o in overrides])


def method_list(names) -> list[tuple[str, object]]:
    """(name, method) for each conf/method name, with its default options: a study's methods list."""
    from harness.methods import build_method

    return [(name, build_method(compose_config([f"method={name}"]).method)) for name in names]


def compose_settings(entries: list[dict], overrides: list[str] | None, config_name: str = "config") -> list[tuple[str, DictConfig]]:
    """(tag, config) per distinct setting: each config composed as `python -m harness <overrides without
    methods> method=<name> method.<option>=<value> ...` composes it (presets' `defaults:` included), with
    `methods` set to null. Entries that resolve to the same tag run once (logged)."""
    from hydra.errors import HydraException

    base = [o.input_line for o in _parse_overrides(overrides or []) if o.key_or_group != "methods"]
    out: list[tuple[str, DictConfig]] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        name = entry["name"]
        options = {k: v for k, v in entry.items() if k != "name"}
        try:
            plain = _compose(config_name, [*base, f"method={name}"])
            unknown = [k for k in options if k not in plain.method]
            if unknown:
                raise HarnessError(f"methods[{i}]: method {name!r} has no option {unknown[0]!r}; "
                                   f"its options: {', '.join(k for k in plain.method if k not in ('name', 'tag'))}")
            scfg = _compose(config_name, [*base, f"method={name}", *(f"method.{k}={override_value(v)}" for k, v in options.items())])
        except HydraException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise HarnessError(f"methods[{i}] ({name}): {first}") from None
        with open_dict(scfg):
            scfg.methods = None
        try:
            tag = str(scfg.method.tag)
        except Exception as exc:  # noqa: BLE001  (an interpolation that cannot resolve)
            raise HarnessError(f"methods[{i}] ({name}): its tag does not resolve ({type(exc).__name__}: {exc})") from None
        if tag in seen:
            log.info("methods[%d] (%s) resolves to tag %s, as methods[%d] does: run once", i, name, tag, seen[tag])
            continue
        seen[tag] = i
        out.append((tag, scfg))
    return out


def setting_dir(cfg: DictConfig, run_dir: Path) -> Path:
    """Where a config's results go inside a run directory: <run dir>/<method tag> (bench: <run dir>)."""
    from harness.tasks import SELF_MANAGED  # by name: planning run directories imports no task module (no torch)

    return Path(run_dir) if str(cfg.task.name) in SELF_MANAGED else Path(run_dir) / str(cfg.method.tag)


# --------------------------------------------------------------------------------------------------
# A setting's method, checked against the model's config (no model loaded)
# --------------------------------------------------------------------------------------------------


def model_facts(model_cfg) -> tuple[int | None, int | None]:
    """(layers, maximum positions) as far as the model's config says without loading it; None if unknown."""
    arch = model_cfg.get("architecture")
    layers = positions = None
    facts: dict = {}
    if arch is not None:
        facts = dict(arch)
    elif model_cfg.get("source") == "local" and model_cfg.get("path"):
        try:
            facts = json.loads((Path(str(model_cfg.path)) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            facts = {}
    if isinstance(facts.get("num_hidden_layers"), int):
        layers = facts["num_hidden_layers"]
    positions = model_cfg.get("max_positions") or facts.get("max_position_embeddings")
    return layers, (int(positions) if positions else None)


def check_method(cfg):
    """Build the method and check it against what the model's config says, before any model loads:
    a bad budget, window or kernel fails in a second. The app checks again against the loaded model."""
    from harness.methods import build_method

    method = build_method(cfg.method)
    layers, positions = model_facts(cfg.model)
    if layers is None:
        # The layer count is unknown until the model loads (a GGUF or hub model without `architecture`):
        # check every option that does not depend on it with a nominal count (a per-layer list: its own
        # length; 2 layers otherwise, the fewest a PyramidKV schedule has). The loaded model is checked again.
        budget = getattr(method, "budget", None)
        layers = len(budget) if isinstance(budget, (list, tuple)) and budget else 2
    method.validate(layers, positions or 0)
    return method
