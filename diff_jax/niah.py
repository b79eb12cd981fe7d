"""Multi-needle retrieval documents ("needle in a haystack"), shared by `eval.py task=niah` and the
`data.source=niah` training source.

A sample is a token sequence: haystack text (the embedded corpus's `pydoc_data` topics, a prose
corpus that ships with Python) with N needles " The magic number of CITY is NUMBER." inserted, then
a question naming the R queried cities and an answer prompt for one of them:

    <haystack … needle … haystack … needle …>
    What is the magic number of CITY_1, …, CITY_R?
    The magic number of CITY_r is| NUMBER_r

Every piece is encoded apart and the token lists are concatenated, so needle spans are exact
token positions: a needle and a question as they read after other text (`continuations` after
`FOLLOWING`: a SentencePiece tokenizer such as Llama 2's begins a text encoded alone with "▁",
a space that text in the middle of a document does not have), an answer as it continues its
question (the ids of question + answer past the question's), the ids a model reading them as
one text is trained and scored on. The context begins with the tokenizer's beginning-of-text
where it has one (`text_prefix`: Llama's `<s>`), as every document does; cl100k has none, and
its samples are the pieces encoded alone. `needles[0]` is the answer needle: its first token
sits at `P + round(depth · (C − P − len))` of the C context tokens, P the prefix's; the other
needles go to random non-overlapping places after the prefix. Evaluation and training draw from separate seed domains (`eval_rng`, `train_rng`), so a
training seed never reproduces an evaluation sample.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from diff_jax.data.tokenizer import FOLLOWING, Encoding, continuations, text_prefix

CITIES = (
    "Amsterdam", "Athens", "Bangkok", "Barcelona", "Beijing", "Berlin", "Bogota", "Boston",
    "Brussels", "Budapest", "Cairo", "Chicago", "Copenhagen", "Dakar", "Delhi", "Dublin", "Geneva",
    "Hanoi", "Havana", "Helsinki", "Istanbul", "Jakarta", "Kyoto", "Lagos", "Lima", "Lisbon",
    "London", "Madrid", "Manila", "Melbourne", "Mexico City", "Milan", "Montreal", "Moscow",
    "Mumbai", "Munich", "Nairobi", "Naples", "Oslo", "Paris", "Prague", "Quito", "Rome",
    "Santiago", "Seoul", "Shanghai", "Singapore", "Stockholm", "Sydney", "Taipei", "Tokyo",
    "Toronto", "Vienna", "Warsaw", "Zurich",
)
_EVAL_DOMAIN, _TRAIN_DOMAIN = 0x5EA1, 0x7EA1


def eval_rng(seed: int, *cell: int) -> np.random.Generator:
    """The generator of evaluation samples for `seed` (and a grid cell, e.g. depth and length)."""
    return np.random.default_rng((_EVAL_DOMAIN, seed, *cell))


def train_rng(seed: int) -> np.random.Generator:
    """The generator of training documents for `seed` (a domain disjoint from `eval_rng`'s)."""
    return np.random.default_rng((_TRAIN_DOMAIN, seed))


def needle_text(city: str, number: str) -> str:
    """The needle sentence stating `city`'s magic `number` (leading space, no newline)."""
    return f" The magic number of {city} is {number}."


def question_text(cities: Sequence[str], city: str) -> str:
    """The question naming the queried `cities`, then the answer prompt for `city` (the answer
    " NUMBER" follows it)."""
    return f"\nWhat is the magic number of {', '.join(cities)}?\nThe magic number of {city} is"


@functools.cache
def haystack(enc: Encoding) -> np.ndarray:
    """(N,) int32: the haystack token stream, every `pydoc_data` topic, in sorted order,
    blank-line separated."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return np.asarray(enc.encode_ordinary(text), np.int32)


@dataclasses.dataclass(frozen=True)
class Needle:
    """One inserted needle: its city and number, and its token span in the sample's context."""

    city: str
    number: str
    start: int  # token span [start, end) in the context
    end: int


@dataclasses.dataclass(frozen=True)
class NiahSample:
    """One retrieval sample: the (C,) context with its needles, and per queried needle the
    question and answer tokens; `sequence(r)` assembles the tokens of query r."""

    context: np.ndarray  # (C,) int32: the tokenizer's prefix, then haystack with the needles in it
    needles: tuple[Needle, ...]  # the first `num_queries` are queried; needles[0] is at `depth`
    num_queries: int
    depth: float  # in [0, 1]
    questions: tuple[np.ndarray, ...]  # per queried needle: the question + answer prompt tokens
    answers: tuple[np.ndarray, ...]  # per queried needle: the answer tokens (" NUMBER")

    def sequence(self, r: int) -> tuple[np.ndarray, int]:
        """((L,) int32 tokens: context + question r + answer r, index of the first answer token)
        for query r."""
        tokens = np.concatenate([self.context, self.questions[r], self.answers[r]])
        return tokens, len(self.context) + len(self.questions[r])


def make_sample(
    rng: np.random.Generator,
    enc: Encoding,
    *,
    length: int,
    num_needles: int,
    num_queries: int,
    depth: float,
    digits: int = 6,
) -> NiahSample:
    """One sample whose longest `sequence(r)` is exactly `length` tokens."""
    if not 1 <= num_queries <= num_needles <= len(CITIES):
        raise ValueError(f"need 1 <= queries ({num_queries}) <= needles ({num_needles}) <= "
                         f"{len(CITIES)}")
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    cities = [CITIES[i] for i in rng.choice(len(CITIES), num_needles, replace=False)]
    numbers = [str(int(rng.integers(10 ** (digits - 1), 10 ** digits))) for _ in cities]
    _, needle_ids = continuations(enc, [FOLLOWING] * num_needles,
                                  [needle_text(c, n) for c, n in zip(cities, numbers)])
    pieces = [np.asarray(p, np.int32) for p in needle_ids]
    queried = cities[:num_queries]
    asked = [question_text(queried, c) for c in queried]
    _, question_ids = continuations(enc, [FOLLOWING] * num_queries, asked)
    _, answered = continuations(enc, [FOLLOWING + q for q in asked],
                                [" " + n for n in numbers[:num_queries]])
    questions = tuple(np.asarray(q, np.int32) for q in question_ids)
    answers = tuple(np.asarray(a, np.int32) for a in answered)
    head = text_prefix(enc)
    c = length - max(len(q) + len(a) for q, a in zip(questions, answers))
    needle_tokens = sum(len(p) for p in pieces)
    if c - len(head) < 2 * needle_tokens:
        raise ValueError(f"length {length} is too short for {num_needles} needles "
                         f"({needle_tokens} needle tokens need a context of at least "
                         f"{2 * needle_tokens + len(head)} tokens)")
    starts = [len(head) + int(round(depth * (c - len(head) - len(pieces[0]))))]
    taken = [(starts[0], starts[0] + len(pieces[0]))]
    for p in pieces[1:]:
        while True:
            s = int(rng.integers(len(head), c - len(p) + 1))
            if all(s + len(p) <= a or s >= b for a, b in taken):
                break
        starts.append(s)
        taken.append((s, s + len(p)))
    stream = haystack(enc)
    offset = int(rng.integers(0, len(stream) - c))
    filler = stream[offset: offset + c - len(head) - needle_tokens]
    placed = np.zeros(c, bool)  # the prefix's and the needles' positions
    context = np.empty(c, np.int32)
    context[:len(head)], placed[:len(head)] = head, True
    for s, p in zip(starts, pieces):
        context[s: s + len(p)] = p
        placed[s: s + len(p)] = True
    context[~placed] = filler
    needles = tuple(Needle(ci, n, s, s + len(p)) for ci, n, s, p in zip(cities, numbers, starts, pieces))
    return NiahSample(context, needles, num_queries, depth, questions, answers)


def training_documents(
    rng: np.random.Generator,
    enc: Encoding,
    *,
    num_tokens: int,
    doc_tokens: int,
    max_needles: int = 6,
    max_queries: int = 2,
) -> list[np.ndarray]:
    """Documents, each (n,) int32 (context + question + answer, no end-of-text), totalling at
    least `num_tokens`: lengths uniform in [doc_tokens/2, doc_tokens], 1..max_needles needles,
    1..max_queries queried, the answer needle at a uniform depth, and one random queried city
    answered."""
    docs: list[np.ndarray] = []
    total = 0
    while total < num_tokens:
        n = int(rng.integers(1, max_needles + 1))
        sample = make_sample(rng, enc, length=int(rng.integers(doc_tokens // 2, doc_tokens + 1)),
                             num_needles=n, num_queries=int(rng.integers(1, min(n, max_queries) + 1)),
                             depth=float(rng.random()))
        tokens, _ = sample.sequence(int(rng.integers(0, sample.num_queries)))
        docs.append(tokens)
        total += len(tokens)
    return docs
