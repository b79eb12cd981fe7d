"""Test set-up: 8 fake CPU devices (before JAX initializes) so sharding tests need no hardware."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
