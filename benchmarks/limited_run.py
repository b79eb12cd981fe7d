"""A child process under a time limit, for the GPU session's stages and the kernel probes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diff_jax.command import STOPS, not_ignored, off_the_terminal  # noqa: E402


class Stopped(KeyboardInterrupt):
    """This process got `signum` (one of `STOPS`) while `run_limited`'s child ran, which was
    stopped with it; `output`: what the child printed until then, for the caller to record
    before it stops as after a Ctrl-C (a KeyboardInterrupt: `command.concluded`'s
    `interrupted:` line and exit status 130)."""

    def __init__(self, signum: int, output: str):
        super().__init__(f"got {signal.Signals(signum).name}")
        self.signum, self.output = signum, output


def run_limited(cmd: list[str], limit: float, grace: float,
                env: dict[str, str] | None = None) -> tuple[str, int | None]:
    """Run `cmd` in the repository root, stdout and stderr together; at `limit` seconds it is
    sent SIGTERM and, `grace` seconds later, killed. Returns (its output, its exit status, or
    None when it ran past `limit`).

    When this process gets SIGINT, SIGTERM or SIGHUP (`STOPS`; in the main thread) while the
    child runs, the child is stopped as at its limit (SIGTERM: attention.py writes what it
    measured, a training loop saves its step, a probe dumps its stacks; killed `grace` seconds
    later, or at once on a second signal), then `Stopped` is raised with its output. Before,
    the child was left running: Python's default SIGTERM and SIGHUP ended this process alone,
    and a KeyboardInterrupt left `communicate` after 0.25 s; measured with `kill -TERM` on the
    parent of a child sleeping 60 s, the child ran on to its end, which on the GPU holds the
    device and its memory through the stages after it. The child stays in this process's
    process group: a signal sent to the whole group (Ctrl-C at a terminal, `timeout`, a SIGKILL
    that nothing can pass on) reaches it as before, and it is passed on as SIGTERM, which a
    child that got it itself takes twice without harm (a second SIGINT would stop a training
    loop without saving its step)."""
    proc: subprocess.Popen | None = None
    caught: list[int] = []
    kill = threading.Timer(grace, lambda: proc.kill())

    def stop() -> None:  # the child, as at its limit
        proc.terminate()
        kill.start()

    def forward(signum: int, _frame) -> None:
        off_the_terminal(signum)
        caught.append(signum)
        if proc is None:  # not started yet: stopped once it is
            return
        if kill.ident is None:
            stop()
        else:  # a second one: at once
            proc.kill()

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in not_ignored(STOPS)} if main else {}
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or dict(os.environ),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if caught and kill.ident is None:  # got while it started
            stop()
        try:
            out, _ = proc.communicate(timeout=max(limit, 1))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, _ = proc.communicate(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            code = None
    finally:
        kill.cancel()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if caught:
        raise Stopped(caught[0], out)
    return out, code
