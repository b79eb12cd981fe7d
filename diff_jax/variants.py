"""One spec per attention variant (`diff`, `diff_v2`, `transformer`): everything the rest of the
code needs to know about a variant, in one place.

A spec owns the variant's attention module, its head layout (the widths the module projects to
and the attention op reads, from which the FLOPs widths follow), the PyTorch reference's
parameter layout of one attention module (`diff_jax.interop`), how the analyses rebuild its
per-head attention maps from the captured ones, how it maps to Hugging Face `transformers`, and
its heads when matched to DIFF V1's parameters (`Variant.matched_heads`).
Callers look the spec up with `spec(config.variant)`; adding a variant is adding one spec here.

    diff         DIFF V1: H heads of 2 query sub-heads (Q1, Q2) and 2 key sub-heads (K1, K2)
                 per kv group, values of width 2d; the op computes A1 − λ·A2 with λ a layer scalar.
    diff_v2      DIFF V2: 2h standard query heads; the module combines head pairs after the op,
                 out_i = O[2i] − sigmoid(x W_λᵀ)_i · O[2i+1].
    transformer  standard GQA softmax attention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from diff_jax.attention import (LAMBDA_VECTORS, AttentionBase, HeadLayout, MultiheadAttention,
                                MultiheadDiffAttn, MultiheadDiffAttnV2)
from diff_jax.config import ModelConfig

# reference state_dict key -> (path in our attention parameter tree, is a Linear weight to transpose)
ReferenceLayout = Mapping[str, tuple[tuple[str, ...], bool]]


@dataclasses.dataclass(frozen=True)
class Variant:
    """What one attention variant is; see the module docstring."""

    name: str
    module: type[AttentionBase]  # the attention module of each decoder layer; owns `layout`
    fixed_head_dim: bool  # d is always E / (sub_heads · H): `model.head_dim` may not differ
    extra_reference_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    extra_reference_layout: Callable[[ModelConfig], ReferenceLayout]
    rebuild_maps: Callable[[dict], jax.Array]  # a layer's `attn` intermediates -> (B, H, T, S)
    hf_model_type: str | None  # the `transformers` model_type with the same computation
    hf_export_refusal: str | None  # None: `hf-diffllama` writes it exactly; else why not
    matched: Callable[[int, int], dict[str, int]]  # (E, H) -> `matched_heads`

    @property
    def sub_heads(self) -> int:
        """Query sub-heads per configured head: the default d is E / (sub_heads · H)."""
        return self.module.SUB_HEADS

    @property
    def differential_op(self) -> bool:
        """The op computes A1 − λ·A2 with a layer scalar λ: a GQA pairing choice, λ per layer."""
        return self.module.DIFFERENTIAL

    @property
    def output_proj(self) -> str:
        """The output projection's name (ours and the reference's)."""
        return self.module.OUTPUT_PROJ

    def layout(self, config: ModelConfig) -> HeadLayout:
        """The head layout of `config` (whose variant is this one)."""
        return self.module.layout(config)

    def reference_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The reference state_dict shapes of one attention module of `config`."""
        e, lay = config.embed_dim, self.layout(config)
        d = lay.head_dim
        return {
            "q_proj.weight": (lay.q_heads * d, e), "k_proj.weight": (lay.k_heads * d, e),
            "v_proj.weight": (lay.v_heads * lay.v_width, e),
            f"{self.output_proj}.weight": (e, lay.out_width),
            **self.extra_reference_shapes(config),
        }

    def reference_layout(self, config: ModelConfig) -> ReferenceLayout:
        """Reference key -> (path in our attention parameter tree, transpose?) of `config`
        (whose variant is this one)."""
        projections = ("q_proj", "k_proj", "v_proj", self.output_proj)
        table = {f"{p}.weight": ((p, "kernel"), True) for p in projections}
        return {**table, **self.extra_reference_layout(config)}

    def matched_heads(self, embed_dim: int, diff_heads: int) -> dict[str, int]:
        """This variant's `model.*` head fields matched to DIFF V1 with H = `diff_heads` heads at
        width E = `embed_dim`, as the replication presets compare them: DIFF V1 {num_heads: H};
        the Transformer {num_heads: 2H} (the paper's pairing: width E/(2H)); DIFF V2
        {num_heads: H, num_kv_heads, head_dim} with `v2_shape`'s kv heads and head width."""
        return self.matched(embed_dim, diff_heads)

    def head_maps(self, layer: dict) -> jax.Array:
        """A layer's per-head attention maps (B, H, T, S) from its sown intermediates (the
        `attn` entry holds the op's captured maps, see `AttentionOp.capture`)."""
        return self.rebuild_maps(layer["attn"])


def _standard_maps(attn: dict) -> jax.Array:
    return attn["attention"][0]["probs"]  # (B, H, T, S)


def _diff_maps(attn: dict) -> jax.Array:
    maps = attn["attention"][0]  # probs (B, 2H, T, S), sub-heads 2h, 2h+1 = A1, A2 of head h
    return maps["probs"][:, 0::2] - maps["lambda"] * maps["probs"][:, 1::2]


def _diff_v2_maps(attn: dict) -> jax.Array:
    probs = attn["attention"][0]["probs"]  # (B, 2h, T, S)
    lam = jnp.swapaxes(attn["lambda"][0], 1, 2)[..., None]  # (B, T, h) -> (B, h, T, 1)
    return probs[:, 0::2] - lam * probs[:, 1::2]


def v2_shape(embed_dim: int, heads: int) -> tuple[int, int]:
    """(kv heads, head dim) of a DIFF V2 layer with `heads` output heads whose attention parameters
    E·(2h·d + 2·kv·d + h·d + h) come closest to DIFF V1's 4E² + 6·E/(2h) (ties: more kv heads)."""
    e, h = embed_dim, heads
    target = 4 * e * e + 6 * (e // (2 * h))
    best: tuple[int, int, int] | None = None  # (|difference|, -kv, d)
    for kv in (k for k in range(1, h + 1) if h % k == 0):
        for d in range(2, 4 * e + 1, 2):
            diff = abs(e * (2 * h * d + 2 * kv * d + h * d + h) - target)
            if best is None or (diff, -kv) < best[:2]:
                best = (diff, -kv, d)
    assert best is not None
    return -best[1], best[2]


def _diff_v2_matched(embed_dim: int, heads: int) -> dict[str, int]:
    kv, d = v2_shape(embed_dim, heads)  # resolved per call: replacing `variants.v2_shape` counts
    return {"num_heads": heads, "num_kv_heads": kv, "head_dim": d}


def _diff_extras(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    d = config.resolved_head_dim
    norm = {"subln.weight": (2 * d,)} if config.head_norm else {}
    return {**{n: (d,) for n in LAMBDA_VECTORS}, **norm}


def _diff_extra_layout(config: ModelConfig) -> ReferenceLayout:
    norm = {"subln.weight": (("subln", "scale"), False)} if config.head_norm else {}
    return {**{n: ((n,), False) for n in LAMBDA_VECTORS}, **norm}


def _diff_v2_extras(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    norm = {"subln.weight": (config.resolved_head_dim,)} if config.v2_head_norm else {}
    return {"lambda_proj.weight": (config.num_heads, config.embed_dim), **norm}


def _diff_v2_extra_layout(config: ModelConfig) -> ReferenceLayout:
    norm = {"subln.weight": (("subln", "scale"), False)} if config.v2_head_norm else {}
    return {"lambda_proj.weight": (("lambda_proj", "kernel"), True), **norm}


DIFF = Variant(
    name="diff", module=MultiheadDiffAttn, fixed_head_dim=True, extra_reference_shapes=_diff_extras,
    extra_reference_layout=_diff_extra_layout,
    rebuild_maps=_diff_maps, hf_model_type="diffllama", hf_export_refusal=None,
    matched=lambda _, h: {"num_heads": h})

DIFF_V2 = Variant(
    name="diff_v2", module=MultiheadDiffAttnV2, fixed_head_dim=False,
    extra_reference_shapes=_diff_v2_extras,
    extra_reference_layout=_diff_v2_extra_layout,
    rebuild_maps=_diff_v2_maps, hf_model_type=None,
    hf_export_refusal="its λ is a per-token sigmoid of lambda_proj, not a layer scalar; "
                      "DiffLlama implements DIFF V1 only",
    matched=_diff_v2_matched)

TRANSFORMER = Variant(
    name="transformer", module=MultiheadAttention, fixed_head_dim=False,
    extra_reference_shapes=lambda _: {},
    extra_reference_layout=lambda _: {}, rebuild_maps=_standard_maps, hf_model_type="llama",
    hf_export_refusal="DiffLlama always subtracts a second attention map and RMS-normalises each "
                      "head; use --format safetensors",
    matched=lambda _, h: {"num_heads": 2 * h})

VARIANTS: dict[str, Variant] = {v.name: v for v in (DIFF, DIFF_V2, TRANSFORMER)}


def spec(name: str) -> Variant:
    """The spec of variant `name`; `KeyError` naming the known variants."""
    if name not in VARIANTS:
        raise KeyError(f"model.variant: unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name]


def for_hf_model_type(model_type: str) -> Variant:
    """The variant a `transformers` checkpoint of `model_type` imports as."""
    return next(v for v in VARIANTS.values() if v.hf_model_type == model_type)
