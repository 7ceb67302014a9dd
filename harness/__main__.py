"""`python -m harness <hydra overrides>`: see conf/config.yaml, the README and docs/scaling.md. The OmegaConf resolvers of the
configs (`kv.*`: method tags, the sweep job directory) are registered by importing harness.app."""

import sys

import hydra

from harness import CONF_DIR
from harness.app import EXIT_USER_ERROR
from harness.app import main as run

# Config groups whose unknown choices are reported here in one line (Hydra's own message is a
# dozen lines: the options, then the config search path).
CHECKED_GROUPS = {"model": "model", "method": "method", "task": "task", "experiment": "experiment"}
# Options that change where configs come from: then Hydra alone decides what exists.
SEARCH_PATH_OPTIONS = ("-cp", "--config-path", "-cd", "--config-dir", "-cn", "--config-name")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg):
    run(cfg)


def _parsed_overrides(args: list[str]):
    """The command line's overrides as Hydra parses them, or None where Hydra should decide alone (a search
    path option, a syntax error Hydra reports itself)."""
    if any(a.split("=", 1)[0] in SEARCH_PATH_OPTIONS or "hydra.searchpath" in a for a in args):
        return None
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        return OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001  (Hydra reports syntax errors itself)
        return None


def unknown_choice(args: list[str]) -> str | None:
    """The `error: ...` line for a command-line choice of model/method/task/experiment that has no
    conf/<group>/<name>.yaml, or None (also whenever the arguments are anything unusual: Hydra decides)."""
    parsed = _parsed_overrides(args)
    if parsed is None:
        return None
    for override in parsed:
        group = override.key_or_group
        if group not in CHECKED_GROUPS or override.package is not None or override.is_delete():
            continue
        try:
            names = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.get_value_element_as_str()]
        except Exception:  # noqa: BLE001  (glob and range sweeps: Hydra expands them)
            continue
        folder = CONF_DIR / group
        available = sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))
        for name in names:
            if name not in ("null", "None", "") and name not in available:
                return f"error: unknown {CHECKED_GROUPS[group]} {name!r}; available: {', '.join(available) or 'none'}"
    return None


def unknown_method_option(args: list[str]) -> str | None:
    """The `error: ...` line for a `method.<option>=` override that the chosen method's config does not have
    (Hydra's own message is a "Key ... is not in struct" block), or None (also for sweeps, `+method.x`, or
    anything unusual: Hydra decides). The method is composed as the command line chooses it (method=,
    experiment=, presets' defaults)."""
    parsed = _parsed_overrides(args)
    if parsed is None:
        return None
    options = [o for o in parsed if o.key_or_group.startswith("method.") and o.package is None
               and o.type.name == "CHANGE"]  # not +method.x (adds a key), ++ or ~
    if not options or any(o.is_sweep_override() for o in parsed):
        return None  # a sweep: each job reports its own error
    if any(o.key_or_group == "methods" for o in parsed):  # harness.app's line, before Hydra's block for a mistyped key
        return ("error: methods and method are exclusive: give each setting as a methods entry "
                f"(e.g. 'methods=[full,{{name: snapkv, budget: 512}}]') instead of {options[0].input_line}")
    try:
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[o.input_line for o in parsed if not o.key_or_group.startswith("method.")])
        method = cfg.method
        known = [k for k in method if k not in ("name", "tag")]
    except Exception:  # noqa: BLE001
        return None
    for o in options:
        option = o.key_or_group.split(".")[1]
        if option not in method:
            import difflib

            close = difflib.get_close_matches(option, known, n=1)
            hint = f" (did you mean method.{close[0]}?)" if close else ""
            return f"error: method {method.get('name')} has no option {option!r}{hint}; its options: {', '.join(known)}"
    return None


if __name__ == "__main__":
    problem = unknown_choice(sys.argv[1:]) or unknown_method_option(sys.argv[1:])
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    main()
