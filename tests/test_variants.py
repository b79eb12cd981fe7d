"""The variant specs: head layouts and FLOPs widths as the paper counts them, the reference
layout against the modules' own parameters, lookups by name and by Hugging Face type, and the
heads matched to DIFF V1 at the replication presets' shapes."""

from __future__ import annotations

import math

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


@pytest.mark.parametrize("name,extra", [*((n, {}) for n in EXPECTED),
                                        ("diff", {"head_norm": False}),
                                        ("diff_v2", {"v2_head_norm": True})])
def test_layout_widths_and_reference_shapes(name, extra):
    """Each variant's widths; its reference layout names every parameter once, with the reference
    shape (V1 without its per-head norm has no `subln.weight`; V2 with `v2_head_norm` has one)."""
    spec = variants.spec(name)
    cfg = ModelConfig(variant=name, embed_dim=E, num_heads=H, num_kv_heads=KV, **extra)
    lay = spec.layout(cfg)
    *heads, widths = EXPECTED[name]
    assert (lay.q_heads, lay.k_heads, lay.v_heads, lay.v_width, lay.op_heads, lay.out_width) == tuple(heads)
    assert lay.attention_widths == widths
    params = nn.meta.unbox(spec.module(cfg, depth=0).init(
        jax.random.key(0), jnp.zeros((1, 3, E))))["params"]
    for key, (path, transpose) in spec.reference_layout(cfg).items():
        leaf = params
        for p in path:
            leaf = leaf[p]
        shape = leaf.shape[::-1] if transpose else leaf.shape
        assert shape == spec.reference_shapes(cfg)[key], key
    assert set(spec.reference_layout(cfg)) == set(spec.reference_shapes(cfg))
    assert ("subln.weight" in spec.reference_shapes(cfg)) == (
        (name == "diff" and cfg.head_norm) or cfg.v2_head_norm)
    assert len(jax.tree.leaves(params)) == len(spec.reference_layout(cfg))  # every parameter mapped


def test_lookups():
    assert variants.for_hf_model_type("diffllama") is variants.DIFF
    assert variants.for_hf_model_type("llama") is variants.TRANSFORMER
    assert [v.name for v in variants.VARIANTS.values() if v.hf_export_refusal is None] == ["diff"]
    with pytest.raises(ConfigError, match=r"model.variant: unknown variant 'diff_v3'; known: diff, "
                                          r"diff_v2, transformer"):
        ModelConfig(variant="diff_v3")


# (E, layers, H): the presets' shapes (cpu-small, cpu-recall, gpu-medium, micro)
PRESET_SHAPES = [(64, 4, 2), (128, 2, 2), (768, 12, 6), (32, 2, 2)]
V2_HEADS = {64: (1, 32), 128: (1, 64), 768: (3, 128), 32: (1, 16)}  # E -> (kv heads, d), written out


@pytest.mark.parametrize("e,layers,h", PRESET_SHAPES)
def test_matched_heads_give_the_presets_overrides(e, layers, h):
    from diff_jax.experiments import presets

    for name in variants.VARIANTS:
        heads = variants.spec(name).matched_heads(e, h)
        ours = [f"model.variant={name}", f"model.embed_dim={e}", f"model.num_layers={layers}",
                *(f"model.{k}={v}" for k, v in heads.items())]
        assert ours == presets.model_overrides(name, e, layers, h), name
    kv, d = V2_HEADS[e]
    assert variants.DIFF_V2.matched_heads(e, h) == {"num_heads": h, "num_kv_heads": kv, "head_dim": d}
    # matched: the Transformer's query·key and value widths are DIFF V1's, and DIFF V2's attention
    # parameters (counted from the reference layout) are within the presets' ±0.5% of DIFF V1's
    configs = {name: ModelConfig(variant=name, embed_dim=e, num_layers=layers,
                                 **variants.spec(name).matched_heads(e, h))
               for name in variants.VARIANTS}
    assert (variants.TRANSFORMER.layout(configs["transformer"]).attention_widths
            == variants.DIFF.layout(configs["diff"]).attention_widths)
    count = {name: sum(math.prod(s) for s in variants.spec(name).reference_shapes(c).values())
             for name, c in configs.items()}
    assert abs(count["diff_v2"] - count["diff"]) <= 0.005 * count["diff"]


def test_v2_shape_breaks_a_tie_towards_more_kv_heads():
    """E = 40, h = 2: DIFF V1 has 4·40² + 6·(40/4) = 6460 attention parameters; V2 has
    40·(d·(6 + 2·kv) + 2), nearest for d·(6 + 2·kv) = 160, reached by (kv 2, d 16) and (kv 1,
    d 20) alike (6480, 20 over): the tie goes to more kv heads."""
    assert variants.v2_shape(40, 2) == (2, 16)
