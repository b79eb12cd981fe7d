"""diff-jax: the Differential Transformer (Ye et al., ICLR 2025) in JAX/Flax."""

from diff_jax.attention import MultiheadAttention, MultiheadDiffAttn, MultiheadDiffAttnV2, lambda_init
from diff_jax.config import Config, ConfigError, ModelConfig, load_config
from diff_jax.transformer import DecoderLayer, DecoderLM, layer_lambdas

__all__ = [
    "Config", "ConfigError", "DecoderLM", "DecoderLayer", "ModelConfig", "MultiheadAttention",
    "MultiheadDiffAttn", "MultiheadDiffAttnV2", "lambda_init", "layer_lambdas", "load_config",
]
