"""Held-out evaluation sets: packed rows spread evenly over the whole validation split.

The validation split (`TokenCorpus.split`) is one stream of randomly drawn documents. An
evaluation of T tokens reads k = ceil(T / L) of its R rows of L targets (rounded up to whole
batches, at most all R rows in whole batches), at rows ⌊i·R/k⌋ for i < k: evenly spread from
the first document to the last, so the tokens come from across the split rather than from its
first documents. Batch n holds the selected rows n·B … n·B + B − 1; process p of P reads its
slice p·b … p·b + b − 1 (b = B / P), as in training. The counts are global.
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
    tokens: int  # target tokens scored, over all processes: rows × L
    documents: int  # distinct documents those targets fall in


def spread_rows(num_rows: int, wanted: int) -> np.ndarray:
    """(k,) row indices: `wanted` rows (at most `num_rows`) spread evenly over 0..num_rows−1."""
    k = min(wanted, num_rows)
    return np.arange(k, dtype=np.int64) * num_rows // k


def documents_covered(corpus: TokenCorpus, rows: np.ndarray, seq_len: int) -> int:
    """How many documents have at least one target token in rows `rows` (of `seq_len`)."""
    targets = (rows[:, None] * seq_len + 1 + np.arange(seq_len)).ravel()
    return len(np.unique(np.searchsorted(corpus.doc_starts, targets, side="right")))


def held_out(corpus: TokenCorpus, seq_len: int, global_batch: int, tokens: int,
             process_index: int = 0, process_count: int = 1) -> HeldOut:
    """Batches of packed rows covering about `tokens` targets spread over `corpus` (see the module
    docstring); with `tokens` = 0, none."""
    if tokens == 0:
        return HeldOut([], 0, 0)
    all_rows = PackedRows(corpus, seq_len, seed=0, shuffle=False)
    whole = len(all_rows) // global_batch * global_batch
    if whole == 0:
        raise DataError(f"data.validation_fraction: the held-out split has {len(all_rows)} row(s) "
                        f"of {seq_len} tokens, fewer than one batch of {global_batch}; hold out "
                        "more documents")
    wanted = -(-tokens // seq_len)
    rows = spread_rows(len(all_rows), min(-(-wanted // global_batch) * global_batch, whole))
    b = local_batch_size(global_batch, process_count)
    batches = []
    for n in range(len(rows) // global_batch):
        first = n * global_batch + process_index * b
        mine = rows[first: first + b]
        picked = [all_rows[int(r)] for r in mine]
        batches.append({k: np.stack([r[k] for r in picked]) for k in picked[0]})
    return HeldOut(batches, len(rows) * seq_len, documents_covered(corpus, rows, seq_len))
