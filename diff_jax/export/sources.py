"""Read (model config, float32 parameters) from a training run, one of its checkpoints, or an export.

Training checkpoints (`<run_dir>/checkpoints/<step>/`) are read with
`diff_jax.checkpoint.restore_inference`: the parameters alone, checked against the saved config.
Exports carry `export.json` (format, dtype, source, step, the run's data.tokenizer, and `run`:
its data section, train.seed and train.seq_len, which define its held-out split) beside
`config.json` (the model config), their tensors and `checksums.json`: the checksum of every
stored array and of the JSON of `config.json` and `export.json` (`checkpoint.checksums_record`
and `checkpoint.json_bytes`, the training checkpoints' own), which loading verifies. Exports
written before a format recorded them are read with a warning; those written before the record
covered a JSON file read it unverified. A safetensors export's `config.json` is compared with
the model config its `model.safetensors` carries (`model_config` metadata) as well
(`check_config_copies`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from diff_jax import checkpoint, summary
from diff_jax.checkpoint import CheckpointError, DamagedCheckpointError
from diff_jax.config import ConfigError, ModelConfig, model_config_from_dict
from diff_jax.data.tokenizer import recorded_identity
from diff_jax.device_memory import out_of_memory_in
from diff_jax.error_text import first_line
from diff_jax.export.errors import ExportError
from diff_jax.export.safetensors_io import read_safetensors
from diff_jax.export.state_dict import from_state_dict
from diff_jax.sharding import Rules, check_divisible, tree_shardings, unboxed

EXPORT_MARKER = "export.json"
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
PARAMS_DIR = "params"
CHECKSUMS_FILE = "checksums.json"  # `checkpoint.checksums_record`: arrays, config.json, export.json
EVAL_DIR = "eval"  # eval.py's output directory in a run or an export (evaluation.loading)


@dataclasses.dataclass(frozen=True)
class Source:
    """What was read: the model config, its float32 parameters, and where they came from."""

    config: ModelConfig
    params: dict[str, Any]
    origin: str  # the directory the parameters were read from
    step: int | None  # the training step, where known
    # what of the run's config defines its data and held-out split (`run_sections`), where
    # known: recorded in export.json; exports written before it was give only
    # {"data": {"tokenizer": ...}}, imports None
    run: dict[str, Any] | None = None
    # the `tokenizer.identity` of the tokenizer the parameters were trained with, where known:
    # recorded in the step's training data and export.json (`trained_tokenizer`); an import's
    # own tokenizer.json where it has a usable one
    trained_tokenizer: dict[str, Any] | None = None

    @property
    def tokenizer(self) -> str | None:
        """The run's data.tokenizer, where known."""
        name = ((self.run or {}).get("data") or {}).get("tokenizer")
        return name if isinstance(name, str) else None


def run_sections(saved: Any) -> dict[str, Any] | None:
    """Of a run's saved config (a dict), what defines its corpus and held-out split: the data
    section and train.seed (which seeds synthetic documents), with train.seq_len; None when
    `saved` has no data section."""
    if not isinstance(saved, dict) or not isinstance(saved.get("data"), dict):
        return None
    train = saved.get("train") if isinstance(saved.get("train"), dict) else {}
    return {"data": saved["data"], "train": {k: train[k] for k in ("seed", "seq_len") if k in train}}


def model_config_from_json(data: Any, where: str) -> ModelConfig:
    """A `ModelConfig` from its JSON dict; `ExportError` naming `where` when it is invalid."""
    if not isinstance(data, dict):
        raise ExportError(f"{where}: expected the model config as a JSON object, got {data!r}")
    try:  # the model section alone: train.seq_len etc. are not part of an export
        return model_config_from_dict(data)
    except ConfigError as e:
        raise ExportError(f"{where}: invalid model config: {e}") from e


def abstract_params(config: ModelConfig, mesh: Mesh | None = None, rules: Rules = ()) -> Any:
    """Float32 ShapeDtypeStructs for the parameters of `config`: on this process's first device,
    or (`mesh` given) sharded over `mesh` by the logical-axis `rules` as training shards them;
    `ShardingError` naming the parameter and dimension that its mesh axes do not divide."""
    if mesh is None:
        first = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return summary.abstract_params(config, first)
    boxed = summary.boxed_params(config)
    check_divisible(boxed, mesh, rules, "parameter")
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        unboxed(boxed), tree_shardings(boxed, mesh, rules))


def shardings_of(abstract: Any) -> Any:
    """The tree of `abstract`'s leaves' shardings (ShapeDtypeStructs with shardings)."""
    return jax.tree.map(lambda x: x.sharding, abstract)


@dataclasses.dataclass(frozen=True)
class Location:
    """What a directory holds: an export (`export`), or a training run (`run_dir`) and one of its
    steps (`step`; None: the latest complete one)."""

    export: Path | None = None
    run_dir: Path | None = None
    step: int | None = None


LOADABLE = ("a run directory (with checkpoints/ or config.yaml), its checkpoints/ directory, one "
            f"step RUN/checkpoints/N, or an export (with {EXPORT_MARKER})")


def locate(path: Path) -> Location | None:
    """What `path` names (see `LOADABLE`), or None when it is none of those: the one place that
    decides "run, checkpoint step or export" for `read_source`, eval.py and fine-tuning."""
    if (path / EXPORT_MARKER).is_file():
        return Location(export=path)
    if path.name.isdigit() and path.parent.name == "checkpoints":
        return Location(run_dir=path.parent.parent, step=int(path.name))
    if path.name == "checkpoints":
        return Location(run_dir=path.parent)
    if (path / "checkpoints").exists() or (path / "config.yaml").exists():
        return Location(run_dir=path)
    return None


def read_source(path: str | Path, mesh: Mesh | None = None, rules: Rules = ()) -> Source:
    """Read an export directory, a run directory, its `checkpoints/` directory, or one step in it.
    The parameters are placed on this process's first device, or (`mesh` given) sharded over
    `mesh` by `rules` (`abstract_params`), never whole on one device (a safetensors file is
    read whole into host memory first)."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise ExportError(f"{path}: expected a directory (a run, a checkpoint or an export)")
    location = locate(path)
    if location is None:
        raise ExportError(f"{path}: neither a run directory nor an export; expected {LOADABLE}")
    if location.export is not None:
        return _read_export(path, mesh, rules)
    return _read_train_checkpoint(path, location, mesh, rules)


def read_json(path: Path, missing: str = "the export is incomplete") -> Any:
    """The JSON value in the file `path`; ExportError naming it when it is missing (`missing`
    says what that means) or holds no JSON."""
    if not path.is_file():
        raise ExportError(f"{path}: missing; {missing}")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: not valid JSON: {e}") from e


def _read_export(path: Path, mesh: Mesh | None, rules: Rules) -> Source:
    info = read_json(path / EXPORT_MARKER)
    fmt = info.get("format") if isinstance(info, dict) else None
    if fmt not in ("safetensors", "orbax-params"):
        hint = (f" (python -m diff_jax.export.hf_import {path} --out DIR converts this one)"
                if fmt == "hf-diffllama" else "")
        raise ExportError(f"{path / EXPORT_MARKER}: format {fmt!r} cannot be loaded back; "
                          f"exports in formats safetensors and orbax-params can{hint}")
    recorded = recorded_checksums(path)
    verify_json(info, recorded, path / EXPORT_MARKER)
    data = read_json(path / CONFIG_FILE)
    verify_json(data, recorded, path / CONFIG_FILE)
    config = model_config_from_json(data, str(path / CONFIG_FILE))
    # before the tensors are read: a mesh whose axes do not divide a parameter is refused at
    # once, not after the whole file was read and summed
    target = abstract_params(config, mesh, rules)
    if fmt == "safetensors":
        file = path / SAFETENSORS_FILE
        if not file.is_file():
            raise ExportError(f"{file}: missing; the export is incomplete")
        tensors, metadata = read_safetensors(file)
        check_config_copies(config, written_config(metadata, file), path / CONFIG_FILE, file)
        verify(tensors, recorded, file)
        params = jax.device_put(from_state_dict(tensors, config, str(file)), shardings_of(target))
    else:
        params = _restore_params(path / PARAMS_DIR, target, recorded)
    step, run, tokenizer = info.get("step"), info.get("run"), info.get("tokenizer")
    trained = info.get("trained_tokenizer")
    if trained is not None and recorded_identity(trained) != trained:
        raise ExportError(f"{path / EXPORT_MARKER}: 'trained_tokenizer' must be a tokenizer's "
                          f"record (its name and tokenizer_* keys), got {trained!r:.200}")
    if run is None:  # written before exports recorded it
        run = {"data": {"tokenizer": tokenizer}} if isinstance(tokenizer, str) else None
    elif not (isinstance(run, dict) and set(run) <= {"data", "train"}
              and all(isinstance(v, dict) for v in run.values())):
        raise ExportError(f"{path / EXPORT_MARKER}: 'run' must map data and train to sections of "
                          f"the run's config, got {run!r:.200}")
    return Source(config, params, str(path), step if isinstance(step, int) else None, run,
                  trained)


def written_config(metadata: dict[str, str], file: Path) -> ModelConfig | None:
    """The model config an export wrote into `file` (its model.safetensors, whose `metadata`)
    beside config.json: `model_config`, the same config's JSON; None for a file without it (not
    written by a diff-jax export: Hugging Face's `save_pretrained` writes only `format`).
    `ExportError` naming the metadata when it is no model config."""
    if "model_config" not in metadata:
        return None
    where = f"{file} model_config metadata"
    try:
        return model_config_from_json(json.loads(metadata["model_config"]), where)
    except json.JSONDecodeError as e:
        raise ExportError(f"{where}: not valid JSON: {e}") from e


def check_config_copies(config: ModelConfig, written: ModelConfig | None, config_file: Path,
                        file: Path) -> None:
    """`ExportError` naming both files and the first field (`ModelConfig.difference`) in which
    `config`, read from `config_file`, computes another model than `written`, the config the
    export wrote into `file` from the same config (`written_config`; None: nothing to compare).
    Nothing compared the two, and config.json alone was read: an export whose checksums.json
    predates config.json's entry (or has none) loaded an edited config.json, or one copied from
    another export, as the model its tensors were trained as (measured: `rope_theta` 10000 ->
    500000 in a 2-step run's safetensors export, eval.py's ppl loss 4.099431 for 4.099423, exit
    0; `rms_norm_eps` 1e-5 -> 1e-3 in its hf-diffllama export, imported as norm_eps 0.001).
    Fields that change nothing the parameters compute (dtype, attention_impl, max_seq_len…) may
    differ, as eval.py's overrides may change them."""
    differs = None if written is None else config.difference(written)
    if differs is not None:
        key, theirs, ours = differs
        raise ExportError(f"{config_file} gives a model with {key}={ours} but {file} holds one "
                          f"with {key}={theirs} (its model_config metadata); the export wrote "
                          "both from one config, so one was edited or comes from another "
                          "export: put back the export's own files, or export the run again")


def _restore_params(path: Path, target: Any, recorded: dict[str, str] | None) -> dict[str, Any]:
    """A params-only orbax PyTree checkpoint -> float32 parameters placed as `target` (the
    model's `abstract_params`) places them, checked against its shapes and against the checksums
    `recorded` beside it (verified in the stored dtype, then cast)."""
    if not path.is_dir():
        raise ExportError(f"{path}: missing; the export is incomplete")
    with ocp.PyTreeCheckpointer() as checkpointer:  # closed on every way out
        try:
            # resolved: orbax answers None for the metadata of a relative path
            saved = checkpointer.metadata(path.resolve()).item_metadata
        # orbax raises AttributeError / TypeError for a _METADATA that is JSON of another shape
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise ExportError(f"{path}: not a readable orbax checkpoint: {type(e).__name__}: "
                              f"{e}") from e
        checkpoint.check_shapes(checkpoint.tree_shapes(saved), checkpoint.tree_shapes(target),
                                f"{path}: ", ExportError)
        keystr = jax.tree_util.keystr
        dtypes = {keystr(p): leaf.dtype
                  for p, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]}
        stored = jax.tree_util.tree_map_with_path(  # read in the stored dtype: what was summed
            lambda p, t: jax.ShapeDtypeStruct(t.shape, dtypes[keystr(p)], sharding=t.sharding),
            target)
        restore_args = jax.tree.map(
            lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype), stored)
        try:
            params = checkpointer.restore(path.resolve(),
                                          args=ocp.args.PyTreeRestore(stored, restore_args))
        except Exception as e:  # tensorstore raises bare Exceptions for unreadable bytes
            if (no_room := out_of_memory_in(e)) is not None:  # the export is fine; devices full
                raise no_room from e
            raise ExportError(f"{path}: the export is damaged: could not read the parameters: "
                              f"{type(e).__name__}: {first_line(e)}") from e
    verify(params, recorded, path)
    return jax.tree.map(lambda x: x.astype(jnp.float32), params)


def recorded_checksums(export_dir: Path) -> dict[str, str] | None:
    """{array name: checksum} from the export's `checksums.json`; None, with a warning, when it has
    none (written before its format recorded them); `ExportError` naming the file when it is
    damaged."""
    sums_file = export_dir / CHECKSUMS_FILE
    if not sums_file.exists():
        return checkpoint.recorded_checksums(None, None, export_dir)
    try:
        return checkpoint.recorded_checksums(read_json(sums_file), None, sums_file)
    except DamagedCheckpointError as e:
        raise ExportError(str(e)) from e


def verify(arrays: Any, recorded: dict[str, str] | None, where: Path) -> None:
    """`ExportError` naming the first array of `arrays` (a tree as stored, read from `where`, a
    file or directory in the export) whose checksum is not the `recorded` one; nothing to check
    when `recorded` is None."""
    if recorded is None:
        return
    try:
        checkpoint.verify_checksums(arrays, recorded, None, where)
    except DamagedCheckpointError as e:
        raise ExportError(str(e)) from e


def verify_json(value: Any, recorded: dict[str, str] | None, file: Path) -> None:
    """`ExportError` naming `file`, the export's `config.json` or `export.json`, when `value` (the
    JSON read from it) is not the one whose checksum `recorded` holds under the file's stem
    (`checkpoint.verify_json`): a digit changed in config.json (a layer count, λ_init, RoPE θ, a
    head count of the same shapes) was read as the model the parameters were exported from, and
    one in export.json's `run` (train.seed, the data section) as the split that eval.py holds
    out. An export written before its record covered the file reads it unverified."""
    try:
        checkpoint.verify_json(value, recorded, None, file, name=file.stem)
    except DamagedCheckpointError as e:
        raise ExportError(str(e)) from e


def _read_train_checkpoint(path: Path, location: Location, mesh: Mesh | None,
                           rules: Rules) -> Source:
    """The parameters of a run's step (`location`), placed as `abstract_params` places them,
    with the model config saved beside them."""
    run_dir, step = location.run_dir, location.step
    configs: list[ModelConfig] = []

    def target(saved: Any) -> Any:
        model = saved.get("model") if isinstance(saved, dict) else None
        configs.append(model_config_from_json(model, f"{run_dir / 'checkpoints'} saved config"))
        return abstract_params(configs[0], mesh, rules)

    try:
        step, saved, params, training_data = checkpoint.restore_inference(
            run_dir, step, target,
            lambda other: f"name the newest instead: {run_dir / 'checkpoints' / str(other)}")
    except CheckpointError as e:
        raise ExportError(f"{path}: {e}") from e
    return Source(configs[0], params, str(run_dir / "checkpoints" / str(step)), step,
                  run_sections(saved), recorded_identity(training_data))
