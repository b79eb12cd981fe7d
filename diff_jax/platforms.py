"""How this process sets JAX up: which platforms it initializes (the CPU alone where no
accelerator is attached), and where compiled programs are kept between runs.

With libtpu installed (the `tpu` extra, for compiling TPU programs ahead of time on any machine),
JAX initializes the TPU plugin at start-up, and on a machine without a TPU that prints errors about
missing TPU metadata before every command. `default_to_cpu_without_accelerators` runs when
`diff_jax` is imported, before JAX reads its configuration: where `JAX_PLATFORMS` is unset and no
TPU, NVIDIA or AMD device node exists, it sets `JAX_PLATFORMS=cpu`. AOT compiles for a TPU slice
(`train.compile_topology`) do not use that backend and still work; an explicit `JAX_PLATFORMS`
is always left as it is. `describe_missing_tpu_host` does the same for those compiles, which load
libtpu themselves; `signals_kept` undoes the SIGHUP disposition that loading sets. On a TPU host
JAX's own backend loads libtpu (not measured there: no TPU here). `use_compile_cache` points JAX's persistent compilation cache at a directory
(`train.compile_cache_dir`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

ACCELERATOR_DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def accelerator_attached() -> bool:
    """Whether a TPU, NVIDIA or AMD device node exists (`ACCELERATOR_DEVICE_NODES`)."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_NODES)


def default_to_cpu_without_accelerators() -> None:
    """Set `JAX_PLATFORMS=cpu` when it is unset and no accelerator device node exists."""
    if "JAX_PLATFORMS" in os.environ or accelerator_attached():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"


def describe_missing_tpu_host(topology: str) -> None:
    """Before libtpu loads to compile for `topology` (e.g. `v5p:2x2x2`) on a machine without a
    TPU: give it the host facts it would otherwise look up in TPU VM metadata, and print errors
    about (worker hostnames: this host; accelerator type: one host of that generation), and let
    it load beside another process that has it loaded (a training run's compile, another
    compile-only run): its lockfile guards TPU chips, and there are none here (without
    `ALLOW_MULTIPLE_LIBTPU_LOAD` the second load failed, "Internal error when accessing libtpu
    multi-process lockfile"). The compile targets the described slice either way; set variables
    are left as they are."""
    if accelerator_attached():
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{topology.split(':')[0]}-8")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@contextlib.contextmanager
def signals_kept(signals: tuple[int, ...] = (signal.SIGHUP,)) -> Iterator[None]:
    """For code that loads libtpu (a TPU slice described for an AOT compile): on the way out,
    `signals` are set back to what Python had set them to before (main thread only; a
    disposition Python did not set, `getsignal` None, is left). Measured with libtpu for jax
    0.10.2: the first `get_topology_desc(platform="tpu")` set SIGHUP and SIGPROF to SIG_IGN with
    sigaction, behind Python's back. `signal.getsignal` still answered SIG_DFL, so
    `command.not_ignored` could not see it, and every process started afterwards inherited
    SIGHUP ignored, as under nohup (a child started after the load printed SIG_IGN for it; the
    test suite's run_limited SIGHUP test, run after a TPU compile in the same pytest worker,
    hung with its child left running). SIGPROF is libtpu's to ignore: set back to SIG_DFL, the
    process was killed by it (exit -27) within a second."""
    main = threading.current_thread() is threading.main_thread()
    before = {s: signal.getsignal(s) for s in signals} if main else {}
    try:
        yield
    finally:
        for s, handler in before.items():
            if handler is not None:
                signal.signal(s, handler)


def use_compile_cache(path: str | None) -> None:
    """Keep the XLA programs this process compiles in `path` (JAX's persistent compilation cache)
    and read back those compiled before, by this or any other process, for the same program,
    devices and versions: a resumed run, the next seed or init of a replication and its repeated
    evaluations skip those compiles. None leaves JAX's own setting (`JAX_COMPILATION_CACHE_DIR`;
    unset: no cache). Takes effect for the compiles that follow, also in a process that cached
    elsewhere before. A local `path` is made here (OSError naming it when it cannot be); a
    `scheme://` one is left to JAX. The cache is trusted, as JAX warns: a program read from it runs
    as this user, so nobody else may write to `path`."""
    if path is None:
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if "://" not in path:
        Path(path).mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:
        compilation_cache.set_cache_dir(path)
        compilation_cache.reset_cache()  # JAX opens its cache once; this re-opens it here
