"""The variant specs: head layouts and FLOPs widths as the paper counts them, the reference
layout against the modules' own parameters, and lookups by name and by Hugging Face type."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from diff_jax import variants
from diff_jax.config import ConfigError, ModelConfig

E, H, KV = 64, 4, 2
# variant: (q heads, k heads, v heads, v width, op heads, out width, (W_qk, W_v)), written out
# from the paper's shapes for E=64, H=4, Hkv=2 (DIFF: d = E/2H = 8; V2: d = E/2h = 8; MHA: 16).
EXPECTED = {
    "diff": (8, 4, 2, 16, 4, 64, (64, 64)),
    "diff_v2": (8, 2, 2, 8, 8, 32, (64, 64)),
    "transformer": (4, 2, 2, 16, 4, 64, (64, 64)),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_layout_widths_and_reference_shapes(name):
    spec = variants.spec(name)
    cfg = ModelConfig(variant=name, embed_dim=E, num_heads=H, num_kv_heads=KV)
    lay = spec.layout(cfg)
    *heads, widths = EXPECTED[name]
    assert (lay.q_heads, lay.k_heads, lay.v_heads, lay.v_width, lay.op_heads, lay.out_width) == tuple(heads)
    assert lay.attention_widths == widths
    params = nn.meta.unbox(spec.module(cfg, depth=0).init(
        jax.random.key(0), jnp.zeros((1, 3, E))))["params"]
    for key, (path, transpose) in spec.reference_layout.items():
        leaf = params
        for p in path:
            leaf = leaf[p]
        shape = leaf.shape[::-1] if transpose else leaf.shape
        assert shape == spec.reference_shapes(cfg)[key], key
    assert len(jax.tree.leaves(params)) == len(spec.reference_layout)  # every parameter mapped


def test_lookups():
    assert variants.for_hf_model_type("diffllama") is variants.DIFF
    assert variants.for_hf_model_type("llama") is variants.TRANSFORMER
    assert [v.name for v in variants.VARIANTS.values() if v.hf_export_refusal is None] == ["diff"]
    with pytest.raises(ConfigError, match=r"model.variant: unknown variant 'diff_v3'; known: diff, "
                                          r"diff_v2, transformer"):
        ModelConfig(variant="diff_v3")
