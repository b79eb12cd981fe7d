"""A child process under a time limit, for the GPU session's stages and the kernel probes."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diff_jax.command import STOPS, not_ignored, off_the_terminal  # noqa: E402

# What `run_limited` starts its child through on Linux: a Python that asks the kernel for SIGKILL
# when its parent (argv[1], the process running run_limited) dies, PR_SET_PDEATHSIG, and execs
# the child (argv[2:]), which keeps it: exec clears it only for set-user-ID or set-group-ID
# programs and ones with file capabilities. A parent that died before the prctl (the child is
# then another process's, init's or a subreaper's) is caught by the parent id it left. Python
# ignores SIGPIPE and SIGXFSZ at its start: they are put back as Popen's restore_signals leaves
# them, so the child (ncu, nvidia-smi) starts with them as it did without this Python. A program
# exec cannot start is one line and exit status 127 or 126, as `not_started` says it (its
# traceback named no path, exit status 1: a child that ran and failed, to the callers).
DIES_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
for s in (signal.SIGPIPE, signal.SIGXFSZ):
    signal.signal(s, signal.SIG_DFL)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    print(f"could not start: {sys.argv[2]}: {e.strerror}", file=sys.stderr)
    sys.exit(127 if isinstance(e, FileNotFoundError) else 126)
"""


class Stopped(KeyboardInterrupt):
    """This process got `signum` (one of `STOPS`) while `run_limited`'s child ran, which was
    stopped with it; `output`: what the child printed until then, for the caller to record
    before it stops as after a Ctrl-C (a KeyboardInterrupt: `command.concluded`'s
    `interrupted:` line and exit status 130)."""

    def __init__(self, signum: int, output: str):
        super().__init__(f"got {signal.Signals(signum).name}")
        self.signum, self.output = signum, output


def not_started(path: str, error: OSError) -> tuple[str, int]:
    """`run_limited`'s output and exit status for a child whose program `path` could not be
    started (`error`: exec's or Popen's): one line, "could not start: PATH: No such file or
    directory", and 127 where there is no such file, else 126 ("Permission denied", "Exec
    format error"), as a POSIX shell reports a command it could not find or could not run.
    `DIES_WITH_PARENT` says it the same way. Measured before: `run_limited(["/nonexistent"])`
    returned the wrapper's FileNotFoundError traceback, which names no path, and exit status 1
    (a probe that ran and failed, in mosaic_probe.py's rows and hopper_session.py's stages);
    off Linux Popen's FileNotFoundError escaped it (and hopper_session.py's `_run`)."""
    return f"could not start: {path}: {error.strerror}\n", (
        127 if isinstance(error, FileNotFoundError) else 126)


def run_limited(cmd: list[str], limit: float, grace: float,
                env: dict[str, str] | None = None) -> tuple[str, int | None]:
    """Run `cmd` in the repository root, stdout and stderr together; at `limit` seconds it is
    sent SIGTERM and, `grace` seconds later, killed. Returns (its output, its exit status, or
    None when it ran past `limit`); a program that cannot be started is a child that failed,
    its output one line naming it (`not_started`).

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
    loop without saving its step).

    A SIGKILL to this process alone (the device tool at its command's limit, the OOM killer)
    cannot be passed on: the child ran on, and on the GPU held the device and its memory for the
    next call. On Linux it now dies with this process, SIGKILLed by the kernel as the thread
    that started it (it waits here for the child) exits (`DIES_WITH_PARENT`; measured with a
    session SIGKILLed in its env stage, a 600 s sleep: still sleeping 30 s later before, gone
    17-31 ms after the kill now). SIGKILL, not SIGTERM: once this
    process is gone nothing reads the child's output (its pipe's reader was this process) and
    nothing kills it after `grace`, while a hung kernel, the case that matters most, ignores
    SIGTERM; and a training child saving its step on SIGTERM would still be writing its run
    directory when the next call's replicate stage resumes from it. A training child killed
    so resumes from its last checkpoint. Through a Python that execs the child, not a Popen
    `preexec_fn`: kernel_profile.py's parent has started jax's backend, whose threads make a
    fork that runs Python in the child risk a deadlock (jax warns at each one); the Python
    costs the child about 17 ms at its start (/bin/true: 17-18 ms against 0.6-0.8 ms).
    Elsewhere the child is started as it is. Only the child: a process it starts is its own
    (`dies_with` for one of ours)."""
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
        if sys.platform.startswith("linux"):
            cmd = [sys.executable, "-I", "-S", "-c", DIES_WITH_PARENT, str(os.getpid()), *cmd]
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env or dict(os.environ),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as e:  # off Linux, the program (on Linux the wrapper's exec says it)
            out, code = not_started(cmd[0], e)
        else:
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


def dies_with(pid: int) -> None:
    """SIGKILL this process once process `pid` exits, where `pid` started it through others:
    kernel_profile.py's profiled program, which ncu starts. Where `ncu` is a launcher script
    that runs the profiler binary as its child (the `ncu` beside target/ in an Nsight Compute
    install is a `sh` one, as packagings reproduce it; the lent machine's was not looked at), a
    kernel_profile.py SIGKILLed takes the script with it (`run_limited`) and left the profiler
    and the program running on the GPU (tested with such a script);
    PR_SET_PDEATHSIG names the parent only (the profiler, which lives on) and is not inherited
    across fork. A thread waits on a pidfd of `pid` instead, readable once it has exited (a
    zombie not yet reaped included); where `pid` is gone already, at once. Without pidfds (not
    Linux, or before 5.3) nothing is watched."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=f"dies with {pid}", daemon=True).start()
