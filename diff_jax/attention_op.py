"""The one attention op between the attention modules and `kernels`.

`AttentionOp.build(model_config, mesh, rules)` is made once per model and handed to every
attention module (`DecoderLM(config, attention_op=op)`). It owns every decision the modules used
to make on the side:

- **Implementation** from `model.attention_impl` (`config.AttentionImpl`): `xla` (the pure-jnp
  oracle), `pallas` (the fused flash kernel), `cudnn` (NVIDIA GPUs, bfloat16), or `auto`, resolved
  here for the platform of the mesh's devices (or the default backend): TPU → pallas; GPU →
  pallas for DIFF V1, cuDNN for standard attention in bfloat16, xla in float32; CPU → xla; and xla
  wherever the fused kernel does not support the head width. An implementation that cannot run is
  a `ConfigError` naming `model.attention_impl`.
- **Sharding.** XLA partitions the oracle by itself; a kernel (a Pallas or cuDNN custom call)
  cannot be partitioned automatically, so on a mesh of more than one device it runs inside
  `jax.shard_map` with specs derived from the logical-axis rules the modules use: batch over the
  mesh axes of `batch` (replicated when they do not divide it, as for the one-row init), query
  heads over those of `act_heads` (whole DIFF heads per shard; replicated, with a warning, when
  those axes do not divide the heads), kv
  heads the same when those axes divide them and replicated otherwise (each shard then gathers
  the kv groups its own heads read), λ replicated, the sequence unsharded. A mesh whose axes are
  Explicit (`jax.make_mesh`'s default on jax ≥ 0.10) works too: the kernel's inputs are first
  resharded (`jax.reshard`) onto those specs on its Explicit axes, as shard_map requires there.
  Without a mesh and rules given, the op reads the context ones (`jax.set_mesh`,
  `nn.logical_axis_rules`).
- **Capture.** `capture=True` returns the attention logits and maps with the output (for
  `eval.py`'s analyses); it runs the xla path, since the maps are the O(T²) tensors the fused
  kernel never forms. `model.attn_logit_bits` (absmax fake-quantized logits) is xla-only too.
- **Decode.** A single-token step over a KV cache (`kv_lengths` given) runs
  `kernels.decode_attention`, which reads the cache chunk by chunk up to the longest row's
  filled length (O(filled) per token, not O(capacity)), on every platform and whatever
  `impl` is; with `capture` it runs the oracle over the cache instead, since the maps need
  every score of a row at once. `logit_bits` is refused with a cache (`attention._attend`): its
  scale spans the whole map, which a step, one query row, cannot reproduce.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from diff_jax import kernels
from diff_jax.config import ConfigError, ModelConfig, check_section
from diff_jax.sharding import Rules, axes_size

Maps = dict[str, Any]

_log = logging.getLogger(__name__)


def _platform(mesh: Mesh | None) -> str:
    """'cpu' | 'gpu' | 'tpu': the platform the op's computation will run on."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def resolve_impl(config: ModelConfig, platform: str) -> str:
    """The concrete implementation ("xla" | "pallas" | "cudnn") of `config` on `platform`."""
    from diff_jax import variants  # the specs hold the attention modules, which import this op

    impl, d = config.attention_impl, config.resolved_head_dim  # ModelConfig checked its value
    kernel_ok = kernels.supports_head_dim(d)
    if impl == "auto":
        if config.attn_logit_bits is not None or platform not in ("gpu", "tpu") or not kernel_ok:
            return "xla"
        if platform == "tpu" or variants.spec(config.variant).differential_op:
            return "pallas"
        return "cudnn" if config.dtype == "bfloat16" else "xla"
    if impl == "pallas" and not kernel_ok:
        raise ConfigError(f"model.attention_impl=pallas: the fused kernel needs the head width d to "
                          f"be a multiple of 16 in [16, {kernels.MAX_HEAD_DIM}], got {d}; use xla or auto")
    if impl == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention_impl=cudnn runs only on NVIDIA GPUs; these devices "
                          f"are {platform}: use auto or xla (the same function; e.g. "
                          f"model.attention_impl=auto to evaluate a run trained with cudnn)")
    return impl


@dataclasses.dataclass(frozen=True)
class AttentionOp:
    """Differential or standard attention for the modules; see the module docstring.

    `impl` is already resolved ("xla" | "pallas" | "cudnn"). `mesh`/`rules` None: the context's.
    """

    impl: str = "xla"
    mesh: Mesh | None = None
    rules: Rules | None = None
    capture: bool = False
    logit_bits: int | jax.Array | None = None  # an int32 array only inside a trace (`quantized`)
    block_sizes: kernels.BlockSizes | None = None

    @classmethod
    def build(cls, config: ModelConfig, mesh: Mesh | None = None, rules: Rules | None = None, *,
              capture: bool = False, block_sizes: kernels.BlockSizes | None = None) -> AttentionOp:
        """The op for `config` (a `ModelConfig`: a Config's .model) on `mesh` (a jax Mesh; None:
        the context mesh at trace time) with `rules`. TypeError for another object in their
        place (a whole Config, a MeshConfig: an AttributeError on the first field read)."""
        check_section(config, ModelConfig, "AttentionOp.build")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"AttentionOp.build takes a jax Mesh (diff_jax.sharding.make_mesh("
                            f"config.mesh)) or None, got {type(mesh).__name__}")
        impl = "xla" if capture else resolve_impl(config, _platform(mesh))
        return cls(impl=impl, mesh=mesh, rules=None if rules is None else tuple(rules),
                   capture=capture, logit_bits=config.attn_logit_bits, block_sizes=block_sizes)

    def quantized(self, bits: jax.Array) -> AttentionOp:
        """This op with its logits absmax fake-quantized to `bits`, an int32 scalar that may be
        traced (one compiled program serves every width; `model.attn_logit_bits` is the static
        form): for use inside the traced function only. ValueError unless the op runs the xla
        path, the only one that forms the logits."""
        if self.impl != "xla":
            raise ValueError(f"quantized logits exist only on the xla path; this op runs "
                             f"{self.impl}")
        return dataclasses.replace(self, logit_bits=bits)

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        lam: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        kv_lengths: jax.Array | None = None,
    ) -> tuple[jax.Array, Maps | None]:
        """(output, maps or None). `lam` selects differential attention.

        Differential: q (B, T, 2H, d) (sub-heads 2h, 2h+1 are Q1, Q2 of head h), k (B, S, 2Hkv, d),
        v (B, S, Hkv, 2d), λ a float32 scalar -> (B, T, H, 2d). Standard: q (B, T, Hq, d), k and
        v (B, S, Hkv, d) -> (B, T, Hq, d). `segment_ids` (B, T): causal attention within a
        segment, 0 = padding. `kv_lengths` (B,) int32: one-token decoding (T = 1) over a cache
        whose first kv_lengths[b] entries are filled (k, v of capacity S). Maps (with
        `capture`): "logits", "probs" (B, 2H or Hq, T, S) float32, "mask", and "lambda" (DIFF).
        """
        if kv_lengths is not None:
            return self._decode(q, k, v, lam, kv_lengths)
        if self.impl == "xla":
            return self._oracle(q, k, v, lam, segment_ids, None)
        return self._kernel(q, k, v, lam, segment_ids), None

    def _decode(self, q, k, v, lam, lengths):
        if self.capture:
            visible = (jnp.arange(k.shape[1])[None, :] < lengths[:, None]).astype(jnp.int32)
            # unfilled entries may hold anything: their probability 0 does not mask a NaN value
            v = jnp.where(visible[:, :, None, None] != 0, v, 0)
            return self._oracle(q, k, v, lam, None, visible)
        return kernels.decode_attention(q, k, v, lam, lengths=lengths), None

    def _oracle(self, q, k, v, lam, segment_ids, kv_valid):
        decoding = kv_valid is not None
        if decoding:  # the query's segment 1 meets the visible (1) keys
            segment_ids = jnp.ones(q.shape[:2], jnp.int32)
        opts = dict(segment_ids=segment_ids, kv_segment_ids=kv_valid, causal=not decoding,
                    logit_bits=self.logit_bits, return_maps=self.capture, impl="xla")
        if lam is None:
            res = kernels.dot_product_attention(q, k, v, **opts)
        else:
            res = kernels.diff_attention(q, k, v, lam, **opts)
        if not self.capture:
            return res, None
        out, maps = res
        if lam is not None:
            maps["lambda"] = lam
        return out, maps

    def _call_kernel(self, q, k, v, lam, segment_ids):
        opts = dict(segment_ids=segment_ids, impl=self.impl, block_sizes=self.block_sizes)
        if lam is None:
            return kernels.dot_product_attention(q, k, v, **opts)
        return kernels.diff_attention(q, k, v, lam, **opts)

    def _kernel(self, q, k, v, lam, segment_ids):
        mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
        if mesh.empty or math.prod(mesh.shape.values()) == 1:
            return self._call_kernel(q, k, v, lam, segment_ids)
        rules = self.rules if self.rules is not None else nn.get_logical_axis_rules()
        # the activations' layout as Flax resolves it: where `batch` and `act_heads` share a
        # mesh axis, the rule listed first takes it and the other dimension stays whole (a spec
        # naming the axis twice is a DuplicateSpecError)
        layout = nn.logical_to_mesh_axes(("batch", "length", "act_heads", "head_dim"), rules)
        batch_axes, head_axes = layout[0], layout[2]
        n_batch, n_head = axes_size(mesh, batch_axes), axes_size(mesh, head_axes)
        nc = 1 if lam is None else 2  # sub-heads per head
        heads, kv_heads = q.shape[2] // nc, v.shape[2]
        if q.shape[0] % n_batch:  # e.g. init on one row, or a small evaluation batch
            batch_axes = None
        if heads % n_head:
            _log.warning("attention: %d heads are not divisible by the mesh axes %r (size %d) "
                         "that `act_heads` maps to; the kernel runs on all heads of every shard",
                         heads, head_axes, n_head)
            head_axes, n_head = None, 1
        shard_kv = kv_heads % n_head == 0
        act = P(batch_axes, None, head_axes, None)
        kv = P(batch_axes, None, head_axes if shard_kv else None, None)
        args, specs = [q, k, v], [act, kv, kv]
        if lam is not None:
            args.append(jnp.asarray(lam, jnp.float32))
            specs.append(P())
        if segment_ids is not None:
            args.append(segment_ids)
            specs.append(P(batch_axes, None))

        if _explicit_axes(mesh):  # shard_map takes an Explicit axis only where the type has it
            args = [jax.reshard(x, NamedSharding(mesh, _on_axes(s, _explicit_axes(mesh))))
                    for x, s in zip(args, specs)]

        def body(q, k, v, *rest):
            lam_l = rest[0] if lam is not None else None
            seg_l = rest[-1] if segment_ids is not None else None
            if not shard_kv:
                k, v = _local_kv(q, k, v, nc, heads // kv_heads, head_axes)
            return self._call_kernel(q, k, v, lam_l, seg_l)

        return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=act,
                             check_vma=False)(*args)


def _explicit_axes(mesh: Any) -> set[str]:
    """The mesh axes of type Explicit (e.g. every axis of a `jax.make_mesh` mesh by default)."""
    return {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}


def _on_axes(spec: P, axes: set[str]) -> P:
    """`spec` with only the mesh axes in `axes` (the others' entries dropped)."""
    def keep(entry: Any) -> Any:
        kept = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in axes)
        return kept or None
    return P(*(None if e is None else keep(e) for e in spec))


def _local_kv(q: jax.Array, k: jax.Array, v: jax.Array, nc: int, n_rep: int,
              head_axes: Any) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map, with kv replicated: the kv group of each of this shard's query heads.

    q (B, T, Hl·nc, d) holds global heads i·Hl … i·Hl + Hl − 1 of shard i; head h reads group
    h // n_rep. Returns k (B, S, Hl·nc, d) and v (B, S, Hl, dv), one group per local head (MHA).
    """
    b, s = k.shape[:2]
    local = q.shape[2] // nc
    first = jax.lax.axis_index(head_axes) * local
    groups = (first + jnp.arange(local)) // n_rep  # (Hl,)
    k = jnp.take(k.reshape(b, s, -1, nc, k.shape[-1]), groups, axis=2)
    return k.reshape(b, s, local * nc, -1), jnp.take(v, groups, axis=2)
