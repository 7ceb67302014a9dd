"""ZeroSCROLLS' official scorer, loaded at run time from the user's copy (`task.scorer_dir`); never shipped here.

The official metric is a `datasets` metric script in the hub dataset repository (tau/zero_scrolls, `metrics/`:
zero_scrolls.py, which imports rouge.py, accuracy.py, f1.py, exp_similarity.py and concordance_index.py beside it),
not on GitHub. `task.scorer_dir` names a local copy of that repository (the folder holding `metrics/zero_scrolls.py`),
e.g. `huggingface-cli download tau/zero_scrolls --repo-type dataset --include 'metrics/*' --local-dir <dir>`.

The script subclasses `datasets.Metric`, which datasets 3+ no longer has (and `load_metric` is gone). So the files are
imported unchanged as one package with a minimal stand-in `datasets` module in place while they load (the Metric base
keeps `config_name` and calls the script's `_compute`; MetricInfo/Features/Value/Sequence and the docstring decorator
are inert), then the real `datasets` is put back. A task's score is the script's `zero_scrolls_score` for the config
named after the task (its own metric choice, reference handling, aggregation and rounding). What the script imports
(rouge-score, nltk and its punkt data, lifelines) must be installed where the harness runs; a missing one ends in one
line naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

from harness.errors import HarnessError

METRIC_FILE = Path("metrics") / "zero_scrolls.py"
PACKAGE = "_zeroscrolls_official_metrics"
HOW = ("pass task.scorer_dir=<a local copy of the hub dataset tau/zero_scrolls holding metrics/zero_scrolls.py> (presets: ZEROSCROLLS_SCORER_DIR) "
       "(huggingface-cli download tau/zero_scrolls --repo-type dataset --include 'metrics/*' --local-dir <dir>)")


def _stand_in() -> types.ModuleType:
    """The part of the `datasets` API the metric script touches at import and in compute."""
    shim = types.ModuleType("datasets")

    class Metric:
        def __init__(self, config_name: str | None = None, **_):
            self.config_name = config_name or "default"

        def compute(self, *, predictions, references, **kwargs):
            return self._compute(predictions=list(predictions), references=[list(r) for r in references], **kwargs)

    def record(**kwargs):
        return dict(kwargs)

    def add_start_docstrings(*docstrings):
        def wrap(obj):
            obj.__doc__ = "".join(docstrings) + (obj.__doc__ or "")
            return obj
        return wrap

    shim.Metric, shim.MetricInfo, shim.Features = Metric, record, record
    shim.Value = lambda dtype, **kw: {"dtype": dtype, **kw}
    shim.Sequence = lambda feature, **kw: {"sequence": feature, **kw}
    shim.utils = types.ModuleType("datasets.utils")
    shim.utils.file_utils = types.ModuleType("datasets.utils.file_utils")
    shim.utils.file_utils.add_start_docstrings = add_start_docstrings
    return shim


def metric_file(scorer_dir) -> Path:
    if not scorer_dir:
        raise HarnessError(f"task=zeroscrolls scores with ZeroSCROLLS' official scorer, which is on the hub only and not part of this "
                           f"repository; {HOW}")
    path = Path(str(scorer_dir)).expanduser() / METRIC_FILE
    if not path.is_file():
        raise HarnessError(f"task.scorer_dir={scorer_dir}: no {METRIC_FILE} there; {HOW}")
    return path


class OfficialScorer:
    """The script's metric class, one instance per task config (gov_report, qasper, ...)."""

    def __init__(self, scorer_dir):
        path = metric_file(scorer_dir)
        self.path = path
        self.module = _load(path)
        self.cls = next((v for v in vars(self.module).values() if isinstance(v, type) and v.__module__ == self.module.__name__
                         and hasattr(v, "_compute")), None)
        if self.cls is None:
            raise HarnessError(f"{path} defines no metric class (a class with _compute); is it ZeroSCROLLS' metrics/zero_scrolls.py?")
        self._metrics: dict[str, object] = {}

    def compute(self, task: str, predictions: list[str], references: list[list[str]]) -> dict:
        """The script's result dict for `task` (its `zero_scrolls_score` and per-metric values)."""
        if task not in self._metrics:
            try:
                self._metrics[task] = self.cls(config_name=task)
            except KeyError as exc:
                raise HarnessError(f"{self.path}: the official scorer has no config {task!r} ({exc})") from None
        try:
            return self._metrics[task].compute(predictions=predictions, references=references)
        except LookupError as exc:  # nltk's punkt data (rouge.py's sentence split) not installed
            first = (str(exc).strip().splitlines() or [type(exc).__name__])
            raise HarnessError(f"the official ZeroSCROLLS scorer needs data that is not installed: "
                               f"{' '.join(x.strip() for x in first[:4] if x.strip())[:200]}") from None

    def score(self, task: str, predictions: list[str], references: list[list[str]]) -> float:
        result = self.compute(task, predictions, references)
        if "zero_scrolls_score" not in result:
            raise HarnessError(f"{self.path}: the scorer's result for {task} has no zero_scrolls_score ({', '.join(result)})")
        return float(result["zero_scrolls_score"])


def _load(path: Path) -> types.ModuleType:
    """Import the metric folder as one package (its relative imports), `datasets` stood in for while it loads."""
    folder = path.parent
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]  # another scorer_dir, or the same one changed: load it afresh
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    package.__package__ = PACKAGE
    saved = {k: sys.modules.get(k) for k in ("datasets", "datasets.utils", "datasets.utils.file_utils")}
    shim = _stand_in()
    sys.modules.update({PACKAGE: package, "datasets": shim, "datasets.utils": shim.utils,
                        "datasets.utils.file_utils": shim.utils.file_utils})
    try:
        return importlib.import_module(f"{PACKAGE}.{path.stem}")
    except ModuleNotFoundError as exc:
        raise HarnessError(f"the official ZeroSCROLLS scorer in {folder} imports {exc.name!r}, which is not installed "
                           f"(it needs rouge-score, nltk with its punkt data and lifelines)") from None
    except SyntaxError as exc:
        raise HarnessError(f"{exc.filename}:{exc.lineno}: not valid Python ({exc.msg}); is task.scorer_dir the metric folder?") from None
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
