"""Cross-task tables from every run under a folder: `python -m harness.report <folder>` (harness/report/build.py).

Only what spans benchmarks lives here (collecting runs, paired deltas, the reuse gap, the paper's claims, code
versions, the index README.md); each benchmark's own tables live in its folder (harness/tasks/<name>/report.py),
found through the task registry. Nothing here imports torch.
"""

from harness.report.build import build, main
from harness.results import Run, collect, run_protocol

__all__ = ["Run", "build", "collect", "main", "run_protocol"]
