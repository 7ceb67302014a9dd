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


def is_out_of_memory(exc: BaseException) -> bool:
    """Out of memory on the device or the host (CPU allocators raise a RuntimeError that says so)."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
