"""A machine without accelerators runs the project's commands without libtpu's start-up errors,
and still compiles for a TPU slice."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diff_jax import platforms

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("TPU", "libtpu", "E0000", "InitGoogle")


def _run(*args: str) -> subprocess.CompletedProcess:
    # A fresh shell's environment: without the test set-up's platform flags, and without the host
    # facts an earlier TPU compile in this process set (`platforms.describe_missing_tpu_host`).
    unset = ("JAX_PLATFORMS", "XLA_FLAGS", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_explicit_platforms_and_accelerators_are_left_alone(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    platforms.default_to_cpu_without_accelerators()
    assert os.environ["JAX_PLATFORMS"] == "cuda"
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(platforms.glob, "glob", lambda p: ["/dev/accel0"] if "accel" in p else [])
    platforms.default_to_cpu_without_accelerators()
    assert "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(platforms.glob, "glob", lambda p: [])
    platforms.default_to_cpu_without_accelerators()
    assert os.environ["JAX_PLATFORMS"] == "cpu"


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (optional extra: jax[tpu]); nothing to silence")
@pytest.mark.skipif(any(platforms.glob.glob(p) for p in platforms.ACCELERATOR_DEVICE_NODES),
                    reason="this machine has an accelerator")
def test_commands_print_no_libtpu_lines_and_tpu_slices_still_compile():
    control = _run("-c", "import jax; jax.devices()")  # plain JAX: libtpu complains here
    if not any(word in control.stderr for word in NOISE):
        pytest.skip("this libtpu prints nothing on a machine without a TPU")
    summary = _run("-m", "diff_jax.summary", "configs/tiny.yaml")
    assert summary.returncode == 0 and not any(w in summary.stderr for w in NOISE), summary.stderr
    compiled = _run("train.py", "model.vocab_size=512", "model.embed_dim=64", "model.num_layers=1",
                    "model.num_heads=2", "train.seq_len=16", "train.batch_size=8",
                    "train.compile_only=true", "train.compile_topology=v5p:2x2x2")
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert not any(w in compiled.stderr for w in NOISE), compiled.stderr
    assert json.loads(compiled.stdout[compiled.stdout.index("{"):])["devices"] == 8
