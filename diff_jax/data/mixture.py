"""The synthetic retrieval source (`data.source=niah`) and weighted mixtures of sources.

A mixture `data.mixture=stdlib:0.5,niah:0.5` gives each source a share of the corpus's tokens.
Finite sources (stdlib, files, tokens) contribute their first documents (in their seeded shuffled
order) up to their share of the largest total that no finite source is too small for; niah
generates its share. The documents of all sources are then interleaved in a seeded order; the
validation split, a random sample of documents, holds each source's share of tokens in
expectation. With niah alone the corpus has about `data.niah_tokens` tokens (generation stops
once they are reached, so its last document and each document's end-of-text go past them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diff_jax import niah
from diff_jax.config import DataConfig
from diff_jax.data.corpus import TokenCorpus
from diff_jax.data.sources import DataError
from diff_jax.data.tokenizer import encoding


def niah_corpus(encoding_name: str, seed: int, num_tokens: int, doc_tokens: int) -> TokenCorpus:
    """Needle/haystack documents (`diff_jax.niah.training_documents`), each + end-of-text."""
    enc = encoding(encoding_name)
    try:
        docs = niah.training_documents(niah.train_rng(seed), enc, num_tokens=num_tokens,
                                       doc_tokens=doc_tokens)
    except ValueError as e:  # a document too short for its needles in this tokenizer's tokens
        raise DataError(f"data.niah_doc_tokens={doc_tokens} is too small for data.tokenizer="
                        f"{encoding_name} ({e}); raise it") from e
    return _concat([np.append(d, enc.eot_token) for d in docs], enc.n_vocab)


def _concat(docs: list[np.ndarray], vocab_size: int, skipped: tuple[str, ...] = ()) -> TokenCorpus:
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    return TokenCorpus(np.concatenate(docs).astype(np.uint32), starts, vocab_size, skipped)


def _documents(corpus: TokenCorpus, budget: float) -> list[np.ndarray]:
    """The leading documents of `corpus` holding about `budget` tokens (at least one)."""
    n = max(1, int(np.searchsorted(corpus.doc_starts[1:], budget, side="right")))
    return [np.asarray(corpus.tokens[corpus.doc_starts[i]: corpus.doc_starts[i + 1]])
            for i in range(n)]


def _budget(corpus: TokenCorpus, share: float) -> float:
    """`share` tokens of `corpus`, all of them where the share is all of it up to rounding: the
    scarcest source's w·(len/w) comes out an ulp below len for some lengths and weights
    (0.7·(13961/0.7) = 13960.999999999998), which left out its last document."""
    return float(len(corpus.tokens)) if share >= len(corpus.tokens) * (1 - 1e-9) else share


def mixed_corpus(cfg: DataConfig, seed: int, finite: dict[str, TokenCorpus]) -> TokenCorpus:
    """The corpus of `cfg.mixture_weights`, given the loaded finite sources by name: each source's
    leading whole documents up to its share of the total, which is as much as the scarcest finite
    source allows, about `cfg.mixture_tokens` at most (niah's last document and end-of-text
    tokens go past its share)."""
    weights = dict(cfg.mixture_weights)
    masked = [name for name, c in finite.items() if c.loss_mask is not None]
    if masked:
        raise DataError(f"data.mixture: source {masked[0]!r} has a loss mask (loss_mask.bin); a "
                        "mixture takes only sources whose every token is a target")
    if finite:
        total = min(len(c.tokens) / weights[name] for name, c in finite.items())
    else:
        total = cfg.niah_tokens / weights["niah"]
    if cfg.mixture_tokens is not None:
        total = min(total, cfg.mixture_tokens)
    docs = [d for name, c in finite.items() for d in _documents(c, _budget(c, weights[name] * total))]
    vocab = max([c.vocab_size for c in finite.values()] or [0])
    skipped = tuple(s for c in finite.values() for s in c.skipped)
    notes = tuple(n for c in finite.values() for n in c.notes)
    if "niah" in weights:
        synthetic = niah_corpus(cfg.tokenizer, seed, max(1, int(weights["niah"] * total)),
                                cfg.niah_doc_tokens)
        docs += _documents(synthetic, len(synthetic.tokens))
        vocab = max(vocab, synthetic.vocab_size)
    order = np.random.default_rng(seed).permutation(len(docs))
    return dataclasses.replace(_concat([docs[i] for i in order], vocab), skipped=skipped,
                               notes=notes)
