"""A run directory takes another grid (records are per item), comparison.md compares like with like, and the
checks that run before any model loads: protocol options a task does not apply, bad method options, budgets."""

from __future__ import annotations

import json

import pytest

from conftest import compose
from harness.app import execute
from harness.errors import HarnessError
from test_robustness import small_haystack

TINY = ("model=tiny-random", "progress=false", "task.max_new_tokens=2")
SNAP = "snapkv_c64_w32_k7_maxpool_expand"
STREAM = "streamingllm_c64_s4_mean"


def _lines(path):
    return path.read_text().splitlines()


@pytest.fixture
def counted(monkeypatch):
    """Counts the (cell, settings) the needle task computes: what `generate_settings` is asked for."""
    from harness.tasks import contract

    calls: list[tuple[int, int, tuple[str, ...]]] = []
    real = contract.generate_settings

    def spy(loaded, methods, prompt, **kw):
        calls.append((len(prompt.ids), prompt.spans["needle"][0], tuple(t for t, _ in methods)))
        return real(loaded, methods, prompt, **kw)

    monkeypatch.setattr(contract, "generate_settings", spy)
    return calls


def test_a_run_directory_takes_a_sub_grid_and_a_super_grid(tmp_path, counted, one_thread):
    base = [*TINY, f"task.haystack_dir={small_haystack(tmp_path / 'haystack')}"]
    run = tmp_path / "run"

    def go(*overrides):
        args = [*base, *overrides]
        return execute(compose(*args), run, overrides=args)

    # The "main job": two settings on a 2 x 3 grid.
    main = ["task.lengths=[128,192]", "task.depths=[0,50,100]", f"methods=[full,{{name: snapkv, budget: 64}}]"]
    go(*main)
    assert len(counted) == 6 and all(tags == ("full", SNAP) for *_, tags in counted)
    before = {t: _lines(run / t / "needle_cells.jsonl") for t in ("full", SNAP)}

    # A sub-grid with one more method: not refused, the held items are reused (only the new setting runs).
    counted.clear()
    sub = go("task.lengths=[192]", "task.depths=[50]", f"methods=[full,{{name: snapkv, budget: 64}},{{name: streamingllm, budget: 64}}]")
    assert [tags for *_, tags in counted] == [(STREAM,)]
    for t in ("full", SNAP):
        assert _lines(run / t / "needle_cells.jsonl") == before[t]  # nothing recomputed, nothing added
        results = json.loads((run / t / "results.json").read_text())
        summary = results["summary"]
        assert summary["cells"] == 1 and list(summary["by_length"]) == ["192"] and list(summary["by_depth"]) == ["50.0"]
        assert [(r["length"], r["depth"]) for r in results["rows"]] == [(192, 50.0)]
        assert sub["settings"][t]["summary"] == summary
        held = {(r["length"], r["depth"]): r for r in map(json.loads, before[t])}
        assert results["rows"][0]["response"] == held[(192, 50.0)]["response"]  # the held record, as it was

    # A super-grid: only the cells never computed run, for every setting that lacks them.
    counted.clear()
    go("task.lengths=[128,192,256]", "task.depths=[0,50,100]", f"methods=[full,{{name: snapkv, budget: 64}}]")
    assert len(counted) == 3 and {n for n, *_ in counted} == {256}
    for t in ("full", SNAP):
        now = _lines(run / t / "needle_cells.jsonl")
        assert now[:6] == before[t] and len(now) == 9
        summary = json.loads((run / t / "results.json").read_text())["summary"]
        assert summary["cells"] == 9 and list(summary["by_length"]) == ["128", "192", "256"]
        assert "- 256" in (run / t / "config.yaml").read_text()  # config.yaml holds the latest grid

    # comparison.md compares the latest run's settings; the streamingllm setting (1 cell, other grid) is left out.
    table = (run / "comparison.md").read_text()
    head, _, rest = table.partition("Left out")
    assert f"[full](full/results.json) | full | all | 9 |" in head and f"[{SNAP}]({SNAP}/results.json) | snapkv | 64 | 9 |" in head
    assert f"[{STREAM}]" not in head, table
    assert f"- {STREAM} (1 cell): task.depths: [50] -> [0, 50, 100]; task.lengths: [192] -> [128, 192, 256]" in rest, table
    index = json.loads((run / "methods.json").read_text())["settings"]
    assert {t: s["cells"] for t, s in index.items()} == {"full": 9, SNAP: 9, STREAM: 1}


def test_options_that_change_an_item_are_still_refused(tmp_path, one_thread):
    base = [*TINY, f"task.haystack_dir={small_haystack(tmp_path / 'haystack')}", "task.lengths=[128]", "task.depths=[50]"]
    run = tmp_path / "run"
    execute(compose(*base), run, overrides=base)
    for change, key in (("task.prompt_style=storybook", "task.prompt_style"), ("task.needle=' A needle. '", "task.needle"),
                        ("model.prefill_chunk_size=64", "model.prefill_chunk_size"), ("seed=3", "seed")):
        with pytest.raises(HarnessError, match=f"holds a run with a different config \\({key}: "):
            execute(compose(*base, change), run, overrides=[*base, change])


def test_comparison_leaves_out_another_prompt_style(tmp_path, one_thread):
    """The Gemma 3 case: a chat-prompt full run next to a completion-prompt SnapKV run is no comparison."""
    base = [*TINY, f"task.haystack_dir={small_haystack(tmp_path / 'haystack')}", "task.lengths=[128]", "task.depths=[50]"]
    run = tmp_path / "run"
    execute(compose(*base), run, overrides=base)
    other = [*base, "task.prompt_style=completion", "method=snapkv", "method.budget=64"]
    execute(compose(*other), run, overrides=other)
    head, _, rest = (run / "comparison.md").read_text().partition("Left out")
    assert f"[{SNAP}]" in head and "[full]" not in head and "prompt_style=completion" in head
    assert '- full (1 cell): task.prompt_style: "chat" -> "completion"' in rest


# ------------------------------------------------------------------------------- before any model loads


@pytest.fixture
def no_model(monkeypatch):
    import harness.models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(harness.models, "load_model", refuse)


@pytest.mark.parametrize("overrides, message", [
    (("task=observation_cpu", "model.prefill_chunk_size=64"),
     r"^task=observation does not apply model.prefill_chunk_size=64 \(it prefills in one forward\); drop it"),
    (("task=observation_cpu", "+task.query_aware=false"), r"^task=observation does not apply task.query_aware=false"),
    (("task=bench", "model.prefill_chunk_size=64"), r"^task=bench does not apply model.prefill_chunk_size=64"),
])
def test_a_protocol_option_a_task_does_not_apply_is_refused(tmp_path, no_model, overrides, message):
    args = ["model=tiny-random", *overrides]
    with pytest.raises(HarnessError, match=message):
        execute(compose(*args), tmp_path / "run", overrides=args)
    assert not (tmp_path / "run").exists()


def test_a_bad_budget_fails_before_a_model_without_known_layers_loads(tmp_path, no_model):
    """smollm2-135m (GGUF, no `architecture`): the layer count is known only once loaded."""
    for args, message in ((["method=snapkv", "method.budget=-5"], "method.budget=-5 must be larger than method.window_size=32"),
                          (["method=pyramidkv", "method.budget=20"], "must be >= method.beta=20"),
                          (["method=h2o", "method.budget=[64,-1]", "method.window_size=8"], "method.budget=-1 must be larger")):
        with pytest.raises(HarnessError, match=message):
            execute(compose(*args), tmp_path / "run", overrides=args)


@pytest.mark.parametrize("args, expected", [
    (["method.budgt=256"], "error: method full has no option 'budgt' (did you mean method.budget?); its options: budget, window_size, ratio"),
    (["method=snapkv", "method.kernel=5"], "error: method snapkv has no option 'kernel' (did you mean method.kernel_size?); "
                                           "its options: budget, ratio, window_size, kernel_size, pooling, gqa, decode_interval, "
                                           "decode_budget, decode_ratio, decode_queries, rerotate"),
    (["method=snapkv", "method.budget=256"], None),
    (["+method.extra=1"], None),                      # adding a key on purpose: Hydra decides
    (["-m", "method=full,snapkv", "method.budgt=1"], None),  # a sweep: every job reports its own error
    (["methods=[full]", "method.budgt=1"], "error: methods and method are exclusive: give each setting as a methods entry "
                                          "(e.g. 'methods=[full,{name: snapkv, budget: 512}]') instead of method.budgt=1"),
])
def test_a_mistyped_method_option_names_the_methods_options(args, expected):
    from harness.__main__ import unknown_method_option

    assert unknown_method_option(args) == expected


def test_needle_prompt_style_follows_the_chat_format():
    assert compose("model=gemma3-270m").task.prompt_style == "completion"  # a base model: chat_format none
    assert compose().task.prompt_style == "chat"
    assert compose("model=gemma3-270m", "task.prompt_style=chat").task.prompt_style == "chat"
    assert compose("model=tiny-random", "model.chat_format=inst").task.prompt_style == "chat"
