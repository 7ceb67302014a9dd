"""task=long_answers: see task.py (the folder layout of issue 31: the registry imports the package, then its `task` module)."""

from harness.tasks.long_answers.task import *  # noqa: F401,F403  (until the registry imports `<package>.task` itself)
from harness.tasks.long_answers.task import GRID_KEYS, PROTOCOL_OPTIONS, run, validate  # noqa: F401
