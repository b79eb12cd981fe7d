"""Checkpoints with orbax: train state, data-iterator state, the resolved config, the training
split's fingerprint with its tokenizer, and their checksums, saved async.

Layout: `<train.run_dir>/checkpoints/<step>/{state,data_iter,config,checksums,training_data}`
(`training_data`: `TokenCorpus.fingerprint` of the split the data position counts rows of, with
the `tokenizer.identity` of `data.tokenizer`, which eval and export read text with; steps saved
before diff-jax recorded it have none, and a resume then compares nothing; those saved before
its tokenizer keys, or their checksum, compare what they hold). Orbax commits a
step atomically (a step directory appears only once every item is complete), so a crash mid-save
leaves the last good checkpoint as the latest, and the checksums are committed with the arrays
they describe. The state is restored onto whatever mesh is live: the restore target carries the
new shardings. A checkpoint whose parameter shapes disagree with the config is refused before
anything is read, naming the parameter.

Integrity: `checksums` holds a 64-bit checksum of every array's bytes, of every process's
data position (`_data_positions`) and of the config's JSON (`json_bytes`), computed when the
step is saved; every restore recomputes it over what was read and refuses a mismatch
(`DamagedCheckpointError`, naming the step and the array or item). The checksum is a jitted
reduction over the logical array, so on a multi-host mesh each process hashes only the shards it
holds and the partial sums are combined by one all-reduce: no process reads an array it does not
own, and the checksum does not depend on the mesh it is computed on (a restore onto another mesh
verifies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from diff_jax.config import CheckpointConfig, Config, ConfigError, ModelConfig, from_dict
from diff_jax.device_memory import devices_here, fit_or_explain, out_of_memory_in
from diff_jax.error_text import chain, first_line
from diff_jax.file_errors import naming
from diff_jax.output_dir import write_whole
from diff_jax.transformer import LAYERS, in_layout, in_layout_placed

CHECKSUM_ALGORITHM = "fmix32-sum-x2"  # recorded with the checksums: what `array_checksums` computes
DAMAGED_DIR = "damaged_checkpoints"  # beside checkpoints/: where a resume sets damaged steps aside
# Beside checkpoints/ while `checkpoint.discard_later` deletes the steps after the one it holds,
# so that deletion, interrupted, is finished by the next resume before it picks a step.
DISCARD_FILE = "discarding_after"

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint does not match the model the config describes, or cannot be used as asked."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's bytes cannot be read or do not match the checksums recorded at save time."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


# How a read fails, by its index, which the processes agree on (`_read_errors`): damage to the
# step's bytes, or out of memory, which says nothing of the step: the devices' (XLA's error, which
# `device_memory.fit_or_explain` reports) or the host's, raised as that error again
READ_FAILURES: tuple[type[Exception], ...] = (DamagedCheckpointError, jax.errors.JaxRuntimeError,
                                              MemoryError)
DAMAGE = 0
TRAINING_DATA = "training_data"  # the item and its checksum's name


def _items(state: ocp.CheckpointHandler) -> dict[str, Any]:
    """The handler of each item of a step (`state`'s differs: whole restores or partial reads)."""
    return {"state": state,
            "data_iter": grain.checkpoint.CheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
            "checksums": ocp.JsonCheckpointHandler(),
            TRAINING_DATA: ocp.JsonCheckpointHandler()}


def manager(run_dir: str | Path, cfg: CheckpointConfig) -> ocp.CheckpointManager:
    """The run's read-write checkpoint manager (`<run_dir>/checkpoints`); `OSError` naming that
    directory when a step cannot be made in it (read-only), found before any step is trained:
    orbax's async save reports it at the first save only as a coordination timeout, minutes on."""
    directory = Path(run_dir).resolve() / "checkpoints"
    probe = directory / f".writable-{jax.process_index()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise naming(e, directory) from e
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True,
                                           enable_async_checkpointing=cfg.async_save)
    return ocp.CheckpointManager(directory, options=options,
                                 item_handlers=_items(ocp.StandardCheckpointHandler()))


def committed_steps(run_dir: str | Path) -> list[int]:
    """The steps orbax has committed in `<run_dir>/checkpoints` (directories named by their
    step; one still being written is `N.orbax-checkpoint-tmp`), sorted; [] when there are none
    (or no such directory). No checkpoint is read or verified."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


# ---------------------------------------------------------------------------------------------
# Checksums


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 that mixes every bit into every bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The array's bytes as uint32 words, same leading shape (8-byte types gain a trailing 2)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)


def _array_checksum(x: jax.Array) -> jax.Array:
    """(2,) uint32: two independently seeded sums of fmix32(word ^ fmix32(position·φ + seed)).

    Changing any single word always changes both sums (fmix32 is a bijection); other changes go
    unnoticed with probability about 2^-64. Sums are order-free, so any sharding gives the same
    value and each device only hashes what it holds.
    """
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):  # row-major position without reshaping a sharded array
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride)
        stride = (stride * w.shape[axis]) % 2**32
    sums = [jnp.sum(_fmix32(w ^ _fmix32(index * jnp.uint32(0x9E3779B9) + jnp.uint32(seed))),
                    dtype=jnp.uint32) for seed in (0x243F6A88, 0x85A308D3)]
    return jnp.stack(sums)


_checksum = jax.jit(_array_checksum)  # per array: compiled once per (shape, dtype, sharding)


def _leaf_name(path: tuple) -> str:
    """`params/layers_0/attn/wq` for a key path, the same for attribute, dict and sequence keys."""
    parts = [getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))) for k in path]
    return "/".join(str(p) for p in parts)


def array_checksums(tree: Any) -> dict[str, str]:
    """{leaf name: 16 hex digits} for every array of `tree` (jax or numpy, sharded or not).

    All processes of a multi-host run must call it together (each array's checksum is a jitted
    reduction, one all-reduce across its devices). The arrays are summed one at a time: many
    collective programs in flight at once can deadlock XLA's CPU collectives.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    with jax.set_mesh(None):  # each array's own devices decide, not a caller's context mesh
        sums = [jax.device_get(_checksum(x)) for _, x in leaves]
    return {_leaf_name(path): "".join(f"{int(v):08x}" for v in np.asarray(value))
            for (path, _), value in zip(leaves, sums)}


def verify_checksums(tree: Any, recorded: dict[str, str], step: int | None, where: Path,
                     hint: str = "") -> None:
    """Raise `DamagedCheckpointError` naming the first array of `tree` whose checksum differs from
    `recorded` (or has none), followed by `hint` (the other steps); `step` None names an
    export."""
    what = f"checkpoint step {step}" if step is not None else f"export {where.parent}"
    for name, value in array_checksums(tree).items():
        if name not in recorded:
            raise DamagedCheckpointError(step, f"{what} is damaged: {where} has no recorded "
                                               f"checksum for {name}{hint}")
        if recorded[name] != value:
            raise DamagedCheckpointError(
                step, f"{what} is damaged: {name} read from {where} does not match the checksum "
                      f"recorded when it was saved ({value} != {recorded[name]}){hint}")


def checksums_record(*trees: Any) -> dict[str, Any]:
    """What is saved beside the arrays of `trees`: the algorithm and their `array_checksums`
    (the trees' leaf names must differ)."""
    arrays = {name: value for tree in trees for name, value in array_checksums(tree).items()}
    return {"algorithm": CHECKSUM_ALGORITHM, "arrays": arrays}


def recorded_checksums(saved: Any, step: int | None, where: Path) -> dict[str, str] | None:
    """The `arrays` of a `checksums_record`; None (with a warning) when `saved` is None, i.e. the
    checkpoint predates checksums; `DamagedCheckpointError` when the record is unreadable."""
    if saved is None:
        log.warning("%s has no recorded checksums (written before diff-jax recorded them): its "
                    "bytes are not verified", where)
        return None
    if (not isinstance(saved, dict) or saved.get("algorithm") != CHECKSUM_ALGORITHM
            or not isinstance(saved.get("arrays"), dict)):
        raise DamagedCheckpointError(step, f"{where}: the checksums record is damaged or of an "
                                           f"unknown kind (expected {CHECKSUM_ALGORITHM})")
    return saved["arrays"]


# ---------------------------------------------------------------------------------------------
# Save and restore for training


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_iter: grain.DatasetIterator,
         config: Config, training_data: dict[str, Any]) -> None:
    """Start saving `step` with its checksums (the state's, the data positions', the config's
    and `training_data`'s) and `training_data` (the training split's `TokenCorpus.fingerprint`
    and its tokenizer's `identity`), async when
    configured; the checksums are computed now, before `state` can be donated. `wait(mngr)`
    before exit. When this save, or the async one before it, fails: `OSError` naming the step's
    directory (`_write_errors`)."""
    saved_config = config.to_dict()
    with _write_errors(mngr):
        mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data_iter=grain.checkpoint.CheckpointSave(data_iter),
            config=ocp.args.JsonSave(saved_config),
            checksums=ocp.args.JsonSave(checksums_record(
                state, _data_positions(data_iter), json_bytes(saved_config),
                json_bytes(training_data, TRAINING_DATA))),
            **{TRAINING_DATA: ocp.args.JsonSave(training_data)},
        ), force=True)


def wait(mngr: ocp.CheckpointManager) -> None:
    """Block until the async save in flight has committed; `OSError` when it failed."""
    with _write_errors(mngr):
        mngr.wait_until_finished()


def check_saves(mngr: ocp.CheckpointManager) -> None:
    """`OSError` when an async save has failed since the last check (without waiting for one
    in flight): a training loop calls it every step, so a full disk stops the run at
    the step after the failure, not at the next save."""
    with _write_errors(mngr):
        mngr.check_for_errors()


@contextlib.contextmanager
def _write_errors(mngr: ocp.CheckpointManager) -> Iterator[None]:
    """A failed write, which orbax raises from `save`, `check_for_errors` or
    `wait_until_finished` -> an `OSError` naming the step's temporary directory and the
    operating system's reason (tensorstore raises ValueErrors that carry the errno as
    `[os_error_code='28']`; an OSError passes as it is), or a one-line `CheckpointError` when the
    error gives no errno. A step is committed by renaming its finished temporary directory, so
    the steps before it are intact and a re-run resumes from the newest. What the failed save's
    abandoned writes raise where nobody catches it is dropped (`_drop_abandoned_io_noise`)."""
    _drop_abandoned_io_noise()
    try:  # only orbax calls run inside: none raises a CheckpointError of ours
        yield
    except OSError:
        raise
    except Exception as e:
        directory = Path(mngr.directory)
        errors = chain(e)
        text = " ".join(str(x) for x in errors)
        step = re.search(re.escape(str(directory)) + r"/(\d+\.orbax-checkpoint-tmp)", text)
        where = directory / step.group(1) if step else directory
        code = re.search(r"os_error_code='(\d+)'", text)
        if code:
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(where)) from e
        raise CheckpointError(f"cannot save a checkpoint in {where}: "
                              f"{type(errors[-1]).__name__}: {first_line(errors[-1])}") from e


def quiet_abandoned_io() -> None:
    """Silence what a failed checkpoint read's or write's abandoned operations print while the
    process exits; a command calls it before printing its one error line, which then stays the
    last. When one tensorstore read or write fails, orbax closes the event loop the others were
    awaited on, and as each of those finishes (during the exit) tensorstore's callback meets the
    closed loop, the coroutines left pending warn that they were never awaited, and asyncio logs
    each future's exception again: screens of tracebacks interleaved with, and after, the error
    line (`eval.py` on a damaged checkpoint: 25-91 lines after it in 3 runs of 4). Those
    (`_drop_abandoned_io_noise`'s) and the never-awaited warnings are dropped; every other
    unraisable exception and warning still prints. Process-wide: for a command that is about to
    exit."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
    _drop_abandoned_io_noise()


def _abandoned_io_noise(unraisable: Any) -> bool:
    """Whether an unraisable exception is what an abandoned orbax operation raises where nobody
    can catch it: tensorstore's callback meeting the event loop orbax closed after the first
    failure (`RuntimeError: Event loop is closed`), or an orbax coroutine that failed as it was
    discarded (`Exception ignored in: <coroutine object _read_array_index_and_device_put>`)."""
    error, source = unraisable.exc_value, getattr(unraisable, "object", None)
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    return (inspect.iscoroutine(source)
            and f"{os.sep}orbax{os.sep}" in source.cr_code.co_filename)


def _drop_abandoned_io_noise() -> None:
    """From now on, drop the unraisable exceptions of `_abandoned_io_noise` (others still reach
    the hook that was there). Called before every checkpoint read (`_read_errors`): a resume
    that skips a damaged step goes on training, and the abandoned reads of that step printed
    thousands of lines of tracebacks before its `skipped` line. And before every save
    (`_write_errors`): a failed save's abandoned writes print from the moment the first write
    fails, often before the training loop learns of it, and a traceback a tensorstore thread
    was still printing when `quiet_abandoned_io` replaced the hook went on after the error
    line (1 run of 22 under a 64 KB file-size limit). Process-wide and idempotent."""
    if getattr(sys.unraisablehook, "drops_abandoned_io", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _abandoned_io_noise(unraisable):
            previous(unraisable)

    hook.drops_abandoned_io = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _not_an_interrupt(record: logging.LogRecord) -> bool:
    """False for a log record that reports a KeyboardInterrupt (`quiet_interrupts`)."""
    return record.exc_info is None or not isinstance(record.exc_info[1], KeyboardInterrupt)


@contextlib.contextmanager
def quiet_interrupts() -> Iterator[None]:
    """For the duration, orbax logs no KeyboardInterrupt: a second Ctrl-C that lands while
    `wait_until_finished` joins its save-finalize thread is logged by orbax as an ERROR with
    its traceback ("Save Finalize thread ... failed") before it propagates, though the save
    still commits; the command's own `interrupted:` line says what happened. Every other record,
    an error's too, still prints."""
    absl = logging.getLogger("absl")
    absl.addFilter(_not_an_interrupt)
    try:
        yield
    finally:
        absl.removeFilter(_not_an_interrupt)


def tree_shapes(params: Any) -> dict[str, tuple[int, ...]]:
    """{"params['layers_0']['attn']…": shape} of every leaf of a parameter tree (arrays,
    ShapeDtypeStructs or orbax metadata), in tree order: the names `check_shapes` reports."""
    return {"params" + jax.tree_util.keystr(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def check_shapes(found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]],
                 prefix: str, error: type[Exception] = CheckpointError) -> None:
    """Raise `error` naming the first entry of `expected` that `found` lacks, then the first entry
    of `found` that `expected` lacks, then the first whose shape differs; each message starts
    with `prefix` (e.g. "checkpoint " or "DIR/model.safetensors: ") and the entry's name.

    The one shape check of stored parameters against a config: training checkpoints
    (`tree_shapes`) and exported state dicts (`diff_jax.export.state_dict` names) alike.
    """
    missing = [k for k in expected if k not in found]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise error(f"{prefix}{missing[0]} is missing (the config gives shape "
                    f"{tuple(expected[missing[0]])}){more}; it was written for another model or "
                    "is incomplete")
    extra = sorted(k for k in found if k not in expected)
    if extra:
        raise error(f"{prefix}{extra[0]} is not part of the model the config describes "
                    f"({len(extra)} unexpected in all); it was written for another model")
    for k, shape in expected.items():
        if tuple(found[k]) != tuple(shape):
            raise error(f"{prefix}{k} has shape {tuple(found[k])} but the config gives "
                        f"{tuple(shape)}; it was written for another model config")


def check_optimizer_state(saved: Any, expected: Any, step: int) -> None:
    """Raise `CheckpointError` unless the optimizer state saved at `step` (orbax metadata) has
    the arrays, by path and shape, of the one the config's optimizer keeps (`expected`): a
    checkpoint written with other `optim.*` settings is refused as such before anything is
    read, not reported as damaged when the read fails."""
    found = {_leaf_name(path): tuple(leaf.shape)
             for path, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]}
    wanted = {_leaf_name(path): tuple(leaf.shape)
              for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]}
    if found == wanted:
        return
    first = next((f"{k} is not saved" for k in wanted if k not in found), None) or next(
        (f"{k} is saved but not kept" for k in found if k not in wanted), None) or next(
        f"{k} has shape {found[k]}, not {wanted[k]}" for k in wanted if found[k] != wanted[k])
    raise CheckpointError(f"checkpoint step {step} holds another optimizer state than optim.* "
                          f"gives (first difference: opt_state/{first}); it was written with other "
                          "optimizer settings (optim.clip_norm > 0 adds a clipping stage that "
                          "optim.clip_norm=0 has not)")


def restore(mngr: ocp.CheckpointManager, step: int, target: Any,
            data_iter: grain.DatasetIterator, model: ModelConfig) -> tuple[Any, dict[str, Any]]:
    """(state, {"config": the config dict it was saved with, "training_data": the fingerprint
    it was saved with, or None for a step that predates it}): restore `step` onto the
    shardings in `target` (ShapeDtypeStructs) and verify its checksums; sets `data_iter`'s state.
    A step saved with its layers in the other layout (`model.scan_layers`) is read in that one,
    verified, and its parameters and optimizer state stacked or sliced onto `target` on the
    devices, one parameter at a time (`in_layout_placed`; out of device memory there, a
    `DeviceMemoryError` that names the saved layout). `DamagedCheckpointError` when it
    cannot be read or does not verify; `CheckpointError` when
    it was written for another model than `model` (shapes, or `ModelConfig.difference`) or
    another optimizer. Read through a `_reader`, so that every process of a job reaches the
    same verdict on every read (`_read_errors`)."""
    where = Path(mngr.directory) / str(step)
    with _reader(Path(mngr.directory).parent, ocp.StandardCheckpointHandler()) as reader:
        _check_readable(step, where)
        fields = tuple(f.name for f in dataclasses.fields(target))  # all of them are read
        metadata = _state_metadata(reader, step, where, fields)
        # the layout it was saved in: the optimizer state holds the parameters' tree again
        layout = dataclasses.replace(model, scan_layers=LAYERS in metadata["params"])
        read = target if layout == model else in_layout(target, layout)
        try:
            check_shapes(tree_shapes(metadata["params"]), tree_shapes(read.params), "checkpoint ")
            check_optimizer_state(metadata["opt_state"], read.opt_state, step)
        except CheckpointError as e:  # most often an override the first invocation had
            raise _as_configured(mngr, e) from e
        _check_process_count(step, where / "data_iter")
        # the config first (read and verified as eval and export will: it must parse), so that a
        # step of another model of the same shapes is refused before its arrays are read
        recorded = _read_checksums(reader, step, where)
        config = _read_config(reader, step, where, recorded)
        try:
            saved = from_dict(config).model
        except ConfigError:  # a config of an older diff-jax: its shapes were checked above
            saved = None
        differs = None if saved is None else model.difference(saved)
        if differs is not None:  # same shapes, another function: λ_init, RoPE θ, the heads' split…
            key, theirs, ours = differs
            raise _as_configured(mngr, CheckpointError(
                f"checkpoint step {step} was trained with {key}={theirs} but the config gives "
                f"{ours}; a run resumes with the model it was trained with"))
        items = {"state": ocp.args.StandardRestore(read),
                 "data_iter": grain.checkpoint.CheckpointRestore(data_iter)}
        restored = _restore_items(reader, step, where, items)
        training_data = _read_training_data(reader, step, where, recorded)
        if recorded is not None:
            verify_checksums(restored["state"], recorded, step, where / "state")
            if any(name.startswith("data_iter/") for name in recorded):  # else it predates them
                verify_checksums(_data_positions(data_iter), recorded, step, where)
        _check_step(restored["state"].step, step, where)
        state = restored["state"]
        if read is not target:
            saved_as = str(layout.scan_layers).lower()
            with fit_or_explain(
                    f"converting checkpoint step {step} from model.scan_layers={saved_as} to "
                    f"{str(model.scan_layers).lower()} holds its state and one parameter's "
                    f"layers more on {devices_here()}; resume with model.scan_layers={saved_as} "
                    "(the layout it was saved in) or shard the parameters and optimizer state "
                    "over more devices (mesh.fsdp)"):
                state = in_layout_placed(state, model, jax.tree.map(lambda x: x.sharding, target))
        return state, {"config": config, "training_data": training_data}


def _data_positions(data_iter: grain.DatasetIterator) -> dict[str, Any]:
    """{"data_iter": {"process_I-of-N.json": state}}: every process's data-iterator state (its
    `next_index`), named by the file grain writes it to, gathered onto every process (all call
    it together), which the checksums record covers beside the arrays: grain's JSON has no
    checksum of its own, so a digit changed in it (`20` to `21` is one bit) still read, and the
    run resumed at another data position without a word. Gathered, it is verified against the
    record (written by process 0) alike on every process, which so reach one verdict."""
    state, n = data_iter.get_state(), jax.process_count()
    if n == 1:
        states = [state]
    else:
        from jax.experimental import multihost_utils

        gathered = multihost_utils.process_allgather(state)
        states = [jax.tree.map(lambda x, i=i: x[i], gathered) for i in range(n)]
    return {"data_iter": {f"process_{i}-of-{n}.json": s for i, s in enumerate(states)}}


def json_bytes(value: Any, name: str = "config") -> dict[str, np.ndarray]:
    """{name: the UTF-8 bytes of `value`'s canonical JSON}, which the checksums record covers
    beside the arrays. JSON files have no checksum of their own, so a digit changed in one was
    read as written: in a step's `config` item (`"num_layers": 2` to 3, a learning rate) by
    resume, eval and export alike, and in an export's `config.json` and `export.json` (whose
    `run` section decides which documents eval.py holds out) by everything that loads the export
    (`diff_jax.export.sources`). Canonical (keys sorted, no spaces) so that the dict written
    (`Config.to_dict` when the step is saved) and the one read back (`json.loads`, as orbax's
    `JsonCheckpointHandler` does) are the same bytes: key order is the file's, a tuple comes back
    as a list (both written `[…]`), and a float is written as its shortest repr, which reads back
    as the same float."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return {name: np.frombuffer(text.encode(), np.uint8)}


def _check_step(saved: jax.Array | np.ndarray, step: int, where: Path, hint: str = "") -> None:
    """`DamagedCheckpointError` unless the step counter `saved` in the state read from `where`
    is `step`, the step its directory is named by (a directory copied or renamed: resumed as
    step N, it trained on from another step's state, data position and learning rate; evaluated
    or exported, it was reported as step N). Resume, eval and export all check it here."""
    if isinstance(saved, jax.Array):  # replicated: every shard holds it
        saved = saved.addressable_data(0)
    held = int(np.asarray(saved))
    if held != step:
        raise DamagedCheckpointError(step, f"checkpoint step {step} is damaged: {where / 'state'} "
                                           f"holds the train state of step {held}{hint}")


def _as_configured(mngr: ocp.CheckpointManager, error: CheckpointError) -> CheckpointError:
    """`error` followed by the command that resumes the run as its `config.yaml` records it:
    `python -m diff_jax.train`, which runs from a clone's root and where diff-jax is installed
    alike (a clone's `python train.py` is no file where the package alone is installed, nor in
    any directory but the clone's root)."""
    run_dir = Path(mngr.directory).parent  # config.yaml names the directory the run was
    # trained in: another one when the run has been moved or copied since
    return CheckpointError(f"{error} (to resume this run as it was configured: python -m "
                           f"diff_jax.train --config {run_dir / 'config.yaml'} "
                           f"train.run_dir={run_dir})")


def _check_process_count(step: int, data_iter_dir: Path) -> None:
    """`CheckpointError` when `step`'s data-iterator item (`data_iter_dir`, one
    `process_I-of-N.json` per process) was saved by another number of processes than this run
    has: each process's data position counts in its own slice of the documents, so the step is
    intact but resumes only with N processes (it is not damage, to be set aside)."""
    counts = {int(m.group(1)) for f in data_iter_dir.glob("process_*-of-*.json")
              if (m := re.fullmatch(r"process_\d+-of-(\d+)\.json", f.name))}
    if counts and jax.process_count() not in counts:
        n = max(counts)
        raise CheckpointError(f"checkpoint step {step} was saved by {n} processes ({data_iter_dir} "
                              f"holds each one's data position) and this run has "
                              f"{jax.process_count()}: resume it with {n} processes "
                              f"(distributed.num_processes={n}); the devices per process and the "
                              "mesh may differ")


def _check_readable(step: int, where: Path) -> None:
    """`CheckpointError` naming the first file or directory of `step` (at `where`) that this
    process may not read: a permission says nothing of the bytes, so the step is refused as it
    is (not reported as damaged, set aside and passed over for an older one)."""
    for path in [where, *where.rglob("*")]:
        try:
            if path.is_dir():
                os.listdir(path)
            elif path.is_file():
                with open(path, "rb"):
                    pass
        except PermissionError as e:
            raise CheckpointError(f"checkpoint step {step} cannot be read: {path}: {e.strerror} "
                                  "(a permission, not damage: the step is left as it is; give "
                                  "this user read access to it)") from e


def _agree(error: str | None, kind: int = DAMAGE) -> tuple[int, int, str] | None:
    """None on every process when `error` (this process's failure, None: none) is None on every
    process; else, on every process, (the first process that failed, its `kind`: `DAMAGE` or
    what `_read_errors` raises instead, its `error`): gathered from it, so that every process
    reports what the failing one saw (process 0, the one that prints, said only "another
    process cannot read …/6/state", and the failing process, which printed nothing, knew which
    file and why). One all-gather of the errors' lengths and kinds, and one of their bytes when
    any failed (every process sees the same lengths, so all take it or none does); with one
    process, `error` itself."""
    if jax.process_count() == 1:
        return None if error is None else (0, kind, error)
    from jax.experimental import multihost_utils

    text = (error or "").encode()
    heads = multihost_utils.process_allgather(
        np.array([-1 if error is None else len(text), kind], np.int32))
    lengths = heads[:, 0]
    failed = [p for p, n in enumerate(lengths) if n >= 0]
    if not failed:
        return None
    width = max(1, int(lengths.max()))
    texts = multihost_utils.process_allgather(np.frombuffer(text.ljust(width, b"\0"), np.uint8))
    first = failed[0]
    return first, int(heads[first, 1]), bytes(texts[first][:lengths[first]]).decode()


def _set_aside(mngr: ocp.CheckpointManager, step: int) -> Path:
    """Move a damaged `step` to `<run_dir>/damaged_checkpoints/` (process 0), keeping its bytes."""
    src = Path(mngr.directory) / str(step)
    dst_dir = Path(mngr.directory).parent / DAMAGED_DIR
    dst, n = dst_dir / str(step), 1
    while dst.exists():
        dst, n = dst_dir / f"{step}.{n}", n + 1
    if jax.process_index() == 0:
        dst_dir.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dst))
    _sync("diff_jax_set_aside")
    mngr.reload()
    return dst


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _discard_after(mngr: ocp.CheckpointManager, step: int) -> None:
    """Delete every step after `step`, recording `step` in `<run_dir>/discarding_after` until
    all are gone: a run killed part-way leaves the record, and its next resume finishes the
    deletion (`_finish_discard`) instead of resuming from a step that was to be discarded."""
    journal = Path(mngr.directory).parent / DISCARD_FILE
    if jax.process_index() == 0:
        write_whole(journal, f"{step}\n")
    _sync("diff_jax_discard_recorded")
    for s in sorted(mngr.all_steps(), reverse=True):
        if s > step:
            mngr.delete(s)
    _sync("diff_jax_discarded")
    if jax.process_index() == 0:
        journal.unlink()
    _sync("diff_jax_discard_done")
    mngr.reload()


def _finish_discard(mngr: ocp.CheckpointManager, say: Callable[[str], None]) -> None:
    """Finish a `checkpoint.discard_later` deletion that a kill or crash interrupted."""
    journal = Path(mngr.directory).parent / DISCARD_FILE
    if not journal.is_file():
        return
    text = journal.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{journal}: expected the step number an interrupted "
                              f"checkpoint.discard_later=true deletes after, found {text[:40]!r}; "
                              "delete the file once the checkpoints are as you want them")
    step = int(text)
    later = [s for s in sorted(mngr.all_steps()) if s > step]
    _discard_after(mngr, step)
    say(f"deleted checkpoints {later}: finishing checkpoint.discard_later=true after step {step}, "
        "which an earlier run began and did not complete")


def resume(mngr: ocp.CheckpointManager, cfg: CheckpointConfig, target: Any,
           data_iter: grain.DatasetIterator, model: ModelConfig,
           say: Callable[[str], None]) -> tuple[int | None, Any, dict[str, Any] | None]:
    """(step, state, what that step was saved with: `restore`'s dict) to continue from, or
    (None, None, None) when the run has no checkpoint; a step written for another model than
    `model` is refused (`restore`) before anything is deleted or set aside.

    With `cfg.resume_step` unset: the newest step that reads and verifies; each damaged newer step
    is reported through `say` and moved to `<run_dir>/damaged_checkpoints/` (when no step verifies,
    nothing is moved and `CheckpointError` says why). With it set: that step, which must verify;
    later steps are deleted only with `cfg.discard_later`, else refused (a deletion that was
    interrupted is finished first, before a step is picked). Every process reaches the
    same verdict: the checksums are global values, and read failures are agreed on, each read's
    before any process goes on (`_read_errors`), each step's before one is set aside; each
    reports the first failing process's error (`_agree`), so `say` names what it saw.
    """
    _finish_discard(mngr, say)
    steps = sorted(mngr.all_steps())
    where = Path(mngr.directory)
    if cfg.resume_step is not None:
        step = cfg.resume_step
        if step not in steps:
            raise CheckpointError(f"checkpoint.resume_step={step}: {where} has no such step; "
                                  f"complete steps: {steps}")
        later = [s for s in steps if s > step]
        if later and not cfg.discard_later:
            raise CheckpointError(f"checkpoint.resume_step={step}: {where} holds later steps "
                                  f"{later}; add checkpoint.discard_later=true to delete them and "
                                  f"continue from step {step}")
        state, saved = restore(mngr, step, target, data_iter, model)
        if later:
            _discard_after(mngr, step)
            say(f"deleted checkpoints {later} (checkpoint.discard_later=true)")
        return step, state, saved
    damaged: list[tuple[int, str]] = []  # set aside only once an intact step is found
    for step in reversed(steps):
        error: DamagedCheckpointError | None = None
        try:
            state, saved = restore(mngr, step, target, data_iter, model)
        except DamagedCheckpointError as e:
            error = e
        agreed = _agree(None if error is None else str(error))
        if agreed is None:
            for bad, why in damaged:
                say(f"skipped {why}; moved it to {_set_aside(mngr, bad)}")
            return step, state, saved
        damaged.append((step, agreed[2]))  # the first failing process's error, on every process
    if damaged:
        raise CheckpointError(f"no checkpoint in {where} verifies; the newest: {damaged[0][1]} "
                              f"(move the damaged steps away, or choose another train.run_dir)")
    return None, None, None


# ---------------------------------------------------------------------------------------------
# Read-only access for eval and export


def _not_read_only_note(record: logging.LogRecord) -> bool:
    """orbax's warning that a manager's directory is read only: what `_reader` asks for."""
    return not record.getMessage().startswith("Given directory is read only")


def _reader(run_dir: Path, state: ocp.CheckpointHandler) -> ocp.CheckpointManager:
    """A read-only manager of `<run_dir>/checkpoints` (`state` reads the `state` item: `_items`)
    for this process alone, whose reads pass no barrier: orbax ends every restore with one that
    all processes of a job must reach, and a process whose read failed never reached it, so the
    others paired it with the next collective that process went on to (`_agree`, as resume
    handles the failure) and the job's processes fell out of step (measured: process 1 unable
    to read step 6's state, a two-process resume ended with "no checkpoint verifies" though step
    3 was intact; with `_read_errors`'s agreement but a reader for all processes, in orbax's
    "sync_global_devices name mismatch"). Each read is this process's own; `_read_errors`
    agrees on its outcome."""
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"no checkpoints directory at {ckpt_dir} (train first: "
                              f"python -m diff_jax.train train.run_dir={run_dir})")
    alone = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                               active_processes={jax.process_index()})
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                           multiprocessing_options=alone)
    absl = logging.getLogger("absl")
    absl.addFilter(_not_read_only_note)
    try:
        return ocp.CheckpointManager(ckpt_dir, options=options, item_handlers=_items(state))
    finally:
        absl.removeFilter(_not_read_only_note)


def restore_inference(run_dir: str | Path, step: int | None, make_target: Callable[[dict], Any],
                      ask_for: Callable[[int], str]) -> tuple[int, dict, Any, Any]:
    """(step, saved config dict, params, training data record) of `step` (None: the latest
    complete step); the record (`save`'s `training_data`: the training split's fingerprint and
    its tokenizer's `identity`) is verified as the config is, None for a step that predates it.

    `make_target(saved config dict)` returns the abstract parameters (ShapeDtypeStructs with
    shardings) to restore onto; only the parameters and the step counter are read, not the
    optimizer or data state, and their checksums are verified (`DamagedCheckpointError` naming
    the step and the array); a step directory whose state counts another step (copied or
    renamed) is damaged, as it is to resume (`_check_step`). The error ends with the run's other
    committed steps and `ask_for(N)`, how the caller's command reads the newest of them instead
    ("evaluate the newest with step=N"): eval and export said "other steps: [10]" and left the
    user to find the key. The other steps are listed, not read: verifying one would read all
    of its parameters (as long again as this step's read, for each), and the command the user
    runs next verifies the one it names.
    """
    run_dir = Path(run_dir).resolve()
    with _reader(run_dir, ocp.PyTreeCheckpointHandler()) as mngr:
        steps = mngr.all_steps()
        if not steps:
            raise CheckpointError(f"{run_dir / 'checkpoints'} holds no complete checkpoint")
        step = mngr.latest_step() if step is None else step
        if step not in steps:
            raise CheckpointError(f"{run_dir / 'checkpoints'} has no step {step}; "
                                  f"complete steps: {sorted(steps)}")
        where = run_dir / "checkpoints" / str(step)
        _check_readable(step, where)
        for item in ("state", "config"):
            if not (where / item).is_dir():
                raise CheckpointError(f"checkpoint {where} is partial: it has no {item!r} item")
        others = sorted(s for s in steps if s != step)
        hint = f"; other steps: {others} (unverified): {ask_for(others[-1])}" if others else ""
        recorded = _read_checksums(mngr, step, where, hint)
        config = _read_config(mngr, step, where, recorded, hint)
        training_data = _read_training_data(mngr, step, where, recorded, hint)
        target = make_target(config)
        metadata = _state_metadata(mngr, step, where, ("params", "step"), hint)
        check_shapes(tree_shapes(metadata["params"]), tree_shapes(target), "checkpoint ")
        restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
        # and the step counter, which `_check_step` compares with the directory's name (read on
        # every process as a NumPy scalar: it needs no place on the parameters' devices)
        counter = np.zeros(metadata["step"].shape, metadata["step"].dtype)
        with _read_errors(step, where, hint):
            state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item={"params": target, "step": counter},
                restore_args={"params": restore_args,
                              "step": ocp.RestoreArgs(restore_type=np.ndarray)},
                partial_restore=True)))
        if recorded is not None:
            verify_checksums(state["state"], recorded, step, where / "state", hint)
        _check_step(state["state"]["step"], step, where, hint)
    return step, config, state["state"]["params"], training_data


def _restore_items(mngr: ocp.CheckpointManager, step: int, where: Path, items: dict[str, Any],
                   hint: str = "") -> dict[str, Any]:
    """{name: restored} of `items` ({name: orbax restore args}) of `step` (at `where`), one
    item at a time, so that a damaged one is named (`where/config`, `where/data_iter`) in its
    `DamagedCheckpointError`, not only the step."""
    restored = {}
    for name, args in items.items():
        with _read_errors(step, where / name, hint):
            restored[name] = mngr.restore(step, args=ocp.args.Composite(**{name: args}))[name]
    return restored


def _read_training_data(mngr: ocp.CheckpointManager, step: int, where: Path,
                        recorded: dict[str, str] | None, hint: str = "") -> Any:
    """The `training_data` item of `step` (at `where`), verified against its checksum in
    `recorded` where the step has one (`verify_json`); None for a step saved before diff-jax
    recorded it. `DamagedCheckpointError` where the item is gone (deleted, or left out of a
    copy) but `recorded` holds its checksum: read as such an old step, it would pass without
    the tokenizer the step was trained with, and any other be taken."""
    if not (where / TRAINING_DATA).is_dir():
        if recorded is not None and TRAINING_DATA in recorded:
            raise DamagedCheckpointError(step, f"checkpoint step {step} is damaged: "
                                               f"{where / TRAINING_DATA} is missing (the step "
                                               "was saved with it: its checksum is recorded)"
                                               f"{hint}")
        return None
    value = _restore_items(mngr, step, where, {TRAINING_DATA: ocp.args.JsonRestore()},
                           hint)[TRAINING_DATA]
    verify_json(value, recorded, step, where / TRAINING_DATA, name=TRAINING_DATA, hint=hint)
    return value


def _read_config(mngr: ocp.CheckpointManager, step: int, where: Path,
                 recorded: dict[str, str] | None, hint: str = "") -> dict:
    """The `config` item of `step` (at `where`): the dict of sections `Config.to_dict` saved.
    `DamagedCheckpointError` when it does not read (`_restore_items`) or reads as JSON that no
    diff-jax saved (no object, a section that is no object, no model section): eval failed on
    a list in an AttributeError traceback, export in an error not naming the step, and resume
    continued from such a step; or when it does not match its checksum in `recorded` (the
    step's `_read_checksums`; a record without one, or none, predates it: read unverified).
    Sections whose keys or values do not parse are an older diff-jax's config, read as before
    (`restore` checks the state's shapes instead)."""
    config = _restore_items(mngr, step, where, {"config": ocp.args.JsonRestore()}, hint)["config"]
    if not (isinstance(config, dict) and isinstance(config.get("model"), dict)
            and all(isinstance(section, dict) for section in config.values())):
        raise DamagedCheckpointError(step, f"checkpoint step {step} is damaged: {where / 'config'} "
                                           "holds no config (expected a JSON object of sections "
                                           f"with a model section, found {json.dumps(config):.60})"
                                           f"{hint}")
    verify_json(config, recorded, step, where / "config", hint=hint)
    return config


def verify_json(value: Any, recorded: dict[str, str] | None, step: int | None, where: Path,
                name: str = "config", hint: str = "") -> None:
    """`DamagedCheckpointError` (`verify_checksums`) when `value`, the JSON read from `where`, is
    not the one whose `json_bytes(…, name)` checksum `recorded` holds; a record without one, or
    none, predates it (steps and exports saved before their JSON was covered): nothing to
    check. `step` None names an export."""
    if recorded is not None and name in recorded:
        verify_checksums(json_bytes(value, name), recorded, step, where, hint)


def _read_checksums(mngr: ocp.CheckpointManager, step: int, where: Path,
                    hint: str = "") -> dict[str, str] | None:
    """The checksums `step` (at `where`) recorded when it was saved (`recorded_checksums`), None
    for a step saved before diff-jax recorded them (`_checksummed`); read before anything they
    cover, so that the config is verified as it is read."""
    if not _checksummed(mngr, step, where, hint):
        return recorded_checksums(None, step, where)
    saved = _restore_items(mngr, step, where, {"checksums": ocp.args.JsonRestore()}, hint)
    return recorded_checksums(saved["checksums"], step, where)


def _state_metadata(mngr: ocp.CheckpointManager, step: int, where: Path, needs: tuple[str, ...],
                    hint: str = "") -> Any:
    """The orbax metadata (array shapes and dtypes) of the `state` item of `step` (at `where`);
    `DamagedCheckpointError` naming `state/_METADATA` when it cannot be read (orbax answers None
    for an item whose metadata file is missing instead of raising), when it lists none of the
    arrays of one of the train state's fields the caller reads (`needs`: "params", "step"…),
    or lists one of those as no array: such a file (no `('step',)` entry, a `value_type` of
    "string") read, and eval, export and resume ended in a KeyError or AttributeError
    traceback."""
    file = where / "state" / "_METADATA"
    with _read_errors(step, file, hint):
        metadata = mngr.item_metadata(step)["state"]
    if metadata is None:
        raise DamagedCheckpointError(step, f"checkpoint step {step} is damaged: cannot read "
                                           f"{file} (missing or unreadable: it lists the saved "
                                           f"arrays){hint}")
    listed = sorted(metadata.keys())
    for field in needs:
        if field not in listed:
            raise DamagedCheckpointError(step, f"checkpoint step {step} is damaged: {file} lists "
                                               f"no {field} (expected the train state's "
                                               f"{', '.join(needs)}, found {', '.join(listed)})"
                                               f"{hint}")
        for path, leaf in jax.tree_util.tree_flatten_with_path(metadata[field])[0]:
            if not isinstance(leaf, ocp.metadata.ArrayMetadata):
                name = _leaf_name((jax.tree_util.DictKey(field), *path))
                raise DamagedCheckpointError(step, f"checkpoint step {step} is damaged: {file} "
                                                   f"lists {name} as {type(leaf).__name__}, not "
                                                   f"an array{hint}")
    return metadata


def _checksummed(mngr: ocp.CheckpointManager, step: int, where: Path, hint: str = "") -> bool:
    """Whether `step` (at `where`) has a `checksums` item to verify against: False for a step
    saved before diff-jax recorded them; `DamagedCheckpointError` when the step's own orbax
    record (`_CHECKPOINT_METADATA`) lists the item but it is gone (deleted, or left out of a
    copy), which would otherwise pass, unverified, for such an old step."""
    if (where / "checksums").is_dir():
        return True
    with _read_errors(step, where, hint):
        saved_items = mngr.metadata(step).item_handlers or {}
    if "checksums" in saved_items:
        raise DamagedCheckpointError(step, f"checkpoint step {step} is damaged: "
                                           f"{where / 'checksums'} is missing (the step was "
                                           f"saved with it), so its arrays cannot be verified"
                                           f"{hint}")
    return False


@contextlib.contextmanager
def _read_errors(step: int, where: Path, hint: str = "") -> Iterator[None]:
    """Any failure to read `where` -> one-line `DamagedCheckpointError` naming the step; out of
    memory (XLA's, `device_memory.out_of_memory_in`, or Python's MemoryError) says nothing of the
    step: it is raised as that type again (`READ_FAILURES`), with its first line. What the
    read's abandoned operations raise where nobody catches it is dropped
    (`_drop_abandoned_io_noise`). The processes of a job agree on the read whatever it raised
    (`_agree`): when it fails on one, it raises on every one, before any goes on into a
    collective (a checksum, the next read's agreement) that the one which failed would not join
    (`_reader`). Every process raises the same line, naming the process that failed and what it
    saw ("process 1 cannot read …/6/state: OSError: …", "process 1: RESOURCE_EXHAUSTED: Out of
    memory …"): process 0 prints it (resume's `skipped` line); before, it printed only "another
    process cannot read …/6/state". Out of memory was raised on the failing process alone, so the
    others waited in the agreement (two processes without `peers.stop_together`: until jax's
    shutdown barrier aborted both, 305 s; train.py's peers stopped process 0 within seconds, but
    with another line than process 1's), and a MemoryError was damage: resume set the step
    aside. A KeyboardInterrupt or SystemExit is no failure of the read: it propagates, unagreed
    (train.py's `peers.stop_together` stops the others)."""
    _drop_abandoned_io_noise()
    failure: Exception | None = None
    try:  # only orbax calls run inside: none raises a CheckpointError of ours
        yield
    except Exception as e:  # orbax/tensorstore raise many types for unreadable bytes
        failure = e
    kind, what = DAMAGE, None
    if failure is not None:
        no_room = out_of_memory_in(failure)
        if no_room is None:
            what = f"cannot read {_unreadable(failure, where)}"
        else:  # the step is fine; the devices or the host full
            kind = next(i for i, t in enumerate(READ_FAILURES) if isinstance(no_room, t))
            what = first_line(no_room, "out of memory")
    agreed = _agree(what, kind)
    if agreed is None:  # never when this process's read failed
        return
    process, kind, what = agreed
    many = jax.process_count() > 1
    if kind != DAMAGE:
        raise READ_FAILURES[kind](f"process {process}: {what}" if many else what) from failure
    who = f"process {process} " if many else ""
    raise DamagedCheckpointError(step, f"checkpoint step {step} is damaged: {who}{what}"
                                       f"{hint}") from failure


def _unreadable(error: BaseException, where: Path) -> str:
    """What could not be read, in one line: the array when the error chain names one (tensorstore
    reports 'Error reading "params.….kernel/0.0"'), and the innermost error's first line (orbax
    wraps it in a multi-line repr of the tensorstore spec)."""
    errors = chain(error)
    inner = errors[-1]
    first = first_line(inner)
    named = next((m.group(1) for e in errors
                  if (m := re.search(r'Error reading "([^"/]+)', str(e)))), None)
    what = f"array {named} of {where}" if named else str(where)
    return f"{what}: {type(inner).__name__}: {first}"
