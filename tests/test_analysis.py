"""The analyses' numbers (eval.py task=attention, task=outliers) against an independent float64
NumPy forward pass of a two-layer model (tests/numpy_reference.py), for every variant: every
layer's shares, logits and hidden states, the second layer's read from the first's output.

The model runs in float32; 1e-4 relative leaves room for that and for summation order, while a
wrong map reconstruction, mask, λ or normalisation is off by O(1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import numpy_reference as npr
from diff_jax.config import ModelConfig
from diff_jax.evaluation.analysis import TOP_K, _activations, _stats, span_shares
from diff_jax.interop import to_reference
from diff_jax.transformer import DecoderLM

B, T, E, H, L = 2, 16, 32, 2, 2
SPANS = (3, 6, 10, 10, 14)  # answer [3, 6), context ends at 10, query rows [10, 14)


def _model(variant: str) -> tuple[ModelConfig, dict, np.ndarray]:
    cfg = ModelConfig(variant=variant, vocab_size=64, embed_dim=E, num_layers=L, num_heads=H,
                      max_seq_len=T)
    tokens = np.random.default_rng(0).integers(0, 64, (B, T)).astype(np.int32)
    params = nn.meta.unbox(DecoderLM(cfg).init(jax.random.key(1), jnp.asarray(tokens)))["params"]
    return cfg, jax.tree.map(np.asarray, params), tokens


def _numpy_layers(cfg: ModelConfig, params: dict, tokens: np.ndarray):
    """Per layer, in order: (|logits| (B, N, T, S) with −1 where masked, per-head maps
    (B, H', T, S), layer output (B, T, E)); each layer reads the one before's output."""
    x = np.asarray(params["embed"], np.float64)[tokens]
    out = []
    for i in range(cfg.num_layers):
        out.append(_numpy_layer(cfg, params[f"layers_{i}"], x, i))
        x = out[-1][2]
    return out


def _numpy_layer(cfg: ModelConfig, layer: dict, x: np.ndarray, depth: int):
    """Layer `depth` on input x (B, T, E): (|logits| (B, N, T, S) with −1 where masked,
    per-head maps (B, H', T, S), layer output)."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    xn = npr.rmsnorm(x, f64(layer["attn_norm"]["scale"]), cfg.norm_eps)
    sd = {k: f64(v) for k, v in to_reference(layer["attn"], cfg).items()}
    d = cfg.resolved_head_dim
    cos, sin = npr.rope_tables(T, d, cfg.rope_theta)
    nq, nk = sd["q_proj.weight"].shape[0] // d, sd["k_proj.weight"].shape[0] // d
    q = npr.rope((xn @ sd["q_proj.weight"].T).reshape(B, T, nq, d), cos, sin)
    k = npr.rope((xn @ sd["k_proj.weight"].T).reshape(B, T, nk, d), cos, sin)
    group = nq // nk  # query heads per key head (1 for DIFF V1: sub-head j meets K sub-head j)
    scores = np.stack([np.einsum("btd,bsd->bts", q[:, :, j], k[:, :, j // group]) / np.sqrt(d)
                       for j in range(nq)], 1)  # (B, N, T, S)
    m = npr.mask(T, None, B)[:, None]
    probs = npr.softmax(scores, m)
    heads = dict(num_heads=H, num_kv_heads=H)
    if cfg.variant == "diff":
        out, _, _, lam = npr.diff_v1(sd, xn, cos, sin, depth=depth, **heads)
        maps = probs[:, 0::2] - lam * probs[:, 1::2]
    elif cfg.variant == "diff_v2":
        out = npr.diff_v2(sd, xn, cos, sin, head_dim=d, **heads)
        lam = 1 / (1 + np.exp(-(xn @ sd["lambda_proj.weight"].T)))  # (B, T, h)
        maps = probs[:, 0::2] - lam.transpose(0, 2, 1)[..., None] * probs[:, 1::2]
    else:
        out, maps = npr.standard(sd, xn, cos, sin, **heads), probs
    y = x + out
    yn = npr.rmsnorm(y, f64(layer["ffn_norm"]["scale"]), cfg.norm_eps)
    ffn = {n: f64(layer["ffn"][n]["kernel"]) for n in ("w_gate", "w_up", "w_down")}
    gate = yn @ ffn["w_gate"]
    hidden = y + (gate / (1 + np.exp(-gate)) * (yn @ ffn["w_up"])) @ ffn["w_down"]
    return np.where(m, np.abs(scores), -1.0), maps, hidden


@pytest.mark.parametrize("variant", ["diff", "diff_v2", "transformer"])
def test_attention_shares_and_activations_match_numpy(variant):
    """Both layers' (answer, noise) shares, |logits| and |hidden states| against NumPy: a task
    that read only the first layer gave (1, ...) arrays and passed on a one-layer model."""
    cfg, params, tokens = _model(variant)
    ref = _numpy_layers(cfg, params, tokens)

    got = np.asarray(span_shares(cfg, params, jnp.asarray(tokens), jnp.asarray(SPANS)))
    assert got.shape == (L, 2)
    np.testing.assert_allclose(got, [_shares(maps) for _, maps, _ in ref], rtol=1e-4)

    ones = jnp.ones((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    got_logits, got_hidden = _activations(cfg, params, jnp.asarray(tokens), ones, positions)
    assert got_logits.shape[0] == got_hidden.shape[0] == L
    for i, (logits, _, hidden) in enumerate(ref):
        np.testing.assert_allclose(np.asarray(got_logits)[i], logits, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_hidden)[i], np.abs(hidden), rtol=1e-4,
                                   atol=1e-5)


def _shares(maps: np.ndarray) -> list[float]:
    """(answer, noise) shares of SPANS from per-head maps (B, H', T, S): clipped at 0, rows
    rescaled to sum 1, averaged over the batch, heads and query rows."""
    clipped = np.maximum(maps, 0.0)
    normalized = clipped / np.maximum(clipped.sum(-1, keepdims=True), 1e-30)
    a0, a1, context, q0, q1 = SPANS
    pos = np.arange(T)
    answer = (pos >= a0) & (pos < a1)
    noise = (pos < context) & ~answer
    return [normalized[..., keys].sum(-1).mean(axis=(0, 1))[q0:q1].mean() for keys in (answer, noise)]


@pytest.mark.parametrize("variant", ["diff", "diff_v2"])
def test_attention_shares_clip_the_negative_entries_of_a_differential_map(variant):
    """Queries scaled ×100 make the maps sharp enough that A1 − λ·A2 is negative in places (at
    initialisation it is not): those entries count as 0, not as their magnitude."""
    cfg, params, tokens = _model(variant)
    attn = params["layers_0"]["attn"]
    attn["q_proj"]["kernel"] = attn["q_proj"]["kernel"] * 100
    _, maps, _ = _numpy_layers(cfg, params, tokens)[0]
    assert (maps < -0.05).any()
    got = np.asarray(span_shares(cfg, params, jnp.asarray(tokens), jnp.asarray(SPANS)))
    np.testing.assert_allclose(got[0], _shares(maps), rtol=1e-4)


def test_outlier_statistics_are_the_top_values_and_median():
    values = np.random.default_rng(3).standard_normal(1000) ** 2
    ranked = np.sort(values)[::-1]
    stats = _stats(values)
    assert stats == {**{f"top{k}": float(ranked[k - 1]) for k in TOP_K},
                     "median": float(np.median(values))}
    assert set(_stats(values[:5])) == {"top1", "top2", "top3", "median"}  # top10/100 need more
