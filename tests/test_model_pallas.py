"""The model gives the same loss and gradients with the fused kernel (interpreted on CPU) as with xla."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from diff_jax.config import ModelConfig
from diff_jax.transformer import DecoderLM


@pytest.mark.parametrize("variant,heads,kv", [("diff", 2, 1), ("transformer", 4, 2)])
def test_pallas_equals_xla_loss_and_grads(variant, heads, kv):
    # head widths are powers of two >= 16, as the Pallas kernels require
    base = ModelConfig(variant=variant, vocab_size=53, embed_dim=64, num_layers=2, num_heads=heads,
                       num_kv_heads=kv, max_seq_len=32)
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 53)
    seg = jnp.asarray([[1] * 10 + [2] * 11 + [0] * 3, [1] * 24], jnp.int32)
    pos = jnp.asarray([list(range(10)) + list(range(11)) + [0] * 3, list(range(24))], jnp.int32)
    params = nn.meta.unbox(DecoderLM(base).init(jax.random.key(1), tokens))["params"]

    def loss(params, impl):
        model = DecoderLM(dataclasses.replace(base, attention_impl=impl))
        logits = model.apply({"params": params}, tokens, positions=pos, segment_ids=seg)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
        weight = (seg[:, 1:] != 0) & (seg[:, 1:] == seg[:, :-1])
        return jnp.sum(nll * weight) / jnp.sum(weight)

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (l_x, g_x), (l_p, g_p) = grad(params, "xla"), grad(params, "pallas")
    np.testing.assert_allclose(l_p, l_x, rtol=1e-6)  # float32 throughout: rounding only
    chex.assert_trees_all_close(g_p, g_x, rtol=1e-4, atol=1e-7)
    lam_grads = [g_p[f"layers_{i}"]["attn"]["lambda_q1"] for i in range(2)] if variant == "diff" else []
    assert all(float(jnp.abs(g).max()) > 0 for g in lam_grads)  # λ is trained through the kernel
