"""KVzip from its definitions: the replay inputs, the reconstruction score (a softmax over sinks, the
chunk and the replay's own keys, written here with plain loops), the global pruning, and the extra
forwards it costs, counted per item."""

from __future__ import annotations

import math

import pytest
import torch

from harness.errors import HarnessError
from harness.methods import build_method
from harness.methods.kvzip import reconstruction_scores, replay_inputs, replay_start

# The replay prompts as KVzip's code writes them (kvpress 0.5.5 KVzipPress._chunk_context / the authors' self_task;
# the authors' later prompt ends with a space, kvpress's does not: we follow kvpress), written out here, not imported.
FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"


class Chars:
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_replay_inputs_chunk_the_context_after_the_prefix():
    context = list(range(1000, 1025))  # 25 ids, prefix of 3, chunks of 10
    out = replay_inputs(context, prefix_length=3, chunk_size=10, suffix=[7, 7], tokenizer=Chars())
    assert [(a, b) for a, b, _ in out] == [(3, 13), (13, 23), (23, 25)]
    first = [ord(c) for c in FIRST] + [7, 7] + context[3:13]
    second = [ord(c) for c in LATER] + context[5:13] + [7, 7] + context[13:23]  # last 8 ids of chunk 1
    assert out[0][2] == first and out[1][2] == second
    assert out[2][2][-2:] == context[23:25]


def test_reconstruction_score_is_the_max_softmax_over_sinks_chunk_and_own_keys():
    torch.manual_seed(0)
    b, hq, hkv, q_len, d, length = 1, 4, 2, 3, 5, 12
    start, end, n_sink = 6, 9, 2
    query = torch.randn(b, hq, q_len, d)
    key = torch.randn(b, hkv, length + q_len, d)  # the context, then the replay's own keys
    got = reconstruction_scores(query, key, start, end, n_sink, scaling=d ** -0.5)
    columns = list(range(n_sink)) + list(range(start, end))
    for g in range(hkv):
        for j_pos, j in enumerate(range(start, end)):
            best = 0.0
            for h in range(g * 2, g * 2 + 2):
                for i in range(q_len):
                    visible = columns + [length + t for t in range(i + 1)]  # causal among the replay tokens
                    logits = [float(query[0, h, i] @ key[0, g, c]) / math.sqrt(d) for c in visible]
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    best = max(best, weights[n_sink + j_pos] / sum(weights))
            assert math.isclose(float(got[0, g, j_pos]), best, rel_tol=1e-4), (g, j)


def test_kvzip_prunes_globally_keeps_sinks_and_counts_its_forwards():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_engine import loaded_of, prompt_ids  # noqa: E402

    from conftest import tiny_model
    from harness.generation.generate import generate_settings
    from harness.generation.prompt import Prompt

    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    method = build_method({"name": "kvzip", "budget": None, "ratio": 0.25, "window_size": 0, "n_sink": 4, "chunk_size": 64,
                           "layerwise": False, "kvzip_plus_normalization": False})
    out = generate_settings(loaded_of(model), [("z", method)], Prompt(prompt_ids()[0].tolist()), max_new_tokens=2)["z"]
    assert out.error is None
    diag = out.diagnostics
    assert diag["reconstruction_forwards"] == 3  # 160 tokens in chunks of 64
    first, later = len(FIRST), len(LATER)  # CharTokenizer: one id per character
    assert diag["reconstruction_tokens"] == (first + 1 + 64) + (later + 8 + 1 + 64) + (later + 8 + 1 + 32)
    kept = {i: int((p >= 0).sum()) for i, p in out.kept.items()}
    pairs = 2 * 2 * 160  # layers x KV heads x positions
    assert sum(kept.values()) == pairs - int(pairs * 0.75)
    for positions in out.kept.values():
        for h in range(2):
            assert positions[0, h, :4].tolist() == [0, 1, 2, 3]  # sinks never evicted
    # stored ragged: the cache holds exactly the kept pairs (2 layers, K and V, 16 dims, float32)
    assert diag["cache_bytes"] == sum(kept.values()) * 16 * 2 * 4


def test_kvzip_settings_of_several_budgets_share_one_replay(monkeypatch):
    """The replay's scores do not depend on the budget: a methods list with kvzip at two ratios replays the
    context once, and each setting's kept positions and tokens equal its separate run's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_engine import loaded_of, prompt_ids  # noqa: E402

    from conftest import tiny_model
    from harness.methods import engine
    from harness.generation.generate import generate_settings
    from harness.generation.prompt import Prompt

    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    options = {"name": "kvzip", "budget": None, "window_size": 0, "n_sink": 4, "chunk_size": 64, "layerwise": False,
               "kvzip_plus_normalization": False}
    methods = [(f"z{r}", build_method({**options, "ratio": r})) for r in (0.25, 0.5)]
    replays, original = [], engine.FinishContext.replay

    def counting(self, *args, **kwargs):
        replays.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(engine.FinishContext, "replay", counting)
    prompt, loaded = Prompt(prompt_ids()[0].tolist()), loaded_of(model)
    shared = generate_settings(loaded, methods, prompt, max_new_tokens=3)
    assert len(replays) == 3  # one replay (3 chunk forwards) for both settings
    for tag, method in methods:
        alone = generate_settings(loaded, [(tag, method)], prompt, max_new_tokens=3)[tag]
        assert shared[tag].generation.tokens == alone.generation.tokens
        assert all(torch.equal(shared[tag].kept[i], alone.kept[i]) for i in alone.kept)
        assert shared[tag].diagnostics["reconstruction_forwards"] == alone.diagnostics["reconstruction_forwards"] == 3
    assert sum(int((p >= 0).sum()) for p in shared["z0.25"].kept.values()) < sum(int((p >= 0).sum()) for p in shared["z0.5"].kept.values())


def test_replay_start_rules():
    prefix = [5, 6, 7]
    # ours: the prefix is skipped only where the prompt opens with it
    assert replay_start([5, 6, 7, 1, 2], prefix, "if_present") == 3
    assert replay_start([9, 5, 6, 7, 1], prefix, "if_present") == 0
    # kvpress: as many positions as the prefix has tokens, whatever the prompt holds
    assert replay_start([9, 5, 6, 7, 1], prefix, "always") == 3
    assert replay_start([9, 8], prefix, "always") == 2
    assert replay_start([1, 2], [], "always") == replay_start([1, 2], [], "if_present") == 0
    with pytest.raises(HarnessError, match="template_prefix"):
        build_method({"name": "kvzip", "budget": 64, "template_prefix": "never"}).validate(2, 4096)


def test_sink_rules_ours_and_kvpress(one_thread):
    """Ours protects the first n_sink positions always; kvpress's rule only those before the replayed context (its
    chunks' scores overwrite the rest). With no chat template the replay starts at 0: kvpress protects nothing, so
    at a small ratio the first positions can go; ours keeps them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_engine import loaded_of, prompt_ids  # noqa: E402

    from conftest import tiny_model
    from harness.generation.generate import generate_settings
    from harness.generation.prompt import Prompt

    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    options = {"name": "kvzip", "budget": None, "ratio": 0.1, "window_size": 0, "n_sink": 4, "chunk_size": 64}
    kept = {}
    for rule in ("always", "kvpress"):
        method = build_method({**options, "sink_rule": rule})
        out = generate_settings(loaded_of(model), [("z", method)], Prompt(prompt_ids()[0].tolist()), max_new_tokens=1)["z"]
        kept[rule] = [set(p[0, h][p[0, h] >= 0].tolist()) for p in out.kept.values() for h in range(2)]
    assert all({0, 1, 2, 3} <= heads for heads in kept["always"])
    assert any(not {0, 1, 2, 3} <= heads for heads in kept["kvpress"])
    assert build_method({**options, "sink_rule": "kvpress"}).describe(2)["sink_rule"] == "kvpress"
    with pytest.raises(HarnessError, match="sink_rule"):
        build_method({**options, "sink_rule": "never"}).validate(2, 4096)
