"""Batched autoregressive decoding with a KV cache, for DIFF V1, V2 and the baseline alike.

Prompts of different lengths share one batch: they are right-padded, prefilled together (each row
reads its first new token at its own last prompt position), and then every row writes its cache
and reads RoPE at its own position, one token per step, all inside one jitted `lax.while_loop`
with the cache as explicit loop state. Cache entries past a row's position are never attended to
(single-token attention reads only the filled part of the cache: `kernels.decode_attention`), so
padding written during the prefill is overwritten before it becomes visible. A batch is padded
to one of a few widths, its rows to one of a few batch sizes and max_new_tokens to one of a few
loop lengths (`padded_size`), so that calls of other prompt lengths, batch sizes and
max_new_tokens reuse the compiled decoding program of their sizes instead of compiling their
own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diff_jax.config import SEED_LIMIT, ModelConfig
from diff_jax.transformer import DecoderLM


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters. top_k keeps every
    token whose logit ties the k-th largest (as Hugging Face's top-k warper does)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (_is_number(self.temperature) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


def _is_int(x: object) -> bool:
    """An integer (Python's or NumPy's), not a float that happens to be whole, nor a bool."""
    try:
        operator.index(x)
    except TypeError:
        return False
    return not isinstance(x, (bool, np.bool_))


def _is_number(x: object) -> bool:
    """A real number (Python's or NumPy's), not a string or a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


MIN_WIDTH = 16  # the narrowest prompt width and new-token count `generate` compiles for


def padded_size(n: int, cap: int | None = None, minimum: int = MIN_WIDTH) -> int:
    """The size a dimension of `n` is padded to for `_generate`'s compiled program: at least
    `minimum`, else the next multiple of an eighth of the next power of two (with minimum 16: 16,
    20, 24, 28, 32, 40, 48, ..., 256, 320, ...: four sizes a doubling, at most 1.25 times `n`;
    with minimum 1, every size up to 8, then 10, 12, 14, 16, 20, ...), at most `cap` (n <= cap;
    None: no cap).

    `generate` pads the prompts' width (cap: max_seq_len − max_new_tokens), the batch (no cap)
    and max_new_tokens (cap: max_seq_len − the width) this way, so that calls of other prompt
    lengths, batch sizes and max_new_tokens reuse one program a size: at their own sizes a loop
    over prompts of 5, 6, 7, ... tokens compiled a program for each (seconds each on a CPU).
    Padded positions, rows and steps are never read."""
    cap = math.inf if cap is None else cap
    if n <= minimum:
        return min(minimum, cap)
    step = max(1, (1 << (n - 1).bit_length()) // 8)
    return min(-(-n // step) * step, cap)


def _prompt_ids(prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array) -> list[list[int]]:
    """The prompts as lists of Python ints: a sequence of token-id sequences, or a (B, T) array."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = np.asarray(prompts).tolist()
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a sequence of token-id sequences, got "
                         f"{type(prompts).__name__}")
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray, jax.Array)):
            raise ValueError(f"prompt {i} must be a sequence of token ids, got {type(p).__name__}")
        p = np.asarray(p).tolist() if isinstance(p, (np.ndarray, jax.Array)) else p
        bad = next((x for x in p if not _is_int(x)), None)
        if bad is not None:
            raise ValueError(f"prompt {i} has a token id that is not an int: {bad!r}")
        rows.append([operator.index(x) for x in p])
    return rows


def sample(logits: jax.Array, key: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Next tokens (B,) from float32 logits (B, V)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # the largest logit at 0 first, and 1/T at most float32's largest: at a tiny temperature
    # (1e-39) x / T overflowed to inf for every positive logit and categorical took the first
    # inf, not the largest logit; 1/T itself overflows below 3e-39 (0 · inf would be NaN)
    inverse = min(1.0 / sampling.temperature, float(jnp.finfo(jnp.float32).max))
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) * inverse
    if sampling.top_k:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop_sorted = jnp.cumsum(probs, axis=-1) - probs >= sampling.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model",))
def prefill(model: DecoderLM, params, cache, tokens: jax.Array, lengths: jax.Array):
    """Run the right-padded prompts (B, W) int32 of `lengths` (B,) tokens into `cache` (made
    for at least W tokens a row, `empty_cache`); returns (the logits (B, V) float32 at each
    row's last prompt token, the cache)."""
    logits, state = model.apply({"params": params, "cache": cache}, tokens,
                                logits_at=(lengths - 1)[:, None], mutable=["cache"])
    return logits[:, 0], state["cache"]


def empty_cache(model: DecoderLM, rows: int, length: int):
    """The KV cache of `model` (made with decode=True) for `rows` sequences of up to `length`
    tokens, zeros (what `model.init` makes, without initializing parameters to get it)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0),
                            jax.ShapeDtypeStruct((rows, length), jnp.int32))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def decode_logits(model: DecoderLM, params, cache, tokens: jax.Array, positions: jax.Array):
    """Feed tokens (B,) at positions (B,), each row attending to its cache entries up to its
    position; returns (their next-token logits (B, V) float32, the cache with them written)."""
    logits, state = model.apply({"params": params, "cache": cache}, tokens[:, None],
                                positions=positions[:, None], mutable=["cache"])
    return logits[:, 0], state["cache"]


@functools.partial(jax.jit, static_argnames=("model", "sampling"), donate_argnums=(2,))
def _decode_step(model: DecoderLM, params, cache, tokens: jax.Array, positions: jax.Array,
                 key: jax.Array, sampling: SamplingConfig):
    """Feed tokens (B,) at positions (B,); returns (next tokens, their logits, cache)."""
    logits, cache = decode_logits(model, params, cache, tokens, positions)
    return sample(logits, key, sampling), logits, cache


@functools.partial(jax.jit, static_argnames=("model", "sampling", "new_width"))
def _generate(model: DecoderLM, params, tokens: jax.Array, lengths: jax.Array, rows: jax.Array,
              key: jax.Array, eos_id: jax.Array, max_new_tokens: jax.Array, *,
              sampling: SamplingConfig, new_width: int) -> jax.Array:
    """Prefill the right-padded prompts (B, W), of which the first `rows` are prompts (the rest
    padding, done from the start), then sample inside one `lax.while_loop` until every row has
    produced `eos_id` or `max_new_tokens` (<= new_width) tokens. Returns (B, new_width) int32,
    −1 after a row stopped and past max_new_tokens.

    The KV cache, W + new_width positions a row, is made here: passed in, its zeros were an
    argument buffer beside the loop's own copy, twice the cache at the peak."""
    b = tokens.shape[0]
    cache = empty_cache(model, b, tokens.shape[1] + new_width)
    logits, cache = prefill(model, params, cache, tokens, lengths)
    first = sample(logits, jax.random.fold_in(key, 0), sampling)
    out = jnp.full((b, new_width), -1, jnp.int32)

    def running(state) -> jax.Array:
        step, _, _, _, _, done = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, tok, pos, cache, out, done = state
        out = out.at[:, step].set(jnp.where(done, -1, tok))
        done = done | (tok == eos_id)
        more = (step + 1 < max_new_tokens) & ~jnp.all(done)

        def decode(cache):
            nxt, _, cache = _decode_step(model, params, cache, tok, pos,
                                         jax.random.fold_in(key, step + 1), sampling)
            return nxt, cache

        tok, cache = jax.lax.cond(more, decode, lambda c: (tok, c), cache)
        return step + 1, tok, pos + 1, cache, out, done

    state = (jnp.int32(0), first, lengths, cache, out, jnp.arange(b) >= rows)
    return jax.lax.while_loop(running, body, state)[4]


def generate(
    config: ModelConfig,
    params: dict,
    prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    eos_id: int | None = None,
) -> list[list[int]]:
    """New tokens for each prompt (the prompt excluded; stops after `eos_id`, which is kept):
    B prompts of any lengths (lists of ints, or a (B, T) array) -> B lists of at most
    `max_new_tokens` ids. `config` is the `ModelConfig` (a `Config`'s `.model`); `params` what
    `init` returns under "params" (boxed or unboxed); `seed` in [0, 2**32) seeds the sampling;
    `eos_id` in [0, vocab_size).

    The whole decode runs on the device in one jitted call (`_generate`); only the finished
    tokens come back to the host. `model.attn_logit_bits` must be null (a KV cache refuses it).
    """
    model = DecoderLM(config, decode=True)  # a TypeError unless config is a ModelConfig
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    prompts = _prompt_ids(prompts)
    if not prompts:
        raise ValueError("prompts is empty: expected one or more prompts, each a list of token ids")
    empty = next((i for i, p in enumerate(prompts) if len(p) == 0), None)
    if empty is not None:
        raise ValueError(f"prompt {empty} is empty: every prompt needs at least one token")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not _is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if eos_id is not None and not (_is_int(eos_id) and 0 <= eos_id < config.vocab_size):
        raise ValueError(f"eos_id must be None or an int in [0, {config.vocab_size}) "
                         f"(model.vocab_size), got {eos_id!r}")
    max_new_tokens, seed = operator.index(max_new_tokens), operator.index(seed)
    if sampling.top_k > config.vocab_size:
        raise ValueError(f"top_k must be <= model.vocab_size ({config.vocab_size}), got "
                         f"{sampling.top_k}")
    lengths = np.array([len(p) for p in prompts], np.int32)
    total = int(lengths.max()) + max_new_tokens
    if total > config.max_seq_len:
        raise ValueError(
            f"longest prompt ({lengths.max()} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds model.max_seq_len ({config.max_seq_len})"
        )
    width = padded_size(int(lengths.max()), config.max_seq_len - max_new_tokens)
    new_width = padded_size(max_new_tokens, config.max_seq_len - width)
    b = len(prompts)
    tokens = np.zeros((padded_size(b, minimum=1), width), np.int32)
    for i, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= config.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {config.vocab_size})")
        tokens[i, : len(p)] = p
    lengths = np.pad(lengths, (0, len(tokens) - b), constant_values=1)  # padding rows: 1 token

    out = np.asarray(_generate(model, params, jnp.asarray(tokens), jnp.asarray(lengths),
                               jnp.int32(b), jax.random.key(seed),
                               jnp.int32(-1 if eos_id is None else eos_id),
                               jnp.int32(max_new_tokens), sampling=sampling, new_width=new_width))
    return [[int(x) for x in row if x >= 0] for row in out[:b]]
