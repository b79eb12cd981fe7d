"""Our parameter tree <-> a flat PyTorch-layout state dict under the export's tensor names.

Names: `embed.weight`, `layers.{i}.attn_norm.weight`, `layers.{i}.attn.<reference names>`,
`layers.{i}.ffn_norm.weight`, `layers.{i}.ffn.{w_gate,w_up,w_down}.weight`, `norm.weight`, and
`lm_head.weight` only when the embeddings are untied. Linear weights are (out, in), the transpose of
a Flax kernel; the embedding and the LM head are (vocab, embed). The attention tensors are
exactly the reference module's state dict (`diff_jax.interop`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from diff_jax.checkpoint import check_shapes
from diff_jax.config import ModelConfig
from diff_jax.export.errors import ExportError
from diff_jax.interop import from_reference, reference_shapes, to_reference
from diff_jax.sharding import unboxed
from diff_jax.transformer import in_layout, unstacked_layers

_FFN = ("w_gate", "w_up", "w_down")


def state_dict_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every exported tensor name of `config` with its (PyTorch-layout) shape."""
    e, v, f = config.embed_dim, config.vocab_size, config.resolved_mlp_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, e)}
    attn = reference_shapes(config)
    for i in range(config.num_layers):
        shapes[f"layers.{i}.attn_norm.weight"] = (e,)
        shapes.update({f"layers.{i}.attn.{k}": s for k, s in attn.items()})
        shapes[f"layers.{i}.ffn_norm.weight"] = (e,)
        shapes[f"layers.{i}.ffn.w_gate.weight"] = (f, e)
        shapes[f"layers.{i}.ffn.w_up.weight"] = (f, e)
        shapes[f"layers.{i}.ffn.w_down.weight"] = (e, f)
    shapes["norm.weight"] = (e,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, e)
    return shapes


def to_state_dict(params: Mapping[str, Any], config: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameter tree (boxed, as `init` returns it, or unboxed), of either layer layout ->
    {export name: numpy array in PyTorch layout}."""
    params = unstacked_layers(unboxed(dict(params)), config.num_layers)
    out = {"embed.weight": np.asarray(params["embed"])}
    for i in range(config.num_layers):
        layer = params[f"layers_{i}"]
        out[f"layers.{i}.attn_norm.weight"] = np.asarray(layer["attn_norm"]["scale"])
        out.update({f"layers.{i}.attn.{k}": w for k, w in to_reference(layer["attn"], config).items()})
        out[f"layers.{i}.ffn_norm.weight"] = np.asarray(layer["ffn_norm"]["scale"])
        for name in _FFN:
            out[f"layers.{i}.ffn.{name}.weight"] = np.ascontiguousarray(
                np.asarray(layer["ffn"][name]["kernel"]).T)
    out["norm.weight"] = np.asarray(params["norm"]["scale"])
    if not config.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    return out


def from_state_dict(tensors: Mapping[str, np.ndarray], config: ModelConfig, where: str) -> dict:
    """{export name: array} -> our parameter tree, float32 (the model's parameter dtype), in the
    layer layout of `config` (`model.scan_layers`).

    `where` names the source in error messages.
    """
    check_shapes({k: np.shape(t) for k, t in tensors.items()}, state_dict_shapes(config),
                 f"{where}: ", ExportError)

    def get(name: str, transpose: bool = False) -> np.ndarray:
        value = np.asarray(tensors[name], np.float32)
        return np.ascontiguousarray(value.T) if transpose else value

    params: dict[str, Any] = {"embed": get("embed.weight")}
    attn_keys = reference_shapes(config)
    for i in range(config.num_layers):
        params[f"layers_{i}"] = {
            "attn_norm": {"scale": get(f"layers.{i}.attn_norm.weight")},
            "attn": from_reference({k: tensors[f"layers.{i}.attn.{k}"] for k in attn_keys}, config),
            "ffn_norm": {"scale": get(f"layers.{i}.ffn_norm.weight")},
            "ffn": {n: {"kernel": get(f"layers.{i}.ffn.{n}.weight", True)} for n in _FFN},
        }
    params["norm"] = {"scale": get("norm.weight")}
    if not config.tie_embeddings:
        params["lm_head"] = get("lm_head.weight", True)
    return in_layout(params, config)
