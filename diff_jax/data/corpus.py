"""A tokenized corpus: one flat stream of token ids with document boundaries.

Every document is encoded with `data.tokenizer` and followed by the end-of-text token. On disk (made by
`python -m diff_jax.data prepare`) a corpus is a directory with `tokens.bin` (raw little-endian
uint32 ids, memory-mapped when read, so a large corpus is tokenized once), `doc_starts.npy`
(int64, num_docs + 1 offsets), `meta.json` and, for a corpus with a loss mask, `loss_mask.bin`
(one uint8 a token: 1 where the token counts as a training target; without it every token
counts). A validation split (`split`) draws its documents
from the whole corpus, so it copies both parts into memory (4 bytes a token).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from diff_jax.data.sources import (DataError, Documents, check_prompt_files, expand_paths,
                                   iter_records)
from diff_jax.data.tokenizer import (BASE, Encoding, continuations, encoding, identity,
                                     mismatch, text_prefix)
from diff_jax.output_dir import refusal, staged

TOKEN_DTYPE = np.dtype("<u4")
# Every file a prepared corpus directory holds (`TokenCorpus.save`, `prepare`).
CORPUS_FILES = frozenset({"tokens.bin", "doc_starts.npy", "loss_mask.bin", "meta.json"})
# the rule the ids of a response after its prompt follow (`tokenizer.continuations`: the joined
# text's ids past the prompt's), which meta.json's `response_ids` records for a corpus prepared
# with prompts; corpora prepared before have none: each response encoded alone
RESPONSE_IDS = "continuations"


@dataclasses.dataclass(frozen=True)
class TokenCorpus:
    """Documents i = tokens[doc_starts[i]:doc_starts[i+1]], each ending in end-of-text."""

    tokens: np.ndarray  # (N,) uint32
    doc_starts: np.ndarray  # (num_docs + 1,) int64, doc_starts[0] = 0, doc_starts[-1] = N
    vocab_size: int  # ids are < vocab_size
    skipped: tuple[str, ...] = ()  # the files and records skipped reading it (none: `load`)
    # (N,) uint8: 1 where predicting the token counts in the training loss; None: every token
    loss_mask: np.ndarray | None = None
    # what a training run says of how a prepared corpus was made, a line each (`load`)
    notes: tuple[str, ...] = ()

    @property
    def num_docs(self) -> int:
        """Number of documents."""
        return len(self.doc_starts) - 1

    def documents(self, which: np.ndarray) -> TokenCorpus:
        """The corpus of documents `which` (indices, in that order), their tokens copied."""
        starts, ends = self.doc_starts[which], self.doc_starts[np.asarray(which) + 1]
        lengths = ends - starts

        def gather(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
            return (np.concatenate([x[a:b] for a, b in zip(starts, ends)]) if len(lengths)
                    else np.zeros(0, dtype))

        mask = None if self.loss_mask is None else gather(self.loss_mask, np.uint8)
        return dataclasses.replace(self, tokens=gather(self.tokens, TOKEN_DTYPE), loss_mask=mask,
                                   doc_starts=np.concatenate([[0], np.cumsum(lengths)]))

    def split(self, validation_fraction: float, seed: int = 0
              ) -> tuple[TokenCorpus, TokenCorpus | None]:
        """(train, validation): round(fraction · documents) documents (at least 1) drawn at
        random with `seed` are held out, in the order drawn; the rest train, in corpus order. No
        document is in both. (None when the fraction is 0.)"""
        n = self.num_docs
        if validation_fraction == 0:
            return self, None
        if n < 2:
            raise DataError(f"data.validation_fraction={validation_fraction}: the corpus has "
                            f"{n} document(s); a validation split needs at least 2")
        n_val = min(max(int(round(validation_fraction * n)), 1), n - 1)
        held = np.random.default_rng((0x5E1D, seed)).choice(n, n_val, replace=False)
        keep = np.ones(n, bool)
        keep[held] = False
        return self.documents(np.flatnonzero(keep)), self.documents(held)

    def sha256(self) -> str:
        """Hex SHA-256 of the token ids (little-endian uint32), the document offsets (int64) and
        the loss mask (uint8) if any: equal digests mean the same documents, in the same order,
        with the same counted targets."""
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.tokens, TOKEN_DTYPE).tobytes())
        h.update(np.ascontiguousarray(self.doc_starts, "<i8").tobytes())
        if self.loss_mask is not None:
            h.update(b"loss_mask")
            h.update(np.ascontiguousarray(self.loss_mask, np.uint8).tobytes())
        return h.hexdigest()

    def fingerprint(self) -> dict[str, Any]:
        """{"sha256", "tokens", "documents"}: what a checkpoint records of its run's training
        split, so that a resume can tell whether the rows its data position counts are the same."""
        return {"sha256": self.sha256(), "tokens": int(len(self.tokens)),
                "documents": int(self.num_docs)}

    def save(self, out_dir: str | Path, meta: dict) -> None:
        """Write the corpus to `out_dir` (the layout of the module docstring), `meta` merged into
        meta.json with the counts, the content digest (`sha256`), what was skipped making it
        (`skipped`) and, when it has any, its `notes`: a corpus made from a prepared one skipped
        nothing itself, and its notes say what that one's prepare skipped and where it is
        listed (before, its `"skipped": []` was all it said)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.tokens.astype(TOKEN_DTYPE).tofile(out / "tokens.bin")
        np.save(out / "doc_starts.npy", self.doc_starts.astype(np.int64))
        if self.loss_mask is not None:
            self.loss_mask.astype(np.uint8).tofile(out / "loss_mask.bin")
        info = dict(meta, num_docs=self.num_docs, num_tokens=int(len(self.tokens)),
                    vocab_size=self.vocab_size, skipped=list(self.skipped), sha256=self.sha256())
        if self.notes:
            info["notes"] = list(self.notes)
        (out / "meta.json").write_text(json.dumps(info, indent=1))


def unigram_loss(train: TokenCorpus, held_out: TokenCorpus) -> float:
    """Mean cross-entropy (nats) of `held_out`'s tokens under `train`'s token frequencies,
    add-one smoothed over `vocab_size` ids: the held-out loss of a model that has learned how
    often each token occurs and nothing else."""
    counts = np.bincount(train.tokens, minlength=train.vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts) - np.log(counts.sum())
    return float(-log_p[held_out.tokens].mean())


def tokenize(docs: Documents, encoding_name: str, seed: int = 0, threads: int = 4) -> TokenCorpus:
    """Encode every document (+ end-of-text) in a seeded shuffled document order, each after the
    tokenizer's `text_prefix` (a Hugging Face tokenizer's beginning-of-text; none for
    tiktoken's). With `docs.prompts`, a document is the prefix, its prompt's tokens (the prompt
    encoded as written, as `eval.py task=generate` encodes one), then its text's as they
    continue the prompt (`continuations`: the joined text's ids past the prompt's, unless a
    token spans the boundary), then end-of-text, and the corpus has a loss mask that counts the
    text's tokens and the end-of-text as targets, not the prefix's and prompt's. An empty prompt
    adds no token: the document is encoded as it is without prompts, its prefix masked."""
    return _tokenize(docs, encoding(encoding_name), seed, threads)


def _tokenize(docs: Documents, enc: Encoding, seed: int = 0, threads: int = 4) -> TokenCorpus:
    """`tokenize` with the tokenizer `enc`, read already: `prepare` encodes each chunk with the
    one it read at its start, which its meta.json records (`encoding` reads a tokenizer.json
    edited since again)."""
    head = text_prefix(enc)
    order = list(range(len(docs.texts)))
    random.Random(seed).shuffle(order)
    texts = [docs.texts[i] for i in order]
    if docs.prompts is None:
        prompts = [[] for _ in order]
        ids = enc.encode_ordinary_batch(texts, num_threads=threads)
    else:
        prompts, ids = continuations(enc, [docs.prompts[i] for i in order], texts, threads)
    lengths = np.array([len(head) + len(p) + len(x) + 1 for p, x in zip(prompts, ids)],
                       dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=TOKEN_DTYPE)
    mask = None if docs.prompts is None else np.ones(len(tokens), np.uint8)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    for i, (p, x) in enumerate(zip(prompts, ids)):
        start, middle = doc_starts[i], doc_starts[i] + len(head) + len(p)
        tokens[start:middle] = head + p
        tokens[middle: doc_starts[i + 1] - 1] = x
        tokens[doc_starts[i + 1] - 1] = enc.eot_token
        if mask is not None:
            mask[start:middle] = 0
    return TokenCorpus(tokens, doc_starts, enc.n_vocab, docs.skipped, mask)


def load(corpus_dir: str | Path, tokenizer: str | None = None) -> TokenCorpus:
    """Memory-map a corpus written by `prepare`. With `tokenizer` (`data.tokenizer`), a corpus
    whose meta.json names a different tiktoken encoding, or records another Hugging Face
    tokenizer.json (its SHA-256, wherever the file now is), end-of-text or beginning-of-text ids
    (`tokenizer.mismatch`), is a DataError: its ids would be decoded with the wrong one. (A
    corpus naming no tokenizer, or an unknown one, loads as it is.)
    One prepared with `prompt_field` whose loss_mask.bin is gone (a copy of the three files an
    unmasked corpus has) is a DataError too: before, it loaded unmasked and trained on every
    prompt token without a word. Its `notes`: those meta.json records (`save`), how many files
    and records `prepare` skipped (which it listed, and meta.json lists), not the list again;
    and for a corpus with prompts that records no `response_ids`, that its responses were
    encoded alone (`RESPONSE_IDS`).
    Its `skipped` is empty: nothing is skipped reading it."""
    d = Path(corpus_dir)
    try:
        meta = json.loads((d / "meta.json").read_text())
        doc_starts = np.load(d / "doc_starts.npy")
        tokens = np.memmap(d / "tokens.bin", dtype=TOKEN_DTYPE, mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"data.paths: {d} is not a prepared token corpus ({type(e).__name__}: "
                        f"{e}); python -m diff_jax.data prepare SRC... OUT_DIR writes one into a "
                        "new OUT_DIR, and data.source=files reads text files as they are") from e
    vocab_size = meta.get("vocab_size") if isinstance(meta, dict) else None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise DataError(f"{d / 'meta.json'}: expected a JSON object whose vocab_size is a positive "
                        f"integer (the ids are below it), got {vocab_size!r}")
    if tokenizer is not None and isinstance(meta, dict):
        problem = mismatch(meta, encoding(tokenizer), f"data.paths={d}", "prepared")
        if problem is not None:
            raise DataError(problem)
    if (doc_starts.ndim != 1 or len(doc_starts) < 2 or doc_starts[0] != 0
            or doc_starts[-1] != len(tokens) or np.any(np.diff(doc_starts) <= 0)):
        raise DataError(f"{d}: doc_starts.npy does not match tokens.bin ({len(tokens)} tokens): "
                        "expected increasing offsets from 0 to the token count")
    for key, found in (("num_tokens", len(tokens)), ("num_docs", len(doc_starts) - 1)):
        if key in meta and meta[key] != found:
            raise DataError(f"{d / 'meta.json'}: {key} is {meta[key]!r} but the corpus holds "
                            f"{found}; it is damaged or from another corpus (prepare it again)")
    top = int(tokens.max())  # one pass over the memory map: an id past the embedding reads NaN
    if top >= vocab_size:
        raise DataError(f"{d / 'tokens.bin'}: holds id {top}, not below meta.json's vocab_size "
                        f"{vocab_size}; it is damaged (prepare it again)")
    mask = None
    if (d / "loss_mask.bin").exists():
        mask = np.memmap(d / "loss_mask.bin", dtype=np.uint8, mode="r")
        if len(mask) != len(tokens):
            raise DataError(f"{d}: loss_mask.bin has {len(mask)} entries, tokens.bin "
                            f"{len(tokens)} tokens; they must match one to one")
    elif "prompt_field" in meta:  # `prepare --prompt-field`: without it every prompt is a target
        raise DataError(f"{d}: meta.json says it was prepared with --prompt-field "
                        f"{meta['prompt_field']}, but loss_mask.bin is missing, so its prompts "
                        "would be training targets; it is damaged (prepare it again)")
    return TokenCorpus(tokens, doc_starts, vocab_size, loss_mask=mask, notes=_notes(d, meta))


def _notes(d: Path, meta: dict) -> tuple[str, ...]:
    """`load`'s notes on the corpus `d`, whose meta.json holds `meta`: those it records (of the
    corpora it was made from, `TokenCorpus.save`), then its own."""
    notes = meta.get("notes", [])
    if not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
        raise DataError(f"{d / 'meta.json'}: notes: expected a list of lines, got {notes!r}")
    notes = list(notes)
    if meta.get("skipped"):
        notes.append(f"data: {len(meta['skipped'])} file(s) or record(s) were skipped when {d} "
                     f"was prepared: see {d / 'meta.json'}")
    if "prompt_field" in meta and "response_ids" not in meta:
        notes.append(f"data: {d} was prepared with --prompt-field before responses were encoded "
                     "as they continue their prompts (its meta.json records no response_ids): "
                     "each response's ids are its own encoding; prepare it again to train on "
                     "the joined text's ids")
    return tuple(notes)


def prepare(sources: list[str], out_dir: str | Path, text_field: str = "text",
            encoding_name: str = BASE, chunk_chars: int = 1 << 25, *,
            overwrite: bool = False, prompt_field: str | None = None) -> dict:
    """Tokenize files/globs (or `stdlib`) into `out_dir`, streaming: the documents are read
    (`iter_records`: a JSONL file a record at a time), tokenized and written about
    `chunk_chars` characters of text at a time, each chunk's documents in a seeded shuffled
    order, so the memory taken is a chunk's (about 50 bytes a token: tiktoken's id lists), not
    the corpus's. With `prompt_field`, each JSONL record's prompt comes first and is no
    training target (`tokenize`): loss_mask.bin holds the mask, one byte a token.

    The corpus is written whole or not at all (`diff_jax.output_dir`): a failure leaves `out_dir`
    as it was, or absent. An existing non-empty `out_dir` is a DataError unless `overwrite` and
    it is a prepared corpus (its meta.json), which is then replaced once the new one is written."""
    from diff_jax.data.sources import stdlib_documents

    out = Path(out_dir)
    problem = refusal(out, overwrite, "meta.json", "a prepared token corpus", CORPUS_FILES)
    if problem is not None:
        raise DataError(f"OUT_DIR {out}: {problem}")
    if prompt_field is not None and prompt_field in ("", text_field):
        raise DataError(f"data.prompt_field={prompt_field!r}: must be a JSONL field name other "
                        f"than data.text_field ({text_field!r})")
    enc = encoding(encoding_name)
    starts, skipped, total = [np.zeros(1, np.int64)], [], 0  # 8 bytes a document
    if sources == ["stdlib"]:
        if prompt_field is not None:
            raise DataError(f"data.prompt_field={prompt_field}: stdlib has no JSONL records to "
                            "read prompts from")
        docs = stdlib_documents()
        skipped.extend(docs.skipped)
        chunks: Iterable[list[tuple[str, str]]] = [[("", t) for t in docs.texts]]
    else:
        files = expand_paths(tuple(sources))
        check_prompt_files(files, prompt_field, sources)
        random.Random(0).shuffle(files)
        chunks = _chunks(iter_records(files, text_field, prompt_field, skipped), chunk_chars)
    with (staged(out) as tmp, open(tmp / "tokens.bin", "wb") as f,  # closed before the rename
          open(tmp / "loss_mask.bin", "wb") if prompt_field is not None
          else contextlib.nullcontext() as masks):
        for records in chunks:
            kept = [(p, t) for p, t in records if t.strip()]
            part = _tokenize(Documents(tuple(t for _, t in kept), (), None if masks is None
                                       else tuple(p for p, _ in kept)), enc)
            part.tokens.tofile(f)
            if masks is not None:
                part.loss_mask.tofile(masks)
            starts.append(part.doc_starts[1:] + total)
            total += len(part.tokens)
        if total == 0:
            first = f" ({len(skipped)} skipped, first: {skipped[0]})" if skipped else ""
            raise DataError(f"prepare {sources}: no non-empty document{first}")
        doc_starts = np.concatenate(starts).astype(np.int64)
        np.save(tmp / "doc_starts.npy", doc_starts)
        meta = dict(sources=sources, **identity(enc), num_docs=len(doc_starts) - 1,
                    num_tokens=total, vocab_size=enc.n_vocab, skipped=skipped,
                    **({} if prompt_field is None else {"prompt_field": prompt_field,
                                                        "response_ids": RESPONSE_IDS}))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _chunks(records: Iterable[tuple[str, str]], chars: int) -> Iterator[list[tuple[str, str]]]:
    """(prompt, text) `records` in consecutive lists of at least `chars` characters (the last
    may hold fewer; a record longer than `chars` ends its list)."""
    chunk: list[tuple[str, str]] = []
    size = 0
    for record in records:
        chunk.append(record)
        size += len(record[0]) + len(record[1])
        if size >= chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
