"""The grain input pipeline: packed rows of a token stream, shuffled, sharded per process, batched.

Packing: the corpus is one stream of documents separated by end-of-text; row j is the window
`stream[j·L : j·L + L + 1]` (inputs = the first L tokens, targets = the last L). `segment_ids`
(from 1) number the documents inside a row and `positions` restart at 0 for each of them, so the
model attends only within a document. `loss_mask` is 1 for the targets that count in the loss
(all of them unless the corpus has a loss mask: `TokenCorpus.loss_mask`). No token is padded or
truncated away, but the stream's last (N − 1) mod L tokens, fewer than a row, are no row's
target. (grain's `FirstFitPackIterDataset` truncates documents longer than L, which would drop
most of a source file at L = 128, and packs per process, which would make the global batch
depend on the number of processes; a window over the stream has neither problem.)

Order: every epoch visits all rows in a fresh seeded permutation (`index_shuffle`, O(1) memory;
`_permuted` works around its gap at row counts 2^k + 1, k ≥ 16).
Global batch k holds the rows k·B … k·B + B − 1 of that order; process p reads its slice
p·b … p·b + b − 1 (b = B / processes), so the global batch is the same for any process count,
and the processes' rows are disjoint. The iterator state is grain's (the next batch index).
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from diff_jax.data.corpus import TokenCorpus
from diff_jax.data.sources import DataError

Batch = dict[str, np.ndarray]  # tokens, targets, segment_ids, positions, loss_mask: (b, L) int32
_UNBOUNDED = 2**62


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Random access to row g ≥ 0 of the endless row stream (epoch = g // rows per epoch)."""

    corpus: TokenCorpus
    seq_len: int
    seed: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        if len(self) == 0:
            raise DataError(f"the corpus has {len(self.corpus.tokens)} tokens, fewer than one row "
                            f"of train.seq_len + 1 = {self.seq_len + 1}")

    def __len__(self) -> int:
        return self.count(self.corpus, self.seq_len)

    @staticmethod
    def count(corpus: TokenCorpus, seq_len: int) -> int:
        """The rows of `seq_len` tokens (and one target more) `corpus` holds, 0 when too short."""
        return max(len(corpus.tokens) - 1, 0) // seq_len

    def __repr__(self) -> str:  # stable, for grain's checkpoint validation
        return f"PackedRows(tokens={len(self.corpus.tokens)}, seq_len={self.seq_len}, seed={self.seed})"

    def __getitem__(self, g: int) -> Batch:
        n, length = len(self), self.seq_len
        epoch, j = divmod(int(g), n)
        if self.shuffle and n > 1:
            j = _permuted(j, n, (self.seed * 7919 + epoch) % 2**31)
        start = j * length
        window = np.asarray(self.corpus.tokens[start: start + length + 1], dtype=np.int32)
        doc = np.searchsorted(self.corpus.doc_starts, np.arange(start, start + length), side="right")
        seg = (doc - doc[0] + 1).astype(np.int32)
        idx = np.arange(length, dtype=np.int32)
        first = np.maximum.accumulate(np.where(np.r_[True, seg[1:] != seg[:-1]], idx, 0))
        mask = (np.ones(length, np.int32) if self.corpus.loss_mask is None else
                np.asarray(self.corpus.loss_mask[start + 1: start + length + 1], dtype=np.int32))
        return {"tokens": window[:-1], "targets": window[1:], "segment_ids": seg,
                "positions": idx - first, "loss_mask": mask}


def _permuted(j: int, n: int, seed: int) -> int:
    """Position j of a seeded permutation of range(n), n ≥ 2 (grain's `index_shuffle`).

    index_shuffle over [0, max_index] sizes its block as ceil(log2(max_index)) bits, one bit
    short when max_index is a power of two from 2^16 up: its map over [0, 65536] sends two
    indices to one row and none to row 65536. There, it runs over [0, n] (one more index, so a
    wide enough block) and walks the cycle back into range(n): still a permutation, the
    order of the other sizes unchanged."""
    shuffle = grain.experimental.index_shuffle
    top = n - 1
    if top < 2**16 or top & (top - 1):
        return shuffle(j, max_index=top, seed=seed, rounds=4)
    j = shuffle(j, max_index=n, seed=seed, rounds=4)
    while j == n:  # the one index outside range(n): the cycle through it continues inside
        j = shuffle(j, max_index=n, seed=seed, rounds=4)
    return j


@dataclasses.dataclass(frozen=True)
class _ProcessRow:
    """Local row i -> the global row it stands for, for process p of P (b local rows a batch)."""

    rows: PackedRows
    global_batch: int
    local_batch: int
    process_index: int

    def __call__(self, i: int) -> Batch:
        b = self.local_batch
        return self.rows[(i // b) * self.global_batch + self.process_index * b + i % b]


def local_batch_size(global_batch: int, process_count: int) -> int:
    """Rows of each global batch one process reads; `DataError` unless it divides evenly."""
    if global_batch % process_count:
        raise DataError(f"train.batch_size ({global_batch}) must be divisible by the number of "
                        f"processes ({process_count})")
    return global_batch // process_count


def train_iterator(rows: PackedRows, global_batch: int, process_index: int, process_count: int,
                   read_threads: int = 2, prefetch: int = 4) -> grain.DatasetIterator:
    """An endless, checkpointable iterator of this process's (b, L) slices of the global batches;
    `DataError` when a global batch would hold more rows than an epoch (rows twice in one batch)."""
    if global_batch > len(rows):
        raise DataError(f"train.batch_size ({global_batch:,}) is more than the {len(rows):,} rows "
                        f"of train.seq_len={rows.seq_len} tokens the training split holds: each "
                        "batch would repeat rows; lower train.batch_size or train on more data")
    b = local_batch_size(global_batch, process_count)
    ds = (grain.MapDataset.range(_UNBOUNDED)
          .map(_ProcessRow(rows, global_batch, b, process_index))
          .batch(b, drop_remainder=True))
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                                     prefetch_buffer_size=prefetch)))

