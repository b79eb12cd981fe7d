"""The attention op: implementation choice, the sharded kernel in the train step, capture, errors.

The sharded comparisons run the fused kernel under the Pallas interpreter inside `shard_map` on 8
fake CPU devices (mesh data=2 fsdp=2 tensor=2) and compare with the xla oracle on one device.
Everything is float32, so the two differ by summation order only: loss to 1e-6, gradients to
2e-5 relative (as the sharded-xla test in test_sharding.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from diff_jax.attention_op import AttentionOp, resolve_impl
from diff_jax.config import Config, ConfigError, MeshConfig, ModelConfig, TrainConfig
from diff_jax.generate import empty_cache
from diff_jax.sharding import make_mesh
from diff_jax.step import build_steps, loss_and_grads
from diff_jax.transformer import DecoderLM
from test_kernels import normals

RULES = MeshConfig().rules
B, T = 8, 24


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Packed rows: segments of random length, positions restarting per segment, some padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 61, (B, T + 1)).astype(np.int32)
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for r in range(B):
        cut = sorted(rng.choice(np.arange(3, T - 3), 2, replace=False))
        bounds = [0, *cut, T - (r % 3)]  # the last r % 3 tokens are padding (segment 0)
        for i in range(len(bounds) - 1):
            seg[r, bounds[i]:bounds[i + 1]] = i + 1
            pos[r, bounds[i]:bounds[i + 1]] = np.arange(bounds[i + 1] - bounds[i])
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg, "positions": pos}


def _loss_and_grads(cfg: ModelConfig, mesh_cfg: MeshConfig, devices) -> tuple[float, dict]:
    """Loss and gradients of the initial parameters, on the training loop's sharded state."""
    config = Config(model=cfg, mesh=mesh_cfg, train=TrainConfig(steps=10, batch_size=B, seq_len=T))
    steps = build_steps(config, make_mesh(mesh_cfg, devices))
    with steps.context():
        state = steps.init(jax.random.PRNGKey(0))
        fn = jax.jit(functools.partial(loss_and_grads, model=steps.model, grad_accum=1),
                     in_shardings=(steps.shardings.params, steps.batch_sharding))
        loss, grads = fn(state.params, jax.device_put(_batch(), steps.batch_sharding))
    return float(loss), jax.device_get(grads)


SHARDED_CASES = {  # name: (variant, heads, kv heads)
    "diff-gqa": ("diff", 4, 2),  # kv heads sharded with the query heads
    "diff-mqa": ("diff", 4, 1),  # one kv head: replicated, each shard gathers its group
    "diff_v2": ("diff_v2", 2, 2),
    "transformer": ("transformer", 4, 2),
}


@pytest.mark.parametrize("name", list(SHARDED_CASES))
def test_sharded_pallas_step_equals_one_device_xla(name):
    variant, heads, kv = SHARDED_CASES[name]
    base = ModelConfig(variant=variant, vocab_size=64, embed_dim=128, num_layers=1, num_heads=heads,
                       num_kv_heads=kv, max_seq_len=32, head_dim=16 if variant != "diff" else None)
    l_ref, g_ref = _loss_and_grads(base, MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    pallas = dataclasses.replace(base, attention_impl="pallas")
    l_sh, g_sh = _loss_and_grads(pallas, MeshConfig(data=2, fsdp=2, tensor=2), None)
    np.testing.assert_allclose(l_sh, l_ref, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), g_sh, g_ref)
    if variant == "diff":  # λ is trained through the sharded kernel
        assert float(np.abs(g_sh["layers_0"]["attn"]["lambda_q1"]).max()) > 0


def _mesh_op(impl: str, mesh):
    cfg = ModelConfig(vocab_size=64, embed_dim=64, num_layers=1, num_heads=2, max_seq_len=32,
                      attention_impl=impl)
    return cfg, AttentionOp.build(cfg, mesh, RULES)


def test_kernel_runs_inside_shard_map_and_xla_does_not():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    q = jax.ShapeDtypeStruct((8, 16, 4, 16), jnp.float32)
    k = jax.ShapeDtypeStruct((8, 16, 4, 16), jnp.float32)
    v = jax.ShapeDtypeStruct((8, 16, 2, 32), jnp.float32)
    lam = jax.ShapeDtypeStruct((), jnp.float32)
    texts = {}
    for impl in ("pallas", "xla"):
        _, op = _mesh_op(impl, mesh)
        texts[impl] = jax.jit(lambda q, k, v, lam: op(q, k, v, lam)[0]).lower(q, k, v, lam).as_text()
    assert "shard_map" in texts["pallas"] or "manual_computation" in texts["pallas"]
    assert "shard_map" not in texts["xla"] and "manual_computation" not in texts["xla"]


def test_odd_batch_and_mqa_heads_on_a_mesh_equal_the_unsharded_kernel():
    """A batch the batch axes do not divide runs replicated; one kv head is gathered per shard."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    _, op = _mesh_op("pallas", mesh)
    _assert_sharded_equals_the_oracle(op, 3, (3, 16, 4, 16), (3, 16, 2, 16), (3, 16, 1, 32))


def _assert_sharded_equals_the_oracle(op: AttentionOp, seed: int, *shapes) -> None:
    """`op` (a kernel inside shard_map) on random q, k, v of `shapes` equals the unsharded
    xla oracle, to float32 accuracy."""
    q, k, v = normals(seed, *shapes)
    sharded = jax.jit(lambda *a: op(*a)[0])(q, k, v, jnp.float32(0.3))
    unsharded, _ = AttentionOp(impl="xla")(q, k, v, jnp.float32(0.3))
    np.testing.assert_allclose(sharded, unsharded, rtol=1e-5, atol=1e-6)


def test_kv_heads_the_head_axes_do_not_divide_are_gathered_per_shard():
    """tensor = 4 shards 4 DIFF heads one per shard, but not their 2 kv heads: kv is replicated
    and shard i reads group i // 2 (its global head's), as the unsharded oracle does."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    cfg = ModelConfig(vocab_size=64, embed_dim=128, num_layers=1, num_heads=4, num_kv_heads=2,
                      max_seq_len=32, attention_impl="pallas")
    op = AttentionOp.build(cfg, mesh, RULES)
    _assert_sharded_equals_the_oracle(op, 5, (2, 16, 8, 16), (2, 16, 4, 16), (2, 16, 2, 32))


def test_heads_the_head_axes_do_not_divide_or_no_head_axes_run_whole_on_every_shard(caplog):
    """3 DIFF heads on tensor = 2 (act_heads' axis): a warning names them, and every shard runs
    all heads of its batch rows; a rule table without act_heads runs them whole too, without a
    warning. Both equal the unsharded oracle."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    shapes = (4, 16, 6, 16), (4, 16, 6, 16), (4, 16, 3, 32)
    op = AttentionOp(impl="pallas", mesh=mesh, rules=RULES)
    with caplog.at_level("WARNING", logger="diff_jax.attention_op"):
        _assert_sharded_equals_the_oracle(op, 6, *shapes)
    assert "3 heads are not divisible by the mesh axes 'tensor' (size 2)" in caplog.text
    caplog.clear()
    rules = tuple((name, axes) for name, axes in RULES if name != "act_heads")
    with caplog.at_level("WARNING", logger="diff_jax.attention_op"):
        _assert_sharded_equals_the_oracle(AttentionOp(impl="pallas", mesh=mesh, rules=rules),
                                          7, *shapes)
    assert caplog.text == ""


@pytest.mark.parametrize("override", [{"batch": ("data", "fsdp", "tensor")},
                                      {"act_heads": ("fsdp", "tensor")}])
def test_batch_and_heads_rules_that_share_a_mesh_axis_follow_flax_priority(override):
    """Pure data parallelism over every axis beside act_heads' default `tensor`, or act_heads on
    (fsdp, tensor) beside batch on (data, fsdp): the rule listed first takes the shared axis
    and the other dimension stays whole, as Flax lays the activations out (and as xla runs
    them); the kernel's specs named the axis twice, a DuplicateSpecError."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rules = tuple((name, override.get(name, axes)) for name, axes in RULES)
    op = AttentionOp(impl="pallas", mesh=mesh, rules=rules)
    _assert_sharded_equals_the_oracle(op, 8, (8, 16, 8, 16), (8, 16, 4, 16), (8, 16, 2, 32))


@pytest.mark.parametrize("types", ["explicit", "mixed"])
def test_kernel_on_a_mesh_with_explicit_axes_equals_the_unsharded_oracle(types):
    """`jax.make_mesh` gives Explicit axes by default; shard_map refuses inputs whose sharding
    type does not match its specs there, so the op reshards them first (forward and gradients,
    one kv head replicated and gathered per shard)."""
    Ex, Au = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
    axis_types = (Ex, Ex, Ex) if types == "explicit" else (Au, Ex, Ex)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=axis_types)
    _, op = _mesh_op("pallas", mesh)
    q, k, v = normals(4, (8, 16, 4, 16), (8, 16, 2, 16), (8, 16, 1, 32))
    lam = jnp.float32(0.3)

    def loss(op, *args):
        return jnp.sum(op(*args)[0] ** 2)

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4))
    got = jax.jit(functools.partial(grad, op))(q, k, v, lam)
    want = grad(AttentionOp(impl="xla"), q, k, v, lam)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5), got, want)


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(embed_dim=256, num_heads=4, **kw)  # DIFF d = 32


def test_auto_resolves_per_platform():
    assert resolve_impl(_cfg(attention_impl="auto"), "cpu") == "xla"
    assert resolve_impl(_cfg(attention_impl="auto"), "tpu") == "pallas"
    assert resolve_impl(_cfg(attention_impl="auto"), "gpu") == "pallas"
    std = dict(variant="transformer", attention_impl="auto")
    assert resolve_impl(_cfg(dtype="bfloat16", **std), "gpu") == "cudnn"
    assert resolve_impl(_cfg(**std), "gpu") == "xla"  # cuDNN needs bf16
    assert resolve_impl(_cfg(**std), "tpu") == "pallas"
    # a head width the kernel does not take: auto falls back to the oracle
    odd = ModelConfig(variant="transformer", embed_dim=64, num_heads=8, attention_impl="auto")
    assert odd.resolved_head_dim == 8 and resolve_impl(odd, "tpu") == "xla"


def test_auto_with_quantized_logits_resolves_to_the_oracle_on_every_platform():
    """`model.attn_logit_bits` exists only in the xla oracle: auto must not pick a kernel that
    would run without it."""
    for platform in ("cpu", "gpu", "tpu"):
        assert resolve_impl(_cfg(attention_impl="auto", attn_logit_bits=8), platform) == "xla"


def test_impossible_implementations_are_config_errors():
    odd = ModelConfig(variant="transformer", embed_dim=64, num_heads=8, attention_impl="pallas")
    with pytest.raises(ConfigError, match="model.attention_impl=pallas: .*got 8"):
        resolve_impl(odd, "tpu")
    with pytest.raises(ConfigError, match="model.attention_impl=cudnn runs only on NVIDIA GPUs; "
                       "these devices are cpu: use auto or xla"):
        resolve_impl(_cfg(attention_impl="cudnn", dtype="bfloat16"), "cpu")
    with pytest.raises(ConfigError, match="model.attention_impl: cudnn runs bfloat16 only"):
        _cfg(attention_impl="cudnn")
    with pytest.raises(ConfigError, match="model.attn_logit_bits: quantized logits exist only"):
        _cfg(attention_impl="pallas", attn_logit_bits=8)
    # capture always runs the oracle, whatever the config says
    assert AttentionOp.build(_cfg(attention_impl="pallas"), capture=True).impl == "xla"


@pytest.mark.parametrize("capture", [False, True])
def test_build_names_what_it_takes_when_given_a_whole_config_or_a_mesh_config(capture):
    """`AttentionOp.build(config)` with the whole Config, or a MeshConfig for `mesh`, failed in
    an AttributeError on the first field read ('Config' object has no attribute
    'attention_impl', or 'attn_logit_bits' with capture; 'MeshConfig' ... 'devices')."""
    config = Config()
    with pytest.raises(TypeError, match=r"^AttentionOp\.build takes a ModelConfig \(a Config's "
                                        r"\.model\), got Config$"):
        AttentionOp.build(config, capture=capture)
    with pytest.raises(TypeError, match=r"^AttentionOp\.build takes a jax Mesh \(diff_jax\."
                                        r"sharding\.make_mesh\(config\.mesh\)\) or None, got "
                                        r"MeshConfig$"):
        AttentionOp.build(config.model, config.mesh, capture=capture)


def test_decode_step_equals_full_forward_with_the_kernel_configured():
    """A model configured for the kernel still decodes one token over the cache (through
    `kernels.decode_attention`, which reads only the filled part)."""
    cfg = ModelConfig(vocab_size=64, embed_dim=64, num_layers=1, num_heads=2, max_seq_len=16,
                      attention_impl="pallas")
    tokens = jax.random.randint(jax.random.key(0), (1, 9), 0, 64)
    params = nn.meta.unbox(jax.jit(DecoderLM(cfg).init)(jax.random.key(1), tokens))["params"]
    full = jax.jit(DecoderLM(cfg).apply)({"params": params}, tokens)
    model = DecoderLM(cfg, decode=True)
    cache = empty_cache(model, 1, 16)
    apply = jax.jit(lambda cache, t, p: model.apply({"params": params, "cache": cache}, t,
                                                    positions=p, mutable=["cache"]))
    _, state = apply(cache, tokens[:, :8], jnp.arange(8)[None])
    last, _ = apply(state["cache"], tokens[:, 8:], jnp.asarray([[8]]))
    # float32, cache vs full forward: measured max |Δ| 8.9e-8 (|logits| ≤ 0.7), 2e-6 ≈ 22×
    np.testing.assert_allclose(last[:, 0], full[:, 8], rtol=1e-6, atol=2e-6)


def test_decode_steps_through_the_oracle_equal_the_full_forward():
    """With `capture` (the analyses' op) a one-token step runs the xla oracle over the cache:
    the query at position p sees the filled entries 0..p, as in the full forward."""
    cfg = ModelConfig(vocab_size=64, embed_dim=64, num_layers=1, num_heads=2, max_seq_len=16)
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, 64)
    params = nn.meta.unbox(jax.jit(DecoderLM(cfg).init)(jax.random.key(1), tokens))["params"]
    full = np.asarray(jax.jit(DecoderLM(cfg).apply)({"params": params}, tokens))
    model = DecoderLM(cfg, decode=True, attention_op=AttentionOp.build(cfg, capture=True))
    cache = empty_cache(model, 2, 8)
    apply = jax.jit(lambda cache, t, p: model.apply({"params": params, "cache": cache}, t,
                                                    positions=p, mutable=["cache"]))
    _, state = apply(cache, tokens[:, :4], jnp.broadcast_to(jnp.arange(4), (2, 4)))
    for p in range(4, 7):
        last, state = apply(state["cache"], tokens[:, p:p + 1], jnp.full((2, 1), p))
        # float32 rounding only, as in the kernel-configured decode test above; a wrong mask is O(1e-2)
        np.testing.assert_allclose(np.asarray(last)[:, 0], full[:, p], rtol=1e-6, atol=2e-6)
