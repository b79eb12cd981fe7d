"""Write an export directory: safetensors, a params-only orbax checkpoint, or Hugging Face DiffLlama.

The export is written into a hidden sibling directory and renamed into place when complete, so an
interrupted export leaves no half-written `--out` (`diff_jax.output_dir`). An existing non-empty
`--out` is replaced only with `overwrite=True`, only when it holds a previous export (its
`export.json`), and not while it holds `eval/` (what `eval.py checkpoint=EXPORT` writes there)
or anything else no export writes (`EXPORT_FILES`), e.g. another export nested in it, which
replacing would delete.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from diff_jax import checkpoint
from diff_jax.command import finish_first
from diff_jax.config import ModelConfig, is_blank_path
from diff_jax.export import hf
from diff_jax.export.errors import ExportError
from diff_jax.export.safetensors_io import write_safetensors
from diff_jax.export.sources import (CHECKSUMS_FILE, CONFIG_FILE, EVAL_DIR, EXPORT_MARKER,
                                     PARAMS_DIR, SAFETENSORS_FILE, Source, read_source)
from diff_jax.export.state_dict import to_state_dict
from diff_jax.data.sources import DataError
from diff_jax.data.tokenizer import encoding, mismatch
from diff_jax.export.tokenizer import TOKENIZER_FILES, max_token_id, write_tokenizer
from diff_jax.output_dir import refusal, staged

FORMATS = ("safetensors", "orbax-params", "hf-diffllama")
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _cast(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).astype(DTYPES[dtype]) for k, v in tensors.items()}


def _config_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2)


def _write_checksums(out: Path, stored: Any) -> None:
    """The checksums of the arrays as stored (cast) and of `config.json` and `export.json` as
    written (their JSON's `checkpoint.json_bytes`, each under its file's stem, after their last
    change: the tokenizer's eos_token_id), committed with them by the export's rename."""
    written = [checkpoint.json_bytes(json.loads((out / name).read_text()), Path(name).stem)
               for name in (CONFIG_FILE, EXPORT_MARKER)]
    record = checkpoint.checksums_record(stored, *written)
    (out / CHECKSUMS_FILE).write_text(json.dumps(record, indent=1))


def _write_model_safetensors(out: Path, tensors: dict[str, np.ndarray], config: ModelConfig) -> None:
    write_safetensors(out / SAFETENSORS_FILE, tensors,
                      {"format": "pt", "model_config": json.dumps(dataclasses.asdict(config))})


def _write_safetensors(out: Path, source: Source, dtype: str) -> Any:
    tensors = _cast(to_state_dict(source.params, source.config), dtype)
    _write_model_safetensors(out, tensors, source.config)
    (out / CONFIG_FILE).write_text(_config_json(source.config))
    return tensors


def _write_orbax_params(out: Path, source: Source, dtype: str) -> Any:
    params = jax.tree.map(lambda x: np.asarray(x).astype(DTYPES[dtype]), source.params)
    # orbax's writer threads go on after a Ctrl-C: let them finish before `staged` removes `out`
    with finish_first("the parameters' write"), ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save((out / PARAMS_DIR).resolve(), params)
    (out / CONFIG_FILE).write_text(_config_json(source.config))
    return params


def _write_hf_diffllama(out: Path, source: Source, dtype: str) -> Any:
    state_dict = to_state_dict(source.params, source.config)
    tensors = _cast(hf.hf_state_dict(state_dict, source.config), dtype)
    _write_model_safetensors(out, tensors, source.config)
    (out / CONFIG_FILE).write_text(json.dumps(hf.hf_config(source.config, dtype), indent=2))
    return tensors


# Every entry an export of any format holds: what replacing one with --overwrite may delete.
EXPORT_FILES = frozenset({EXPORT_MARKER, CONFIG_FILE, SAFETENSORS_FILE, PARAMS_DIR,
                          CHECKSUMS_FILE, *TOKENIZER_FILES})

# Each writes the stored arrays and config.json, and returns the arrays as stored (`_write_checksums`).
_WRITERS: dict[str, Callable[[Path, Source, str], Any]] = {
    "safetensors": _write_safetensors,
    "orbax-params": _write_orbax_params,
    "hf-diffllama": _write_hf_diffllama,
}


def _check_tokenizer(name: str, loaded: Source, where: str) -> None:
    """Refuse a tokenizer whose ids do not all fit the model's vocabulary, or that is not the
    one the parameters were trained with where `loaded` records it (`Source.trained_tokenizer`:
    a tokenizer.json edited since, or another tokenizer, would be written beside them; checked
    first, since the message names the one to pass); `where`: how the tokenizer was chosen, for
    the message."""
    if name == "none":
        return
    try:
        top = max_token_id(name)
    except ExportError as e:  # it names --tokenizer, which a run's data.tokenizer was not given as
        raise ExportError(f"{where}: {str(e).split(': ', 1)[-1]}") from e
    if loaded.trained_tokenizer is not None:
        problem = mismatch(loaded.trained_tokenizer, encoding(name), loaded.origin, "trained",
                           key="--tokenizer")
        if problem is not None:
            raise ExportError(f"{where}: {problem}, or --tokenizer none to export without one")
    if top >= loaded.config.vocab_size:
        raise ExportError(f"{where}: its ids reach {top} but model.vocab_size is "
                          f"{loaded.config.vocab_size}; pass --tokenizer none to export without "
                          "one")


def _default_tokenizer(loaded: Source) -> tuple[str, str, str | None]:
    """(the tokenizer an hf-diffllama export of `loaded` writes without --tokenizer, how it was
    chosen for `_check_tokenizer`'s messages, a note saying why it is "none", else None): the
    run's data.tokenizer (`Source.tokenizer`); for a source that names none (an import), the
    tokenizer the parameters were trained with (`Source.trained_tokenizer`) where it is there
    and unchanged (`tokenizer.mismatch`), else "none", the note saying why and what to pass."""
    if loaded.tokenizer is not None:
        return (loaded.tokenizer, f"data.tokenizer={loaded.tokenizer} (the run's, the default "
                "--tokenizer)", None)
    record = loaded.trained_tokenizer
    if record is None:
        return "none", "", (f"note: no tokenizer files written: {loaded.origin} records no "
                            "tokenizer (no run's data.tokenizer, none it was trained with); pass "
                            "--tokenizer with the one it was trained with")
    name = record["tokenizer"]
    try:
        problem = mismatch(record, encoding(name), loaded.origin, "trained", key="--tokenizer")
    except DataError as e:  # gone, or no longer a tokenizer: the message's first part says which
        why = str(e).split(": ", 1)[-1].split("; ")[0]
        problem = (f"{loaded.origin} was trained with the tokenizer {name}, which cannot be read "
                   f"now ({why}); set --tokenizer to that tokenizer.json")
    if problem is None:
        return name, f"--tokenizer {name} (the one it was trained with, the default)", None
    return "none", "", ("note: no tokenizer files written (by default --tokenizer is the "
                        f"tokenizer the parameters were trained with): {problem}")


def _add_tokenizer(out: Path, name: str, config: ModelConfig) -> None:
    """Tokenizer files for `name`, and its end-of-text id as the config's eos_token_id."""
    eos = write_tokenizer(out, name, config.max_seq_len)
    hf_config = json.loads((out / CONFIG_FILE).read_text())
    hf_config["eos_token_id"] = eos
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))


def _is_checkpoints_dir(path: Path) -> bool:
    """Whether `path` is a run's checkpoints directory: beside the run's config.yaml, or holding
    a step (a directory named by its number)."""
    return path.name == "checkpoints" and path.is_dir() and (
        (path.parent / "config.yaml").is_file()
        or any(c.name.isdigit() and c.is_dir() for c in path.iterdir()))


def _check_destination(out: Path, source: Path, overwrite: bool) -> None:
    resolved = out.resolve()
    if resolved == source.resolve() or resolved in source.resolve().parents:
        raise ExportError(f"--out {out}: contains the source {source}; choose another directory")
    inside = next((a for a in resolved.parents if _is_checkpoints_dir(a)), None)
    if inside is not None:  # RUN/checkpoints/3 would read as the run's newest (partial) step
        raise ExportError(f"--out {out}: is inside the run's checkpoints directory {inside}, where "
                          "the run's readers take it for a step; choose another directory")
    if overwrite and (out / EXPORT_MARKER).is_file() and (out / EVAL_DIR).exists():
        raise ExportError(f"--out {out}: holds {out / EVAL_DIR} (eval.py results of the export "
                          "it would replace); move or delete it first, or choose another --out")
    problem = refusal(out, overwrite, EXPORT_MARKER, "a diff_jax export", EXPORT_FILES)
    if problem is not None:
        raise ExportError(f"--out {out}: {problem}")


def export(source: str | Path | Source, out: str | Path, fmt: str = "safetensors", *,
           dtype: str = "float32", overwrite: bool = False,
           tokenizer: str | None = None) -> Path:
    """Export the model at `source` (run, checkpoint or export directory, or a `Source` already
    read, e.g. by `diff_jax.export.hf_import`) to `out` in `fmt`.

    `dtype` is the storage dtype of every tensor (`float32` or `bfloat16`). `tokenizer`
    (hf-diffllama only): the tokenizer whose Hugging Face tokenizer files are written beside
    the model (`diff_jax.export.tokenizer`: a tiktoken encoding's built, a tokenizer.json
    copied), or "none"; None: the source's
    `data.tokenizer` (`Source.tokenizer`), else (an import) the tokenizer it was trained with,
    where that is there and unchanged, else "none" with a printed note (`_default_tokenizer`).
    Returns `out`.
    """
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: must be one of {list(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: must be one of {list(DTYPES)}")
    if tokenizer not in (None, "none") and fmt != "hf-diffllama":
        raise ExportError(f"--tokenizer {tokenizer}: only --format hf-diffllama writes tokenizer "
                          f"files, not {fmt}; leave --tokenizer out")
    for flag, value, expected in (("source", source, "a run, checkpoint or export directory"),
                                  ("--out", out, "the export directory to write")):
        if isinstance(value, str) and is_blank_path(value):  # Path("") is the working directory
            raise ExportError(f"{flag} {value!r}: empty; name {expected}")
    given = source if isinstance(source, Source) else None
    source, out = Path(given.origin if given else source), Path(out)
    _check_destination(out, source, overwrite)
    loaded = given or read_source(source)
    name, note = "none", None
    if fmt == "hf-diffllama":
        hf.check_mappable(loaded.config)
        name, where, note = ((tokenizer, f"--tokenizer {tokenizer}", None)
                             if tokenizer is not None else _default_tokenizer(loaded))
        _check_tokenizer(name, loaded, where)
    with staged(out) as tmp:
        stored = _WRITERS[fmt](tmp, loaded, dtype)
        if fmt == "hf-diffllama" and name != "none":
            _add_tokenizer(tmp, name, loaded.config)
        info: dict[str, Any] = {"format": fmt, "dtype": dtype, "source": loaded.origin,
                                "step": loaded.step, "tokenizer": loaded.tokenizer,
                                "run": loaded.run, "trained_tokenizer": loaded.trained_tokenizer}
        (tmp / EXPORT_MARKER).write_text(json.dumps(info, indent=2))
        _write_checksums(tmp, stored)
    if note is not None:
        print(note)
    return out
