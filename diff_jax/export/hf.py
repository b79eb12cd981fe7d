"""DIFF V1 -> Hugging Face `transformers` DiffLlama (`DiffLlamaForCausalLM`), exactly.

DiffLlama counts 2H query heads of width d (our H differential heads, component width d): query
head j < H is Q1 of our head j, query head H + j is its Q2. Its 2·Hkv kv heads are likewise
[all K1 | all K2] and [first V halves | second V halves]; DiffLlama's head j reads kv group
j // n_rep for both maps, which is our `flash` GQA pairing. Its RoPE rotates half-split pairs
(r, r + d/2) where ours rotates interleaved pairs (2r, 2r + 1), so q/k rows are permuted within
each sub-head; q·k is unchanged. λ (its four vectors, λ_init from the 0-based layer index) is
copied. Its per-head RMSNorm has no weight, so our `subln.weight` (shared by all heads) is folded
into the columns of o_proj. Everything else is Llama: embed_tokens, input/post_attention
layernorms, SwiGLU mlp (gate/up/down), final norm, lm_head (absent when tied).

Refused (no exact DiffLlama equivalent), with each variant's reason in its spec
(`diff_jax.variants.Variant.hf_export_refusal`): `diff_v2` (per-token sigmoid λ), `transformer`
(no differential map, no per-head norm); `gqa_pairing: naive` with num_kv_heads < num_heads
(Q1 and Q2 of one head may meet the same K component); a `lambda_init` set (DiffLlama's is
always the per-layer 0.8 − 0.6·exp(−0.3·depth)); and `head_norm: false` (DiffLlama always
normalises each head).

`from_hf_state_dict` is the exact inverse (used by `diff_jax.export.hf_import`): rows back to
[Q1 | Q2] per head and interleaved RoPE order, o_proj as out_proj, `subln.weight` ones. On
exports whose `subln.weight` is all ones, export then import gives back every tensor bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from diff_jax import variants
from diff_jax.attention import LAMBDA_VECTORS
from diff_jax.config import ModelConfig
from diff_jax.export.errors import ExportError


def check_mappable(config: ModelConfig) -> None:
    """Raise `ExportError` with the reason when `config` cannot be exported exactly (the
    variant's `Variant.hf_export_refusal`, or a GQA pairing DiffLlama does not have)."""
    refusal = variants.spec(config.variant).hf_export_refusal
    if refusal is not None:
        raise ExportError(f"variant {config.variant} cannot be exported to DiffLlama: {refusal}")
    if config.resolved_gqa_pairing == "naive":
        raise ExportError(
            "gqa_pairing naive with num_kv_heads < num_heads cannot be exported to DiffLlama: "
            "DiffLlama pairs Q1/Q2 of a head with K1/K2 of one kv group (the flash pairing)")
    if not config.head_norm:
        raise ExportError("model.head_norm=false cannot be exported to DiffLlama: it always "
                          "RMS-normalises each head; use --format safetensors")
    if config.lambda_init is not None:
        raise ExportError(
            f"model.lambda_init={config.lambda_init} cannot be exported to DiffLlama: it derives "
            "λ_init from the layer index (0.8 − 0.6·exp(−0.3·depth)) and has no setting for it")


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
    """The `config.json` of a DiffLlamaForCausalLM equivalent to `config` (weights in `dtype`)."""
    check_mappable(config)
    theta, lay = config.rope_theta, variants.spec(config.variant).layout(config)
    return {
        "architectures": ["DiffLlamaForCausalLM"],
        "model_type": "diffllama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.resolved_mlp_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": lay.q_heads,  # its query heads are our Q1, Q2 sub-heads
        "num_key_value_heads": lay.k_heads,  # and its kv heads our K1, K2 components
        "head_dim": lay.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_theta": theta,  # the key transformers < 5 reads
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "lambda_std_dev": 0.1,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": dtype,
    }


def half_split_order(d: int) -> np.ndarray:
    """(d,) int: half-split RoPE row r is interleaved row `order[r]` (2r for r < d/2, else
    2(r − d/2) + 1). `x[..., order]` takes interleaved rows to half-split ones;
    `x[..., np.argsort(order)]` goes back."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def _component_major(w: np.ndarray, groups: int, d: int, permute: bool) -> np.ndarray:
    """Rows (groups, 2, d) of a reference projection -> (2, groups, d), RoPE rows half-split."""
    rows = w.reshape(groups, 2, d, w.shape[-1]).transpose(1, 0, 2, 3)
    if permute:
        rows = rows[:, :, half_split_order(d)]
    return np.ascontiguousarray(rows.reshape(-1, w.shape[-1]))


def _head_major(w: np.ndarray, groups: int, d: int, permute: bool) -> np.ndarray:
    """The inverse of `_component_major`: DiffLlama rows (2, groups, d) -> ours (groups, 2, d)."""
    rows = w.reshape(2, groups, d, w.shape[-1])
    if permute:
        rows = rows[:, :, np.argsort(half_split_order(d))]
    return np.ascontiguousarray(rows.transpose(1, 0, 2, 3).reshape(-1, w.shape[-1]))


def hf_state_dict(state_dict: Mapping[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """Our export state dict (`diff_jax.export.state_dict` names) -> DiffLlama's state dict.

    Per layer q_proj (2H·d, E) and k_proj, v_proj (2Hkv·d, E) get their rows component-major
    ([all Q1 | all Q2], likewise K and V; q and k rows half-split for RoPE); o_proj (E, 2H·d)
    has `subln.weight` folded into its columns."""
    check_mappable(config)
    lay = variants.spec(config.variant).layout(config)
    h, hkv, d = lay.op_heads, lay.v_heads, lay.head_dim  # q rows (H, 2, d); k, v rows (Hkv, 2, d)
    out = {"model.embed_tokens.weight": state_dict["embed.weight"]}
    for i in range(config.num_layers):
        src, dst = f"layers.{i}", f"model.layers.{i}"
        attn = f"{src}.attn"
        out[f"{dst}.input_layernorm.weight"] = state_dict[f"{src}.attn_norm.weight"]
        out[f"{dst}.self_attn.q_proj.weight"] = _component_major(state_dict[f"{attn}.q_proj.weight"], h, d, True)
        out[f"{dst}.self_attn.k_proj.weight"] = _component_major(state_dict[f"{attn}.k_proj.weight"], hkv, d, True)
        out[f"{dst}.self_attn.v_proj.weight"] = _component_major(state_dict[f"{attn}.v_proj.weight"], hkv, d, False)
        w_out, subln = state_dict[f"{attn}.out_proj.weight"], state_dict[f"{attn}.subln.weight"]
        out[f"{dst}.self_attn.o_proj.weight"] = w_out * np.tile(subln, h)[None, :]
        for name in LAMBDA_VECTORS:
            out[f"{dst}.self_attn.{name}"] = state_dict[f"{attn}.{name}"]
        out[f"{dst}.post_attention_layernorm.weight"] = state_dict[f"{src}.ffn_norm.weight"]
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out[f"{dst}.mlp.{theirs}.weight"] = state_dict[f"{src}.ffn.{ours}.weight"]
    out["model.norm.weight"] = state_dict["norm.weight"]
    if not config.tie_embeddings:
        out["lm_head.weight"] = state_dict["lm_head.weight"]
    return out


def from_hf_state_dict(tensors: Mapping[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """DiffLlama's state dict -> ours (`diff_jax.export.state_dict` names): `hf_state_dict`'s inverse.

    `tensors` must hold exactly DiffLlama's names for `config` (the caller checks extra names and
    tied heads); shapes are checked afterwards by `from_state_dict`. `subln.weight` is ones (2d,)
    since DiffLlama's per-head RMSNorm has no weight.
    """
    check_mappable(config)
    lay = variants.spec(config.variant).layout(config)
    h, hkv, d = lay.op_heads, lay.v_heads, lay.head_dim  # q rows (H, 2, d); k, v rows (Hkv, 2, d)
    get = tensor_getter(tensors, config, "DiffLlamaForCausalLM")
    out = shared_llama_tensors(get, config)
    for i in range(config.num_layers):
        src, attn = f"model.layers.{i}", f"layers.{i}.attn"
        for proj, groups, permute in (("q_proj", h, True), ("k_proj", hkv, True), ("v_proj", hkv, False)):
            name = f"{src}.self_attn.{proj}.weight"
            w = get(name)
            if w.ndim != 2 or w.shape[0] != 2 * groups * d:
                raise ExportError(f"{name}: shape {w.shape}, expected ({2 * groups * d}, "
                                  f"{config.embed_dim}) for {2 * groups} heads of width {d}")
            out[f"{attn}.{proj}.weight"] = _head_major(w, groups, d, permute)
        out[f"{attn}.out_proj.weight"] = get(f"{src}.self_attn.o_proj.weight")
        for name in LAMBDA_VECTORS:
            out[f"{attn}.{name}"] = get(f"{src}.self_attn.{name}")
        out[f"{attn}.subln.weight"] = np.ones(lay.v_width, out[f"{attn}.out_proj.weight"].dtype)
    return out


def tensor_getter(tensors: Mapping[str, np.ndarray], config: ModelConfig,
                  architecture: str) -> Callable[[str], np.ndarray]:
    """`get(name)`: the named tensor of a Hugging Face checkpoint, or an error naming it."""

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ExportError(f"{name}: missing from the checkpoint (a {architecture} with "
                              f"{config.num_layers} layers has it)")
        return np.asarray(tensors[name])

    return get


def shared_llama_tensors(get: Callable[[str], np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """What DiffLlama and Llama lay out alike, under our state_dict names: the embedding, each
    layer's two norms and SwiGLU, the final norm and an untied head (attention is the caller's)."""
    out = {"embed.weight": get("model.embed_tokens.weight")}
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        out[f"{dst}.attn_norm.weight"] = get(f"{src}.input_layernorm.weight")
        out[f"{dst}.ffn_norm.weight"] = get(f"{src}.post_attention_layernorm.weight")
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out[f"{dst}.ffn.{ours}.weight"] = get(f"{src}.mlp.{theirs}.weight")
    out["norm.weight"] = get("model.norm.weight")
    if not config.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out
