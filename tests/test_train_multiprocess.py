"""Two processes on localhost (jax.distributed, 2 CPU devices each) == one process with 4 devices,
across a stop and a resume, and past a damaged checkpoint both processes set aside; one process
that fails stops the other at once."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from diff_jax.checkpoint import committed_steps
from training_fixtures import process_env, write_corpus

ROOT = Path(__file__).resolve().parents[1]

# train.py, but process 1's disk is full: its check for a failed async save, at the start of
# step 5, raises what tensorstore's failed write of step 3 becomes
FULL_DISK = """
import errno, runpy
from diff_jax import checkpoint
calls = []
def check_saves(mngr):
    calls.append(mngr)
    if len(calls) == 5:
        raise OSError(errno.ENOSPC, "No space left on device", str(mngr.directory))
checkpoint.check_saves = check_saves
runpy.run_path("train.py", run_name="__main__")
"""

# train.py, but something prints as process 0 leaves, after the line of the failure that stopped
# it: what its runner thread, still going until the process exits, draws meanwhile (the progress
# of the step in flight came after the line in 1 of 8 runs)
PRINTS_LATE = """
import runpy, sys
from diff_jax import peers
leave = peers._Job.leave
def printing_leave(job, status):
    print("[####....] step 5/6 (drawn as the process leaves)", file=sys.stderr, flush=True)
    leave(job, status)
peers._Job.leave = printing_leave
runpy.run_path("train.py", run_name="__main__")
"""

# train.py, but every process's disk is full (one shared disk): each one's check for a failed
# async save, at the start of step 5, raises what tensorstore's failed write of step 3 becomes.
# Process 1 goes on unwinding its error until process 0 has announced its own (the race where one
# host's error is announced first while another's is on its way out)
ALL_DISKS_FULL = """
import errno, runpy, time
import jax
from jax._src import distributed
from diff_jax import checkpoint
calls = []
def check_saves(mngr):
    calls.append(mngr)
    if len(calls) == 5:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(mngr.directory))
        finally:
            if jax.process_index() == 1:
                distributed.global_state.client.blocking_key_value_get("diff_jax/stop/1", 120_000)
                time.sleep(0.5)  # the watcher hears of it meanwhile
checkpoint.check_saves = check_saves
runpy.run_path("train.py", run_name="__main__")
"""

# train.py, but process 1 alone gets a SIGTERM (a scheduler's notice, `kill PID`) as step 4
# begins (its check for a failed async save)
SIGTERM_AT_4 = """
import os, runpy, signal
from diff_jax import checkpoint
calls, check = [], checkpoint.check_saves
def check_saves(mngr):
    calls.append(mngr)
    if len(calls) == 4:
        os.kill(os.getpid(), signal.SIGTERM)
    check(mngr)
checkpoint.check_saves = check_saves
runpy.run_path("train.py", run_name="__main__")
"""


# train.py, but process 1 alone fails to read step 6's train state: FAILS there
STATE_FAILS_ON_1 = """
import errno, runpy
import jax, jax.numpy as jnp
import orbax.checkpoint as ocp
restore = ocp.StandardCheckpointHandler.restore
def failing(handler, directory, *args, **kwargs):
    if jax.process_index() == 1 and directory.parent.name == "6":
        FAILS
    return restore(handler, directory, *args, **kwargs)
ocp.StandardCheckpointHandler.restore = failing
runpy.run_path("train.py", run_name="__main__")
"""
# an I/O error on its host: each process reads only the shards it holds, from a file system of
# its own mount
STATE_UNREADABLE_ON_1 = STATE_FAILS_ON_1.replace(
    "FAILS", 'raise OSError(errno.EIO, "Input/output error", str(directory))')
# out of device memory: XLA's own error, a 1 PiB array asked of the CPU backend
# (`training_fixtures.xla_out_of_memory`)
STATE_OUT_OF_MEMORY_ON_1 = STATE_FAILS_ON_1.replace(
    "FAILS", "jax.block_until_ready(jnp.ones((1 << 50,), jnp.uint8))")


def _args(corpus: Path, run: Path, script: tuple[str, ...] = ("train.py",)) -> list[str]:
    return [sys.executable, *script, "model.vocab_size=64", "model.embed_dim=32",
            "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=64", "train.seq_len=16",
            "train.batch_size=8", "train.steps=6", "train.log_every=1", "train.eval_every=0",
            "data.source=tokens", f"data.paths=[{corpus}]", "data.validation_fraction=0",
            "checkpoint.every_steps=3", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1",
            f"train.run_dir={run}"]


def _losses(run: Path) -> list[float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x]


def _start(corpus: Path, run: Path, *overrides: str, process_0: tuple[str, ...] = ("train.py",),
           process_1: tuple[str, ...] = ("train.py",),
           out: Path | None = None) -> list[subprocess.Popen]:
    """Start train.py as processes 0 and 1 of a localhost job (process I runs `python
    *process_I` instead), their output piped, or written to `out`/0 and `out`/1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        with open(out / str(i), "w") if out else contextlib.nullcontext(subprocess.PIPE) as stdout:
            procs.append(subprocess.Popen(_args(corpus, run, process_1 if i else process_0) + [
                f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
                f"distributed.process_id={i}", *overrides], cwd=ROOT, env=process_env(2),
                stdout=stdout, stderr=subprocess.STDOUT, text=True))
    return procs


def _outcome(procs: list[subprocess.Popen], out: Path, seconds: float,
             after_error: float | None = None) -> tuple[list[int], list[str]]:
    """(exit statuses, outputs) of the processes `_start` wrote to `out`/0 and `out`/1, each
    killed if still running `seconds` from now, or `after_error` seconds after process 1
    printed an `error:` line (a hang guard, not a timing: the hangs fixed lasted 300 s)."""
    deadline, failed = time.monotonic() + seconds, False
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if after_error is not None and not failed and "error:" in (out / "1").read_text():
            failed, deadline = True, time.monotonic() + after_error
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs], [(out / str(i)).read_text() for i in range(2)]


def _two_processes(corpus: Path, run: Path, *overrides: str) -> list[str]:
    """Run train.py as processes 0 and 1 of a localhost job; returns their outputs."""
    procs = _start(corpus, run, *overrides)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def test_two_processes_match_one_process_resume_and_set_a_damaged_step_aside_together(tmp_path):
    """The two-process job stops at step 4 and is started again, with its layers scanned: it
    resumes from its checkpoint (each process's own data-iterator state; the unrolled layers'
    parameters and optimizer state stacked on both processes) and its six losses equal one
    uninterrupted, unrolled four-device process's. Then the resume paths where the processes
    must agree and wait for each other: step 6's recorded checksums damaged, both processes
    refuse it (`_agree`), process 0 moves it to damaged_checkpoints/ while the other waits
    (`_sync`), and both resume from step 4; then `checkpoint.resume_step=4 discard_later=true`
    deletes step 6 on both sides of the journal's barriers. Each time the job ends (no process left waiting) on the same
    losses. One job's checkpoints serve both parts: each two-process job starts two JAX
    processes, the slowest part of the suite's multi-host checks."""
    corpus = write_corpus(tmp_path / "corpus")
    single = subprocess.Popen(_args(corpus, tmp_path / "single"), cwd=ROOT, env=process_env(4),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "multi"
    first = _two_processes(corpus, run, "train.steps=4")
    assert "step 4/4" in first[0] and "step 4/4" not in first[1]  # only process 0 reports
    second = _two_processes(corpus, run, "model.scan_layers=true")
    assert "resumed from step 4" in second[0] and "step 6/6" in second[0]
    assert "resumed with model.scan_layers=true, where step 4 was saved with false" in second[0]
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
    positions = [n for n in record["arrays"] if n.startswith("data_iter/")]  # gathered to save
    assert positions == [f"data_iter/process_{i}-of-2.json/next_index" for i in range(2)]
    name = sorted(n for n in record["arrays"] if n not in positions)[0]  # an array of the state
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


def test_a_process_that_fails_stops_the_other_at_once_naming_it(tmp_path):
    """Process 1's disk fills at step 5 (`FULL_DISK`) while process 0 waits for it in the
    step's collectives. Process 1 ends in its one `error:` line and process 0, within seconds
    (before, both waited out jax's 300 s shutdown barrier and aborted with a C++ log and stack
    trace, exit status -6), in one line naming process 1 and its error, with its exit status;
    what process 0 prints as it leaves (`PRINTS_LATE`) does not come after it. Step 3, committed
    before the failure, is kept."""
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    procs = _start(corpus, run, process_0=("-c", PRINTS_LATE), process_1=("-c", FULL_DISK),
                   out=tmp_path)
    # after process 1's error line, 60 s: jax's heartbeat timeout is 100 s, its barrier 300
    statuses, outs = _outcome(procs, tmp_path, 300, after_error=60)
    assert statuses == [2, 2], outs[0][-3000:] + outs[1][-3000:]
    directory = run.resolve() / "checkpoints"
    assert outs[1].splitlines()[-1].startswith("error: ") and "No space left on device" in outs[1]
    assert outs[0].splitlines()[-1] == (
        f"error: process 1 of 2 failed: OSError: [Errno 28] No space left on device: "
        f"'{directory}'; this process stopped with it")
    assert "Traceback" not in outs[0] + outs[1] and "Check failure" not in outs[0] + outs[1]
    assert committed_steps(run) == [3]


def test_processes_that_fail_alike_each_report_their_own_error(tmp_path):
    """Both processes' disks fill at step 5 (`ALL_DISKS_FULL`); process 0 announces first, while
    process 1's own error is still on its way out. Each ends in its own error line, exit status
    2; before, process 1 printed process 0's (`process 0 of 2 failed: …; this process stopped
    with it`), its own error lost, as every process but the first did when all hit the same
    bad checkpoint or config value."""
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    full = ("-c", ALL_DISKS_FULL)
    procs = _start(corpus, run, process_0=full, process_1=full, out=tmp_path)
    statuses, outs = _outcome(procs, tmp_path, 300, after_error=60)
    assert statuses == [2, 2], outs[0][-3000:] + outs[1][-3000:]
    for out in outs:
        assert out.splitlines()[-1].startswith("error: "), out[-3000:]
        assert "No space left on device" in out.splitlines()[-1], out[-3000:]
        assert "stopped with it" not in out and "Traceback" not in out, out[-3000:]
    assert committed_steps(run) == [3]


def test_a_process_refused_before_connecting_leaves_the_other_one_line(tmp_path):
    """Process 1's --config file is missing: it stops before `jax.distributed.initialize`, so it
    cannot tell process 0, which waits there for it to connect. Process 0 stops once
    `distributed.initialization_timeout_s` has passed, in one line naming it, exit status 2;
    before, it waited jax's 300 s and aborted with a C++ log and stack trace (exit status -6)."""
    corpus = write_corpus(tmp_path / "corpus")
    missing = ("train.py", "--config", str(tmp_path / "missing.yaml"))
    procs = _start(corpus, tmp_path / "run", "distributed.initialization_timeout_s=5",
                   process_1=missing, out=tmp_path)
    statuses, outs = _outcome(procs, tmp_path, 120)  # the abort came after 310 s
    assert statuses == [2, 2], outs[0][-3000:] + outs[1][-3000:]
    assert outs[1].splitlines() == [f"error: config file not found: {tmp_path / 'missing.yaml'}"]
    address = next(a for a in procs[0].args if a.startswith("distributed.coordinator="))
    assert outs[0].splitlines() == [
        f"error: distributed.initialization_timeout_s=5: the job's processes did not all connect "
        f"to the coordinator {address.split('=')[1]} within 5 s; one that stopped before "
        "connecting (refusing its config, say) printed why on its own host, and one that starts "
        "later needs a longer timeout"]
    assert not (tmp_path / "run").exists()


def test_a_signal_one_process_caught_stops_every_process_at_one_saved_step(tmp_path):
    """Process 1 alone gets a SIGTERM as step 4 of 10 begins (`SIGTERM_AT_4`). It asks the
    others through the coordination service, and every process saves the one step they agree
    on (the step in flight plus 2 on the last to hear of it) and exits 0, as train.py does on a
    SIGTERM. Before, process 1 saved step 4 alone and exited while process 0 trained on into
    the next step's collectives, and both waited out jax's 300 s shutdown barrier and aborted
    (exit status -6). The same command then resumes from the saved step."""
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    procs = _start(corpus, run, "train.steps=10", process_1=("-c", SIGTERM_AT_4), out=tmp_path)
    # two processes start in about 30 s and the steps take ms; the old hang was 300 s
    statuses, outs = _outcome(procs, tmp_path, 240)
    assert statuses == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    saved = committed_steps(run)[-1]  # beside step 3 or 6, the periodic ones (keep=2)
    assert 4 < saved < 10, committed_steps(run)
    assert outs[0].splitlines()[-1] == f"SIGTERM on process 1 received: saved step {saved}, exiting"
    assert "Traceback" not in outs[0] + outs[1] and "Check failure" not in outs[0] + outs[1]
    resumed = _two_processes(corpus, run, "train.steps=10")
    assert f"resumed from step {saved}" in resumed[0] and "step 10/10" in resumed[0]


def test_a_step_one_process_cannot_read_is_set_aside_by_both_and_both_resume_together(tmp_path):
    """Process 1 alone fails to read step 6's train state (`STATE_UNREADABLE_ON_1`) while
    process 0 reads it whole. Both must reach one verdict before either goes on into a
    collective the other does not join: step 6 is damaged, set aside, and both resume from
    step 3 and train to the end on the same losses. Before, process 1 left the read while
    process 0 waited in the barrier orbax ends a restore with, each took the other's next
    collective for its own, and both exited 2 on `no checkpoint … verifies` (step 3 intact).
    Process 0, which prints the `skipped` line, names what process 1 saw (the file and its
    error, gathered in the agreement): before, it said only "another process cannot read …",
    and process 1's own error was shown nowhere.

    First, process 1 alone runs out of device memory reading step 6's state
    (`STATE_OUT_OF_MEMORY_ON_1`): no damage, but agreed on all the same, so both processes end
    in the same out-of-memory line naming process 1 and XLA's error, exit status 2, and no step
    is set aside. Before, process 1 raised it alone: process 0 waited in the agreement until
    train.py's peers stopped it with another line (`process 1 of 2 failed: DeviceMemoryError:
    …; this process stopped with it`), and without them until jax's shutdown barrier aborted
    both (305 s, exit status -6)."""
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    _two_processes(corpus, run)
    losses = _losses(run)
    procs = _start(corpus, run, process_1=("-c", STATE_OUT_OF_MEMORY_ON_1), out=tmp_path)
    statuses, outs = _outcome(procs, tmp_path, 240, after_error=60)
    assert statuses == [2, 2], outs[0][-3000:] + outs[1][-3000:]
    lines = [out.splitlines()[-1] for out in outs]
    assert lines[0] == lines[1], lines
    assert lines[0].startswith("error: out of device memory (process 1: RESOURCE_EXHAUSTED: Out "
                               "of memory allocating 1125899906842624 bytes.): the training run "
                               "at train.batch_size=8, "), lines[0]
    assert "Traceback" not in outs[0] + outs[1] and "Check failure" not in outs[0] + outs[1]
    assert committed_steps(run) == [3, 6] and not (run / "damaged_checkpoints").exists()

    procs = _start(corpus, run, process_1=("-c", STATE_UNREADABLE_ON_1), out=tmp_path)
    statuses, outs = _outcome(procs, tmp_path, 240)  # the processes start in about 30 s
    assert statuses == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    state = run.resolve() / "checkpoints" / "6" / "state"
    assert (f"skipped checkpoint step 6 is damaged: process 1 cannot read {state}: OSError: "
            f"[Errno 5] Input/output error: '{state}'; moved it to") in outs[0], outs[0][-3000:]
    assert "resumed from step 3" in outs[0], outs[0][-3000:]
    assert sorted(p.name for p in (run / "damaged_checkpoints").iterdir()) == ["6"]
    assert "Traceback" not in outs[0] + outs[1] and "Check failure" not in outs[0] + outs[1]
    np.testing.assert_allclose(_losses(run), losses, rtol=1e-6)
