"""The repetition penalty (a decoding option, off unless a task asks: LooGLE's 2.0) equals transformers'
RepetitionPenaltyLogitsProcessor over `generate`'s input_ids, and decodes alike in the single-setting decode and in the
batched decode of a methods list (every setting x question of a many-questions prompt in one batch)."""

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from conftest import tiny_model
from harness.decoding import _seen_tokens, greedy_generate, penalize_repetition
from harness.errors import HarnessError
from harness.generation.generate import generate_settings
from harness.generation.prompt import Prompt, Question
from harness.methods import build_method
from harness.models import LoadedModel


def loaded_of(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name="tiny", chat_format="none", eos_token_ids=[], max_positions=4096,
                       prompt_max_length=None, device=torch.device("cpu"))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("penalty", [2.0, 1.3, 0.7])
def test_penalized_logits_equal_the_transformers_processor(penalty):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 4  # positive and negative scores
    history = torch.randint(0, 50, (3, 30), generator=torch.Generator().manual_seed(2))  # repeats included
    want = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
    got = penalize_repetition(logits, _seen_tokens(history.tolist(), 3, logits), penalty)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)


def test_greedy_decode_with_the_penalty_equals_generate(one_thread):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([ids(60, 3)])
    want = model.generate(prompt, max_new_tokens=16, do_sample=False, num_beams=1, repetition_penalty=2.0,
                          attention_mask=torch.ones_like(prompt), pad_token_id=0)[0, 60:].tolist()
    got = greedy_generate(model, prompt, max_new_tokens=16, repetition_penalty=2.0, penalty_history=[prompt[0].tolist()])
    plain = greedy_generate(model, prompt, max_new_tokens=16)
    assert got.tokens[0] == want
    assert plain.tokens[0] != want  # the penalty changed the answer: the test can tell


def test_the_penalty_needs_each_rows_history(one_thread):
    model = tiny_model("llama")
    with pytest.raises(HarnessError, match="penalty_history"):
        greedy_generate(model, torch.tensor([ids(20, 4)]), max_new_tokens=2, repetition_penalty=2.0)


@pytest.mark.parametrize("query_aware", [False, True])
def test_batched_decode_of_a_methods_list_equals_each_setting_alone(query_aware, one_thread):
    """Every (setting, question) row of one batch is penalized with its own question's prompt ids, as alone."""
    model = tiny_model("llama")
    context = ids(120, 5)
    questions = [Question(ids(6 + i, 10 + i), {"question": (120, 126 + i)}) for i in range(3)]
    prompt = Prompt(context, questions=questions)
    methods = [("full", build_method({"name": "full"})),
               ("snapkv", build_method({"name": "snapkv", "budget": 48, "window_size": 8, "kernel_size": 5, "pooling": "maxpool"}))]
    decode = dict(max_new_tokens=12, repetition_penalty=2.0)
    together = generate_settings(loaded_of(model), methods, prompt, query_aware=query_aware, **decode)
    apart = generate_settings(loaded_of(model), methods, prompt, query_aware=query_aware, decode_together=False, **decode)
    plain = generate_settings(loaded_of(model), methods, prompt, query_aware=query_aware, max_new_tokens=12)
    for tag, _ in methods:
        for a, b, c in zip(together[tag].answers, apart[tag].answers, plain[tag].answers):
            assert a.generation.tokens == b.generation.tokens
            assert a.diagnostics["decoded_with"].startswith("batch of") and b.diagnostics["decoded_with"].startswith("alone")
        assert [a.generation.tokens for a in together[tag].answers] != [c.generation.tokens for c in plain[tag].answers]
    # the full setting alone (one question, no compression) is what `generate` gives on that question's whole prompt
    model.generation_config.eos_token_id = None
    whole = torch.tensor([context + questions[0].ids])
    want = model.generate(whole, max_new_tokens=12, do_sample=False, repetition_penalty=2.0, attention_mask=torch.ones_like(whole),
                          pad_token_id=0)[0, whole.shape[1]:].tolist()
    assert together["full"].answers[0].generation.tokens[0] == want


def test_rows_that_stop_early_keep_their_own_penalty_history(one_thread):
    """A row that ends at EOS leaves the batch (RowsCache.drop_finished): the others' seen-token flags stay theirs."""
    model = tiny_model("llama")
    context = ids(120, 5)
    prompt = Prompt(context, questions=[Question(ids(6 + i, 10 + i), {"question": (120, 126 + i)}) for i in range(3)])
    methods = [("full", build_method({"name": "full"})),
               ("snapkv", build_method({"name": "snapkv", "budget": 48, "window_size": 8, "kernel_size": 5, "pooling": "maxpool"}))]
    first = generate_settings(loaded_of(model), methods, prompt, query_aware=False, max_new_tokens=12, repetition_penalty=2.0)
    eos = first["full"].answers[1].generation.tokens[0][3]  # the 4th token of one row: that row stops there
    loaded = loaded_of(model)
    loaded.eos_token_ids = [eos]
    together = generate_settings(loaded, methods, prompt, query_aware=False, max_new_tokens=12, repetition_penalty=2.0)
    apart = generate_settings(loaded, methods, prompt, query_aware=False, decode_together=False, max_new_tokens=12, repetition_penalty=2.0)
    stopped = [a.generation.stopped_by[0] for tag, _ in methods for a in together[tag].answers]
    assert "eos" in stopped and "length" in stopped
    for tag, _ in methods:
        assert [a.generation.tokens for a in together[tag].answers] == [a.generation.tokens for a in apart[tag].answers]
