"""One method's own failure fails its setting alone: the other settings of the shared prefill compress and decode
on, each still equal to its separate run (engine.Session.guarded, common._generate_group).

A 46-setting grid (conf/experiment/ruler_methods_cpu.yaml) must not lose every setting's sample because one method
raised: before this, CAKE's budget overshoot at ratio 0.75 failed 10 of 11 RULER samples for all 46 settings.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import pytest

from harness.methods import build_method
from harness.methods.cake import CAKE
from harness.methods.snapkv import SnapKV
from harness.generation.generate import generate_settings
from harness.generation.prompt import Prompt
from test_many_questions import loaded_of, tokens
from tiny_models import tiny_model

CONTEXT, QUESTION, NEW = 96, 16, 5


@dataclass
class BrokenInLayer(SnapKV):
    """SnapKV that raises in layer 1's selection (a per-layer method failing mid-prefill)."""

    def select(self, keys, values, stats):
        if stats.layer_idx == 1:
            raise RuntimeError("broken selection in layer 1")
        return super().select(keys, values, stats)


@dataclass
class BrokenFinish(CAKE):
    """CAKE that raises once every layer is summarised (an across-layer method failing after the prefill)."""

    def finish(self, summaries, layers, num_layers, context=None):
        raise RuntimeError("broken allocation")


def healthy() -> list[tuple[str, object]]:
    return [("snapkv", build_method({"name": "snapkv", "budget": 40, "window_size": 8, "kernel_size": 5, "pooling": "maxpool"})),
            ("h2o", build_method({"name": "h2o", "budget": 40, "window_size": 8})),
            ("cake", build_method({"name": "cake", "budget": 40, "window_size": 8})),
            ("full", build_method({"name": "full"}))]


def prompt() -> Prompt:
    ids = tokens(CONTEXT + QUESTION, 5)
    return Prompt(ids, CONTEXT, {"question": (CONTEXT, len(ids))})


@pytest.mark.parametrize("query_aware", [True, False])
def test_a_failing_method_fails_its_setting_alone(query_aware, one_thread):
    loaded = loaded_of(tiny_model("llama"))
    broken = [("broken_layer", BrokenInLayer(budget=40, window_size=8)), ("broken_finish", BrokenFinish(budget=40, window_size=8))]
    alone = generate_settings(loaded, healthy(), prompt(), query_aware=query_aware, max_new_tokens=NEW)
    mixed = generate_settings(loaded, [broken[0], *healthy()[:2], broken[1], *healthy()[2:]], prompt(),
                              query_aware=query_aware, max_new_tokens=NEW)
    for tag, message, where in [("broken_layer", "broken selection in layer 1", "select"),
                                ("broken_finish", "broken allocation", "finish")]:
        out = mixed[tag]
        assert out.generation is None and isinstance(out.error, RuntimeError) and str(out.error) == message
        assert out.error.__traceback__ is None  # its frames (the layers it was reading) are released
        assert f"in {where}" in "".join(traceback.format_exception(out.error))  # the traceback kept as text
    for tag, _ in healthy():
        assert mixed[tag].error is None
        assert mixed[tag].generation.tokens == alone[tag].generation.tokens, tag
        assert mixed[tag].kept.keys() == alone[tag].kept.keys()


def test_the_only_method_failing_still_fails_the_item(one_thread):
    """A lone method compresses the one cache in place: its error ends the forward, as before."""
    loaded = loaded_of(tiny_model("llama"))
    with pytest.raises(RuntimeError, match="broken selection in layer 1"):
        generate_settings(loaded, [("broken_layer", BrokenInLayer(budget=40, window_size=8))], prompt(), max_new_tokens=NEW)
