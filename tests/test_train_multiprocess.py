"""Two processes on localhost (jax.distributed, 2 CPU devices each) == one process with 4 devices."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.training_fixtures import write_corpus

ROOT = Path(__file__).resolve().parents[1]


def _args(corpus: Path, run: Path) -> list[str]:
    return [sys.executable, "train.py", "model.vocab_size=64", "model.embed_dim=32",
            "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=64", "train.seq_len=16",
            "train.batch_size=8", "train.steps=6", "train.log_every=1", "train.eval_every=0",
            "data.source=tokens", f"data.paths=[{corpus}]", "data.validation_fraction=0",
            "checkpoint.every_steps=3", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1",
            f"train.run_dir={run}"]


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return env


def _losses(run: Path) -> list[float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x]


def test_two_processes_match_one_process_with_four_devices(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    multi = tmp_path / "multi"
    procs = [subprocess.Popen(_args(corpus, multi) + [
        f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
        f"distributed.process_id={i}"], cwd=ROOT, env=_env(2), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    single = subprocess.run(_args(corpus, tmp_path / "single"), cwd=ROOT, env=_env(4),
                            capture_output=True, text=True, timeout=300)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    assert "step 6/6" in outs[0] and "step 6/6" not in outs[1]  # only process 0 reports
    np.testing.assert_allclose(_losses(multi), _losses(tmp_path / "single"), rtol=1e-5)
    assert len(_losses(multi)) == 6
    for step in (3, 6):
        iter_dir = multi / "checkpoints" / str(step) / "data_iter"
        states = [json.loads((iter_dir / f"process_{i}-of-2.json").read_text()) for i in range(2)]
        assert [s["next_index"] for s in states] == [step, step]  # batches consumed
