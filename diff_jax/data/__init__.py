"""Training data: text sources (or synthetic niah documents, or a mixture) -> tiktoken -> packed
rows -> per-process grain batches; a held-out split of random documents for evaluation.

    python -m diff_jax.data prepare SRC... OUT_DIR   # tokenize once, train with data.source=tokens
"""

from __future__ import annotations

import dataclasses

import grain

from diff_jax.config import DataConfig
from diff_jax.data.corpus import TokenCorpus, load, prepare, tokenize, unigram_loss
from diff_jax.data.heldout import HeldOut, held_out
from diff_jax.data.mixture import mixed_corpus, niah_corpus
from diff_jax.data.pipeline import Batch, PackedRows, train_iterator
from diff_jax.data.sources import DataError, Documents, file_documents, stdlib_documents
from diff_jax.data.tokenizer import encoding

__all__ = [
    "Batch", "DataError", "Documents", "HeldOut", "InputData", "PackedRows", "TokenCorpus", "build",
    "encoding", "file_documents", "held_out", "known_vocab_size", "load", "load_corpus",
    "mixed_corpus", "niah_corpus", "prepare", "split_corpus", "stdlib_documents", "tokenize",
    "train_iterator", "unigram_loss",
]


def load_corpus(cfg: DataConfig, seed: int = 0) -> TokenCorpus:
    """The whole corpus named by `data.source` (or `data.mixture`) / `data.paths`; `seed` seeds
    the synthetic niah documents and the mixture's interleaving."""
    if cfg.mixture is not None:
        finite = {name: _source(cfg, name) for name, _ in cfg.mixture_weights if name != "niah"}
        return mixed_corpus(cfg, seed, finite)
    if cfg.source == "niah":
        return niah_corpus(cfg.tokenizer, seed, cfg.niah_tokens, cfg.niah_doc_tokens)
    return _source(cfg, cfg.source)


def known_vocab_size(cfg: DataConfig) -> int | None:
    """The vocabulary size of `load_corpus(cfg)`, known without reading any data: the
    tokenizer's when every source is tokenized with it; None when a `tokens` corpus is read (its
    meta.json holds its size)."""
    return None if "tokens" in cfg.sources else encoding(cfg.tokenizer).n_vocab


def _source(cfg: DataConfig, name: str) -> TokenCorpus:
    if name == "stdlib":
        return tokenize(stdlib_documents(), cfg.tokenizer, threads=cfg.read_threads)
    if name == "files":
        return tokenize(file_documents(cfg.paths, cfg.text_field, cfg.prompt_field), cfg.tokenizer,
                        threads=cfg.read_threads)
    if len(cfg.paths) != 1:
        raise DataError(f"data.paths: data.source=tokens takes exactly one prepared directory, "
                        f"got {list(cfg.paths)}")
    return load(cfg.paths[0], cfg.tokenizer)


def split_corpus(cfg: DataConfig, seed: int = 0) -> tuple[TokenCorpus, TokenCorpus | None]:
    """(train, validation) of `load_corpus(cfg, seed)`: `data.validation_fraction` of its documents,
    drawn with `data.split_seed`, held out (None when the fraction is 0)."""
    return load_corpus(cfg, seed).split(cfg.validation_fraction, cfg.split_seed)


@dataclasses.dataclass
class InputData:
    """What `build` gives the training loop: the batch iterator, the held-out batches and the
    training split."""

    train: grain.DatasetIterator  # this process's (b, L) slices, checkpointable
    validation: HeldOut  # fixed; no batches when data.validation_fraction or eval_tokens is 0
    corpus: TokenCorpus  # the training split


def build(cfg: DataConfig, seq_len: int, global_batch: int, eval_tokens: int, seed: int,
          process_index: int, process_count: int) -> InputData:
    """Load, split and wrap the corpus for this process; the validation batches cover about
    `eval_tokens` held-out tokens (`diff_jax.data.heldout`)."""
    train, val = split_corpus(cfg, seed)
    if PackedRows.count(train, seq_len) == 0:  # before PackedRows, which would say "the corpus"
        held = (f"; data.validation_fraction={cfg.validation_fraction} holds out the other "
                f"{len(val.tokens)}" if val is not None else "")
        raise DataError(f"the training split has {len(train.tokens)} tokens, fewer than one row "
                        f"of train.seq_len + 1 = {seq_len + 1}{held}")
    rows = PackedRows(train, seq_len, seed)
    it = train_iterator(rows, global_batch, process_index, process_count,
                        cfg.read_threads, cfg.prefetch)
    validation = (HeldOut([], 0, 0, ()) if val is None else
                  held_out(val, seq_len, global_batch, eval_tokens, process_index, process_count))
    return InputData(it, validation, train)
