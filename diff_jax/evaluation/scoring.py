"""Likelihood tasks: `ppl` (held-out loss, perplexity, NLL by position) and `score` (per-token
log-probabilities of a file), plus the held-out data and forward passes the analyses share."""

from __future__ import annotations

import functools
import io
import itertools
import math
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diff_jax.config import Config, ModelConfig
from diff_jax.data import (Batch, DataError, HeldOut, TokenCorpus, encoding, held_out,
                           split_corpus)
from diff_jax.data.tokenizer import text_prefix
from diff_jax.error_text import first_line
from diff_jax.evaluation import plots
from diff_jax.evaluation.loading import Loaded, check_trained_tokenizer, text_encoding
from diff_jax.evaluation.options import EvalError, EvalOptions
from diff_jax.evaluation.report import Report, progress
from diff_jax.output_dir import write_whole
from diff_jax.transformer import DecoderLM


@functools.partial(jax.jit, static_argnames=("model",))
def token_nll(model: DecoderLM, params: Any, tokens: jax.Array, targets: jax.Array,
              segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
              logit_bits: jax.Array | None = None) -> jax.Array:
    """−log p(target | prefix) per position (B, T), normalized over the full output vocabulary;
    `logit_bits` (int32 scalar) quantizes an xla-path model's attention logits
    (`DecoderLM.quantized`), one program for every width."""
    return model.quantized(logit_bits).apply({"params": params}, tokens, positions=positions,
                                             segment_ids=segment_ids, targets=targets)


def batch_nll(model_cfg: ModelConfig, params: Any, batch: Batch,
              logit_bits: int | None = None) -> np.ndarray:
    """Per-token NLL (B, T) of a packed batch (segments and positions as in training), with the
    attention logits quantized to `logit_bits` (`token_nll`) when given."""
    bits = None if logit_bits is None else jnp.int32(logit_bits)
    return np.asarray(token_nll(DecoderLM(model_cfg), params, jnp.asarray(batch["tokens"]),
                                jnp.asarray(batch["targets"]), jnp.asarray(batch["segment_ids"]),
                                jnp.asarray(batch["positions"]), bits))


def counted_nll(model_cfg: ModelConfig, params: Any, batches: list[Batch],
                logit_bits: int | None = None, read: Callable[[], None] | None = None
                ) -> np.ndarray:
    """(n,) the NLL of every counted target of `batches` (`loss_mask`: all targets of a corpus
    without a loss mask), batch by batch in row-major order; `logit_bits` as in `batch_nll`.
    `read`, where given, is called after each batch."""
    nll = []
    for b in batches:
        nll.append(batch_nll(model_cfg, params, b, logit_bits)[b["loss_mask"] != 0])
        if read is not None:
            read()
    return np.concatenate(nll)


def eval_length(config: Config, options: EvalOptions, default: int | None = None) -> int:
    """The evaluation's row length: `options.length`, else `default` (None: the run's
    `train.seq_len`); `EvalError` when it exceeds `model.max_seq_len`."""
    length = options.length or default or config.train.seq_len
    if length > config.model.max_seq_len:
        raise EvalError(f"length={length} exceeds model.max_seq_len ({config.model.max_seq_len})")
    return length


def held_out_corpus(loaded: Loaded) -> TokenCorpus:
    """The validation split of the run's data (`data.*`), as training held it out; `EvalError`
    when `data.tokenizer` is not the one the parameters were trained with
    (`check_trained_tokenizer`) or the data's ids do not fit `model.vocab_size` (as train.py
    refuses it)."""
    config = loaded.config
    if config.data.validation_fraction == 0:
        raise DataError("data.validation_fraction is 0 for this run, so no text was held out; "
                        "pass data.validation_fraction=F (F of the documents, drawn at random) or "
                        "point data.source/data.paths at other text")
    check_trained_tokenizer(loaded, encoding(config.data.tokenizer))
    _, val = split_corpus(config.data, config.train.seed)
    if val.vocab_size > config.model.vocab_size:
        raise EvalError(f"data.tokenizer={config.data.tokenizer}: the held-out text's "
                        f"{val.vocab_size:,} ids do not fit model.vocab_size "
                        f"({config.model.vocab_size:,}); pass the tokenizer the model was trained "
                        "with")
    return val


def held_out_rows(corpus: TokenCorpus, length: int, batch_size: int, tokens: int) -> HeldOut:
    """Batches of `batch_size` (fewer if the split is smaller) packed rows of `length` tokens
    covering about `tokens` targets spread over the whole split (`diff_jax.data.heldout`)."""
    rows = (len(corpus.tokens) - 1) // length
    if rows < 1:
        raise DataError(f"the held-out split has {len(corpus.tokens)} tokens, fewer than one row "
                        f"of length + 1 = {length + 1}")
    return held_out(corpus, length, min(batch_size, rows), tokens)


def held_out_batches(corpus: TokenCorpus, length: int, batch_size: int, batches: int) -> list[Batch]:
    """Up to `batches` batches of `batch_size` packed rows of `length` tokens, spread over the
    whole split."""
    return held_out_rows(corpus, length, batch_size, batches * batch_size * length).batches


def fewer_rows_note(batches: list[Batch], asked: int, asked_as: str) -> list[str]:
    """[a note] when the held-out split held fewer whole batches of rows than a task asked for:
    its `batches` hold fewer target tokens than `asked` (named by `asked_as`, the option or
    product of options that asked); [] otherwise."""
    read = sum(b["tokens"].size for b in batches)  # rows × length
    if read >= asked:
        return []
    return [f"the held-out split has room for {read:,} tokens in whole batches, fewer than "
            f"{asked_as}"]


def long_documents(corpus: TokenCorpus, length: int, max_docs: int) -> np.ndarray:
    """The indices of the first `max_docs` documents of `corpus` of at least length + 1
    tokens, which `nll_by_position` reads."""
    starts, ends = corpus.doc_starts[:-1], corpus.doc_starts[1:]
    return np.flatnonzero(ends - starts >= length + 1)[:max_docs]


def nll_by_position(model_cfg: ModelConfig, params: Any, corpus: TokenCorpus, length: int,
                    max_docs: int, batch_size: int, read: Callable[[], None] | None = None
                    ) -> tuple[np.ndarray, int]:
    """((length,) mean NLL at each position 0..length−1, number of documents) over the first
    `max_docs` documents of at least length + 1 tokens (`long_documents`), each read from its
    start (the paper's Figure 4), in batches of `batch_size` rows (the last one padded);
    `read`, where given, is called after each batch."""
    long_docs = long_documents(corpus, length, max_docs)
    if len(long_docs) == 0:
        return np.zeros(0), 0
    starts = corpus.doc_starts
    rows = np.stack([np.asarray(corpus.tokens[starts[i]: starts[i] + length + 1], np.int32)
                     for i in long_docs])
    model = DecoderLM(model_cfg)
    padded = rows[np.arange(len(rows) + -len(rows) % batch_size) % len(rows)]  # whole batches
    nll = []
    for chunk in np.split(padded, len(padded) // batch_size):
        nll.append(np.asarray(token_nll(model, params, jnp.asarray(chunk[:, :-1]),
                                        jnp.asarray(chunk[:, 1:]))))
        if read is not None:
            read()
    return np.concatenate(nll)[: len(rows)].mean(axis=0), len(long_docs)


def ppl(loaded: Loaded, options: EvalOptions) -> Report:
    """Held-out loss and perplexity over packed rows; cumulative average NLL by position over
    whole documents read from their starts (different rows, which the table says)."""
    cfg = loaded.config
    length = eval_length(cfg, options)
    corpus = held_out_corpus(loaded)
    rows = held_out_rows(corpus, length, options.batch_size, options.held_out_tokens)
    masked = corpus.loss_mask is not None
    max_docs = options.batch_size * options.batches
    by_pos_batches = 0 if masked else -(-len(long_documents(corpus, length, max_docs))
                                        // options.batch_size)
    total = len(rows.batches) + by_pos_batches
    with progress(total, "batch") as bar:
        done = itertools.count(1)
        nll = counted_nll(cfg.model, loaded.params, rows.batches,
                          read=lambda: bar.draw(next(done), "held-out rows"))
        by_pos, n_docs = (np.zeros(0), 0) if masked else nll_by_position(
            cfg.model, loaded.params, corpus, length, max_docs, options.batch_size,
            read=lambda: bar.draw(next(done), "by position"))
    loss = float(nll.mean())
    cumulative = np.cumsum(by_pos) / np.arange(1, len(by_pos) + 1)
    report = Report(
        {"length": length, "num_tokens": int(nll.size), "num_documents": rows.documents,
         "split_documents": corpus.num_docs, "split_tokens": int(len(corpus.tokens)),
         "loss": loss, "ppl": math.exp(loss),
         "by_position": {"num_documents": n_docs, "nll": by_pos.tolist(),
                         "cumulative_nll": cumulative.tolist()}},
        [("held-out tokens", f"{nll.size:,}{' counted by the loss mask' if masked else ''} from "
                             f"{rows.documents} documents, in packed rows of "
                             f"{length} spread over the split ({len(corpus.tokens):,} tokens, "
                             f"{corpus.num_docs} documents) (loss, perplexity)"),
         ("loss", f"{loss:.4f}"), ("perplexity", f"{math.exp(loss):.2f}"),
         ("by position (other rows)", f"{n_docs} documents of >= {length + 1} tokens, each read "
                                      "from its start")])
    if loaded.split_note:
        report.notes.append(loaded.split_note)
    report.notes += fewer_rows_note(rows.batches, options.held_out_tokens,
                                    f"held_out_tokens={options.held_out_tokens:,}")
    if masked:
        report.notes.append("the corpus has a loss mask: by_position (every target of whole "
                            "documents) is not computed")
    elif n_docs == 0:
        report.notes.append(f"no held-out document has {length + 1} tokens: by_position is empty")
    else:
        marks = [(name, i) for name, i in (("1/4", length // 4 - 1), ("1/2", length // 2 - 1),
                                            ("end", length - 1)) if i >= 0]
        report.table.append((f"cumulative NLL at {', '.join(name for name, _ in marks)}",
                             ", ".join(f"{cumulative[i]:.3f}" for _, i in marks)))
        png = loaded.out_dir / "ppl.png"
        plots.attach(report, png, plots.lines(
            png, np.arange(1, length + 1), {cfg.model.variant: cumulative},
            title="Cumulative average NLL by position", xlabel="position",
            ylabel="cumulative average NLL", logx=True))
    return report


def _load_npy(path: Path) -> np.ndarray:
    """The array of the .npy file `path`; `EvalError` naming `input` when it is not one (no .npy
    header, cut short, or Python objects, which are never unpickled)."""
    with path.open("rb") as f:
        magic = f.read(len(np.lib.format.MAGIC_PREFIX))
    if magic != np.lib.format.MAGIC_PREFIX:
        raise EvalError(f"input={path}: not a NumPy array of token ids (no .npy header)")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as e:
        reason = ("it holds Python objects" if "allow_pickle" in str(e)
                  else first_line(e, empty=type(e).__name__))
        raise EvalError(f"input={path}: not a NumPy array of token ids ({reason})") from e


def read_tokens(path: Path, loaded: Loaded) -> np.ndarray:
    """(n,) int32: the ids of a .npy file (1-D integers) or the encoding of a .txt file
    (data.tokenizer), checked against the vocabulary (n ≥ 2)."""
    if path.is_dir():
        raise EvalError(f"input={path}: is a directory; expected a .txt or .npy file")
    if not path.is_file():
        raise EvalError(f"input={path}: no such file")
    if path.suffix == ".npy":
        ids = _load_npy(path)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise EvalError(f"input={path}: expected a 1-D array of integer token ids, got "
                            f"{ids.dtype} {ids.shape}")
    elif path.suffix == ".txt":
        try:
            # utf-8-sig: a leading byte-order mark (Windows editors write one) is not text
            text = path.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as e:
            raise EvalError(f"input={path}: not UTF-8 text (byte {e.start}: {e.reason}); pass "
                            "UTF-8 text or a .npy of token ids") from e
        enc = text_encoding(loaded)
        ids = np.asarray(text_prefix(enc) + enc.encode_ordinary(text))
    else:
        raise EvalError(f"input={path}: expected a .txt or .npy file")
    if len(ids) < 2:
        raise EvalError(f"input={path}: {len(ids)} token(s); scoring needs at least 2")
    vocab = loaded.config.model.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
        raise EvalError(f"input={path}: token ids must be in [0, {vocab})")
    return ids.astype(np.int32)


def token_logprobs(model_cfg: ModelConfig, params: Any, ids: np.ndarray, window: int,
                   scored: Callable[[int], None] | None = None) -> np.ndarray:
    """(n − 1,) float32: log p(ids[t+1] | ids[:t+1]) for t = 0..n−2 of ids (n,). Texts longer
    than `window` are read in windows of `window` tokens advancing by window/2: every later token
    keeps ≥ window/2 context. `ValueError` for a window under 2 tokens, which holds no token
    together with the one it predicts. `scored`, where given, is called after each window with
    how many tokens are scored so far."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens (a token and the one it predicts), got "
                         f"{window}")
    n, stride = len(ids), window // 2
    model = DecoderLM(model_cfg)
    out = np.empty(n - 1, np.float32)
    done = 0  # targets scored: ids[1..done]
    while done < n - 1:
        end = min(n, window if done == 0 else done + 1 + stride)
        start = max(0, end - window)
        chunk = np.zeros(window + 1, np.int32)  # right padding never reaches earlier positions
        chunk[: end - start] = ids[start:end]
        nll = np.asarray(token_nll(model, params, jnp.asarray(chunk[None, :-1]),
                                   jnp.asarray(chunk[None, 1:])))[0]
        out[done: end - 1] = -nll[done - start: end - 1 - start]
        done = end - 1
        if scored is not None:
            scored(done)
    return out


def score(loaded: Loaded, options: EvalOptions) -> Report:
    """Per-token log-probabilities of `input` to `output` (.npy float32, one per predicted token)."""
    cfg = loaded.config
    ids = read_tokens(Path(options.input), loaded)
    window = eval_length(cfg, options, cfg.model.max_seq_len)
    if window < 2:
        raise EvalError(f"length={window}: score needs windows of at least 2 tokens (a token and "
                        "the one it predicts)")
    with progress(len(ids) - 1, "token") as bar:
        logp = token_logprobs(cfg.model, loaded.params, ids, window, scored=bar.draw)
    output = Path(options.output) if options.output else loaded.out_dir / "score.npy"
    output.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.save(buffer, logp)
    write_whole(output, buffer.getvalue())  # an earlier score.npy stays whole on a failed write
    mean = float(logp.mean())
    return Report(
        {"input": str(options.input), "output": str(output), "num_tokens": int(len(ids)),
         "num_scored": int(len(logp)), "window": window, "mean_logprob": mean,
         "ppl": math.exp(-mean)},
        [("input tokens", f"{len(ids):,}"), ("mean log p", f"{mean:.4f}"),
         ("perplexity", f"{math.exp(-mean):.2f}"), ("written", str(output))],
        files=[str(output)])
