"""What each sublayer of a freshly initialized model writes into the residual stream.

At initialization the token embedding (std `init_std`) is the only signal of which token stands
where. A sublayer that adds more than that to the residual stream at every position drowns it
until training shrinks the addition or makes it informative. DIFF V1 normalizes each head's
output (`subln`, unit RMS whatever the two softmax maps cancel) and scales it by (1 − λ_init),
so its attention writes about (1 − λ_init)·σ_o·√E at init (σ_o the output projection's std);
a standard attention writes a mix of the value vectors, whose average over the prefix shrinks
with its length. `residual_writes` measures both on real tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from diff_jax.config import ModelConfig
from diff_jax.transformer import DecoderLM


def _rms(x: jax.Array) -> float:
    return float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))


def residual_writes(config: ModelConfig, tokens: np.ndarray, seed: int = 0) -> dict[str, object]:
    """RMS of what a model initialized from `jax.random.key(seed)` adds to the residual stream
    on `tokens` (B, T) int: {"embed": the token embeddings', "attn": [per layer, the attention
    sublayer's output], "ffn": [per layer, the MLP's]}, each over every position and channel."""
    model = DecoderLM(config)
    tokens = jnp.asarray(tokens, jnp.int32)
    params = model.init(jax.random.key(seed), tokens[:1, :2])["params"]
    _, state = model.apply({"params": params}, tokens, capture_intermediates=lambda module, method:
                           method == "__call__" and module.name in ("attn", "ffn"))
    layers = state["intermediates"]
    embed = nn.meta.unbox(params)["embed"][tokens]
    return {"embed": _rms(embed),
            **{part: [_rms(layers[f"layers_{i}"][part]["__call__"][0])
                      for i in range(config.num_layers)] for part in ("attn", "ffn")}}
