"""The one list of compression methods: configs, README and tests all read it.

Also the config-level rules every method shares, checked before any model loads:

- Budgets: `method.budget` (tokens kept per head per layer, window included) or `method.ratio` (the
  fraction of the prompt kept per head per layer, window included): exactly one of the two for a
  compressing method. The method configs write `budget: ${kv.budget:1024,${.ratio}}`, i.e. 1024 unless
  a ratio is given, so `method.ratio=0.25` alone switches a config to a ratio.
- Shared knobs: every method config has `budget`, `window_size` and `ratio`, so one override can be
  swept across methods (`-m method=full,snapkv method.budget=512`). Where a knob means nothing
  (`full`), the method lists it in `NOOP_OPTIONS`: accepted, recorded, and ignored by the run
  directory's config comparison.
- Tags: the OmegaConf resolvers below (`kv.*`, registered when this module is imported) build the
  parts of `method.tag` that depend on which options are set (`c1024` for a budget, `r0.25` for a ratio).
"""

from __future__ import annotations

from dataclasses import fields

from omegaconf import OmegaConf

from harness.errors import HarnessError

class _Registry(dict):
    """name -> method class. The method modules (and so torch) are imported on first lookup, so that
    composing configs and resolving their tags (reproduce_paper.py --dry-run) never loads torch."""

    MODULES = ("full", "h2o", "pyramidkv", "snapkv", "streamingllm",
               "tova", "knorm", "expected_attention", "keydiff", "lagkv", "observed_attention", "criticalkv", "chunkkv",
               "adakv", "cake", "kvzip", "rkv")
    _loaded = False

    def _load(self) -> None:
        if not _Registry._loaded:
            _Registry._loaded = True
            from importlib import import_module

            for module in self.MODULES:
                import_module(f"harness.methods.{module}")

    def __getitem__(self, key):
        self._load()
        return super().__getitem__(key)

    def __contains__(self, key):
        self._load()
        return super().__contains__(key)

    def __iter__(self):
        self._load()
        return super().__iter__()

    def __len__(self):
        self._load()
        return super().__len__()

    def get(self, key, default=None):
        self._load()
        return super().get(key, default)

    def keys(self):
        self._load()
        return super().keys()

    def items(self):
        self._load()
        return super().items()

    def values(self):
        self._load()
        return super().values()


METHODS: dict[str, type] = _Registry()
# Options every method config carries (so a shared override applies to any method of a sweep).
SHARED_OPTIONS = ("budget", "window_size", "ratio")
# Decode-time compression options every method config carries, null = off (harness/methods/decode_time.py).
DECODE_OPTIONS = ("decode_interval", "decode_budget", "decode_ratio", "decode_queries", "rerotate")


def register(cls):
    if dict.__contains__(METHODS, cls.name) and dict.__getitem__(METHODS, cls.name) is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


def noop_options(name) -> tuple[str, ...]:
    """Options a method accepts and ignores (recorded, never compared for resume)."""
    cls = METHODS.get(str(name)) if name is not None else None
    return tuple(getattr(cls, "NOOP_OPTIONS", ())) if cls is not None else ()


def _plain(value):
    if hasattr(value, "__iter__") and not isinstance(value, (str, dict)):
        return [_plain(v) for v in value]
    return value


def build_method(cfg):
    """Build a method from its config node (`name` plus the method's own options)."""
    options = {k: _plain(v) for k, v in dict(cfg).items() if k not in ("name", "tag")}
    decode = {k: options.pop(k) for k in DECODE_OPTIONS if k in options}
    name = cfg["name"] if "name" in cfg else None
    if name not in METHODS:
        raise HarnessError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    cls = METHODS[name]
    known = {f.name for f in fields(cls)}
    for key in SHARED_OPTIONS:  # a shared knob the method does not have: fine while it is unset
        if key not in known and options.get(key, 0) is None:
            del options[key]
    if "budget" in known and "budget" not in noop_options(name):
        check_budget_or_ratio(options.get("budget"), options.get("ratio"), name)
    if ("window_size" in known and "window_size" in options and options["window_size"] is None
            and "window_size" not in noop_options(name) and not getattr(cls, "WINDOW_FROM_BUDGET", False)):
        # conf/method/h2o.yaml: window_size = budget / 2, null with a ratio (half of the budget resolved per item);
        # a method takes that only if it says so (WINDOW_FROM_BUDGET)
        raise HarnessError(f"method {name}: method.window_size is null (half of a budget resolved per item) and this method "
                           "needs it in tokens: give method.window_size=<tokens>")
    method = cls.from_config(options)
    if any(v is not None for v in decode.values()):
        from harness.methods.decode_rule import DecodeRule

        method.decode = DecodeRule.from_options(method, decode)
    return method


def check_budget_or_ratio(budget, ratio, name: str) -> None:
    """Exactly one of method.budget (tokens) and method.ratio (fraction of the prompt) for a compressing method."""
    if budget is not None and ratio is not None:
        raise HarnessError(f"method.budget={budget} and method.ratio={ratio} are exclusive: give one (method.budget: tokens kept "
                           "per head per layer; method.ratio: the fraction of the prompt kept; e.g. method.budget=null method.ratio=0.25)")
    if budget is None and ratio is None:
        raise HarnessError(f"method {name} needs method.budget (tokens kept per head per layer) or method.ratio "
                           "(the fraction of the prompt kept, in (0, 1])")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < float(ratio) <= 1:
            raise HarnessError(f"method.ratio={ratio!r} must be a number in (0, 1]: the fraction of the prompt kept per head per layer")


# ---------------------------------------------------------------------------------------- tag resolvers


def _number(value) -> str:
    return format(float(value), "g") if isinstance(value, float) else str(value)


def budget_default(tokens, ratio):
    """`${kv.budget:1024,${.ratio}}`: the default budget in tokens, or None once a ratio is given."""
    return None if ratio is not None else tokens


def budget_tag(budget, ratio) -> str:
    """`c1024` (tokens), `r0.25` (ratio); both or neither are refused by build_method, tagged as they are."""
    parts = []
    if budget is not None:
        parts.append(f"c{_plain(budget)}")
    if ratio is not None:
        parts.append(f"r{_number(ratio)}")
    return "_".join(parts) or "cnone"


def half(budget):
    """`${kv.half:${.budget}}`: half the budget (the smallest, for per-layer budgets); None without one
    (a ratio: the method takes half of the budget it resolves per item)."""
    budget = _plain(budget)
    if budget is None:
        return None
    if isinstance(budget, list):
        return min(int(b) for b in budget) // 2 if budget else None
    return int(budget) // 2


def minus(budget, amount):
    """`${kv.minus:${.budget},4}`: budget - amount; None without a budget."""
    budget = _plain(budget)
    if budget is None:
        return None
    if isinstance(budget, list):
        return min(int(b) for b in budget) - int(amount) if budget else None
    return int(budget) - int(amount)


def window_tag(window) -> str:
    return "whalf" if window is None else f"w{window}"


def streamingllm_rule(variant, sink_tokens, window) -> str:
    """The part of a StreamingLLM tag that says which rule ran: `s4` (the paper: sinks + recent) or
    `kvcf_w8` (KVCache-Factory: the first C - W positions + the last W)."""
    if variant == "kvcache_factory":
        return f"kvcf_{window_tag(window)}"
    if variant == "paper":
        return f"s{sink_tokens}"
    return f"{variant}_s{sink_tokens}_{window_tag(window)}"


def unless_default(value, default, label) -> str:
    """`${kv.unless_default:${.option},<default>,<label>}`: "" at the default (tags of earlier runs stay), else
    `_<label><value>`."""
    return "" if str(value) == str(default) else f"_{label}{value}"


def protocol_suffix(query_aware) -> str:
    """`${kv.protocol_suffix:${oc.select:task.query_aware,true}}`: run directories of query-agnostic runs get
    their own folder (`needle_query_agnostic/`), so the two protocols of one method never collide."""
    return "" if str(query_aware).lower() != "false" else "_query_agnostic"


def decode_tag(interval, budget, ratio, queries, rerotate) -> str:
    """`${kv.decode_tag:...}`: "" without decode-time compression (tags of earlier runs stay), else
    `_d<interval>c<budget>` (or `r<ratio>`), `q<queries>` when set, `_rerot` with rerotation."""
    if interval is None:
        return ""
    target = f"r{_number(ratio)}" if ratio is not None else f"c{budget}" if budget is not None else ""
    return f"_d{interval}{target}" + (f"q{queries}" if queries is not None else "") + ("_rerot" if rerotate else "")


RESOLVERS = {
    "kv.protocol_suffix": protocol_suffix,
    "kv.budget": budget_default,
    "kv.budget_tag": budget_tag,
    "kv.half": half,
    "kv.minus": minus,
    "kv.window_tag": window_tag,
    "kv.streamingllm_rule": streamingllm_rule,
    "kv.unless_default": unless_default,
    "kv.decode_tag": decode_tag,
}


def register_resolvers() -> None:
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()
