"""Held-out evaluation sets: packed rows spread evenly over the whole validation split.

The validation split (`TokenCorpus.split`) is one stream of randomly drawn documents. An
evaluation of T tokens reads k = ceil(T / L) of its R rows of L targets (rounded up to whole
batches, at most all R rows in whole batches), at rows ⌊i·R/k⌋ for i < k: evenly spread from
the first document to the last, so the tokens come from across the split rather than from its
first documents. Batch n holds the selected rows n·B … n·B + B − 1; process p of P reads its
slice p·b … p·b + b − 1 (b = B / P), as in training. The counts are global and, on a corpus
with a loss mask (`TokenCorpus.loss_mask`), count only the targets the mask counts: a batch's
mean loss weighs by its count, so the held-out loss is the mean over counted targets.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diff_jax.data.corpus import TokenCorpus
from diff_jax.data.pipeline import Batch, PackedRows, local_batch_size
from diff_jax.data.sources import DataError


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """This process's slices of the evaluation batches, and what all processes' batches cover."""

    batches: list[Batch]  # each (b, L) int32 per key; empty when no evaluation was asked for
    tokens: int  # counted target tokens, over all processes (rows × L without a loss mask)
    documents: int  # distinct documents with a counted target
    counts: tuple[int, ...]  # counted targets of each batch, over all processes

    def mean(self, batch_losses: list[float]) -> float:
        """The held-out loss: the mean over counted targets of batches whose mean losses over
        their counted targets are `batch_losses` (one per batch)."""
        return float(np.dot(batch_losses, self.counts) / self.tokens)


def spread_rows(num_rows: int, wanted: int) -> np.ndarray:
    """(k,) row indices: `wanted` rows (at most `num_rows`) spread evenly over 0..num_rows−1."""
    k = min(wanted, num_rows)
    return np.arange(k, dtype=np.int64) * num_rows // k


def counted_targets(corpus: TokenCorpus, rows: np.ndarray, seq_len: int) -> np.ndarray:
    """Corpus positions, (at most n·seq_len,) integers, of the targets of rows `rows` ((n,) row
    indices, rows of `seq_len`) that the loss mask counts (all of them without a loss mask)."""
    targets = (rows[:, None] * seq_len + 1 + np.arange(seq_len)).ravel()
    if corpus.loss_mask is None:
        return targets
    return targets[np.asarray(corpus.loss_mask[targets]) != 0]


def documents_covered(corpus: TokenCorpus, rows: np.ndarray, seq_len: int) -> int:
    """How many documents have at least one counted target token in rows `rows` ((n,) row
    indices, rows of `seq_len`)."""
    targets = counted_targets(corpus, rows, seq_len)
    return len(np.unique(np.searchsorted(corpus.doc_starts, targets, side="right")))


def held_out(corpus: TokenCorpus, seq_len: int, global_batch: int, tokens: int,
             process_index: int = 0, process_count: int = 1) -> HeldOut:
    """Batches of packed rows covering about `tokens` targets spread over `corpus` (see the module
    docstring); with `tokens` = 0, none."""
    if tokens == 0:
        return HeldOut([], 0, 0, ())
    num_rows = PackedRows.count(corpus, seq_len)
    whole = num_rows // global_batch * global_batch
    if whole == 0:  # before PackedRows, whose "the corpus has N tokens" would name the corpus
        raise DataError(f"data.validation_fraction: the held-out split has {num_rows} row(s) "
                        f"of {seq_len} tokens ({len(corpus.tokens)} tokens), fewer than one batch "
                        f"of {global_batch}; hold out more documents")
    all_rows = PackedRows(corpus, seq_len, seed=0, shuffle=False)
    wanted = -(-tokens // seq_len)
    rows = spread_rows(len(all_rows), min(-(-wanted // global_batch) * global_batch, whole))
    b = local_batch_size(global_batch, process_count)
    batches, counts = [], []
    for n in range(len(rows) // global_batch):
        first = n * global_batch + process_index * b
        mine = rows[first: first + b]
        picked = [all_rows[int(r)] for r in mine]
        batches.append({k: np.stack([r[k] for r in picked]) for k in picked[0]})
        counts.append(len(counted_targets(corpus, rows[n * global_batch: (n + 1) * global_batch],
                                          seq_len)))
    if sum(counts) == 0:
        raise DataError(f"data.validation_fraction: the loss mask of the held-out split counts "
                        f"none of the {len(rows) * seq_len:,} targets its rows select")
    return HeldOut(batches, sum(counts), documents_covered(corpus, rows, seq_len), tuple(counts))
