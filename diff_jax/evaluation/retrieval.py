"""The `niah` task: multi-needle retrieval accuracy per (answer depth, context length) — the
paper's Table 2 / Figure 5 protocol on `diff_jax.niah` samples.

A query counts as retrieved when greedy decoding after "The magic number of CITY is" produces the
needle's number: every answer token is the argmax given the correct tokens before it (teacher
forcing the answer is exactly greedy decoding of its length). A sample's accuracy is the share of
its R queried needles retrieved; a cell's is the mean over its S samples.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diff_jax import niah as needles
from diff_jax.config import Config, ModelConfig
from diff_jax.data.tokenizer import Encoding
from diff_jax.evaluation import plots
from diff_jax.evaluation.loading import Loaded, text_encoding
from diff_jax.evaluation.options import EvalError, EvalOptions
from diff_jax.evaluation.report import Report, progress
from diff_jax.transformer import DecoderLM


def niah_lengths(config: Config, options: EvalOptions) -> tuple[int, ...]:
    """The context lengths of the niah grid: `lengths=`, else (train.seq_len,); each must fit
    model.max_seq_len (`EvalError` naming `lengths`)."""
    lengths = options.lengths or (config.train.seq_len,)
    too_long = [n for n in lengths if n > config.model.max_seq_len]
    if too_long:
        raise EvalError(f"lengths={list(lengths)}: {too_long} exceed model.max_seq_len "
                        f"({config.model.max_seq_len})")
    return tuple(lengths)


def cell_samples(enc: Encoding, options: EvalOptions, depth: int,
                 length: int) -> list[needles.NiahSample]:
    """The S samples of one (depth %, length) cell; each cell has its own seeded stream."""
    rng = needles.eval_rng(options.seed, depth, length)
    try:
        return [needles.make_sample(rng, enc, length=length, num_needles=options.needles,
                                    num_queries=options.queries, depth=depth / 100)
                for _ in range(options.samples)]
    except ValueError as e:
        raise EvalError(f"{options.task}: {e}") from e


@functools.partial(jax.jit, static_argnames=("model",))
def _greedy_hits(model: DecoderLM, params: Any, tokens: jax.Array, answer_pos: jax.Array,
                 answer_tok: jax.Array, answer_mask: jax.Array,
                 logit_bits: jax.Array | None = None) -> jax.Array:
    """(B,) bool: the argmax at every answer position (B, K) predicts its answer token;
    `logit_bits` as in `scoring.token_nll`."""
    logits = model.quantized(logit_bits).apply({"params": params}, tokens, logits_at=answer_pos)
    pred = jnp.argmax(logits, axis=-1)
    return jnp.all((pred == answer_tok) | ~answer_mask, axis=-1)


def accuracy(model_cfg: ModelConfig, params: Any, samples: list[needles.NiahSample],
             length: int, batch_size: int, logit_bits: int | None = None) -> float:
    """Mean over samples of the share of queried needles retrieved by greedy decoding; the
    samples are scored in batches (batch_size, length) of token rows, with the attention logits
    quantized to `logit_bits` when given (an xla-path `model_cfg`)."""
    rows = [(s, r) for s, sample in enumerate(samples) for r in range(sample.num_queries)]
    k = max(len(a) for sample in samples for a in sample.answers)
    n = len(rows) + -len(rows) % batch_size  # whole batches: one compiled shape
    tokens = np.zeros((n, length), np.int32)
    pos, tok, mask = (np.zeros((n, k), np.int32) for _ in range(3))
    for i, (s, r) in enumerate(rows):
        seq, start = samples[s].sequence(r)
        answer = samples[s].answers[r]
        tokens[i, : len(seq)] = seq
        pos[i, : len(answer)] = np.arange(start - 1, start - 1 + len(answer))
        tok[i, : len(answer)] = answer
        mask[i, : len(answer)] = 1
    model = DecoderLM(model_cfg)
    bits = None if logit_bits is None else jnp.int32(logit_bits)
    hits = np.concatenate([np.asarray(_greedy_hits(model, params, *map(jnp.asarray, (
        tokens[i: i + batch_size], pos[i: i + batch_size], tok[i: i + batch_size],
        mask[i: i + batch_size].astype(bool))), bits)) for i in range(0, n, batch_size)])[: len(rows)]
    per_sample = [np.mean([h for (s, _), h in zip(rows, hits) if s == j]) for j in range(len(samples))]
    return float(np.mean(per_sample))


def accuracy_grid(model_cfg: ModelConfig, params: Any, enc: Encoding,
                  options: EvalOptions, lengths: tuple[int, ...],
                  logit_bits: int | None = None) -> tuple[np.ndarray, list[dict]]:
    """(accuracy (depths, lengths), per-cell records with the answer needles' start positions);
    `logit_bits` as in `accuracy`. A progress line counts the cells."""
    grid = np.zeros((len(options.depths), len(lengths)))
    cells = []
    with progress(grid.size, "cell") as bar:
        for i, depth in enumerate(options.depths):
            for j, length in enumerate(lengths):
                samples = cell_samples(enc, options, depth, length)
                grid[i, j] = accuracy(model_cfg, params, samples, length, options.batch_size,
                                      logit_bits)
                cells.append({"depth": depth, "length": length, "accuracy": grid[i, j],
                              "context_tokens": [len(s.context) for s in samples],
                              "answer_starts": [s.needles[0].start for s in samples]})
                bar.draw(len(cells), f"depth {depth}% length {length}")
    return grid, cells


def niah(loaded: Loaded, options: EvalOptions) -> Report:
    """Accuracy per (depth, length) and on average, with a heatmap."""
    cfg = loaded.config
    lengths = niah_lengths(cfg, options)
    grid, cells = accuracy_grid(cfg.model, loaded.params, text_encoding(loaded), options,
                                lengths)
    report = Report(
        {"needles": options.needles, "queries": options.queries, "samples": options.samples,
         "seed": options.seed, "depths": list(options.depths), "lengths": list(lengths),
         "accuracy": grid.tolist(), "average": float(grid.mean()), "cells": cells},
        [(f"depth {d:>3}%", "  ".join(f"{a:.2f}" for a in row))
         for d, row in zip(options.depths, grid)])
    report.table.insert(0, (f"N={options.needles} R={options.queries} S={options.samples}",
                            "lengths " + ", ".join(map(str, lengths))))
    report.table.append(("average", f"{grid.mean():.3f}"))
    png = loaded.out_dir / "niah.png"
    plots.attach(report, png, plots.heatmap(
        png, grid, [f"{d}%" for d in options.depths], [str(n) for n in lengths],
        title=f"{cfg.model.variant}: N={options.needles}, R={options.queries}",
        xlabel="context length", ylabel="answer depth"))
    return report
