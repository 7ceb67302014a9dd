"""User-facing errors.

A `HarnessError` is a mistake the user can fix (a bad config value, a missing file, a model that is
not installed). The entry point prints its message as one line and exits non-zero without a
traceback; anything else is a bug and keeps its traceback.
"""


class HarnessError(Exception):
    """A user error: bad configuration, bad data, or a missing asset. The message says how to fix it."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise HarnessError(message)


# How running out of memory reads when it is not a torch.OutOfMemoryError or MemoryError: CUDA's message,
# torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory"), the C library's ENOMEM text and
# C++'s std::bad_alloc surfacing through a RuntimeError.
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "std::bad_alloc")


def is_out_of_memory(exc: BaseException) -> bool:
    """Out of memory on the device or the host, in any of its forms: the one test, used by the
    shared-prefill fallback, the per-item failure records and the bench."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in OOM_MARKERS)
