"""task=observation (SnapKV Figures 2-5): the hit-rate math on hand-computed tensors, the capture against an
independent computation (eager attention weights of a tiny random model), prompt building, and a tiny
end-to-end run through the CLI (resume, report section)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import compose, run_cli, tiny_model
from harness.tasks.observation import task as obs

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ the math by hand

def test_topk_mask_and_hit_rate_by_hand():
    votes = torch.tensor([[0.1, 0.5, 0.3, 0.2], [0.9, 0.0, 0.05, 0.6]])
    assert obs.topk_mask(votes, 2).tolist() == [[False, True, True, False], [True, False, False, True]]
    important = torch.tensor([[True, True, False, False], [False, False, False, True]])   # 3 important
    selected = torch.tensor([
        [[True, False, False, False], [False, False, False, True]],   # holds 2 of them
        [[False, False, True, True], [False, False, False, False]],   # holds none
        [[True, True, True, True], [True, True, True, True]],         # holds all
    ])
    assert obs.hit_rate(important, selected).tolist() == pytest.approx([2 / 3, 0.0, 1.0])
    assert math.isnan(float(obs.hit_rate(torch.zeros(2, 4, dtype=torch.bool), selected)[0]))
    # H(M_vote_A, M_vote_B) = |A and B| / |A|
    a = torch.tensor([[True, True, False, False], [False, False, True, True]])
    b = torch.tensor([[True, False, True, False], [False, False, True, True]])
    assert obs.overlap(a, b) == pytest.approx(3 / 4)


def test_window_votes_are_causal_softmax_sums_over_the_prefix():
    torch.manual_seed(0)
    hq, hkv, d, start, w, prefix = 4, 2, 8, 6, 3, 5
    q = torch.randn(hq, w, d)
    k = torch.randn(hkv, start + w, d)
    scaling = d ** -0.5
    votes = obs.window_votes(q, k, start, prefix, scaling)
    expected = torch.zeros(hq, prefix)
    for h in range(hq):
        kh = k[h // (hq // hkv)]
        for i in range(w):
            seen = start + i + 1                      # keys 0 .. its own position
            a = torch.softmax(kh[:seen] @ q[h, i] * scaling, dim=0)
            expected[h] += a[:prefix]
    torch.testing.assert_close(votes, expected)


def test_decode_attention_is_the_softmax_over_every_key():
    torch.manual_seed(1)
    q, k = torch.randn(4, 1, 8), torch.randn(2, 11, 8)
    got = obs.decode_attention(q, k, 7, 0.5)
    for h in range(4):
        a = torch.softmax(k[h // 2] @ q[h, 0] * 0.5, dim=0)
        torch.testing.assert_close(got[h], a[:7])
    assert float(got.sum(-1).max()) < 1.0   # prefix part only: the rest of the mass is on the later keys


def test_probe_on_hand_made_queries_and_keys():
    """L=8, windows of 2, N=2: P=4, rate 0.5 -> k=2. Keys are one-hot, so each query's attention is set by hand."""
    params = obs.Params(window_tokens=2, prompt_windows=2, generation_windows=1, generation_window_tokens=2, theta=0.2, rate=0.5)
    probe = obs.HitRateProbe(8, params)
    big = 20.0
    keys = torch.eye(8).reshape(1, 1, 8, 8)                    # key i = e_i: logit of key i = query[i]
    queries = torch.zeros(1, 1, 8, 8)
    queries[0, 0, 4, [0, 1]] = big                             # window 1 (positions 4, 5) votes 0 and 1
    queries[0, 0, 5, [0, 1]] = big
    queries[0, 0, 6, [2, 3]] = big                             # window 2 (positions 6, 7) votes 2 and 3
    queries[0, 0, 7, [2, 3]] = big

    class Layer:
        layer_idx, scaling, sliding_window = 0, 1.0, None

    probe(Layer, queries, keys)
    cap = probe.layers[0]
    assert cap.masks[:, 0].tolist() == [[True, True, False, False], [False, False, True, True]]
    # two generated queries: the first attends to 1 and 2 (half each), the second to 3 only
    for step, hot in enumerate(([1, 2], [3])):
        k = torch.cat([keys, torch.zeros(1, 1, step + 1, 8)], dim=2)   # the generated tokens' keys: zeros
        q = torch.zeros(1, 1, 1, 8)
        q[0, 0, 0, hot] = big
        probe(Layer, q, k)
    res = probe.results(1)
    # query 1: important {1, 2}; window 1 holds 1 -> 1/2, window 2 holds 2 -> 1/2. query 2: {3} -> 0, 1
    assert res["fig2_hit_rate"][0] == pytest.approx([0.25, 0.75])
    assert res["fig3_hit_rate"][0] == pytest.approx([0.75])
    assert res["counted_queries"] == [2] and res["decoded_queries"] == [2]
    assert res["important_per_head"][0] == pytest.approx(1.5)
    # the generation window's own vote (1, 2, 3 weigh 0.5, 0.5, 1): top-2 = {3, 1 or 2}; window 2 holds 3 (+ 2 perhaps)
    assert res["fig3_vote_overlap"][0][0] in (0.5, 1.0)


# ------------------------------------------------------------------------------------------ the capture vs eager weights

@pytest.mark.parametrize("attn,block", [("sdpa", None), ("eager", None), ("sdpa", 1)])
def test_capture_matches_eager_attention_weights(attn, block, monkeypatch):
    """The probe (queries/keys of any implementation) against hit rates recomputed from the eager model's own
    attention weights (output_attentions) over prompt + generated tokens. block=1: one window / one generated
    query per batched softmax (the blocking a long prompt gets), the same numbers."""
    if block is not None:
        monkeypatch.setattr(obs, "BLOCK_ELEMENTS", block)
    from harness.decoding import greedy_generate
    from harness.methods.engine import attention_probe

    L = 40
    params = obs.Params(window_tokens=4, prompt_windows=3, generation_windows=2, generation_window_tokens=3,
                        theta=0.05, rate=0.25)
    g = params.generated_queries
    def peaky(model):  # random weights attend almost uniformly: sharpen the queries so that some weights pass theta
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.data *= 12
            layer.self_attn.k_proj.weight.data *= 12
        return model

    model = peaky(tiny_model("llama", attn, layers=2, heads=4, kv_heads=2, seed=3))
    torch.manual_seed(5)
    ids = torch.randint(3, 1000, (1, L))
    probe = obs.HitRateProbe(L, params, keep_votes=True)
    with attention_probe(model, probe):
        gen = greedy_generate(model, ids, max_new_tokens=g + 1, ignore_eos=True)
    res = probe.results(2)

    reference = peaky(tiny_model("llama", "eager", layers=2, heads=4, kv_heads=2, seed=3))
    full = torch.cat([ids, torch.tensor([gen.tokens[0][:g]])], dim=1)
    with torch.no_grad():
        attentions = reference(full, output_attentions=True).attentions
    P, k, N, w = L - 12, params.k(L - 12), params.prompt_windows, params.window_tokens
    for layer in range(2):
        A = attentions[layer][0].float()                   # (Hq, T, T)
        masks = []
        for j in range(N):
            s = L - (N - j) * w
            votes = A[:, s:s + w, :P].sum(dim=1)
            masks.append(obs.topk_mask(votes, k))
            if j == N - 1:
                torch.testing.assert_close(probe.layers[layer].last_votes, votes, rtol=1e-4, atol=1e-5)
        masks = torch.stack(masks)
        rates, per_window = [], [[] for _ in range(params.generation_windows)]
        important_total = 0
        for t in range(g):
            important = A[:, L + t, :P] > params.theta
            important_total += int(important.sum())
            if important.sum() == 0:
                continue
            h = ((masks & important).sum(dim=(-1, -2)).double() / important.sum()).tolist()
            rates.append(h)
            per_window[t // params.generation_window_tokens].append(h[-1])
        assert rates, "theta too high for this model: nothing to compare"
        expected = [sum(r[j] for r in rates) / len(rates) for j in range(N)]
        assert res["fig2_hit_rate"][layer] == pytest.approx(expected, abs=1e-4)
        assert res["fig3_hit_rate"][layer] == pytest.approx([sum(x) / len(x) if x else None for x in per_window], abs=1e-4)
        assert res["counted_queries"][layer] == len(rates)
        assert res["important_per_head"][layer] == pytest.approx(important_total / (g * 4), abs=1e-4)
        generation = A[:, L:L + g, :P]
        torch.testing.assert_close(probe.votes("generation")[layer], generation.sum(dim=1), rtol=1e-4, atol=1e-5)
        gw = params.generation_window_tokens
        for m in range(params.generation_windows):  # a generation window's own vote against the last prompt window's
            mine = obs.topk_mask(generation[:, m * gw:(m + 1) * gw].sum(dim=1), k)
            assert res["fig3_vote_overlap"][layer][m] == pytest.approx(float((mine & masks[-1]).sum()) / float(mine.sum()), abs=1e-4)


def test_a_probed_decode_step_does_no_tensor_work():
    """The probe's per-step cost: a decode call only keeps the query and the keys (views); all the attention math
    runs batched in finish(). Before, ~20 small tensor ops per layer and step made a probed step
    ~3x a plain one on a loaded 2-core CPU (observation_cpu: 23 minutes)."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):  # tensor operations, not reads of a shape or views by indexing
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += getattr(func, "__name__", "") not in ("__get__", "__getitem__", "_set_grad_enabled")
            return func(*args, **(kwargs or {}))

    params = obs.Params(window_tokens=2, prompt_windows=2, generation_windows=2, generation_window_tokens=3, theta=0.2, rate=0.5)
    probe = obs.HitRateProbe(8, params)

    class Layer:
        layer_idx, scaling, sliding_window = 0, 1.0, None

    torch.manual_seed(0)
    keys = torch.randn(1, 1, 8 + 6, 8)
    probe(Layer, torch.randn(1, 1, 8, 8), keys[:, :, :8])
    per_step = []
    for step in range(6):
        query, seen = torch.randn(1, 1, 1, 8), keys[:, :, :9 + step]
        with Count() as count:
            probe(Layer, query, seen)
        per_step.append(count.calls)
    assert per_step == [0] * 6, per_step   # before: 30-40 operations per layer and step
    assert probe.results(1)["decoded_queries"] == [6]


# ------------------------------------------------------------------------------------------ prompts and documents

def test_haystack_documents_are_shared_by_every_instruction(tiny_random):
    task = compose("task=observation", "task.lengths=[600]", "task.window_tokens=16", "task.prompt_windows=4").task
    docs = obs.haystack_documents(task, tiny_random)
    assert len(docs) == 2 and docs[0].ids != docs[1].ids                # two different slices
    doc = docs[0]
    tok = tiny_random.tokenizer
    lengths = []
    for ins in doc.instructions:
        for pos in ("end", "begin"):
            ids, spans = obs.build_prompt(tiny_random, task, doc.ids, ins.text, pos)
            s, e = spans["document"]
            assert ids[s:e] == doc.ids
            a, b = spans["instruction"]
            assert tok.decode(ids[a:b]) == ins.text
            assert (a > s) == (pos == "end")
            lengths.append(len(ids))
    assert max(lengths) == 600
    for needle, at in zip(task.needles, doc.meta["needle_token_index"]):
        n = len(tok(needle.text, add_special_tokens=False)["input_ids"])
        assert tok.decode(doc.ids[at:at + n]) == needle.text


def test_longbench_source_uses_the_official_template_and_groups_contexts(tiny_random):
    task = compose("task=observation", "task.source=longbench", "task.data_dir=tests/fixtures/longbench").task
    obs.validate(task)
    assert "Now, answer the query based on the above meeting transcript" in obs.template(task, "end")
    items = obs.longbench_items(task)
    assert len(items) == 3 and all(len(instr) == 1 for _, _, instr in items)
    docs = obs.make_documents(task, tiny_random)
    ids, spans = obs.build_prompt(tiny_random, task, docs[0].ids, docs[0].instructions[0].text, "end")
    assert "Transcript:" in tiny_random.tokenizer.decode(ids[:spans["document"][0]])


def test_progress_counts_generated_tokens(tmp_path, capfd):
    """One document is minutes of work on a CPU: the bar counts generated tokens (prompts x G), not documents."""
    from harness.app import execute

    cfg = compose("task=observation", "model=tiny-random", "task.window_tokens=16", "task.prompt_windows=4",
                  "task.generation_windows=2", "task.generation_window_tokens=4", "task.lengths=[200]",
                  "task.documents_per_length=1", "task.positions=[end]", "progress=true")
    execute(cfg, tmp_path)
    err = capfd.readouterr().err
    assert "observation: generated tokens" in err and "24/24" in err, err[-2000:]  # 3 questions x 8 generated queries
    assert "observation documents" not in err


def test_bad_settings_fail_before_any_model_loads(tmp_path):
    proc = run_cli("task=observation", "model=tiny-random", "task.lengths=[1000]", f"hydra.run.dir={tmp_path / 'r'}")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: task.lengths: 1000 tokens leave no prefix")
    proc = run_cli("task=observation", "model=tiny-random", "task.theta=1.5", f"hydra.run.dir={tmp_path / 'r'}")
    assert proc.returncode == 2 and "task.theta" in proc.stderr
    proc = run_cli("task=observation", "model=tiny-random", "method=snapkv", "task.lengths=[4096]", f"hydra.run.dir={tmp_path / 'r'}")
    assert proc.returncode == 2 and "method=full" in proc.stderr


# ------------------------------------------------------------------------------------------ end to end

def test_observation_end_to_end_cli_resume_and_report(tmp_path):
    run = tmp_path / "obs"
    args = ("task=observation", "model=tiny-random", "task.window_tokens=16", "task.prompt_windows=4",
            "task.generation_windows=2", "task.generation_window_tokens=8", "task.lengths=[256]", "task.documents_per_length=1",
            "task.theta=0.001", f"hydra.run.dir={run}", "progress=false")
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((run / "full" / "results.json").read_text())   # <run dir>/<method tag>
    s = res["summary"]
    assert res["task"] == "observation" and s["layers"] == 2 and s["prompts"] == 6
    assert s["parameters"]["theta"] == 0.001 and s["parameters"]["rate_p"] == 0.05 and s["parameters"]["window_tokens"] == 16
    assert len(s["fig2_hit_rate"]) == 2 and all(len(r) == 4 for r in s["fig2_hit_rate"])
    assert len(s["fig3_hit_rate"]) == 2 and all(len(r) == 2 for r in s["fig3_hit_rate"])
    assert len(s["fig4_hit_rate"]) == 2 and set(s["fig4_pairs"]) == {"q0-q1", "q0-q2", "q1-q2"}
    assert set(s["fig5_hit_rate"]) == {"end", "begin"}
    values = [v for r in s["fig2_hit_rate"] + s["fig3_hit_rate"] for v in r] + s["fig4_hit_rate"] + s["fig5_hit_rate"]["begin"]
    assert all(v is not None and 0 <= v <= 1 for v in values)
    for n in (2, 3, 4, 5):
        assert (run / "full" / f"observation_fig{n}.png").exists()
    lines = (run / "full" / obs.LOG_FILE).read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["prompts"][0]["decoded_queries"] == [16, 16]
    meta = json.loads(lines[0])["meta"]
    assert len(meta["needle_token_index"]) == len(meta["needle_depth_actual"]) == 3  # per needle, as task=needle records

    again = run_cli(*args)                                   # resumes: the document is not redone
    assert again.returncode == 0 and len((run / "full" / obs.LOG_FILE).read_text().splitlines()) == 1
    assert json.loads((run / "full" / "results.json").read_text())["summary"]["fig2_hit_rate"] == s["fig2_hit_rate"]

    from harness.report import collect
    from harness.tasks.observation.report import report_sections

    runs, _ = collect(tmp_path)
    out = tmp_path / "tables"
    out.mkdir()
    sections = report_sections(runs, out)
    assert [name for name, _ in sections] == ["observation.md"]
    assert "Observation experiments" in sections[0][1] and (out / "observation.csv").exists()
    assert len(list((out / "observation").rglob("*.png"))) == 4
