"""A machine without accelerators runs the project's commands without libtpu's start-up errors,
and still compiles for a TPU slice."""

from __future__ import annotations

import fnmatch
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
COMPILE = ("train.py", "model.vocab_size=512", "model.embed_dim=64", "model.num_layers=1",
           "model.num_heads=2", "train.seq_len=16", "train.batch_size=8", "train.compile_only=true",
           "train.compile_topology=v5p:2x2x2")


def _fresh_env() -> dict[str, str]:
    """A fresh shell's environment: without the test set-up's platform flags and libtpu setting
    (conftest), and without the host facts an earlier TPU compile in this process set
    (`platforms.describe_missing_tpu_host`)."""
    unset = ("JAX_PLATFORMS", "XLA_FLAGS", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE",
             "ALLOW_MULTIPLE_LIBTPU_LOAD")
    return {k: v for k, v in os.environ.items() if k not in unset}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_fresh_env(), capture_output=True,
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
@pytest.mark.skipif(platforms.accelerator_attached(),
                    reason="this machine has an accelerator")
def test_commands_print_no_libtpu_lines_and_tpu_slices_still_compile():
    control = _run("-c", "import jax; jax.devices()")  # plain JAX: libtpu complains here
    if not any(word in control.stderr for word in NOISE):
        pytest.skip("this libtpu prints nothing on a machine without a TPU")
    summary = _run("-m", "diff_jax.summary", "configs/tiny.yaml")
    assert summary.returncode == 0 and not any(w in summary.stderr for w in NOISE), summary.stderr
    compiled = _run(*COMPILE)
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert not any(w in compiled.stderr for w in NOISE), compiled.stderr
    assert json.loads(compiled.stdout[compiled.stdout.index("{"):])["devices"] == 8


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (optional extra: jax[tpu])")
@pytest.mark.skipif(platforms.accelerator_attached(),
                    reason="this machine has an accelerator")
def test_a_tpu_slice_compiles_while_another_process_has_libtpu_loaded(tmp_path):
    """libtpu's multi-process lockfile guards TPU chips; on a machine without them a compile-only
    run loads libtpu beside another process that has (a training run's compile, another
    compile). Before, it failed on the lockfile with a line saying it needed libtpu."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom jax.experimental import topologies\n"
         "topologies.get_topology_desc('v5p:2x2x1', platform='tpu')\nprint('held', flush=True)\n"
         "sys.stdin.read()"], env=_fresh_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=(tmp_path / "holder.err").open("w"), text=True)
    try:
        # libtpu loaded, its lockfile held; or not loaded because another process holds it
        if holder.stdout.readline().strip() != "held":
            holder.wait(60)
            said = (tmp_path / "holder.err").read_text()
            assert "lockfile" in said, f"the libtpu holder failed to start: {said[-1000:]}"
        compiled = _run(*COMPILE)
    finally:  # stdin closed: the holder exits as a process that has libtpu loaded would
        try:
            holder.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.communicate()
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert json.loads(compiled.stdout[compiled.stdout.index("{"):])["devices"] == 8


@pytest.mark.parametrize("node", ["/dev/accel0", "/dev/vfio/0", "/dev/nvidia0", "/dev/kfd"])
def test_any_accelerator_node_keeps_jax_platforms_and_tpu_host_facts_unset(monkeypatch, node):
    """A TPU (accel, vfio), NVIDIA or AMD device node: JAX picks its platforms and libtpu its host
    facts itself. Without one, the TPU host facts are set only where unset."""
    names = ("JAX_PLATFORMS", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE",
             "ALLOW_MULTIPLE_LIBTPU_LOAD")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(platforms.glob, "glob", lambda p: [node] if fnmatch.fnmatch(node, p) else [])
    platforms.default_to_cpu_without_accelerators()
    platforms.describe_missing_tpu_host("v5p:2x2x2")
    assert not set(names) & set(os.environ)  # a TPU host keeps libtpu's lockfile guarding it
    monkeypatch.setattr(platforms.glob, "glob", lambda p: [])
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-16")
    platforms.describe_missing_tpu_host("v4:2x2x1")
    assert (os.environ["TPU_ACCELERATOR_TYPE"], os.environ["TPU_WORKER_HOSTNAMES"],
            os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"]) == ("v5p-16", "localhost", "1")
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    platforms.describe_missing_tpu_host("v4:2x2x1")
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v4-8"
