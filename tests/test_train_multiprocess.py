"""Two processes on localhost (jax.distributed, 2 CPU devices each) == one process with 4 devices,
across a stop and a resume, and past a damaged checkpoint both processes set aside."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from training_fixtures import process_env, write_corpus

ROOT = Path(__file__).resolve().parents[1]


def _args(corpus: Path, run: Path) -> list[str]:
    return [sys.executable, "train.py", "model.vocab_size=64", "model.embed_dim=32",
            "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=64", "train.seq_len=16",
            "train.batch_size=8", "train.steps=6", "train.log_every=1", "train.eval_every=0",
            "data.source=tokens", f"data.paths=[{corpus}]", "data.validation_fraction=0",
            "checkpoint.every_steps=3", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1",
            f"train.run_dir={run}"]


def _losses(run: Path) -> list[float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x]


def _two_processes(corpus: Path, run: Path, *overrides: str) -> list[str]:
    """Run train.py as processes 0 and 1 of a localhost job; returns their outputs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(_args(corpus, run) + [
        f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
        f"distributed.process_id={i}", *overrides], cwd=ROOT, env=process_env(2),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def test_two_processes_match_one_process_resume_and_set_a_damaged_step_aside_together(tmp_path):
    """The two-process job stops at step 4 and is started again: it resumes from its checkpoint
    (each process's own data-iterator state) and its six losses equal one uninterrupted
    four-device process's. Then the resume paths where the processes must agree and wait for
    each other: step 6's recorded checksums damaged, both processes refuse it (`_agree`),
    process 0 moves it to damaged_checkpoints/ while the other waits (`_sync`), and both resume
    from step 4; then `checkpoint.resume_step=4 discard_later=true` deletes step 6 on both sides
    of the journal's barriers. Each time the job ends (no process left waiting) on the same
    losses. One job's checkpoints serve both parts: each two-process job starts two JAX
    processes, the slowest part of the suite's multi-host checks."""
    corpus = write_corpus(tmp_path / "corpus")
    single = subprocess.Popen(_args(corpus, tmp_path / "single"), cwd=ROOT, env=process_env(4),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "multi"
    first = _two_processes(corpus, run, "train.steps=4")
    assert "step 4/4" in first[0] and "step 4/4" not in first[1]  # only process 0 reports
    second = _two_processes(corpus, run)
    assert "resumed from step 4" in second[0] and "step 6/6" in second[0]
    err = single.communicate(timeout=300)[1]
    assert single.returncode == 0, err[-3000:]
    losses = _losses(run)
    assert len(losses) == 6
    np.testing.assert_allclose(losses, _losses(tmp_path / "single"), rtol=1e-5)
    for step in (4, 6):  # the checkpoints configs/tiny.yaml keeps (checkpoint.keep=2)
        iter_dir = run / "checkpoints" / str(step) / "data_iter"
        states = [json.loads((iter_dir / f"process_{i}-of-2.json").read_text()) for i in range(2)]
        assert [s["next_index"] for s in states] == [step, step]  # batches consumed

    sums = run / "checkpoints" / "6" / "checksums" / "metadata"
    record = json.loads(sums.read_text())
    name = sorted(record["arrays"])[0]
    record["arrays"][name] = "0" * 16
    sums.write_text(json.dumps(record))
    outs = _two_processes(corpus, run)
    assert f"skipped checkpoint step 6 is damaged: {name} read from" in outs[0], outs[0][-3000:]
    assert "resumed from step 4" in outs[0] and "step 6/6" in outs[0]
    assert sorted(p.name for p in (run / "damaged_checkpoints").iterdir()) == ["6"]
    np.testing.assert_allclose(_losses(run), losses, rtol=1e-6)
    outs = _two_processes(corpus, run, "checkpoint.resume_step=4", "checkpoint.discard_later=true")
    assert "deleted checkpoints [6] (checkpoint.discard_later=true)" in outs[0], outs[0][-3000:]
    assert "resumed from step 4" in outs[0] and "step 6/6" in outs[0]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [4, 6]
    assert not (run / "discarding_after").exists()
    np.testing.assert_allclose(_losses(run), losses, rtol=1e-6)
