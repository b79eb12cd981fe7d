"""ptxas's register and spill report of the Mosaic GPU kernels, read where they are compiled.

Mosaic GPU turns each kernel into PTX and runs ptxas on it when XLA compiles the program that
calls it (for the GPU that program targets: `diff_jax.aot.topology_devices("h100:N")` describes
H100s to a machine without one, given the CUDA plugin and ptxas: the `cuda-aot` extra). With
`MOSAIC_GPU_DUMP_PTXAS` set, Mosaic GPU prints ptxas's verbose report on the process's standard
output (file descriptor 1). `ptxas_report(compile)` runs `compile` with that set, captures the
descriptor and returns what `compile` returned and one `KernelReport` per entry function: the registers a thread is given,
the bytes it spills to local memory and ptxas's performance notes (e.g. C7512: wgmma serialized
for want of registers). The compute warpgroups raise their share of the register
file (`setmaxnreg`, `flash_mgpu.compute_registers`) and ptxas allocates each warpgroup's code
within its share, so spill bytes are where a register plan does not hold.

Spill bytes count every spill instruction in the kernel once, wherever it is. Where it is
decides its cost: with `MOSAIC_GPU_DUMP_SASS` also set (it needs `nvdisasm` beside ptxas, the
`cuda-aot` extra), Mosaic GPU prints the kernel's SASS too, and each report carries its step
loops (`StepLoop`): the innermost loops that issue wgmmas, i.e. the kv (or q) steps, each with
its instruction count and the local-memory stores (STL) and loads (LDL) it runs every step.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Callable, Iterator

DUMP_VARIABLE = "MOSAIC_GPU_DUMP_PTXAS"
SASS_VARIABLE = "MOSAIC_GPU_DUMP_SASS"
# Mosaic GPU writes each kernel it disassembles to kernel.bin in a directory of its own at this
# fixed place (jaxlib's mkdtemp pattern, TMPDIR not consulted) and leaves it there
SASS_SCRATCH = "/tmp/mosaic-gpu-*"
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")
_NOTE = re.compile(r"\((C\d+)\) Potential Performance Loss: (.*?),? (?:in|for) the function '(\w+)'")
# nvdisasm's listing: a section header, a label, an instruction ("/*0a10*/ @P1 BRA `(.L_x_0) ;")
_SECTION = re.compile(r"^//-+ (\S+) -+$")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"\bBRA\b.*?(?:`\((\.L_x_\d+)\)|\b0x([0-9a-f]+))")


@dataclasses.dataclass(frozen=True)
class StepLoop:
    """One innermost loop of a kernel's SASS that issues wgmmas (HGMMA): a kv or q step."""

    instructions: int  # in the loop's body, once per step
    wgmmas: int
    spill_stores: int  # STL instructions (local-memory stores) in the body
    spill_loads: int  # LDL instructions


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """ptxas's account of one entry function (one kernel) for one GPU architecture."""

    name: str  # e.g. "diff_flash_fwd_mosaic_gpu_kernel"
    arch: str  # e.g. "sm_90a"
    registers: int  # a thread's registers at launch (before any setmaxnreg)
    barriers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    # ptxas's "Potential Performance Loss" notes, e.g. "C7512: wgmma.mma_async instructions
    # are serialized due to insufficient register resources"
    notes: tuple[str, ...] = ()
    # its step loops in address order; None where no SASS was read (nvdisasm absent)
    loops: tuple[StepLoop, ...] | None = None

    @property
    def spills(self) -> bool:
        """Whether ptxas reports any spill stores or loads for the kernel."""
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0

    @property
    def loop_spills(self) -> int | None:
        """Spill instructions (STL + LDL) its step loops run in one step each, summed."""
        if self.loops is None:
            return None
        return sum(x.spill_stores + x.spill_loads for x in self.loops)


def step_loops(text: str) -> dict[str, tuple[StepLoop, ...]]:
    """Per function in nvdisasm's listing `text`, its step loops. A loop is a backward branch
    and the code from its target to it; blocks after the function's last EXIT are left out
    (ptxas puts the retries of barrier waits there, jumping back into the body). Of the loops
    that contain an HGMMA, those containing no other such loop are the step loops."""
    functions: dict[str, list[str]] = {}
    body = None
    for line in text.splitlines():
        if m := _SECTION.match(line):
            name = m[1].removeprefix(".text.")
            body = functions.setdefault(name, []) if m[1].startswith(".text.") else None
        elif body is not None:
            body.append(line)
    return {name: _loops(lines) for name, lines in functions.items()}


def _loops(lines: list[str]) -> tuple[StepLoop, ...]:
    code, labels, pending = [], {}, []
    for line in lines:
        if m := _LABEL.match(line):
            pending.append(m[1])
        elif m := _INSTRUCTION.match(line):
            address = int(m[1], 16)
            labels.update((label, address) for label in pending)
            pending = []
            code.append((address, m[2]))
    exits = [a for a, op in code if re.search(r"\bEXIT\b", op)]
    spans = set()
    for address, op in code:
        if (m := _TARGET.search(op)) and exits and address <= exits[-1]:
            target = labels.get(m[1]) if m[1] else int(m[2], 16)
            if target is not None and target <= address:
                spans.add((target, address))

    def count(span, word):
        return sum(1 for a, op in code if span[0] <= a <= span[1] and re.search(word, op))

    wgmma = [x for x in spans if count(x, r"\bHGMMA\.")]
    inner = sorted(x for x in wgmma
                   if not any(y != x and x[0] <= y[0] and y[1] <= x[1] for y in wgmma))
    return tuple(StepLoop(count(x, r"."), count(x, r"\bHGMMA\."), count(x, r"\bSTL\b"),
                          count(x, r"\bLDL\b")) for x in inner)


def parse(text: str) -> list[KernelReport]:
    """The `KernelReport`s of ptxas -v output `text`, in order, with their step loops where
    `text` also holds the kernels' SASS; ValueError where an entry function's report is
    incomplete."""
    loops = step_loops(text)
    notes: dict[str, list[str]] = {}
    for m in _NOTE.finditer(text):
        notes.setdefault(m[3], []).append(f"{m[1]}: {m[2]}")
    reports, entry, frame = [], None, None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            if entry is not None:
                raise ValueError(f"ptxas report of {entry[0]} ends before its register count")
            entry, frame = (m[1], m[2]), None
        elif (m := _FRAME.search(line)) and entry is not None:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _USED.search(line)) and entry is not None:
            if frame is None:
                raise ValueError(f"ptxas report of {entry[0]} has no stack frame line")
            reports.append(KernelReport(entry[0], entry[1], int(m[1]), int(m[2] or 0), *frame,
                                        notes=tuple(notes.get(entry[0], ())),
                                        loops=loops.get(entry[0])))
            entry = None
    if entry is not None:
        raise ValueError(f"ptxas report of {entry[0]} ends before its register count")
    return reports


@contextlib.contextmanager
def _persistent_cache_off() -> Iterator[None]:
    """JAX's persistent compilation cache off for the block, then as it was (JAX decides whether
    it uses the cache once, so each switch re-opens it)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def ptxas_report(compile: Callable[[], Any]) -> tuple[Any, list[KernelReport]]:
    """Run `compile` (a call that makes XLA compile Mosaic GPU kernels, e.g.
    `jax.jit(f).lower(*args).compile`) with ptxas's report and the SASS listing switched on:
    what it returned, and the report parsed.
    Kernels this process compiled before are cached by Mosaic GPU and not reported again
    (`mosaic_kernels` remembers them). JAX's persistent compilation cache is off meanwhile: a
    program read from it runs no ptxas, and one compiled for GPUs described to a machine
    without them cannot be read back (JAX warns and compiles)."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    before = {name: os.environ.get(name) for name in (DUMP_VARIABLE, SASS_VARIABLE)}
    os.environ.update(dict.fromkeys(before, "1"))
    scratch = set(glob.glob(SASS_SCRATCH))
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        try:
            with _persistent_cache_off():
                result = compile()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            for name, value in before.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
            for left in set(glob.glob(SASS_SCRATCH)) - scratch:  # this compile's kernel.bin's
                if os.listdir(left) == ["kernel.bin"]:
                    shutil.rmtree(left, ignore_errors=True)
        captured.seek(0)
        return result, parse(captured.read().decode(errors="replace"))


# A Mosaic GPU custom call in lowered StableHLO: its kernel hash, then (in its serialized module)
# the kernel's name, e.g. "diff_flash_fwd" (jax 0.10) or "diff_flash_fwd_0" (jax 0.11).
_KERNEL = re.compile(r'kernel_hash = "((?:[^"\\]|\\.)*)".*?(diff_flash_[a-z]+)(?:_\d+)?\\00')
# Mosaic GPU compiles a kernel (and runs ptxas) once a process, keyed by the hash of its module:
# the reports seen so far by that hash, so a kernel compiled before is still reported.
_SEEN: dict[str, KernelReport] = {}


def mosaic_kernels(devices: list[Any], d: int, tiles: Any, *, has_seg: bool,
                   parts: tuple[str, ...] = ("fwd", "bwd"), dtype: Any = None) -> list[KernelReport]:
    """ptxas's report of the Mosaic GPU kernels (`flash_mgpu`) at head width `d` and `tiles`,
    compiled for `devices[0]` (e.g. `diff_jax.aot.gpu_devices("h100:1")`): the forward
    ("fwd") and the dQ and dK/dV kernels ("bwd"), causal, with segment ids if `has_seg`,
    bf16 unless `dtype`, one report per kernel in launch order (a kernel this process compiled
    before, whose module hash is the same, gives its earlier report). A ValueError from
    `flash_mgpu.warpgroups` where the tiles do not fit."""
    import jax
    import jax.numpy as jnp

    from . import flash_mgpu

    dtype = jnp.bfloat16 if dtype is None else dtype
    flash_mgpu.warpgroups(d, tiles)
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    b, t, h = 1, 512, 2  # registers and spills depend on the tiles and d, not on these

    def spec(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    q, k, v = spec((b, t, 2 * h, d)), spec((b, t, 2 * h, d)), spec((b, t, h, 2 * d))
    lam = spec((), jnp.float32)
    seg = spec((b, t), jnp.int32) if has_seg else None
    stats = spec((b, h, 2, t), jnp.float32)

    def fwd(q, k, v, lam, seg):
        return flash_mgpu.fwd(q, k, v, lam, seg, seg, causal=True, tiles=tiles)

    def bwd(q, k, v, lam, seg, do, lse, delta):
        return flash_mgpu.bwd(q, k, v, lam, seg, seg, do, lse, delta, causal=True, tiles=tiles)

    lowered = []
    if "fwd" in parts:
        lowered.append(jax.jit(fwd).lower(q, k, v, lam, seg))
    if "bwd" in parts:
        lowered.append(jax.jit(bwd).lower(q, k, v, lam, seg, spec((b, t, h, 2 * d)), stats,
                                          stats))
    kernels = [(m[2], m[1]) for low in lowered for m in _KERNEL.finditer(low.as_text())]
    _, fresh = ptxas_report(lambda: [low.compile() for low in lowered])
    fresh = {r.name.removesuffix("_mosaic_gpu_kernel"): r for r in fresh}
    reports = []
    for name, digest in kernels:
        if name in fresh:
            _SEEN[digest] = fresh[name]
        if digest not in _SEEN:
            raise RuntimeError(f"ptxas reported nothing for {name} (compiled before this "
                               "process read reports?)")
        reports.append(_SEEN[digest])
    return reports
