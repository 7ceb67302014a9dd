"""`methods=[...]`: several settings in one process, each written as a separate `method=<entry>` run writes it;
shared knobs across methods (budget sweeps with `full`), ratio budgets and their tags, the sweep's job directory."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from conftest import compose
from harness.app import execute
from harness.errors import HarnessError
from harness.methods import build_method
from harness.rundir import result_key_differences
from harness.settings import compose_settings, job_dirname, method_entries, override_value
from test_robustness import small_haystack

TINY = ("model=tiny-random", "progress=false")


def _container(cfg) -> dict:
    out = OmegaConf.to_container(cfg, resolve=True)
    out.pop("methods", None)
    return out


# ---------------------------------------------------------------------------------------------- composition


def test_each_setting_equals_the_separate_run():
    """A setting's config is what `python -m harness <same overrides> method=<name> method.<k>=<v>` composes,
    presets' `defaults:` included, whatever the entry's form."""
    base = [*TINY, "task.lengths=[128]", "+experiment=smoke_needle"]
    entries_text = "methods=[full,{name: snapkv_needle, budget: 512, gqa: mean},{name: h2o, ratio: 0.2},streamingllm]"
    cfg = compose(*base, entries_text)
    entries = method_entries(cfg, [*base, entries_text])
    settings = compose_settings(entries, [*base, entries_text])
    separate = [
        compose(*base, "method=full"),
        compose(*base, "method=snapkv_needle", "method.budget=512", "method.gqa=mean"),
        compose(*base, "method=h2o", "method.ratio=0.2"),
        compose(*base, "method=streamingllm"),
    ]
    assert [tag for tag, _ in settings] == [str(c.method.tag) for c in separate] == [
        "full", "snapkv_c512_w16_k5_maxpool_mean", "h2o_r0.2_whalf_expand", "streamingllm_c256_s4_mean"]
    for (tag, got), want in zip(settings, separate):
        assert _container(got) == _container(want), tag
        assert got.methods is None
    # the experiment's `method.budget: 256` applies to every setting, as it does to a separate run
    assert settings[0][1].method.budget == 256 and settings[3][1].method.budget == 256


def test_entries_resolving_to_one_tag_run_once():
    ov = [*TINY, "methods=[full,{name: full, budget: 64},snapkv,{name: snapkv, budget: 1024}]"]
    tags = [tag for tag, _ in compose_settings(method_entries(compose(*ov), ov), ov)]
    assert tags == ["full", "snapkv_c1024_w32_k7_maxpool_expand"]


@pytest.mark.parametrize("overrides,message", [
    (["methods=[full,snapkv]", "method=snapkv"], r"methods and method are exclusive: .* instead of method=snapkv"),
    (["methods=[full,snapkv]", "method.budget=512"], r"methods and method are exclusive: .* instead of method\.budget=512"),
    (["methods=[]"], r"methods is empty"),
    (["methods=[full,nope]"], r"methods\[1\]: unknown method 'nope'; available: .*snapkv"),
    (["methods=[{budget: 3}]"], r"methods\[0\]: .* neither a method config name nor a mapping with name"),
    (["methods=[{name: snapkv, budgett: 3}]"], r"methods\[0\]: method 'snapkv' has no option 'budgett'; its options: .*budget"),
])
def test_bad_methods_lists(overrides, message):
    ov = [*TINY, *overrides]
    with pytest.raises(HarnessError, match=message):
        compose_settings(method_entries(compose(*ov), ov), ov)


def test_the_default_method_is_not_given():
    ov = [*TINY, "methods=[snapkv]"]
    assert compose(*ov).method.name == "full"  # conf/config.yaml's default, not the command line's
    assert method_entries(compose(*ov), ov) == [{"name": "snapkv"}]
    assert method_entries(compose(*TINY), list(TINY)) is None


@pytest.mark.parametrize("value,text", [(None, "null"), (True, "true"), (512, "512"), (0.25, "0.25"), ("maxpool", "maxpool"),
                                        ("true", "'true'"), ("a b", "'a b'"), ("it's", "'it\\'s'"), ([512, 256], "[512,256]"),
                                        ("${kv.half:${.budget}}", "'${kv.half:${.budget}}'")])
def test_override_values(value, text):
    assert override_value(value) == text
    parsed = compose(*TINY, "method=snapkv", f"method.pooling={text}").method.pooling
    assert parsed == value or isinstance(value, str) and value.startswith("${")


# ------------------------------------------------------------------------------------ shared knobs, ratio, tags


@pytest.mark.parametrize("sweep", [("full", "snapkv"), ("snapkv", "streamingllm"), ("full", "streamingllm", "h2o", "pyramidkv")])
@pytest.mark.parametrize("shared", ["method.budget=64", "method.window_size=4", "method.budget=null method.ratio=0.5"])
def test_a_shared_override_composes_for_every_method(sweep, shared):
    """`-m method=a,b <shared>`: every job composes and builds (issue 11 item 4)."""
    from harness.methods.h2o import H2O

    for name in sweep:
        cfg = compose(*TINY, f"method={name}", *shared.split())
        if name == "h2o" and "ratio" in shared and not getattr(H2O, "WINDOW_FROM_BUDGET", False):
            with pytest.raises(HarnessError, match="window_size is null"):  # see the next test
                build_method(cfg.method)
            continue
        method = build_method(cfg.method)
        assert str(cfg.method.tag)
        if name == "full":
            assert cfg.method.tag == "full" and not method.compresses
            for key, value in (kv.split("=") for kv in shared.split()):
                assert str(getattr(method, key.split(".")[1])).lower().replace("none", "null") == value  # recorded


def test_full_ignores_the_shared_knobs_on_resume():
    a = OmegaConf.to_container(compose(*TINY, "method=full", "method.budget=512"), resolve=True)
    b = OmegaConf.to_container(compose(*TINY, "method=full", "method.budget=1024", "method.window_size=8"), resolve=True)
    assert result_key_differences(a, b) == []
    c = OmegaConf.to_container(compose(*TINY, "method=snapkv", "method.budget=512"), resolve=True)
    assert "method.budget" in result_key_differences(c, OmegaConf.to_container(compose(*TINY, "method=snapkv"), resolve=True))


@pytest.mark.parametrize("overrides,tag,budget", [
    (["method=snapkv"], "snapkv_c1024_w32_k7_maxpool_expand", 1024),
    (["method=snapkv", "method.ratio=0.25"], "snapkv_r0.25_w32_k7_maxpool_expand", None),
    (["method=snapkv_needle"], "snapkv_c1024_w16_k5_maxpool_expand", 1024),
    (["method=h2o"], "h2o_c1024_w512_expand", 1024),
    (["method=h2o", "method.budget=256"], "h2o_c256_w128_expand", 256),
    (["method=h2o", "method.ratio=0.2"], "h2o_r0.2_whalf_expand", None),
    (["method=h2o_longbench_c4096"], "h2o_c4096_w8_expand", 4096),
    (["method=pyramidkv", "method.ratio=0.1"], "pyramidkv_r0.1_w8_k7_maxpool_b20_expand", None),
    (["method=streamingllm"], "streamingllm_c1024_s4_mean", 1024),
    (["method=streamingllm", "method.variant=kvcache_factory", "method.window_size=8"], "streamingllm_c1024_kvcf_w8_mean", 1024),
])
def test_tags_say_budget_or_ratio(overrides, tag, budget):
    cfg = compose(*TINY, *overrides)
    assert cfg.method.tag == tag and cfg.method.budget == budget


def test_budget_and_ratio_are_exclusive():
    with pytest.raises(HarnessError, match=r"^method\.budget=512 and method\.ratio=0\.25 are exclusive"):
        build_method(compose(*TINY, "method=snapkv", "method.budget=512", "method.ratio=0.25").method)
    with pytest.raises(HarnessError, match=r"^method snapkv needs method\.budget \(tokens kept per head per layer\) or method\.ratio"):
        build_method(compose(*TINY, "method=snapkv", "method.budget=null").method)
    with pytest.raises(HarnessError, match=r"^method\.ratio=1\.5 must be a number in \(0, 1\]"):
        build_method(compose(*TINY, "method=snapkv", "method.ratio=1.5").method)
    with pytest.raises(HarnessError, match=r"exclusive"):  # a preset is defined by its budget
        build_method(compose(*TINY, "method=snapkv_longbench_c2048", "method.ratio=0.25").method)
    assert build_method(compose(*TINY, "method=snapkv", "method.ratio=0.25").method).ratio == 0.25
    build_method(compose(*TINY, "method=full", "method.budget=512", "method.ratio=0.25").method)  # full: no-ops


def test_h2o_with_a_ratio_takes_half_of_the_resolved_budget_as_window():
    from harness.methods.h2o import H2O

    cfg = compose(*TINY, "method=h2o", "method.ratio=0.2")
    assert cfg.method.window_size is None
    if not getattr(H2O, "WINDOW_FROM_BUDGET", False):
        with pytest.raises(HarnessError, match=r"^method h2o: method\.window_size is null .* give method\.window_size=<tokens>"):
            build_method(cfg.method)
        return
    method = build_method(cfg.method)
    method.validate(2, 4096)
    resolved = method.resolve(1000)
    assert resolved.budget == 200 and resolved.window_size == 100


def test_modern_streamingllm_is_kvcache_factorys_setting():
    cfg = compose("+experiment=modern_streamingllm", "method.budget=128")
    assert cfg.method.variant == "kvcache_factory" and cfg.method.window_size == 124  # run_longbench.py: C - 4
    assert cfg.method.tag == "streamingllm_c128_kvcf_w124_expand"


# ------------------------------------------------------------------------------------------ sweep directories


def test_job_dirname_leaves_out_the_method_keys():
    keys = ["task.data_dir", "resume"]
    assert job_dirname(["method=snapkv", "method.budget=64", "model=tiny-random", "task.depths=[0,100]", "resume=false"], keys) == \
        "model=tiny-random,task.depths=[0,100]"
    assert job_dirname(["methods=[full,snapkv]", "+method.foo=1", "seed=1"], keys) == "seed=1"
    assert job_dirname([], keys) == ""


def test_sweep_subdir_resolves_per_job():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from harness import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["model=tiny-random", "method=snapkv", "method.budget=64", "resume=false"],
                            return_hydra_config=True)
    assert list(cfg.hydra.overrides.task) == ["model=tiny-random", "method=snapkv", "method.budget=64", "resume=false"]
    assert cfg.hydra.sweep.subdir == "model=tiny-random"  # the method keys, and resume (exclude_keys), left out


# ---------------------------------------------------------------------------------------- one run, many settings


def test_methods_run_writes_what_separate_runs_write_and_resumes_them(tmp_path, one_thread):
    haystack = small_haystack(tmp_path / "haystack")
    base = [*TINY, "task.lengths=[128]", "task.depths=[0]", "task.max_new_tokens=3", f"task.haystack_dir={haystack}"]
    run = tmp_path / "run"
    # A separate run first: its item is not redone by the methods run.
    single = execute(compose(*base, "method=snapkv", "method.budget=64"), run, overrides=[*base, "method=snapkv", "method.budget=64"])
    tag = "snapkv_c64_w32_k7_maxpool_expand"
    assert single["method_tag"] == tag and (run / tag / "results.json").exists()
    cells = (run / tag / "needle_cells.jsonl").read_text()
    listing = "methods=[full,{name: snapkv, budget: 64},{name: streamingllm, budget: 64}]"
    out = execute(compose(*base, listing), run, overrides=[*base, listing])
    tags = ["full", tag, "streamingllm_c64_s4_mean"]
    assert list(out["settings"]) == tags and out["failures"] == 0
    assert (run / tag / "needle_cells.jsonl").read_text() == cells  # resumed: nothing redone, nothing added
    for t in tags:
        results = json.loads((run / t / "results.json").read_text())
        assert results["method_tag"] == t and results["status"] == "complete" and results["summary"]["cells"] == 1
        stored = OmegaConf.to_container(OmegaConf.load(run / t / "config.yaml"))
        name, options = {"full": ("full", []), tag: ("snapkv", ["method.budget=64"]),
                         "streamingllm_c64_s4_mean": ("streamingllm", ["method.budget=64"])}[t]
        assert stored == OmegaConf.to_container(compose(*base, f"method={name}", *options), resolve=True)
        assert all("_code" in json.loads(line) for line in (run / t / "needle_cells.jsonl").read_text().splitlines())
    index = json.loads((run / "methods.json").read_text())
    assert list(index["settings"]) == tags and {s["dir"] for s in index["settings"].values()} == set(tags)
    table = (run / "comparison.md").read_text()
    assert all(f"[{t}]({t}/results.json)" in table for t in tags) and "keyword_recall" in table
    # The separate run of a setting the methods run made resumes it in turn.
    again = execute(compose(*base, "method=full"), run, overrides=[*base, "method=full"])
    assert again["summary"]["cells"] == 1
    assert len((run / "full" / "needle_cells.jsonl").read_text().splitlines()) == 1
