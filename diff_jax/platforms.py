"""Which JAX platforms this machine initializes: the CPU alone where no accelerator is attached.

With libtpu installed (the `tpu` extra, for compiling TPU programs ahead of time on any machine),
JAX initializes the TPU plugin at start-up, and on a machine without a TPU that prints errors about
missing TPU metadata before every command. `default_to_cpu_without_accelerators` runs when
`diff_jax` is imported, before JAX reads its configuration: where `JAX_PLATFORMS` is unset and no
TPU, NVIDIA or AMD device node exists, it sets `JAX_PLATFORMS=cpu`. AOT compiles for a TPU slice
(`train.compile_topology`) do not use that backend and still work; an explicit `JAX_PLATFORMS`
is always left as it is. `describe_missing_tpu_host` does the same for those compiles, which load
libtpu themselves.
"""

from __future__ import annotations

import glob
import os

ACCELERATOR_DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def default_to_cpu_without_accelerators() -> None:
    """Set `JAX_PLATFORMS=cpu` when it is unset and no accelerator device node exists."""
    if "JAX_PLATFORMS" in os.environ:
        return
    if any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_NODES):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"


def describe_missing_tpu_host(topology: str) -> None:
    """Before libtpu loads to compile for `topology` (e.g. `v5p:2x2x2`) on a machine without a
    TPU: give it the host facts it would otherwise look up in TPU VM metadata, and print errors
    about (worker hostnames: this host; accelerator type: one host of that generation). The
    compile targets the described slice either way; set variables are left as they are."""
    if any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_NODES):
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{topology.split(':')[0]}-8")
