"""The `recall` task: multi-query associative recall with distractors (`diff_jax.recall`) —
query accuracy per context length, and on the same items Table 3's attention shares.

A query counts as retrieved when the argmax of the logits at its key's last token is its value
(one answer token: the argmax is what greedy decoding would produce). Queries after the first
see the earlier queries' correct values, as they would after correct answers. A cell's accuracy is
the share of all its queries retrieved (every sample has R queries, each of a different pair: R
is at most the N − distractors pairs that are not distractors).

Attention: the rows of query 0's key tokens, their normalized attention (`analysis`) on the
queried pair's triple in the context (`answer`) and on the rest of the context (`noise`: noise
tokens, the other pairs and the distractors); the remainder is on QUERY and the query itself.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diff_jax import recall
from diff_jax.config import ModelConfig
from diff_jax.evaluation.analysis import span_shares
from diff_jax.evaluation.loading import Loaded
from diff_jax.evaluation.options import EvalError, EvalOptions
from diff_jax.evaluation.report import Report, progress
from diff_jax.evaluation.retrieval import niah_lengths
from diff_jax.transformer import DecoderLM


def cell_samples(options: EvalOptions, length: int) -> list[recall.RecallSample]:
    """The S samples of one (pairs, queries, distractor share, length) cell, from a seeded stream
    of their own. `EvalError` when R exceeds the pairs that are not distractors: a repeated
    query's value stands in the earlier query's triple, so copying it would count as retrieval."""
    targets = recall.max_queries(options.needles, options.distractors)
    if targets == 0:
        raise EvalError(f"recall: distractors={options.distractors:g} leaves none of "
                        f"needles={options.needles} to query; lower distractors or raise needles")
    if options.queries > targets:
        raise EvalError(f"recall: queries={options.queries} exceeds the {targets} of "
                        f"needles={options.needles} that are not distractors "
                        f"(distractors={options.distractors:g}); pass queries <= {targets}")
    rng = recall.eval_rng(options.seed, options.needles, options.queries,
                          round(100 * options.distractors), length)
    try:
        return [recall.make_sample(rng, length=length, pairs=options.needles,
                                   queries=options.queries, distractor_share=options.distractors)
                for _ in range(options.samples)]
    except ValueError as e:
        raise EvalError(f"recall: {e}") from e


@functools.partial(jax.jit, static_argnames=("model",))
def _predictions(model: DecoderLM, params: Any, tokens: jax.Array, answer_pos: jax.Array) -> jax.Array:
    """(B, R) int32: the argmax token at the position before each answer position (B, R)."""
    return jnp.argmax(model.apply({"params": params}, tokens, logits_at=answer_pos - 1), axis=-1)


def hits(model_cfg: ModelConfig, params: Any, samples: list[recall.RecallSample],
         batch_size: int) -> np.ndarray:
    """(S, R) bool: query r of sample s retrieved (samples of one length and one R)."""
    tokens = np.stack([s.tokens for s in samples])
    pos = np.stack([s.answer_positions for s in samples])
    n = len(samples) + -len(samples) % batch_size  # whole batches: one compiled shape
    tokens = np.pad(tokens, ((0, n - len(samples)), (0, 0)))
    pos = np.pad(pos, ((0, n - len(samples)), (0, 0)), constant_values=1)
    model = DecoderLM(model_cfg)
    pred = np.concatenate([np.asarray(_predictions(model, params, jnp.asarray(tokens[i: i + batch_size]),
                                                   jnp.asarray(pos[i: i + batch_size])))
                           for i in range(0, n, batch_size)])[: len(samples)]
    return pred == np.stack([s.answers for s in samples])


def attention_shares(model_cfg: ModelConfig, params: Any,
                     samples: list[recall.RecallSample]) -> np.ndarray:
    """(S, 2): per sample, query 0's mean normalized attention on (answer triple, rest of the
    context), averaged over its key rows, heads and layers."""
    out = []
    for s in samples:
        start = int(s.pair_starts[s.queried[0]])
        spans = jnp.asarray([start, start + recall.TRIPLE, s.context_end, s.query_start,
                             s.query_start + 2])
        out.append(np.asarray(span_shares(model_cfg, params, jnp.asarray(s.tokens[None]),
                                          spans)).mean(axis=0))
    return np.stack(out)


def recall_task(loaded: Loaded, options: EvalOptions) -> Report:
    """Accuracy and attention shares per context length for N=`needles` pairs, R=`queries`
    queries and a `distractors` share of near-duplicate pairs."""
    cfg = loaded.config
    if cfg.model.vocab_size < recall.VOCAB_SIZE:
        raise EvalError(f"recall: model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                        f"task's {recall.VOCAB_SIZE} token ids")
    lengths = niah_lengths(cfg, options)
    accuracy, answer, noise = [], [], []
    with progress(len(lengths), "length") as bar:
        for length in lengths:
            samples = cell_samples(options, length)
            accuracy.append(float(hits(cfg.model, loaded.params, samples,
                                       options.batch_size).mean()))
            shares = attention_shares(cfg.model, loaded.params, samples).mean(axis=0)
            answer.append(float(shares[0]))
            noise.append(float(shares[1]))
            bar.draw(len(accuracy), f"length {length}")
    return Report(
        {"pairs": options.needles, "queries": options.queries, "distractors": options.distractors,
         "samples": options.samples, "seed": options.seed, "lengths": list(lengths),
         "accuracy": accuracy, "answer_share": answer, "noise_share": noise},
        [(f"N={options.needles} R={options.queries} distractors={options.distractors:g} "
          f"S={options.samples}", "accuracy  answer  noise")]
        + [(f"length {n}", f"{a:.3f}     {s:.3f}   {z:.3f}")
           for n, a, s, z in zip(lengths, accuracy, answer, noise)])
