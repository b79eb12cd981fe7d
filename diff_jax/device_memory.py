"""A program that does not fit in device memory: XLA's out-of-memory error as one error line.

XLA reports it as a `jax.errors.JaxRuntimeError` whose message starts `RESOURCE_EXHAUSTED: Out of
memory while trying to allocate N bytes.` (GPU, followed by the buffer assignment's dump), `...
Ran out of memory on HBM ...` (a TPU compile), `... Error allocating device buffer ...` (a TPU
step) or `Out of memory allocating N bytes.` (the CPU backend). It surfaces where the program is
compiled or where its result is first read, not where the allocation was asked for.
`fit_or_explain` turns it into a `DeviceMemoryError` whose message keeps XLA's first line and
adds what the command can change (`train_advice`: the settings that size a train step).
`train.py`, `eval.py` and the replication's commands print it as their one error line and exit
2, like other input that cannot run.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

from diff_jax.config import Config
from diff_jax.error_text import chain, first_line


class DeviceMemoryError(RuntimeError):
    """A program did not fit in device memory; the message names the settings that size it."""


# what XLA says when a buffer does not fit in device (or, on the CPU backend, host) memory
OUT_OF_MEMORY = ("out of memory while trying to allocate", "out of memory allocating",
                 "error allocating device buffer", "ran out of memory on hbm",
                 "memory space hbm", "hbm capacity")
# a kernel's on-chip scratch memory (GPU shared memory, TPU VMEM/SMEM): a tile size, not the batch
ON_CHIP = ("shared memory", "vmem", "smem", "scoped")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA running out of device (or, on the CPU backend, host) memory: one of
    the phrases of `OUT_OF_MEMORY`, and a first line (where XLA names what ran out) not about a
    kernel's on-chip memory (`ON_CHIP`), which the batch size does not change. Only the first
    line: the report after an XLA:TPU compile's out-of-HBM line lists the program's scoped
    allocations too."""
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    text = str(error).lower()
    first = text.strip().partition("\n")[0]
    return any(p in text for p in OUT_OF_MEMORY) and not any(p in first for p in ON_CHIP)


def out_of_memory_in(error: BaseException) -> BaseException | None:
    """The out-of-memory error in the chain of `error` (its causes and contexts; orbax wraps what
    a restore raised): XLA's (`is_out_of_memory`) or the host's (`MemoryError`); else None. A
    reader that labels its failures (damaged checkpoint or export) re-raises it instead, so that
    `fit_or_explain` reports XLA's, and a full host is not called damage (an export read that
    ran out of host memory was "the export is damaged")."""
    return next((e for e in chain(error) if is_out_of_memory(e) or isinstance(e, MemoryError)),
                None)


@contextlib.contextmanager
def fit_or_explain(advice: str) -> Iterator[None]:
    """Re-raise XLA's out-of-memory error inside the block as a `DeviceMemoryError`: `out of
    device memory (XLA's first line): advice`. Other errors pass unchanged."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if not is_out_of_memory(e):
            raise
        raise DeviceMemoryError(f"out of device memory ({first_line(e)}): {advice}") from e


def devices_here() -> str:
    """This process's devices as the advice names them, e.g. "8 gpu device(s)"."""
    return f"{jax.device_count()} {jax.devices()[0].platform} device(s)"


def train_advice(config: Config, what: str, devices: str) -> str:
    """What to change when `what` (the training run, the train step) of `config` does not fit
    in the memory of `devices` (e.g. "8 gpu device(s)"), for `fit_or_explain`."""
    t, m = config.train, config.model
    changes = ["lower train.batch_size or raise train.grad_accum (the same tokens per step in "
               "smaller micro-batches)"]
    if m.remat != "full":
        changes.append("set model.remat=full")
    if not 0 < m.loss_chunk < t.seq_len:
        changes.append("set model.loss_chunk (the logits of that many positions at a time)")
    changes.append("shard the parameters and optimizer state over more devices (mesh.fsdp)")
    return (f"{what} at train.batch_size={t.batch_size}, train.seq_len={t.seq_len}, "
            f"train.grad_accum={t.grad_accum}, model.remat={m.remat}, "
            f"model.loss_chunk={m.loss_chunk} does not fit on {devices}; " + ", ".join(changes[:-1])
            + " or " + changes[-1])
