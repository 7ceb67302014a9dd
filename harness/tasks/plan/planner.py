"""Single planned points for other tasks: the bench's planned columns and its maximum-length search on a machine
without a GPU (`task=bench task.max_length_search=true`), and scripts/gpu_check.py's predictions."""

from __future__ import annotations

import logging

from harness.tasks.plan.task import GIB, load_fake

log = logging.getLogger(__name__)


class Planner:
    """The fake twin of a `conf/model` config (built once), planning one method at one length and batch size."""

    def __init__(self, model_cfg, target: str = "cuda"):
        self.loaded, self.mode = load_fake(model_cfg, None, target)
        self.target = target

    def point(self, method_cfg: dict, length: int, *, batch_size: int = 1, new_tokens: int = 8) -> dict:
        """The bench's measurement, planned: the prompt prefilled in one forward, `new_tokens` decoded (EOS ignored).
        Returns peak_bytes, weights_bytes, peak_phase, kv_bytes (the cache after prefill), bound."""
        from harness.methods import build_method
        from harness.tasks.plan.trace import trace_generation

        method = build_method({k: v for k, v in method_cfg.items() if k != "label"})
        got = trace_generation(self.loaded, [("planned", method)], int(length), batch_size=int(batch_size),
                               new_tokens=int(new_tokens), mode=self.mode, target=self.target)
        return {"peak_bytes": got["peak_bytes"], "weights_bytes": got["weights_bytes"], "peak_phase": got["peak_phase"],
                "kv_bytes": got["cache_bytes"], "bound": got["bound"]}


def planned_columns(table: list[dict], methods: dict[str, dict], model_cfg, *, batch_size: int, decode_tokens: int,
                    target: str) -> None:
    """Add the plan beside the bench's measured KV bytes and peak (in place): kv_bytes_planned, peak_bytes_planned and
    peak_increase_bytes_planned (the peak above the weights, as the bench's increase is above what was loaded).
    Nothing is added for a model without an `architecture` to build its twin from."""
    if not table or model_cfg.get("architecture") is None:
        return
    planner = Planner(model_cfg, target)
    for e in table:
        got = planner.point(methods[e["label"]], e["length"], batch_size=batch_size, new_tokens=decode_tokens + 1)
        e.update(kv_bytes_planned=got["kv_bytes"], peak_bytes_planned=got["peak_bytes"],
                 peak_increase_bytes_planned=got["peak_bytes"] - got["weights_bytes"], plan_bound=got["bound"])


def planned_search(cfg, methods: dict[str, dict], *, reserve_gb: float) -> dict:
    """The bench's maximum-length search, planned (no GPU here): per method, the longest prompt whose planned peak
    is at most task.memory_cap_gb less `reserve_gb`, doubling then bisection as the measured search."""
    from harness.tasks.bench.search import search_max_length

    task = cfg.task
    cap = int((float(task.memory_cap_gb) - float(reserve_gb)) * GIB)
    planner = Planner(cfg.model, "cuda")
    out: dict = {"memory_cap_gb": float(task.memory_cap_gb), "cap_bytes": cap, "start": int(task.search_start),
                 "resolution": int(task.search_resolution), "upper": int(task.search_max), "planned": True,
                 "reserve_gb": float(reserve_gb), "methods": {}}
    for label, method in methods.items():
        def fits(n: int, method=method, label=label) -> bool:
            got = planner.point(method, n, batch_size=int(task.batch_size), new_tokens=int(task.search_decode_tokens) + 1)
            log.info("planned search %-24s %7d tokens: peak %.2f GiB%s", label, n, got["peak_bytes"] / GIB,
                     " (fits)" if got["peak_bytes"] <= cap else "")
            return got["peak_bytes"] <= cap

        out["methods"][label] = search_max_length(fits, start=int(task.search_start), resolution=int(task.search_resolution),
                                                  upper=int(task.search_max))
    return out
