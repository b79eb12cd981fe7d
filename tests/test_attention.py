"""Attention modules against the float64 NumPy reference, plus causality and segment isolation.

Tolerance: the modules run in float32; against float64 the relative error ‖out−ref‖/‖ref‖ is
a few 1e-7, so 2e-6 leaves room for summation order without hiding a layout bug (those are O(1)).
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import numpy_reference as npr
from diff_jax import variants
from diff_jax.attention import lambda_init
from diff_jax.attention_op import AttentionOp
from diff_jax.config import ModelConfig
from diff_jax.interop import from_reference, reference_shapes

B, T, E = 2, 12, 64
F32_TOL = 2e-6


def _run(cfg: ModelConfig, depth: int, sd, x, cos, sin, segment_ids=None):
    module = variants.spec(cfg.variant).module(cfg, depth=depth)
    fn = jax.jit(lambda p, x, c, s, seg: module.apply({"params": p}, x, rope=(c, s), segment_ids=seg))
    return np.asarray(fn(from_reference(sd, cfg), jnp.asarray(x), jnp.asarray(cos, jnp.float32),
                         jnp.asarray(sin, jnp.float32), segment_ids))


def _inputs(d: int, seed: int = 0):
    x = np.random.default_rng(seed).normal(size=(B, T, E)).astype(np.float32)
    cos, sin = npr.rope_tables(T, d)
    return x, cos, sin


SEGMENTS = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12], np.int32)


@pytest.mark.parametrize("heads,kv,pairing,depth", [
    (4, 4, "flash", 0), (4, 2, "flash", 3), (4, 2, "naive", 3), (4, 1, "flash", 7), (2, 1, "naive", 1),
])
@pytest.mark.parametrize("segmented", [False, True])
def test_diff_v1_matches_numpy(heads, kv, pairing, depth, segmented):
    cfg = ModelConfig(variant="diff", embed_dim=E, num_heads=heads, num_kv_heads=kv, gqa_pairing=pairing)
    d = cfg.resolved_head_dim
    sd = npr.random_state_dict(reference_shapes(cfg), seed=heads * 10 + kv)
    x, cos, sin = _inputs(d)
    seg = SEGMENTS if segmented else None
    ours = _run(cfg, depth, sd, x, cos, sin, None if seg is None else jnp.asarray(seg))
    ref, *_ = npr.diff_v1(sd, x, cos, sin, num_heads=heads, num_kv_heads=kv, depth=depth,
                          pairing=pairing, segment_ids=seg)
    if segmented:  # padding rows attend to nothing: their output is exactly 0 in both
        chex.assert_trees_all_close(ours[0, 9:], np.zeros_like(ours[0, 9:]), atol=0)
    assert npr.rel_err(ours, ref) < F32_TOL


def test_gqa_pairings_differ_when_grouped():
    """flash and naive agree for MHA and disagree (by O(1)) when Hkv < H: the two reference files
    pair GQA sub-heads differently. `ModelConfig.difference` agrees: without GQA the two are one
    model (before, resume, train.init_from and eval refused naive parameters for a flash config
    that computes the same), with GQA another."""
    outs, cfgs = {}, {}
    for kv in (4, 2):
        for pairing in ("flash", "naive"):
            cfg = ModelConfig(variant="diff", embed_dim=E, num_heads=4, num_kv_heads=kv, gqa_pairing=pairing)
            cfgs[kv, pairing] = cfg
            sd = npr.random_state_dict(reference_shapes(cfg), seed=kv)
            x, cos, sin = _inputs(cfg.resolved_head_dim)
            outs[kv, pairing] = _run(cfg, 2, sd, x, cos, sin)
    assert npr.rel_err(outs[4, "naive"], outs[4, "flash"]) < 1e-6
    assert npr.rel_err(outs[2, "naive"], outs[2, "flash"]) > 0.05
    assert cfgs[4, "naive"].difference(cfgs[4, "flash"]) is None
    assert cfgs[2, "naive"].difference(cfgs[2, "flash"]) == ("model.gqa_pairing", "flash", "naive")


@pytest.mark.parametrize("heads,kv,head_dim", [(4, 2, 8), (4, 4, 8), (2, 1, 16)])
def test_diff_v2_matches_numpy(heads, kv, head_dim):
    cfg = ModelConfig(variant="diff_v2", embed_dim=E, num_heads=heads, num_kv_heads=kv, head_dim=head_dim)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=heads + kv)
    x, cos, sin = _inputs(head_dim, seed=1)
    ours = _run(cfg, 0, sd, x, cos, sin, jnp.asarray(SEGMENTS))
    ref = npr.diff_v2(sd, x, cos, sin, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                      segment_ids=SEGMENTS)
    assert npr.rel_err(ours, ref) < F32_TOL


def test_diff_v2_with_a_head_norm_matches_numpy():
    """model.v2_head_norm (an ablation): each head's O[2i] − λ·O[2i+1] RMS-normalised over its d
    channels with the learned scale `subln`, against the float64 reference (the scale drawn
    1 ± 0.1, so a norm that ignored it would fail)."""
    cfg = ModelConfig(variant="diff_v2", embed_dim=E, num_heads=4, num_kv_heads=2, head_dim=8,
                      v2_head_norm=True)
    assert reference_shapes(cfg)["subln.weight"] == (8,)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=7)
    x, cos, sin = _inputs(8, seed=3)
    ours = _run(cfg, 0, sd, x, cos, sin, jnp.asarray(SEGMENTS))
    kwargs = dict(num_heads=4, num_kv_heads=2, head_dim=8, segment_ids=SEGMENTS)
    assert npr.rel_err(ours, npr.diff_v2(sd, x, cos, sin, head_norm=True, **kwargs)) < F32_TOL
    assert npr.rel_err(ours, npr.diff_v2(sd, x, cos, sin, **kwargs)) > 0.05
    # model.subln_init starts that scale elsewhere, as V1's
    small = dataclasses.replace(cfg, subln_init=0.05)
    params = variants.spec("diff_v2").module(small, depth=0).init(
        jax.random.key(0), jnp.zeros((1, 3, E)))["params"]
    np.testing.assert_array_equal(nn.meta.unbox(params)["subln"]["scale"],
                                  np.full(8, 0.05, np.float32))


@pytest.mark.parametrize("heads,kv", [(8, 8), (8, 2)])
def test_baseline_matches_numpy(heads, kv):
    cfg = ModelConfig(variant="transformer", embed_dim=E, num_heads=heads, num_kv_heads=kv)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=heads + kv)
    x, cos, sin = _inputs(cfg.resolved_head_dim, seed=2)
    ours = _run(cfg, 0, sd, x, cos, sin, jnp.asarray(SEGMENTS))
    ref = npr.standard(sd, x, cos, sin, num_heads=heads, num_kv_heads=kv, segment_ids=SEGMENTS)
    assert npr.rel_err(ours, ref) < F32_TOL


def test_rope_from_positions_matches_the_numpy_tables():
    """Given no tables, the module builds RoPE from `positions` (default 0..T-1) with
    `model.rope_theta`: as with the float64 reference tables θ^(−2i/d) (θ = 500 here)."""
    cfg = ModelConfig(variant="diff", embed_dim=E, num_heads=4, rope_theta=500.0)
    d = cfg.resolved_head_dim
    x, _, _ = _inputs(d)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=5)
    want = _run(cfg, 0, sd, x, *npr.rope_tables(T, d, 500.0))
    module = variants.spec("diff").module(cfg, depth=0)
    got = np.asarray(jax.jit(module.apply)({"params": from_reference(sd, cfg)}, jnp.asarray(x)))
    assert npr.rel_err(got, want) < F32_TOL


def test_rope_tables_refuse_an_odd_head_dim():
    """RoPE rotates pairs (2i, 2i+1): an odd width has a last element without a partner (the
    config refuses one as model.head_dim; this is the function called directly)."""
    from diff_jax.rope import rope_tables

    with pytest.raises(ValueError, match=r"RoPE needs an even head dim, got 5$"):
        rope_tables(jnp.arange(4), 5, 10000.0)


def test_lambda_init_and_lambda_values():
    assert lambda_init(0) == pytest.approx(0.2)
    for depth in range(12):
        assert lambda_init(depth) == pytest.approx(0.8 - 0.6 * np.exp(-0.3 * depth), abs=1e-15)
    np.testing.assert_allclose(float(lambda_init(jnp.asarray(5.0))), lambda_init(5), rtol=1e-6)
    # λ from the parameters: exp(q1·k1) − exp(q2·k2) + λ_init, checked on a module's own init.
    cfg = ModelConfig(variant="diff", embed_dim=E, num_heads=4)
    module = variants.DIFF.module(cfg, depth=3)
    params = jax.tree.map(np.asarray, jax.jit(module.init)(jax.random.key(1), jnp.zeros((1, 4, E)))["params"])
    params = {k: getattr(v, "value", v) for k, v in params.items()}
    d = cfg.resolved_head_dim
    for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        assert params[n].shape == (d,) and params[n].dtype == np.float32
        assert 0.03 < params[n].std() < 0.3  # drawn from N(0, 0.1²)
    from diff_jax.attention import diff_lambda
    want = (np.exp(params["lambda_q1"] @ params["lambda_k1"])
            - np.exp(params["lambda_q2"] @ params["lambda_k2"]) + lambda_init(3))
    got = diff_lambda(*(params[n] for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")),
                      lambda_init(3))
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    # model.lambda_init: one value for every layer, int depth or array
    assert lambda_init(0, 0.5) == lambda_init(7, 0.5) == 0.5
    np.testing.assert_array_equal(np.asarray(lambda_init(jnp.arange(3.0), 0.8)),
                                  np.full(3, 0.8, np.float32))


@pytest.mark.parametrize("fixed,depth", [(0.5, 0), (0.8, 5), (0.0, 2)])
def test_diff_v1_with_a_fixed_lambda_init_matches_numpy(fixed, depth):
    """model.lambda_init replaces the depth schedule in λ's offset and in the (1 − λ_init)
    output scale (the float64 reference with that λ_init), and differs from the schedule's
    output: the setting is not ignored."""
    cfg = ModelConfig(variant="diff", embed_dim=E, num_heads=4, num_kv_heads=2, lambda_init=fixed)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=5)
    x, cos, sin = _inputs(cfg.resolved_head_dim)
    ours = _run(cfg, depth, sd, x, cos, sin, None)
    ref, *_ = npr.diff_v1(sd, x, cos, sin, num_heads=4, num_kv_heads=2, depth=depth,
                          fixed_lambda_init=fixed)
    assert npr.rel_err(ours, ref) < F32_TOL
    scheduled, *_ = npr.diff_v1(sd, x, cos, sin, num_heads=4, num_kv_heads=2, depth=depth)
    assert npr.rel_err(scheduled, ref) > 1e-2


@pytest.mark.parametrize("depth,segmented", [(0, False), (3, True)])
def test_diff_v1_without_its_head_norm_matches_numpy(depth, segmented):
    """model.head_norm=false (the paper's "w/o GroupNorm" ablation) drops the per-head RMSNorm
    and its weight and keeps the (1 − λ_init) scale: the float64 reference without the norm."""
    cfg = ModelConfig(variant="diff", embed_dim=E, num_heads=4, num_kv_heads=2, head_norm=False)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=7)
    assert "subln.weight" not in sd
    x, cos, sin = _inputs(cfg.resolved_head_dim)
    seg = SEGMENTS if segmented else None
    ours = _run(cfg, depth, sd, x, cos, sin, None if seg is None else jnp.asarray(seg))
    ref, *_ = npr.diff_v1(sd, x, cos, sin, num_heads=4, num_kv_heads=2, depth=depth,
                          segment_ids=seg, head_norm=False)
    assert npr.rel_err(ours, ref) < F32_TOL
    normed, *_ = npr.diff_v1({**sd, "subln.weight": np.ones(cfg.resolved_head_dim * 2)}, x, cos,
                             sin, num_heads=4, num_kv_heads=2, depth=depth, segment_ids=seg)
    assert npr.rel_err(normed, ref) > 1e-1


@pytest.mark.parametrize("variant,heads", [("diff", 4), ("diff_v2", 4), ("transformer", 8)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shapes_dtypes_causality(variant, heads, dtype):
    """Output (B, T, E) in the compute dtype, float32 params; future tokens never change the past."""
    cfg = ModelConfig(variant=variant, embed_dim=E, num_heads=heads, num_kv_heads=2, dtype=dtype)
    module = variants.spec(variant).module(cfg, depth=1)
    x = jax.random.normal(jax.random.key(0), (B, T, E), jnp.dtype(dtype))
    variables = module.init(jax.random.key(1), x)
    for leaf in jax.tree.leaves(variables):
        assert leaf.dtype == jnp.float32
    fn = jax.jit(module.apply)
    out = fn(variables, x)
    chex.assert_shape(out, (B, T, E))
    chex.assert_type(out, jnp.dtype(dtype))
    chex.assert_tree_all_finite(out)
    x2 = x.at[:, 7:].set(jax.random.normal(jax.random.key(2), (B, T - 7, E), jnp.dtype(dtype)))
    out2 = fn(variables, x2)
    np.testing.assert_array_equal(np.asarray(out[:, :7], np.float32), np.asarray(out2[:, :7], np.float32))
    assert not np.allclose(np.asarray(out[:, 7:], np.float32), np.asarray(out2[:, 7:], np.float32))


def test_sown_maps_and_logit_quantization():
    """Captured logits/probs match the NumPy maps; 16-bit logits ≈ float; 3-bit visibly differs."""
    cfg = ModelConfig(variant="diff", embed_dim=E, num_heads=4, num_kv_heads=2)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=11)
    x, cos, sin = _inputs(cfg.resolved_head_dim, seed=4)
    module = variants.DIFF.module(cfg, depth=2, attention_op=AttentionOp.build(cfg, capture=True))
    params = from_reference(sd, cfg)
    out, state = module.apply({"params": params}, jnp.asarray(x), rope=(cos, sin),
                              mutable=["intermediates"])
    (maps,) = state["intermediates"]["attention"]
    # Collecting intermediates without asking the op to capture sows no maps.
    _, plain_state = variants.DIFF.module(cfg, depth=2).apply(
        {"params": params}, jnp.asarray(x), rope=(cos, sin), mutable=["intermediates"])
    assert "attention" not in plain_state.get("intermediates", {})
    _, a1, a2, lam = npr.diff_v1(sd, x, cos, sin, num_heads=4, num_kv_heads=2, depth=2)
    chex.assert_shape(maps["probs"], (B, 8, T, T))
    assert npr.rel_err(maps["probs"][:, 0::2], a1) < 2e-6 and npr.rel_err(maps["probs"][:, 1::2], a2) < 2e-6
    np.testing.assert_allclose(float(maps["lambda"]), lam, rtol=1e-6)
    plain = _run(cfg, 2, sd, x, cos, sin)
    np.testing.assert_allclose(np.asarray(out), plain, rtol=1e-5, atol=1e-6)

    def quantized(bits):
        return _run(ModelConfig(**{**cfg.__dict__, "attn_logit_bits": bits}), 2, sd, x, cos, sin)

    # 16-bit absmax steps (max|s|/32767): measured rel err 2.9e-5; 3e-4 (10×) still fails 12 bits
    # (measured 4.3e-4) and 8 bits (6.8e-3)
    assert npr.rel_err(quantized(16), plain) < 3e-4
    assert npr.rel_err(quantized(3), plain) > 1e-2


def test_quantize_logits_levels():
    from diff_jax.kernels.reference import quantize_logits
    s = jnp.asarray([[[[-2.0, 0.1, 0.9, 2.0]]]])
    q = np.asarray(quantize_logits(s, None, 3))  # 3 levels each side: step 2/3
    np.testing.assert_allclose(q, [[[[-2.0, 0.0, 2 / 3 * 1, 2.0]]]], atol=1e-6)
    # the masked 5.0 does not set the scale: absmax 0.9 over the visible entries
    s2 = jnp.asarray([[[[-0.9, 0.1, 0.9, 5.0]]]])
    masked = np.asarray(quantize_logits(s2, jnp.asarray([[[[True, True, True, False]]]]), 2))
    np.testing.assert_allclose(masked[..., :3], [[[[-0.9, 0.0, 0.9]]]], atol=1e-6)
    with pytest.raises(ValueError, match=r"logit_bits must be in \[2, 32\], got 1$"):  # 1 bit: no level but 0
        quantize_logits(s, None, 1)
    with pytest.raises(ValueError, match=r"logit_bits must be in \[2, 32\], got 129$"):
        quantize_logits(s, None, 129)  # rounded to integers: 2^128 levels overflow float32
    # a map of zeros (a query of zeros, every logit 0) stays zeros: its absmax scale is 0
    zeros = np.asarray(quantize_logits(jnp.zeros((1, 2, 3, 4)), None, 4))
    np.testing.assert_array_equal(zeros, np.zeros((1, 2, 3, 4)))


def test_quantize_logits_scales_each_map_whole_and_rounds_to_nearest():
    """One absmax scale per (batch, score map) over its whole (T, S) map, and round to nearest,
    against float64 NumPy on maps of other magnitudes (batch 1 ×10, map 2 ×4); a scale per row
    or one for the whole array, or truncation toward 0, passed the one-row test above."""
    from diff_jax.kernels.reference import quantize_logits

    s = np.random.default_rng(5).standard_normal((2, 3, 4, 5)).astype(np.float32)
    s *= np.float32([1.0, 10.0])[:, None, None, None] * np.float32([1.0, 0.25, 4.0])[:, None, None]
    step = np.abs(s.astype(np.float64)).max(axis=(-2, -1), keepdims=True) / 7  # 4 bits: ±7
    want = np.round(s / step) * step
    got = np.asarray(quantize_logits(jnp.asarray(s), None, 4), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("positions_shape", [(B, 1), (1,), (B, T + 1)])
def test_positions_that_do_not_cover_every_token_are_refused(positions_shape):
    """`positions` must give every token its own position ((B, T), or (T,) for all rows): a
    (B, 1) or (1,) array used to broadcast one position over the whole row (silently wrong
    RoPE); longer or wider ones failed deep in a broadcast. Both are one error naming them."""
    cfg = ModelConfig(variant="diff", embed_dim=E, num_heads=4)
    module = variants.spec(cfg.variant).module(cfg, depth=0)
    x = jnp.ones((B, T, E))
    variables = module.init(jax.random.key(0), x)
    chex.assert_shape(module.apply(variables, x, positions=jnp.arange(T)), (B, T, E))
    with pytest.raises(ValueError, match=r"do not fit x \(2, 12, 8, 8\).*from `positions` \(B, T\)"):
        module.apply(variables, x, positions=jnp.zeros(positions_shape, jnp.int32))


def test_diff_v1_bfloat16_scale_is_unbiased():
    """(1 − λ_init) multiplies in float32 and rounds once: at depth 2 bfloat16 would round the
    constant 0.52929 to 0.52734 (−3.7e-3), the same on every token. The bfloat16 module's output
    against the float32 module's, on the same bfloat16-representable weights and input: the
    least-squares scale lies within 1e-3 of 1 (its rounding noise averages out over 16K
    values; the rounded constant gave 0.9962)."""
    cfg = ModelConfig(variant="diff", vocab_size=97, embed_dim=128, num_layers=4, num_heads=2,
                      max_seq_len=64)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 64, 128)), jnp.bfloat16)
    module = variants.spec("diff").module(cfg, depth=2)
    params = nn.meta.unbox(module.init(jax.random.key(0), x.astype(jnp.float32))["params"])
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)
    ref = np.asarray(module.apply({"params": params}, x.astype(jnp.float32)), np.float64)
    half = variants.spec("diff").module(dataclasses.replace(cfg, dtype="bfloat16"), depth=2)
    out = np.asarray(half.apply({"params": params}, x).astype(jnp.float32), np.float64)
    scale = float(np.sum(out * ref) / np.sum(ref * ref))
    assert abs(scale - 1.0) < 1e-3, scale
