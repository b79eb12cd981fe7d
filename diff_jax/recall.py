"""Multi-query associative recall with distractors: a retrieval task tiny models learn on a CPU,
shared by `eval.py task=recall` and the training corpora of `--preset cpu-recall`.

Token ids (no tokenizer: `VOCAB_SIZE` ids in all):

    0 end-of-text · 1 QUERY · haystack 2..33 · key firsts 34..49 · key seconds 50..65 ·
    values 66..97

A key is two tokens (a, b), a from the key-first and b from the key-second alphabet. A sample of
`length` tokens is a context of N key–value triples `a b v` in random order, inserted into a
haystack, then QUERY and R query triples `a b v` repeating keys of the context:

    h h a₁ b₁ v₁ h a₂ b₂ v₂ h h h a₃ b₃ v₃ h … QUERY a₂ b₂ v₂ a₁ b₁ v₁

The haystack is one counting run through its alphabet (2, 3, …, 33, 2, …) from a random start,
interrupted by the triples: like `diff_jax.niah`'s prose haystack it is predictable text that
carries no answer. The model must predict each query's value v from its key: the value token is
the answer, read by greedy decoding after the query's `a b`. A share of the N pairs are
near-duplicate distractors: their key repeats one token of a queried key, (a, b') or (a', b),
with another value, so matching one token of the key finds the wrong pair. Distractors are never
queried; all N keys of a sample differ, and so do their N values. Queries cover the
non-distractor pairs in random order, then (R larger) repeat them at random. `length` counts
every token; the haystack fills what the triples leave.

Evaluation and training draw from separate seed streams (`eval_rng`, `train_rng`); separate
streams do not make the samples disjoint where a cell has few possible samples: among 12 seeds'
training samples of cpu-recall, 2 equal evaluation samples, both of the easiest cell (1 pair,
no distractor, the training length), which every model answers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from diff_jax.data import TokenCorpus

EOT, QUERY = 0, 1
HAYSTACK = np.arange(2, 34)
KEY_FIRST = np.arange(34, 50)
KEY_SECOND = np.arange(50, 66)
VALUES = np.arange(66, 98)
VOCAB_SIZE = 98
TRIPLE = 3  # tokens of a key–value pair: a b v
_EVAL_DOMAIN, _TRAIN_DOMAIN = 0x5EC4, 0x7EC4


def eval_rng(seed: int, *cell: int) -> np.random.Generator:
    """The generator of evaluation samples for `seed` (and a grid cell's integers)."""
    return np.random.default_rng((_EVAL_DOMAIN, seed, *cell))


def train_rng(seed: int) -> np.random.Generator:
    """The generator of training samples for `seed` (a domain disjoint from `eval_rng`'s)."""
    return np.random.default_rng((_TRAIN_DOMAIN, seed))


def num_distractors(pairs: int, distractor_share: float) -> int:
    """How many of `pairs` pairs are near-duplicate distractors at `distractor_share`."""
    return int(round(distractor_share * pairs))


def max_queries(pairs: int, distractor_share: float) -> int:
    """The queries of an evaluation cell: one per pair that is not a distractor."""
    return pairs - num_distractors(pairs, distractor_share)


@dataclasses.dataclass(frozen=True)
class RecallSample:
    """One sample. Positions index `tokens`; pair i's triple is tokens[pair_starts[i] : +3]."""

    tokens: np.ndarray  # (length,) int32
    pair_starts: np.ndarray  # (N,) int32: start of each context triple, in context order
    distractor: np.ndarray  # (N,) bool: pair i's key is a near-duplicate of a queried key
    queried: np.ndarray  # (R,) int32: the context slot (into pair_starts) each query repeats
    query_start: int  # position of the first query triple (QUERY is at query_start - 1)

    @property
    def answer_positions(self) -> np.ndarray:
        """(R,) int32: positions of the queries' value tokens; the logits one before predict them."""
        return self.query_start + TRIPLE * np.arange(len(self.queried), dtype=np.int32) + 2

    @property
    def answers(self) -> np.ndarray:
        """(R,) int32: the value tokens to retrieve."""
        return self.tokens[self.answer_positions]

    @property
    def context_end(self) -> int:
        """End of the context (the QUERY token's position)."""
        return self.query_start - 1


def make_sample(rng: np.random.Generator, *, length: int, pairs: int, queries: int,
                distractor_share: float) -> RecallSample:
    """One sample of exactly `length` tokens (see the module docstring). ValueError for sizes
    that cannot be met, among them more distractors than the queried keys have distinct
    near-duplicates (15 + 15 per key, fewer the keys already drawn)."""
    n_dist = num_distractors(pairs, distractor_share)
    if not 1 <= pairs - n_dist or queries < 1:
        raise ValueError(f"need a pair that is not a distractor ({pairs} pairs, {n_dist} "
                         f"distractors) and a query ({queries})")
    context = length - 1 - TRIPLE * queries
    if context < TRIPLE * pairs:
        raise ValueError(f"length {length} is too short for {pairs} pairs and {queries} queries "
                         f"(needs {TRIPLE * (pairs + queries) + 1})")
    if pairs > len(VALUES):
        raise ValueError(f"at most {len(VALUES)} pairs (their values differ), got {pairs}")
    targets = pairs - n_dist  # pairs that are not distractors, drawn first
    keys: list[tuple[int, int]] = []
    while len(keys) < targets:
        key = (int(rng.choice(KEY_FIRST)), int(rng.choice(KEY_SECOND)))
        if key not in keys:
            keys.append(key)
    covered = keys[: min(queries, targets)]  # the keys the queries cover first
    near = ({(a, int(b2)) for a, _ in covered for b2 in KEY_SECOND}
            | {(int(a2), b) for _, b in covered for a2 in KEY_FIRST}) - set(keys)
    if len(near) < n_dist:
        raise ValueError(f"{n_dist} distractors need as many keys sharing one token with the "
                         f"{len(covered)} queried key(s), which have only {len(near)}: use fewer "
                         "distractors or more queries")
    while len(keys) < pairs:  # distractors: one token of a key the queries cover first
        a, b = covered[int(rng.integers(len(covered)))]
        if rng.random() < 0.5:
            key = (a, int(rng.choice(KEY_SECOND)))
        else:
            key = (int(rng.choice(KEY_FIRST)), b)
        if key not in keys:
            keys.append(key)
    values = rng.choice(VALUES, pairs, replace=False)
    order = rng.permutation(pairs)  # context position of pair order[j] is j
    filler = context - TRIPLE * pairs
    gaps = np.bincount(rng.integers(0, pairs + 1, filler), minlength=pairs + 1)
    haystack = HAYSTACK[(int(rng.integers(len(HAYSTACK))) + np.arange(filler)) % len(HAYSTACK)]
    tokens = np.empty(length, np.int32)
    starts = np.zeros(pairs, np.int32)
    pos = used = 0
    for j in range(pairs + 1):
        tokens[pos: pos + gaps[j]] = haystack[used: used + gaps[j]]
        pos += gaps[j]
        used += gaps[j]
        if j == pairs:
            break
        i = order[j]
        tokens[pos: pos + TRIPLE] = (*keys[i], values[i])
        starts[i] = pos
        pos += TRIPLE
    tokens[pos] = QUERY
    query_start = pos + 1
    queried = np.concatenate([rng.permutation(min(queries, targets)),
                              rng.integers(0, targets, max(0, queries - targets))]).astype(np.int32)
    for r, i in enumerate(queried):
        p = query_start + TRIPLE * r
        tokens[p: p + TRIPLE] = (*keys[i], values[i])
    # Pairs were drawn targets first; index them by context slot instead.
    slot = np.argsort(order)  # slot[i]: context slot of pair i
    return RecallSample(tokens, starts[order], order >= targets, slot[queried].astype(np.int32),
                        query_start)


def training_samples(rng: np.random.Generator, *, count: int, length: int, max_pairs: int,
                     distractor_shares: tuple[float, ...]) -> list[RecallSample]:
    """`count` samples of `length` tokens: pairs uniform in 1..max_pairs, a distractor share
    uniform over `distractor_shares`, and a number of queries uniform in 1..(as many triples as
    fit after the context's), so that the haystack's share varies from none to most of the
    context. Queries beyond the non-distractor pairs repeat them."""
    out = []
    for _ in range(count):
        pairs = int(rng.integers(1, max_pairs + 1))
        share = float(rng.choice(distractor_shares))
        r = int(rng.integers(1, (length - 1 - TRIPLE * pairs) // TRIPLE + 1))
        out.append(make_sample(rng, length=length, pairs=pairs, queries=r, distractor_share=share))
    return out


TRAIN_LOSSES = ("all", "queries")  # which targets of a training sample count in the loss


def write_training_corpus(out_dir: Path, samples: list[RecallSample], meta: dict,
                          loss: str = "all") -> None:
    """Write `samples` (each + end-of-text) as a token corpus that `data.source=tokens` reads.

    With samples of train.seq_len − 1 tokens every document is exactly one training row, so a
    row never splits a sample's context from its queries. `loss="queries"` writes a loss mask
    (`TokenCorpus.loss_mask`) under which only the query part counts: the query triples' tokens
    and the end-of-text after them, not the context (random keys and values, the haystack) nor the
    QUERY token; `"all"`: every token counts.
    """
    if loss not in TRAIN_LOSSES:
        raise ValueError(f"loss must be one of {TRAIN_LOSSES}, got {loss!r}")
    tokens = np.concatenate([np.append(s.tokens, EOT) for s in samples]).astype(np.uint32)
    starts = np.concatenate([[0], np.cumsum([len(s.tokens) + 1 for s in samples])]).astype(np.int64)
    mask = None
    if loss == "queries":
        mask = np.concatenate([np.arange(len(s.tokens) + 1) >= s.query_start
                               for s in samples]).astype(np.uint8)
    TokenCorpus(tokens, starts, VOCAB_SIZE, loss_mask=mask).save(
        out_dir, dict(meta, source="recall", loss=loss))
