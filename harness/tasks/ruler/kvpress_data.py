"""kvpress's pre-generated RULER (`task.source=kvpress`): the hub dataset behind kvpress's leaderboard.

`simonjegou/ruler` (kvpress/evaluation/benchmarks/ruler/create_huggingface_dataset.py at 8bb29b9c) holds one
config per context length ("4096", "8192", "16384"), split "test", written by `Dataset.push_to_hub` as
`<length>/test-<k>-of-<n>.parquet`. Each row: `context` (RULER's base-template input up to the last match of the
task's question pattern), `question` (up to the answer pattern: it keeps RULER's trailing space), `answer_prefix`,
`answer` (RULER's `outputs`: a list of references), `task` (RULER's task name) and `max_new_tokens` (kvpress's
per-family budget). 500 rows per task, generated with Llama-3.1-8B's tokenizer (kvpress's note: lengths are
that tokenizer's, whatever model runs them). A sample here is the n-th row of its task in the file order, so the
first `task.samples` rows of each task run unchanged; the model input is built from the three text columns as
kvpress's pipeline builds it (harness.tasks.ruler.task.Tokenized, split `kvpress`).
"""

from __future__ import annotations

import re

from omegaconf import DictConfig

from harness.errors import HarnessError
from harness.tasks.hub_files import data_files
from harness.tasks.ruler.data import ANSWER_PATTERNS, TASKS, Sample

HUB_REPO = "simonjegou/ruler"
COLUMNS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")


def read_rows(task: DictConfig, length: int, names: list[str], samples: int) -> tuple[dict[str, list[dict]], str]:
    """({task name: its first `samples` rows in file order}, origin) of the config `length`."""
    import pyarrow.parquet as pq

    paths, origin = data_files(task, str(length), "test-", ".parquet", "kvpress's RULER (simonjegou/ruler)")
    rows: dict[str, list[dict]] = {name: [] for name in names}
    for path in paths:
        table = pq.read_table(path)
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise HarnessError(f"{path}: no column {', '.join(missing)}; kvpress's RULER files have {', '.join(COLUMNS)}")
        for row in table.select(list(COLUMNS)).to_pylist():
            part = rows.get(row["task"])
            if part is not None and len(part) < samples:
                part.append(row)
    short = {name: len(r) for name, r in rows.items() if len(r) < samples}
    if short:
        have = ", ".join(f"{n}: {k}" for n, k in short.items())
        raise HarnessError(f"kvpress's RULER {length} ({origin}) has fewer rows than task.samples={samples} ({have}); "
                           "lower task.samples or leave those tasks out of task.tasks")
    return rows, origin


def sample_from_row(name: str, index: int, row: dict) -> Sample:
    """The row as a Sample: text = context + question + answer prefix, split after the context (kvpress's cut)."""
    context, question, prefix = str(row["context"]), str(row["question"]), str(row["answer_prefix"])
    family = TASKS[name][0]
    found = re.search(ANSWER_PATTERNS[family], question + prefix)
    if found is None or found.start() != len(question):
        raise HarnessError(f"kvpress's RULER {name} row {index}: the answer prefix does not start where the task's answer "
                           f"pattern {ANSWER_PATTERNS[family]!r} first matches; not kvpress's cut")
    references = [str(a) for a in (row["answer"] or [])]
    if not references:
        raise HarnessError(f"kvpress's RULER {name} row {index}: no reference in `answer`")
    return Sample(task=name, index=index, text=context + question + prefix, references=references, answer_prefix=prefix,
                  needles=[], context=context, tokens_to_generate=int(row["max_new_tokens"]), question_start=len(context))
