"""The maximum-length search: doubling, then bisection (the bench's measured search and task=plan's planned one)."""

from __future__ import annotations

from typing import Callable


def search_max_length(fits: Callable[[int], bool], *, start: int, resolution: int, upper: int) -> dict:
    """Longest n in (0, upper] with fits(n), for a monotone `fits`: doubling from `start` until a
    failure (or `upper`), then bisection until the gap between the longest fit and the shortest
    failure is at most `resolution`. Returns max_length (0 when nothing fits), first_failure (None
    when `upper` fits), reached_upper, and the probes in order."""
    probes: list[tuple[int, bool]] = []

    def probe(n: int) -> bool:
        ok = bool(fits(n))
        probes.append((n, ok))
        return ok

    lo, hi = 0, None
    n = min(int(start), int(upper))
    while True:
        if probe(n):
            lo = n
            if n >= upper:
                break
            n = min(2 * n, int(upper))
        else:
            hi = n
            break
    if hi is not None:
        while hi - lo > resolution:
            mid = lo + (hi - lo) // 2
            if probe(mid):
                lo = mid
            else:
                hi = mid
    return {"max_length": lo, "first_failure": hi, "reached_upper": hi is None, "probes": probes}
