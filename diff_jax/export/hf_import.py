"""Import a local Hugging Face checkpoint as an `orbax-params` export, exactly.

    python -m diff_jax.export.hf_import HF_DIR --out DIR [--overwrite]

- `DiffLlamaForCausalLM` (`model_type: diffllama`) -> variant `diff` (DIFF V1, `flash` GQA
  pairing): the inverse of the `hf-diffllama` export (`diff_jax.export.hf.from_hf_state_dict`).
  DiffLlama's 2H query heads of width d are our H differential heads; its 2·Hkv kv heads our Hkv.
- `LlamaForCausalLM` (`model_type: llama`) -> variant `transformer`: the same heads, q/k rows
  of every head permuted from half-split RoPE pairs (r, r + d/2) to interleaved pairs (2r, 2r + 1).

HF_DIR is what `save_pretrained` writes: `config.json` and `model.safetensors` (or shards listed
in `model.safetensors.index.json`); nothing is downloaded. A diff-jax `hf-diffllama` export's
`config.json` is verified against its `checksums.json` and compared with the config its
`model.safetensors` carries (`sources.check_config_copies`). Every tensor becomes float32, the
parameter dtype of our models. Configurations that the model cannot compute exactly are refused
with the reason: `rope_scaling` / a rope type other than default, partial rotary factors,
attention or MLP biases, an activation other than silu, attention dropout, sliding windows,
quantized checkpoints, and DiffLlama head counts without an even split into (Q1, Q2) / (K1, K2).

The result is an export like any other: `python -m diff_jax.eval checkpoint=DIR`, `python -m
diff_jax.export DIR --format ...`, and `python -m diff_jax.train ... train.init_from=DIR`
(fine-tuning) read it; the import prints those two commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from diff_jax import variants
from diff_jax.attention import LAMBDA_VECTORS
from diff_jax.checkpoint import quiet_abandoned_io
from diff_jax.command import as_ctrl_c, failed, leave, output_kept
from diff_jax.config import ConfigError, ModelConfig, override_value
from diff_jax.data.tokenizer import identity
from diff_jax.export import hf
from diff_jax.export.errors import ExportError
from diff_jax.export.safetensors_io import read_safetensors
from diff_jax.export.sources import (CHECKSUMS_FILE, EXPORT_MARKER, Source, check_config_copies,
                                     read_json, recorded_checksums, verify, verify_json,
                                     written_config)
from diff_jax.export.state_dict import from_state_dict
from diff_jax.export.writer import export
from diff_jax.file_errors import describe

ARCHITECTURES = {"diffllama": "DiffLlamaForCausalLM", "llama": "LlamaForCausalLM"}
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_FLOATS = {np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64)}


def _require(cond: bool, where: str, reason: str) -> None:
    if not cond:
        raise ExportError(f"{where}: {reason}; no exact diff-jax equivalent, refusing to import")


# The JSON types of config.json's fields, by how an error names them ("... must be a boolean").
_KINDS: dict[str, Callable[[Any], bool]] = {
    "a boolean": lambda v: isinstance(v, bool),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "a positive number": lambda v: _KINDS["a number"](v) and v > 0,
    "a positive integer": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
}


def _field(hf: dict[str, Any], key: str, kind: str, where: str, default: Any = None, *,
           parent: str = "") -> Any:
    """`hf[key]` (or `default` when absent or null), which must be `kind` (one of `_KINDS`):
    `ExportError` naming `where` and the field (`parent` + `key`) otherwise."""
    value = hf.get(key)
    value = default if value is None else value
    if not _KINDS[kind](value):
        raise ExportError(f"{where}: {parent}{key} must be {kind}, got {value!r}")
    return value


def _rope_theta(hf: dict[str, Any], where: str) -> float:
    """The RoPE base, refusing every rope variant other than the default (transformers 4 and 5)."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    _require(scaling is None, where, f"rope_scaling {scaling!r} is set (our RoPE is unscaled)")
    theta = _field(hf, "rope_theta", "a positive number", where, 10_000.0)
    if params is not None:
        _require(isinstance(params, dict), where, f"rope_parameters {params!r} is not a mapping")
        kind = params.get("rope_type", params.get("type", "default"))
        _require(kind == "default", where, f"rope_parameters.rope_type is {kind!r} (only 'default')")
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        _require(not extra, where, f"rope_parameters has {extra} (our RoPE has no such setting)")
        theta = _field(params, "rope_theta", "a positive number", where, theta, parent="rope_parameters.")
        factor = _field(params, "partial_rotary_factor", "a number", where, 1.0, parent="rope_parameters.")
        _require(factor == 1.0, where, f"rope_parameters.partial_rotary_factor is {factor!r} "
                 "(we rotate whole heads)")
    factor = _field(hf, "partial_rotary_factor", "a number", where, 1.0)
    _require(factor == 1.0, where, f"partial_rotary_factor is {factor!r} (we rotate whole heads)")
    return float(theta)


def model_config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """Our `ModelConfig` for a DiffLlama or Llama `config.json` dict; `ExportError` (one line,
    naming `where` and the field) for a field of the wrong JSON type and for anything that cannot
    be computed exactly."""
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise ExportError(f"{where}: model_type {model_type!r} cannot be imported; supported: "
                          f"{sorted(ARCHITECTURES)} ({', '.join(ARCHITECTURES.values())})")
    architectures = (_field(hf, "architectures", "a list of strings", where, [])
                     or [ARCHITECTURES[model_type]])
    _require(architectures == [ARCHITECTURES[model_type]], where,
             f"architectures is {architectures!r}; only {ARCHITECTURES[model_type]} (a causal LM "
             "with its head) is imported")
    act = hf.get("hidden_act", "silu")
    _require(act == "silu", where, f"hidden_act is {act!r} (our SwiGLU uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        _require(not _field(hf, key, "a boolean", where, False), where,
                 f"{key} is true (our projections have no bias)")
    dropout = _field(hf, "attention_dropout", "a number", where, 0.0)
    _require(dropout == 0, where, f"attention_dropout is {dropout!r} (our attention has no dropout)")
    for key in ("sliding_window", "quantization_config"):
        _require(hf.get(key) is None, where, f"{key} is set ({hf.get(key)!r})")
    _require(not _field(hf, "use_sliding_window", "a boolean", where, False), where,
             "use_sliding_window is true")
    theta = _rope_theta(hf, where)

    e = _field(hf, "hidden_size", "a positive integer", where)
    heads = _field(hf, "num_attention_heads", "a positive integer", where)
    kv = _field(hf, "num_key_value_heads", "a positive integer", where, heads)
    head_dim = _field(hf, "head_dim", "a positive integer", where, e // heads)
    _require(heads % kv == 0, where, f"num_attention_heads ({heads}) is not a multiple of "
             f"num_key_value_heads ({kv})")
    eps = _field(hf, "rms_norm_eps", "a positive number", where,
                 1e-5 if model_type == "diffllama" else 1e-6)  # the class defaults
    fields: dict[str, Any] = dict(
        vocab_size=_field(hf, "vocab_size", "a positive integer", where), embed_dim=e,
        num_layers=_field(hf, "num_hidden_layers", "a positive integer", where),
        mlp_dim=_field(hf, "intermediate_size", "a positive integer", where),
        max_seq_len=_field(hf, "max_position_embeddings", "a positive integer", where),
        rope_theta=theta, norm_eps=float(eps),
        tie_embeddings=_field(hf, "tie_word_embeddings", "a boolean", where, False),  # as in HF
        init_std=float(_field(hf, "initializer_range", "a number", where, 0.02)))  # initialization only
    variant = variants.for_hf_model_type(model_type)
    n = variant.sub_heads  # DiffLlama counts the (Q1, Q2) and (K1, K2) halves of our heads
    if n > 1:
        _require(heads % n == 0 and kv % n == 0, where, f"num_attention_heads ({heads}) and "
                 f"num_key_value_heads ({kv}) must both be even: DiffLlama's heads are (Q1, Q2) "
                 "and (K1, K2) halves of our differential heads")
    if variant.fixed_head_dim:
        _require(head_dim * heads == e, where, f"head_dim ({head_dim}) · num_attention_heads "
                 f"({heads}) != hidden_size ({e}); our DIFF V1 heads have width hidden_size / "
                 "num_attention_heads")
    h, hkv = heads // n, kv // n
    fields.update(variant=variant.name, num_heads=h, num_kv_heads=None if hkv == h else hkv,
                  head_dim=None if head_dim * heads == e else head_dim)
    try:
        return ModelConfig(**fields)
    except ConfigError as err:
        raise ExportError(f"{where}: gives an invalid diff-jax model config: {err}") from err


def read_hf_tensors(hf_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(every tensor of `model.safetensors`, or of the shards `model.safetensors.index.json`
    lists; the single file's metadata, {} for shards)."""
    index = hf_dir / _INDEX_FILE
    if (hf_dir / _SINGLE_FILE).is_file():
        return read_safetensors(hf_dir / _SINGLE_FILE)
    if not index.is_file():
        found = sorted(p.name for p in hf_dir.glob("*.bin")) or ["no weights"]
        raise ExportError(f"{hf_dir}: no {_SINGLE_FILE} or {_INDEX_FILE} (found {found[0]}); "
                          "only safetensors checkpoints are read: re-save with save_pretrained")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(f"{index}: not a safetensors index with a weight_map: {e}") from e
    not_names = [shard for shard in shards if not isinstance(shard, str) or not shard]
    if not_names:
        raise ExportError(f"{index}: weight_map's values must be shard file names, got "
                          f"{not_names[0]!r}")
    tensors: dict[str, np.ndarray] = {}
    for shard in shards:
        tensors.update(read_safetensors(hf_dir / shard)[0])
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise ExportError(f"{index}: {missing[0]!r} is listed but in none of its shards")
    return tensors, {}


def _llama_to_ours(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """LlamaForCausalLM's state dict -> ours (`diff_jax.export.state_dict` names)."""
    lay = variants.spec(config.variant).layout(config)
    h, hkv, d = lay.q_heads, lay.k_heads, lay.head_dim
    interleaved = np.argsort(hf.half_split_order(d))
    get = hf.tensor_getter(tensors, config, "LlamaForCausalLM")

    def rope_rows(name: str, heads: int) -> np.ndarray:
        w = get(name)
        if w.ndim != 2 or w.shape[0] != heads * d:
            raise ExportError(f"{name}: shape {w.shape}, expected ({heads * d}, {config.embed_dim}) "
                              f"for {heads} heads of width {d}")
        rows = w.reshape(heads, d, w.shape[-1])[:, interleaved]
        return np.ascontiguousarray(rows.reshape(w.shape))

    out = hf.shared_llama_tensors(get, config)
    for i in range(config.num_layers):
        src, attn = f"model.layers.{i}.self_attn", f"layers.{i}.attn"
        out[f"{attn}.q_proj.weight"] = rope_rows(f"{src}.q_proj.weight", h)
        out[f"{attn}.k_proj.weight"] = rope_rows(f"{src}.k_proj.weight", hkv)
        out[f"{attn}.v_proj.weight"] = get(f"{src}.v_proj.weight")
        out[f"{attn}.out_proj.weight"] = get(f"{src}.o_proj.weight")
    return out


def _expected_names(config: ModelConfig) -> set[str]:
    """The tensor names a checkpoint of `config` holds (lm_head only when untied)."""
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
                 *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
    if variants.spec(config.variant).differential_op:  # DiffLlama's λ vectors
        per_layer += [f"self_attn.{name}" for name in LAMBDA_VECTORS]
    names = {f"model.layers.{i}.{n}" for i in range(config.num_layers) for n in per_layer}
    names |= {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_embeddings:
        names.add("lm_head.weight")
    return names


_TO_OURS = {"diffllama": hf.from_hf_state_dict, "llama": _llama_to_ours}  # by model_type


def read_hf(hf_dir: str | Path) -> Source:
    """(our config, float32 parameters) of the DiffLlama / Llama checkpoint in `hf_dir`."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ExportError(f"{hf_dir}: not a directory (HF_DIR is a local save_pretrained directory)")
    config_file = hf_dir / "config.json"
    hf_config = read_json(config_file, "HF_DIR must be a local save_pretrained directory")
    if not isinstance(hf_config, dict):
        raise ExportError(f"{config_file}: expected a JSON object")
    # a diff-jax hf-diffllama export, whose config.json and stored tensors carry their checksums
    exported = (hf_dir / EXPORT_MARKER).is_file() and (hf_dir / CHECKSUMS_FILE).is_file()
    recorded = recorded_checksums(hf_dir) if exported else None
    verify_json(hf_config, recorded, config_file)
    config = model_config_from_hf(hf_config, str(config_file))
    tensors, metadata = read_hf_tensors(hf_dir)
    verify(tensors, recorded, hf_dir / _SINGLE_FILE)
    # a diff-jax hf-diffllama export also holds the config it was exported from (DiffLlama has
    # no GQA pairing; naive without GQA, the one case `hf.check_mappable` lets through, computes
    # flash's function: `ModelConfig.resolved_gqa_pairing`)
    written = written_config(metadata, hf_dir / _SINGLE_FILE)
    check_config_copies(config, written, config_file, hf_dir / _SINGLE_FILE)
    # Buffers some older checkpoints carry: RoPE frequencies, recomputed from rope_theta.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_embeddings and "lm_head.weight" in tensors:
        if not np.array_equal(tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")):
            raise ExportError(f"{hf_dir}: tie_word_embeddings is true but lm_head.weight differs "
                              "from model.embed_tokens.weight; refusing to import")
        del tensors["lm_head.weight"]
    # before the names of every layer are listed: num_hidden_layers=10**30 filled the memory
    layers = {name.split(".")[2] for name in tensors if name.startswith("model.layers.")}
    if config.num_layers > len(layers):
        raise ExportError(f"{config_file}: num_hidden_layers is {config.num_layers} but the "
                          f"checkpoint holds the tensors of {len(layers)} layers; refusing to import")
    extra = sorted(set(tensors) - _expected_names(config))
    if extra:
        raise ExportError(f"{hf_dir}: tensor {extra[0]!r} ({len(extra)} unexpected in all) has no "
                          f"place in a {ARCHITECTURES[hf_config['model_type']]} as its config.json "
                          "describes it; refusing to import")
    for name, value in tensors.items():
        if value.dtype not in _FLOATS:
            raise ExportError(f"{hf_dir}: {name} has dtype {value.dtype}; expected one of "
                              f"{sorted(str(d) for d in _FLOATS)}")
    try:
        ours = _TO_OURS[hf_config["model_type"]](tensors, config)
    except ExportError as e:
        raise ExportError(f"{hf_dir}: {e}") from e
    params = from_state_dict(ours, config, str(hf_dir))
    enc, _ = own_encoding(hf_dir, config)  # the tokenizer the checkpoint was trained with
    return Source(config, params, str(hf_dir), None,
                  trained_tokenizer=None if enc is None else identity(enc))


def import_hf(hf_dir: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Convert the checkpoint in `hf_dir` to an `orbax-params` export (float32) at `out`."""
    return export(read_hf(hf_dir), out, "orbax-params", dtype="float32", overwrite=overwrite)


# Model fields that only choose how the model is computed or initialized: left to the run's config.
_RUN_CHOICES = (*ModelConfig.HOW_COMPUTED, "dtype", "attn_logit_bits", "init_std")


def finetune_overrides(config: ModelConfig, out: str | Path) -> list[str]:
    """The `train.py` overrides that fine-tune the export at `out`: every model field that the
    parameters depend on (whatever the --config file says), and `train.init_from`."""
    overrides = [f"model.{f.name}={override_value(getattr(config, f.name))}"
                 for f in dataclasses.fields(config) if f.name not in _RUN_CHOICES]
    return [*overrides, f"train.init_from={out}"]


def own_encoding(hf_dir: str | Path, config: ModelConfig) -> tuple[Any, str | None]:
    """(the `HFEncoding` of the tokenizer.json in `hf_dir`, named by its absolute directory,
    where it loads and its ids fit `config.vocab_size`, else None; why one that is there cannot
    be used, else None)."""
    from diff_jax.data import DataError
    from diff_jax.data.tokenizer import HF_FILE, HFEncoding

    where = Path(hf_dir).expanduser().resolve()
    if not (where / HF_FILE).is_file():
        return None, None
    try:
        enc = HFEncoding(str(where))
    except DataError as e:
        return None, str(e)
    if enc.n_vocab > config.vocab_size:
        return None, (f"{where / HF_FILE}: its ids reach {enc.n_vocab - 1}, past the model's "
                      f"vocab_size {config.vocab_size}")
    return enc, None


def own_tokenizer(hf_dir: str | Path, config: ModelConfig) -> tuple[list[str], str | None]:
    """(`["data.tokenizer=ABSOLUTE_HF_DIR"]` where `hf_dir` holds a usable tokenizer.json
    (`own_encoding`), so that the printed commands read text with the model's own tokenizer,
    else []; why one that is there cannot be used, else None). Without it the commands'
    tokenizer, cl100k, is another vocabulary's."""
    enc, unusable = own_encoding(hf_dir, config)
    return ([] if enc is None else [f"data.tokenizer={enc.name}"]), unusable


def main(argv: list[str] | None = None) -> int:
    """`python -m diff_jax.export.hf_import HF_DIR --out DIR [--overwrite]`; 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m diff_jax.export.hf_import",
        description="Import a local DiffLlamaForCausalLM (-> DIFF V1) or LlamaForCausalLM (-> "
                    "Transformer) checkpoint as a diff-jax orbax-params export.")
    parser.add_argument("hf_dir", help="a save_pretrained directory: config.json, model.safetensors")
    parser.add_argument("--out", required=True, help="the export directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export at --out")
    args = parser.parse_args(argv)
    out = None  # the export's directory, once it is written whole
    try:
        with as_ctrl_c(signals=()):  # a closed stdout (`| head`) is a Ctrl-C; SIGTERM as it was
            source = read_hf(args.hf_dir)
            out = export(source, args.out, "orbax-params", dtype="float32",
                         overwrite=args.overwrite)
            print(f"imported {args.hf_dir} ({source.config.variant}) to {out} (orbax-params, "
                  "float32)")
            tokenizer, unusable = own_tokenizer(args.hf_dir, source.config)
            if unusable is not None:
                print(f"note: the commands below read text with cl100k, not the checkpoint's "
                      f"tokenizer ({unusable})")
            # the commands as `python -m`, which an installed diff-jax runs as a clone's root does
            print("evaluate:  python -m diff_jax.eval task=ppl "
                  + shlex.join([f"checkpoint={out}", *tokenizer]))
            # a run directory of its own: the config file's (configs/tiny.yaml: runs/tiny) may
            # hold a run, which would resume instead, ignoring train.init_from
            print("fine-tune: python -m diff_jax.train " + shlex.join(
                [*finetune_overrides(source.config, out), *tokenizer,
                 f"train.run_dir=runs/{out.name}-finetune"]))
    except ExportError as e:
        quiet_abandoned_io()  # a damaged checkpoint's reads: this line stays the last
        return failed(str(e))
    except OSError as e:  # e.g. --out in a directory that cannot be made or written
        quiet_abandoned_io()
        named = [(f"--out {args.out}", args.out), (f"HF_DIR {args.hf_dir}", args.hf_dir)]
        return failed(describe(e, named))
    except KeyboardInterrupt:
        return output_kept(f"--out {args.out}", complete=out is not None)
    return 0


if __name__ == "__main__":
    leave(main())
