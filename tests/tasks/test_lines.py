"""task=lines (LongEval-Lines, the SnapKV pooling ablation): deterministic generation and its format, exact-match
scoring, the no-pooling preset, and a tiny end-to-end run through the CLI (resume, heatmap, report section)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import compose, run_cli
from harness.tasks import contract
from harness.tasks.lines import task as lines

pytestmark = pytest.mark.usefixtures("one_thread")
LINE = re.compile(r"^line ([a-z]+-[a-z]+): REGISTER_CONTENT is <(\d{5})>$")


def test_word_lists_and_sequences_are_deterministic():
    adjectives, nouns = lines.word_lists()
    assert len(adjectives) >= 200 and len(nouns) >= 200
    a = lines.line_sequence(0, 0)
    assert a == lines.line_sequence(0, 0)
    assert a[:50] != lines.line_sequence(0, 1)[:50] and a[:50] != lines.line_sequence(1, 0)[:50]
    keys = [k for k, _ in a]
    assert len(set(keys)) == len(keys) == len(adjectives) * len(nouns)
    assert all(10000 <= v <= 99999 for _, v in a)
    # pinned: the same records on every machine and Python version (string seed)
    lines.line_sequence.cache_clear()
    assert lines.line_sequence(0, 0)[:3] == a[:3]


def test_prompt_format_fit_and_positions(tiny_random):
    task = compose("task=lines").task
    tok = tiny_random.tokenizer
    ids, info = lines.build_prompt(task, tiny_random, 1024, 50, 0)
    assert (ids, info) == lines.build_prompt(task, tiny_random, 1024, 50, 0)       # deterministic
    assert len(ids) <= 1024
    n = info["n_lines"]
    seq = lines.line_sequence(0, 0)
    # as many lines as fit: one more would not
    more = tiny_random.encode(tiny_random.format_chat([{"role": "user", "content": lines.record_text(task, list(seq[:n + 1]), 0)[0]}]))
    assert len(more) > 1024
    text = tok.decode(ids)
    body = [ln for ln in text.splitlines() if ln.startswith("line ")]
    assert len(body) == n and all(LINE.match(ln) for ln in body)
    assert info["target_index"] == round(0.5 * (n - 1)) and info["key"] == seq[info["target_index"]][0]
    assert f"REGISTER_CONTENT of line {info['key']}?" in text
    assert LINE.match(body[info["target_index"]]).groups() == (info["key"], str(info["expected"]))
    s, e = info["line_span"]
    assert info["key"] in tok.decode(ids[s:e]) and str(info["expected"]) in tok.decode(ids[s:e])
    assert lines.build_prompt(task, tiny_random, 1024, 0, 0)[1]["target_index"] == 0
    assert lines.build_prompt(task, tiny_random, 1024, 100, 0)[1]["target_index"] == n - 1
    longer = lines.build_prompt(task, tiny_random, 2048, 50, 0)[1]
    assert longer["n_lines"] > n


@pytest.mark.parametrize("response, expected, correct, parsed, contains", [
    ("The REGISTER_CONTENT of line tender-harbor is <48213>.", 48213, True, 48213, True),
    ("48213", 48213, True, 48213, True),
    ("It is 48213, or maybe 12345", 48213, False, 12345, True),    # LongEval: the last number counts
    ("I do not know.", 48213, False, None, False),
    ("<4821>", 48213, False, 4821, False),
])
def test_exact_match_scoring(response, expected, correct, parsed, contains):
    got = lines.score_record(response, expected)
    assert got == {"score": float(correct), "correct": correct, "parsed": parsed, "contains": contains}


def test_pooling_presets_and_kernel_one_is_no_pooling():
    from harness.methods import build_method
    from harness.methods.snapkv import snapkv_votes, window_attention

    pool = build_method(compose("method=snapkv_lines_maxpool").method)
    nopool = build_method(compose("method=snapkv_lines_nopool").method)
    assert (pool.window_size, pool.kernel_size, pool.pooling) == (16, 5, "maxpool")
    assert (nopool.window_size, nopool.kernel_size) == (16, 1)
    nopool.validate(30, 8192)   # kernel 1 is odd and positive: accepted
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    raw = window_attention(q, k, 16)[..., :-16].sum(dim=-2)
    torch.testing.assert_close(snapkv_votes(q, k, window_size=16, kernel_size=1, pooling="maxpool"), raw)


def test_bad_settings_fail_in_one_line(tmp_path):
    proc = run_cli("task=lines", "model=tiny-random", "task.positions=[120]", f"hydra.run.dir={tmp_path / 'r'}")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == "error: task.positions: 120 is outside [0, 100]"


def test_lines_end_to_end_cli_resume_heatmap_and_report(tmp_path):
    base = ("task=lines", "model=tiny-random", "task.lengths=[256,384]", "task.positions=[0,100]", "task.max_new_tokens=4",
            "progress=false")
    runs = {}
    for preset in ("snapkv_lines_maxpool", "snapkv_lines_nopool"):
        proc = run_cli(*base, f"method={preset}", "method.budget=64", f"hydra.run.dir={tmp_path / 'runs'}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[preset] = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir() and f"_k{5 if 'max' in preset else 1}_" in p.name)
    res = json.loads((runs["snapkv_lines_nopool"] / "results.json").read_text())
    assert res["task"] == "lines" and res["method"]["kernel_size"] == 1
    s = res["summary"]
    assert s["cells"] == 4 and set(s["by_length"]) == {"256", "384"} and 0 <= s["accuracy"] <= 1
    row = res["rows"][0]
    assert row["prompt_tokens"] <= row["length"] and set(row) >= {"expected", "parsed", "score", "response", "key", "n_lines"}
    assert (runs["snapkv_lines_nopool"] / "lines_heatmap.png").exists() and (runs["snapkv_lines_nopool"] / "lines_cells.csv").exists()
    log_file = runs["snapkv_lines_nopool"] / lines.LOG_FILE
    again = run_cli(*base, "method=snapkv_lines_nopool", "method.budget=64", f"hydra.run.dir={tmp_path / 'runs'}")
    assert again.returncode == 0 and len(log_file.read_text().splitlines()) == 4

    from harness.report import collect
    from harness.tasks.lines.report import lines_section

    found, _ = collect(tmp_path / "runs")
    out = tmp_path / "tables"
    out.mkdir()
    md = lines_section(found, out)
    assert "Pooling ablation" in md and "no pooling" in md and len(list((out / "lines").glob("*.png"))) == 2


def test_question_start_splits_the_lines_from_the_question(tiny_random):
    task = compose("task=lines").task
    tok = tiny_random.tokenizer
    ids, info = lines.build_prompt(task, tiny_random, 512, 50, 0)
    split = info["question_start"]
    question = task.question.format(key=info["key"])
    after, before = tok.decode(ids[split:]), tok.decode(ids[:split])
    assert after.lstrip().startswith(question.strip()[:20]) and question.strip() in after
    last_key, last_value = lines.line_sequence(0, 0)[info["n_lines"] - 1]
    assert before.rstrip().endswith(f"line {last_key}: REGISTER_CONTENT is <{last_value}>")
    assert info["line_span"][1] <= split


def test_lines_applies_both_protocols_and_chunked_prefill(tmp_path, monkeypatch):
    """task.query_aware=false and model.prefill_chunk_size reach the engine (they were ignored): the question is
    prefilled after compression (question_kept 1, the asked line's retention recorded), chunks give one-shot's tokens."""
    from harness.app import execute

    seen = []
    real = contract.generate_settings

    def spy(loaded, methods, prompt, **kw):
        seen.append((kw.get("query_aware"), kw.get("chunk_size"), prompt.question_start))
        return real(loaded, methods, prompt, **kw)

    monkeypatch.setattr(contract, "generate_settings", spy)
    base = ["task=lines", "model=tiny-random", "task.lengths=[320]", "task.positions=[50]", "task.max_new_tokens=4",
            "progress=false", "methods=[full,{name: snapkv, budget: 64}]"]
    records = {}
    for name, extra in (("aware", []), ("agnostic", ["task.query_aware=false"]),
                        ("agnostic_chunked", ["task.query_aware=false", "model.prefill_chunk_size=96"])):
        args = [*base, *extra]
        execute(compose(*args), tmp_path / name, overrides=args)
        records[name] = {t: json.loads((tmp_path / name / t / lines.LOG_FILE).read_text().splitlines()[0])
                         for t in ("full", "snapkv_c64_w32_k7_maxpool_expand")}
    assert [(qa, chunk) for qa, chunk, _ in seen] == [(True, None), (False, None), (False, 96)]
    assert all(0 < start < 320 for *_, start in seen)
    aware, agnostic = records["aware"]["snapkv_c64_w32_k7_maxpool_expand"], records["agnostic"]["snapkv_c64_w32_k7_maxpool_expand"]
    assert aware["protocol"] == "query_aware" and agnostic["protocol"] == "query_agnostic"
    # query-aware: the question was inside the 64 kept positions' competition and lost some (this model, these seeds);
    # query-agnostic: it is prefilled after compression, whole
    assert aware["question_kept"] < 1 and agnostic["question_kept"] == 1.0
    assert "line_kept" in agnostic and aware["question_start"] == agnostic["question_start"] == seen[0][2]
    for tag, record in records["agnostic_chunked"].items():
        assert record["response"] == records["agnostic"][tag]["response"], tag
        assert record.get("line_kept_by_layer") == records["agnostic"][tag].get("line_kept_by_layer"), tag
    summary = json.loads((tmp_path / "agnostic_chunked" / "full" / "results.json").read_text())["summary"]
    assert summary["protocol"] == "query_agnostic" and summary["prefill_chunk_size"] == 96
