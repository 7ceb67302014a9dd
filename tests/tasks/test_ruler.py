"""RULER's generator against RULER's rules (on the real Llama-2 SentencePiece and Llama-3 vocabularies),
and one tiny-model run through the app with methods=[full, snapkv]."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import pytest

from conftest import compose
from harness.app import execute
from harness.errors import HarnessError
from harness.tasks.ruler import task as ruler
from harness.tasks.ruler.data import (
    DEPTHS,
    NOISE,
    SYNTHETIC,
    TASKS,
    AdjNounKeys,
    TaskGenerator,
    Wrapper,
    split_sentences,
    wonderwords_lists,
)
from vocab import vocab_tokenizer

LENGTH = 4096
SAMPLES = 2
# Tolerance on the fitted length: a sample is never longer than the length (RULER's acceptance rule),
# and RULER's fit steps down a whole haystack increment (500 essay words, 25 noise lines, ~1/32 of fwe's
# words) when a draw overflows, so a sample may be up to one increment short: at 4096 tokens that is
# under 750 tokens in both vocabularies. We require at least 80% of the length.
MIN_SHARE = 0.80


@pytest.fixture(scope="module")
def essay():
    return ruler.essay_text(compose("task=ruler").task)


def _tokenized(name: str):
    tok = vocab_tokenizer(name)
    loaded = SimpleNamespace(tokenizer=tok, chat_format="none", format_chat=lambda m: m[0]["content"])
    return ruler.Tokenized(loaded, "base")


@pytest.fixture(scope="module", params=["llama-spm", "llama-bpe"])
def generated(request, essay):
    """The 11 synthetic tasks at 4096 tokens, two samples each, in one vocabulary."""
    t = _tokenized(request.param)
    out = {}
    for name in SYNTHETIC:
        gen = TaskGenerator(name, LENGTH, seed=42, measure=t.measure, wrapper=t.wrapper, essay=essay)
        out[name] = gen.samples(SAMPLES)
    return t, out


def test_lengths_fit_the_budget_within_tolerance(generated):
    t, out = generated
    for name, samples in out.items():
        for s in samples:
            # RULER's count (no BOS) fits the length; the model input adds the tokenizer's BOS, if any
            total = t.measure(s.text) + s.tokens_to_generate
            assert MIN_SHARE * LENGTH <= total <= LENGTH, (name, total)
            assert len(t.prompt(s).ids) - t.measure(s.text) == len(t.tok("x")["input_ids"]) - len(t.tok.tokenize("x"))


def test_every_needle_once_and_answers_in_the_context(generated):
    t, out = generated
    for name, samples in out.items():
        family, args = TASKS[name]
        for s in samples:
            context = s.text[:s.question_start]
            if family == "niah":
                want = max(args["nk"], args["nq"]) * args["nv"]
                assert len(s.needles) == want, name
                for needle in s.needles:
                    assert context.count(needle) == 1, (name, needle)
                for value in s.references:  # every answer is the value of a needle in the context
                    assert any(n.endswith(f" is: {value}.") for n in s.needles) and value in context
                expected = {"niah_multivalue": 4, "niah_multiquery": 4}.get(name, 1)
                assert len(s.references) == expected
            elif family == "variable_tracking":
                # the chain VAR A = value, VAR B = VAR A, ... : 5 names, each assigned once in the context
                assert len(s.references) == 5
                value = re.search(r"VAR [A-Z]{5} = (\d{5})\n", context).group(1)
                chain = [f"VAR {s.references[0]} = {value}"] + [
                    f"VAR {b} = VAR {a} " for a, b in zip(s.references, s.references[1:])]
                assert s.needles == chain
                for stmt in chain:
                    assert context.count(stmt + "\n") == 1, stmt
                assert f"assigned the value {value} in the text above" in s.text
            elif family == "common_words_extraction":
                # the 10 answers appear 30 times each in the real list, every other word 3 times
                real = context[context.rfind("Below is a numbered list"):]
                words = re.findall(r"\d+\. (.+?)(?= \d+\. |\n|$)", real.split("\n")[1])
                counts = {w: words.count(w) for w in set(words)}
                assert len(s.references) == 10 and all(counts[w] == 30 for w in s.references)
                assert all(c == 3 for w, c in counts.items() if w not in s.references)
            elif family == "freq_words_extraction":
                # the answers are the 2nd to 4th most frequent coded words (the most frequent is "...")
                words = context[context.rfind("coded words. ") + len("coded words. "):].split("\n")[0].split(" ")
                ranked = sorted(set(words), key=words.count, reverse=True)
                assert ranked[0] == "..." and ranked[1:4] == s.references
            # every answer is in the compressed part of the prompt, none in the question part
            for ref in s.references:
                assert ref in context


def test_needle_spans_hold_the_needle_tokens(generated):
    t, out = generated
    tok = t.tok
    for name, samples in out.items():
        s = samples[0]
        prompt = t.prompt(s)
        needles = {k: v for k, v in prompt.spans.items() if k.startswith("needle_")}
        assert len(needles) == len(s.needles), name
        for i, needle in enumerate(s.needles):
            a, b = needles[f"needle_{i}"]
            assert needle.strip() in tok.decode(prompt.ids[a:b]), (name, needle)
            assert needle.strip() not in tok.decode(prompt.ids[a + 1:b]), "the span starts at the needle"
        q = prompt.question_start
        assert tok.decode(prompt.ids[q:]).lstrip().startswith(("What", "Question:", "Answer the question")), name
        assert s.text.endswith(s.answer_prefix)


def test_same_seed_same_samples_other_seed_other_samples(essay):
    t = _tokenized("llama-bpe")
    for name in ("niah_single_1", "niah_multikey_3", "vt", "fwe"):
        def gen(seed):
            g = TaskGenerator(name, 2048, seed=seed, measure=t.measure, wrapper=t.wrapper, essay=essay)
            return [(s.text, s.references) for s in g.samples(2)]
        a, b = gen(42), gen(42)
        assert a == b, name
        assert gen(7) != a, name


def test_niah_rules_by_construction(essay):
    t = _tokenized("llama-bpe")
    g = TaskGenerator("niah_single_1", LENGTH, seed=42, measure=t.measure, wrapper=t.wrapper)
    s = g.samples(1)[0]
    # singular template, 7-digit number value, "adjective-noun" key; noise lines joined by "\n"
    assert s.text.startswith("A special magic number is hidden within the following text. Make sure to memorize it.")
    key = re.search(r"What is the special magic number for (\S+) mentioned in the provided text\?", s.text).group(1)
    assert re.fullmatch(r"\d{7}", s.references[0])
    assert s.needles == [f"One of the special magic numbers for {key} is: {s.references[0]}."]
    lines = s.context.split("\n")
    assert set(lines) == {NOISE, s.needles[0]}
    assert s.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    # the multi-query task keeps the plural template and joins its 4 keys RULER's way
    g = TaskGenerator("niah_multiquery", LENGTH, seed=42, measure=t.measure, wrapper=t.wrapper, essay=essay)
    s = g.samples(1)[0]
    query = re.search(r"What are all the special magic numbers for (.+) mentioned in the provided text\?", s.text).group(1)
    assert re.fullmatch(r"[^,]+, [^,]+, [^,]+, and [^,]+", query)
    assert len(s.references) == 4 and len(set(s.references)) == 4


def test_depths_and_word_keys():
    # RULER's 40 depths: np.round(np.linspace(0, 100, 40)) -> 0, 3, 5, 8, ..., 97, 100
    assert len(DEPTHS) == 40 and DEPTHS[:4] == [0, 3, 5, 8] and DEPTHS[-2:] == [97, 100]
    nouns, adjs, _ = wonderwords_lists()
    keys = AdjNounKeys(adjs, nouns)
    assert len(keys) == 6_175_260  # wonderwords 2.2.0's distinct "adj-noun" keys, as RULER counts them
    # the lazy index equals sorted(set(...)) built in full, on a subset with the interleaving families
    rng = random.Random(0)
    sub_a = rng.sample(adjs, 40) + ["wide", "wide-eyed", "old", "old-fashioned", "ad hoc", "x-rated"]
    sub_n = rng.sample(nouns, 200) + ["eyed-fish", "rated", "hoc", "arch-rival"]
    brute = sorted(set(f"{a}-{n}" for a in sub_a for n in sub_n))
    lazy = AdjNounKeys(sub_a, sub_n)
    assert len(lazy) == len(brute) and [lazy[i] for i in range(len(brute))] == brute


def test_sentence_split():
    text = "I met Mr. Smith in the U.S. today. He said hi! Then J. Doe left. \"Why?\" she asked. no split here."
    assert split_sentences(text) == ["I met Mr. Smith in the U.S. today.", "He said hi!", "Then J. Doe left.",
                                     "\"Why?\" she asked. no split here."]
    assert " ".join(split_sentences(text)) == text


def test_chat_wrapper_and_answer_prefix_after_it():
    w = Wrapper("<|user|>{x}", "<|end|><|assistant|>")
    assert w.template("T {context}", " P") == "<|user|>{{x}}T {context}<|end|><|assistant|> P"


def test_validation_errors(tmp_path):
    with pytest.raises(HarnessError, match="unknown RULER task 'niah_7'"):
        ruler.validate(compose("task=ruler", "task.tasks=[niah_7]").task)
    with pytest.raises(HarnessError, match=r"qa_1 needs squad\.json or dev-v2\.0\.json in task\.qa_data_dir"):
        ruler.validate(compose("task=ruler", "task.tasks=[qa_1]", f"task.qa_data_dir={tmp_path}").task)
    with pytest.raises(HarnessError, match=r"qa_2 needs hotpotqa\.json or hotpot_dev_distractor_v1\.json"):
        ruler.validate(compose("task=ruler", "task.tasks=[qa_2]").task)
    with pytest.raises(HarnessError, match="task.tasks is empty"):
        ruler.validate(compose("task=ruler", "task.tasks=[]").task)
    assert ruler.task_names(compose("task=ruler", "task.tasks=null").task) == list(SYNTHETIC)
    with pytest.raises(HarnessError, match="not one of model, base"):
        ruler.validate(compose("task=ruler", "task.template=chat").task)


def test_qa_from_a_squad_file(tmp_path):
    # A two-article SQuAD v2 file: RULER's rules give the gold paragraph plus the article's other paragraphs
    # first, then random ones; answerable questions only, in file order; all answer texts as references.
    def para(i, q):
        return {"context": f"Paragraph {i} says the answer is A{i}.", "qas": q}
    data = {"data": [
        {"paragraphs": [para(0, [{"question": "Q0?", "is_impossible": False, "answers": [{"text": "A0"}, {"text": "A0"}]},
                                 {"question": "Qx?", "is_impossible": True, "answers": []}]),
                        para(1, [])]},
        {"paragraphs": [para(i, [{"question": f"Q{i}?", "is_impossible": False, "answers": [{"text": f"A{i}"}]}])
                        for i in range(2, 40)]}]}
    (tmp_path / "dev-v2.0.json").write_text(json.dumps(data))
    t = _tokenized("llama-bpe")
    g = TaskGenerator("qa_1", 1024, seed=42, measure=t.measure, wrapper=t.wrapper, qa_data_dir=str(tmp_path))
    s = g.samples(2)
    assert s[0].references == ["A0", "A0"] and s[1].references == ["A2"]
    assert "Paragraph 0 says" in s[0].context and "Paragraph 1 says" in s[0].context
    assert s[0].text.endswith("Question: Q0? Answer:") and len(t.prompt(s[0]).ids) + 32 <= 1024


def test_tiny_model_run_with_full_and_snapkv(tmp_path, one_thread):
    overrides = ["model=tiny-random", "progress=false", "task=ruler", "task.lengths=[1024]", "task.samples=2",
                 "task.tasks=[niah_single_1,niah_multivalue,vt]", "task.log_prompts=true", "task.query_aware=false",
                 "methods=[full,{name: snapkv, budget: 256}]"]
    cfg = compose(*overrides)
    out = execute(cfg, tmp_path, overrides)
    tags = sorted(out["settings"])
    assert tags == ["full", "snapkv_c256_w32_k7_maxpool_expand"]
    for tag in tags:
        saved = json.loads((tmp_path / tag / "results.json").read_text())
        summary = saved["summary"]
        assert summary["protocol"] == "query_agnostic" and summary["samples"] == 6
        assert set(summary["by_length"]["1024"]["tasks"]) == {"niah_single_1", "niah_multivalue", "vt"}
        per_length = summary["by_length"]["1024"]
        assert per_length["average"] == round(sum(per_length["tasks"].values()) / 3, 2) == summary["main_score"]
        rows = [json.loads(line) for line in (tmp_path / tag / "ruler_samples.jsonl").read_text().splitlines()]
        assert len(rows) == 6
        for r in rows:
            assert {"task", "length", "references", "response", "score", "protocol", "prompt"} <= set(r)
            assert r["prompt"].endswith(r["answer_prefix"]) and r["prompt_tokens"] + r["tokens_to_generate"] <= 1024
            assert r["new_tokens"] <= r["tokens_to_generate"]
            assert r["question_kept"] == 1.0  # query-agnostic: the question is prefilled after compression
            if r["task"] in ("niah_single_1", "niah_multivalue", "vt"):
                assert r["needle_kept"] is not None and "needle_0_kept" in r
                if tag == "full":
                    assert r["needle_kept"] == 1.0
        # the task score is RULER's metric over the samples, recomputed here by its definition
        for name in ("niah_single_1", "vt"):
            mine = [r for r in rows if r["task"] == name]
            frac = [sum(ref.lower() in r["response"].strip().lower() for ref in r["references"]) / len(r["references"])
                    for r in mine]
            assert summary["by_length"]["1024"]["tasks"][name] == round(sum(frac) / len(frac) * 100, 2)
        # the setting's RULER table: one row per length, the task scores and the average as in results.json
        table = (tmp_path / tag / "ruler_table.md").read_text()
        scores = per_length["tasks"]
        assert "| Length | S1 | MV | VT | Avg. |" in table
        assert (f"| 1024 | {scores['niah_single_1']:.2f} | {scores['niah_multivalue']:.2f} | {scores['vt']:.2f} | "
                f"{per_length['average']:.2f} |") in table
    snap = [json.loads(line) for line in (tmp_path / tags[1] / "ruler_samples.jsonl").read_text().splitlines()]
    assert all(r["budget_tokens"] == 256 for r in snap)
    assert any(r["needle_kept"] is not None and r["needle_kept"] < 1 for r in snap)
    # a rerun resumes: nothing is redone
    before = (tmp_path / tags[0] / "ruler_samples.jsonl").read_text()
    execute(cfg, tmp_path, overrides)
    assert (tmp_path / tags[0] / "ruler_samples.jsonl").read_text() == before


def test_qa_from_a_hotpotqa_file(tmp_path):
    # HotpotQA: a document is "title\n" + its sentences joined; the gold set is all 10 of the question's paragraphs;
    # the reference is [answer]. With 10 paragraphs per question and a 1024 budget, the fit keeps the gold ones.
    data = [{"question": f"Who is {q}?", "answer": f"ans{q}",
             "context": [[f"T{q}_{i}", [f"Sentence {q} {i} a. ", f"Sentence {q} {i} b."]] for i in range(10)]}
            for q in range(3)]
    (tmp_path / "hotpot_dev_distractor_v1.json").write_text(json.dumps(data))
    t = _tokenized("llama-bpe")
    g = TaskGenerator("qa_2", 1024, seed=42, measure=t.measure, wrapper=t.wrapper, qa_data_dir=str(tmp_path))
    s = g.samples(2)
    assert s[0].references == ["ans0"] and s[1].references == ["ans1"]
    assert len(s[0].needles) == 10 and all(f"T0_{i}\nSentence 0 {i} a. Sentence 0 {i} b." in s[0].context for i in range(10))
    assert s[0].text.endswith("Question: Who is 0? Answer:")
    # with supporting facts (the distractor file's own field), the retention spans are the paragraphs they name
    for q, d in enumerate(data):
        d["supporting_facts"] = [[f"T{q}_3", 0], [f"T{q}_7", 1], [f"T{q}_3", 1]]
    (tmp_path / "hotpot_dev_distractor_v1.json").write_text(json.dumps(data))
    g = TaskGenerator("qa_2", 1024, seed=42, measure=t.measure, wrapper=t.wrapper, qa_data_dir=str(tmp_path))
    s = g.samples(1)
    assert s[0].needles == [f"T0_{i}\nSentence 0 {i} a. Sentence 0 {i} b." for i in (3, 7)]
    assert len(s[0].needle_chars) == 2 and all(s[0].text[a:b] in s[0].needles for a, b in s[0].needle_chars)


@pytest.mark.parametrize("name", ["niah_multikey_1", "niah_multiquery"])
def test_one_key_at_a_time_asks_each_inserted_key_alone(essay, name):
    t = _tokenized("llama-bpe")
    make = lambda one_key: TaskGenerator(name, 2048, seed=42, measure=t.measure, wrapper=t.wrapper,
                                         essay=essay, one_key_at_a_time=one_key).samples(2)
    for plain, split in zip(make(False), make(True)):
        assert split.context == plain.context and split.needles == plain.needles  # the same draw: the sample is RULER's
        assert len(split.questions) == 4 and plain.questions == []
        # each inserted needle "One of the special magic numbers for KEY is: VALUE." is one question, asked RULER's
        # one-key way, its reference that key's value; every question shares the text before the question
        pairs = dict(re.fullmatch(r"One of the special magic numbers for (.+) is: (\d+)\.", n).groups() for n in plain.needles)
        asked = []
        for text, references in split.questions:
            key = re.search(r"What is the special magic number for (.+) mentioned in the provided text\?", text).group(1)
            assert references == [pairs[key]]
            assert text.endswith(f" The special magic number for {key} mentioned in the provided text is")
            assert text[:split.question_start] == split.questions[0][0][:split.question_start]
            assert text.startswith("A special magic number is hidden within the following text.")
            asked.append(key)
        assert sorted(asked) == sorted(pairs)
        assert (split.text, split.references) == split.questions[0]
    assert ruler.questions_per_sample(name, True) == 4 and ruler.questions_per_sample(name, False) == 1
    assert ruler.questions_per_sample("niah_multivalue", True) == ruler.questions_per_sample("vt", True) == 1


def test_one_key_at_a_time_run_records_each_question_and_resumes(tmp_path, one_thread):
    overrides = ["model=tiny-random", "progress=false", "task=ruler", "task.lengths=[1024]", "task.samples=2",
                 "task.tasks=[niah_multikey_1,niah_single_1]", "task.query_aware=false", "task.one_key_at_a_time=true",
                 "methods=[full,{name: snapkv, budget: 256}]"]
    cfg = compose(*overrides)
    execute(cfg, tmp_path, overrides)
    for tag in ("full", "snapkv_c256_w32_k7_maxpool_expand"):
        rows = [json.loads(line) for line in (tmp_path / tag / "ruler_samples.jsonl").read_text().splitlines()]
        keyed = sorted((r["task"], r["index"], r["question_index"]) for r in rows)
        assert keyed == sorted([("niah_multikey_1", i, q) for i in range(2) for q in range(4)] + [("niah_single_1", i, 0) for i in range(2)])
        for r in rows:
            assert r["one_key_at_a_time"] is True and r["question_kept"] == 1.0 and len(r["references"]) == 1
            # one context per sample: every question of a sample starts at the same compressed context
            same = {x["question_start"] for x in rows if (x["task"], x["index"]) == (r["task"], r["index"])}
            assert same == {r["question_start"]}
        mk = [r for r in rows if r["task"] == "niah_multikey_1" and r["index"] == 0]
        assert len({tuple(r["references"]) for r in mk}) == 4
        summary = json.loads((tmp_path / tag / "results.json").read_text())["summary"]
        assert summary["one_key_at_a_time"] is True and summary["samples"] == 10
    before = (tmp_path / "full" / "ruler_samples.jsonl").read_text()
    execute(cfg, tmp_path, overrides)
    assert (tmp_path / "full" / "ruler_samples.jsonl").read_text() == before


def test_app_scores_a_scripted_decoder(tmp_path, one_thread, monkeypatch):
    """Through the app, with a scripted decoder (the decoded text of each sample replaced by a chosen answer):
    some samples right, some partly, some wrong, at two lengths, so that every task score, per-length average,
    the headline and the per-length table are numbers worked out here by RULER's rules."""
    script = {  # (task, length, index) -> what the decoder "says", from the sample's references
        ("niah_single_1", 1536, 0): lambda refs: f"  {refs[0]}.\n",
        ("niah_single_1", 1536, 1): lambda refs: "I do not know",
        ("niah_single_1", 1024, 0): lambda refs: f"The number is {refs[0]}",
        ("niah_single_1", 1024, 1): lambda refs: f"\t{refs[0]}",
        ("vt", 1536, 0): lambda refs: " ".join(r.lower() for r in refs),  # RULER's match is case-insensitive
        ("vt", 1536, 1): lambda refs: ", ".join(refs[:2]),
        ("vt", 1024, 0): lambda refs: "none",
        ("vt", 1024, 1): lambda refs: ", ".join(refs[2:]),
    }
    original = ruler.RulerTask.record

    def scripted(self, item, built, i, text, answer):
        name, length, index = item
        return original(self, item, built, i, script[(name, length, index)](built.data.references), answer)

    monkeypatch.setattr(ruler.RulerTask, "record", scripted)
    overrides = ["model=tiny-random", "progress=false", "task=ruler", "task.lengths=[1024,1536]", "task.samples=2",
                 "task.tasks=[niah_single_1,vt]", "methods=[full]"]
    execute(compose(*overrides), tmp_path, overrides)
    summary = json.loads((tmp_path / "full" / "results.json").read_text())["summary"]
    rows = [json.loads(line) for line in (tmp_path / "full" / "ruler_samples.jsonl").read_text().splitlines()]
    assert all(len(r["references"]) == 5 for r in rows if r["task"] == "vt")
    # niah (all): 1536: 1 + 0 -> 50; 1024: 1 + 1 -> 100. vt (all, 5 names): 1536: 5/5 + 2/5 -> 70; 1024: 0 + 3/5 -> 30
    assert summary["by_length"]["1536"]["tasks"] == {"niah_single_1": 50.0, "vt": 70.0}
    assert summary["by_length"]["1024"]["tasks"] == {"niah_single_1": 100.0, "vt": 30.0}
    assert summary["by_length"]["1536"]["average"] == 60.0 and summary["by_length"]["1024"]["average"] == 65.0
    assert summary["tasks"] == {"niah_single_1": 75.0, "vt": 50.0} and summary["main_score"] == summary["average"] == 62.5
    assert sorted(r["score"] for r in rows if r["task"] == "vt") == [0.0, 40.0, 60.0, 100.0]
    table = (tmp_path / "full" / "ruler_table.md").read_text()
    assert "| 1536 | 50.00 | 70.00 | 60.00 |" in table and "| 1024 | 100.00 | 30.00 | 65.00 |" in table


@pytest.mark.parametrize("vocab", ["llama-spm", "smollm2"])
def test_kvpress_split_builds_kvpress_inputs(vocab, essay):
    """task.split=kvpress: the model input as kvpress's RULER dataset and pipeline build it, written out here from
    their rules: context = the base input up to the last question-pattern match, question up to the answer pattern
    (so it ends with RULER's space), answer prefix (no leading space); [chat prefix + context] and [question +
    chat suffix + answer prefix] tokenized apart; without a chat template the prefix is the BOS text and the
    suffix "\\n"."""
    from harness.models import embedded_tokenizer

    questions = {"niah": r"What (?:is|are all) the special magic", "variable_tracking": r"Question: Find all variables"}
    answers = {"niah": r"The special magic", "variable_tracking": r"Answer:"}
    if vocab == "smollm2":
        tok = embedded_tokenizer()
        render = lambda m: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)  # noqa: E731
        loaded = SimpleNamespace(tokenizer=tok, chat_format="template", format_chat=render)
    else:
        tok = vocab_tokenizer(vocab)
        loaded = SimpleNamespace(tokenizer=tok, chat_format="none", format_chat=lambda m: m[0]["content"])
    t = ruler.Tokenized(loaded, "model", "kvpress")
    base = _tokenized(vocab) if vocab != "smollm2" else None
    for name in ("niah_single_2", "vt"):
        family = TASKS[name][0]
        s = TaskGenerator(name, 2048, seed=42, measure=t.measure, wrapper=t.wrapper, essay=essay).samples(1)[0]
        if base is not None:  # the samples are RULER's base-template ones (kvpress's data)
            assert s.text == TaskGenerator(name, 2048, seed=42, measure=base.measure, wrapper=Wrapper(), essay=essay).samples(1)[0].text
        cut = list(re.finditer(questions[family], s.text))[-1].start()
        context, rest = s.text[:cut], s.text[cut:]
        a = re.search(answers[family], rest).start()
        question, prefix = rest[:a], rest[a:]
        assert question.endswith(" ") and not prefix.startswith(" ")  # kvpress's first two points
        if vocab == "smollm2":
            separator = "#" * (len(context) + 10)
            head, suffix = render([{"role": "user", "content": context + separator}]).split(separator)
        else:
            head, suffix = tok.bos_token + context, "\n"
        context_ids = tok.encode(head, add_special_tokens=False)
        expected = context_ids + tok.encode(question + suffix + prefix, add_special_tokens=False)
        prompt = t.prompt(s)
        assert prompt.ids == expected and prompt.question_start == len(context_ids), name
        if vocab != "smollm2":
            assert prompt.ids[0] == tok.bos_token_id and tok.decode(prompt.ids[len(context_ids):]).startswith(question)
        for i, needle in enumerate(s.needles[:2]):  # the needle spans still hold the needles' tokens
            a, b = prompt.spans[f"needle_{i}"]
            assert needle.split(":")[0].split()[-1] in tok.decode(prompt.ids[a:b])
