"""Test set-up: 8 fake CPU devices (before JAX initializes) so sharding tests need no hardware."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU tests only compile (AOT, with the `tpu` extra): let libtpu load even when another
# process on the machine holds its lockfile (e.g. a training run in the same environment).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
