"""A multi-process job stops together: when one process fails, the others stop within a second.

Without this, a process that raised (bad input only it sees, a full disk, a device out of
memory, Ctrl-C pressed twice on it) printed its error and then waited in jax's shutdown barrier,
and its peers waited in their next collective, until jax's coordination service gave up on the
barrier (300 s) and aborted every process with a screen of C++ log and stack trace (exit status
-6).

`stop_together` wraps a process's part of the job. An error that escapes it is announced in
the coordination service's key-value store before it propagates: `FAILED_KEY` holds the first
process's failure (its index, exit status and error's first line), and each other process's
`STOP_KEY` is set. Each process waits for its own `STOP_KEY` in a thread, so it hears of the
failure even while its main thread waits inside a collective: it prints one line naming the
process that failed (`error: process 1 of 2 failed: …`, or `interrupted:` after Ctrl-C) and
exits at once with that process's status. A process that failed too (the same bad checkpoint
or config value on every host) reports its own error instead, and announces it; the job's
failure stays the first. They then leave together through jax's shutdown
barrier, without the interpreter's teardown; process 0, which hosts the coordination service,
joins it once the others have said they are leaving (they would abort with a C++ log on losing
the service first), and leaves without it after `LEAVE_WAIT_S`. A process that ends normally
sets its own `STOP_KEY` to stop its thread before jax shuts down.

A process killed outright (SIGKILL, a lost host) announces nothing: the others then stop when
the coordination service misses its heartbeats (`distributed.heartbeat_timeout_s`), with jax's
own abort. Checkpoints: the failing process closes its checkpoint manager, which waits for a
save in flight to commit, before it announces; the others stop where a killed process would,
and orbax commits a step only once every process has written it, so the committed steps stay as
they were.

A process that stops before it has connected (its config refused on its host, say) announces
nothing either: the others wait in `jax.distributed.initialize` for every process to connect,
and stop in one line naming `distributed.initialization_timeout_s` once it has passed
(`connected_within`), exit status 2. Before, they aborted after jax's 300 s with a C++ log and
stack trace (exit status -6); jax's own timeout, which still aborts that way, is left
`CONNECT_MARGIN_S` longer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import jax

from diff_jax.command import (EXIT_INTERRUPTED, before_leaving, failed, interrupted,
                              to_devnull)
from diff_jax.error_text import first_line

FAILED_KEY = "diff_jax/failed"  # the job's first failure, a `Failure` as JSON
STOP_KEY = "diff_jax/stop/"  # + a process index: "failed" (by the failing process) or "done"
LEFT_KEY = "diff_jax/left/"  # + a process index: that process is leaving (process 0 waits)
DONE = "done"  # a process's own STOP_KEY at its normal end
LEAVE_WAIT_S = 10.0  # how long process 0 waits for the others to leave before it does
WATCH_MS = 2**31 - 1  # the watcher's wait: the whole job (it ends with a STOP_KEY)
GIVE_WAY_S = LEAVE_WAIT_S / 2  # the most the watcher waits for an error unwinding (`_Job.watch`)
MAIN, WATCHER = "main", "watcher"  # who reports how a process ends (`_Job.report`)
CONNECT_MARGIN_S = 10  # jax's initialization timeout is this much longer than ours (its abort)


@dataclasses.dataclass(frozen=True)
class Failure:
    """How one process of the job failed: its index, exit status and what happened."""

    process: int
    status: int
    what: str  # "failed: <error>" or "was stopped at once (Ctrl-C)"

    @classmethod
    def of(cls, error: BaseException, process: int, status: int) -> Failure:
        """`error`, which ends `process` with `status`."""
        what = ("was stopped at once (Ctrl-C)" if isinstance(error, KeyboardInterrupt)
                else f"failed: {type(error).__name__}: {first_line(error)}")
        return cls(process, status, what)

    def line(self, processes: int) -> int:
        """Print this failure as the one line a peer ends with; return its exit status."""
        text = f"process {self.process} of {processes} {self.what}; this process stopped with it"
        return interrupted(text) if self.status == EXIT_INTERRUPTED else failed(text, self.status)


@contextlib.contextmanager
def connected_within(seconds: int) -> Iterator[None]:
    """Around `jax.distributed.initialize`: where it has not returned within `seconds`
    (`distributed.initialization_timeout_s`: a process of the job stopped before connecting, or
    did not start), end this process in one line naming the field, exit status 2. jax's own
    timeout would abort it (a C++ log, exit status -6), and a Python exception cannot reach the
    thread waiting in it, so a timer thread does (the wait releases the GIL)."""
    timer = threading.Timer(seconds, _not_connected, (seconds,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _not_connected(seconds: int) -> NoReturn:
    """`connected_within`'s line and exit, from its timer thread."""
    from jax._src import distributed

    address = distributed.global_state.coordinator_address or "jax detects"
    sys.stdout.flush()
    os._exit(failed(f"distributed.initialization_timeout_s={seconds}: the job's processes did "
                    f"not all connect to the coordinator {address} within {seconds} s; one that "
                    "stopped before connecting (refusing its config, say) printed why on its "
                    "own host, and one that starts later needs a longer timeout"))


@contextlib.contextmanager
def stop_together(status: Callable[[BaseException], int]) -> Iterator[None]:
    """In a multi-process job, announce an error escaping the block (with its exit status
    `status(error)`, which the command must exit with) to the other processes, and stop this
    process at once when another one announces its own. A no-op in a single process."""
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None or state.num_processes < 2:
        yield
        return
    job = _Job(state.client, jax.process_index(), jax.process_count(), threading.get_ident())
    job.watcher.start()
    before_leaving(job.at_exit)
    try:
        yield
    except BaseException as e:
        if not job.report(MAIN):
            job.watcher.join()  # it is ending this process with the other's line
        job.announce(Failure.of(e, job.me, status(e)))
        raise


@dataclasses.dataclass
class _Job:
    """This process's part in stopping together: the coordination-service client, the watcher
    thread, which of the two reports how this process ends, and its own failure once
    announced."""

    client: Any
    me: int
    processes: int
    runner: int  # the thread running the job (`stop_together`'s block), by `threading.get_ident`
    failure: Failure | None = None
    reporter: str | None = None  # MAIN (this process failed) or WATCHER (another one did)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    watcher: threading.Thread = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.watcher = threading.Thread(target=self.watch, name="diff_jax-peers", daemon=True)

    def report(self, who: str) -> bool:
        """Whether `who` (MAIN or WATCHER) reports how this process ends: the first to ask does,
        the other gives way."""
        with self.lock:
            if self.reporter is None:
                self.reporter = who
            return self.reporter == who

    def announce(self, failure: Failure) -> None:
        """Keep `failure` as this process's and tell the other processes; the job's
        (`FAILED_KEY`) stays the first one announced, which the processes that did not fail
        report."""
        self.failure = failure
        # ALREADY_EXISTS (jax's error type differs across versions), or the service gone
        with contextlib.suppress(Exception):
            self.client.key_value_set(FAILED_KEY, json.dumps(dataclasses.asdict(failure)))
        for p in range(self.processes):
            if p != self.me:
                with contextlib.suppress(Exception):  # already "done", or the service gone
                    self.client.key_value_set(f"{STOP_KEY}{p}", "failed")

    def watch(self) -> None:
        """The watcher thread: wait for this process's STOP_KEY; after another process's
        failure, end this process with its line and status, unless this process failed too.
        That one reports its own error: the runner thread, once the error reaches
        `stop_together`, and until then, while the error unwinds the runner's blocks (closing a
        checkpoint manager, say), the watcher gives way for up to `GIVE_WAY_S`."""
        try:
            if self.client.blocking_key_value_get(f"{STOP_KEY}{self.me}", WATCH_MS) == DONE:
                return
            failure = Failure(**json.loads(self.client.key_value_try_get(FAILED_KEY)))
        except Exception:  # the service is gone: jax's own error handling stops this process
            return
        deadline = time.monotonic() + GIVE_WAY_S
        while (self.reporter is None and _handling_error(self.runner)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        if not self.report(WATCHER):
            return  # this process failed too: it reports its own error and leaves
        sys.stdout.flush()  # what was printed so far comes before the line
        status = failure.line(self.processes)
        _last_output()  # the runner thread goes on until this process exits (drawing progress)
        self.leave(status)

    def at_exit(self) -> None:
        """As the command ends: after this process's failure, leave with the others; else stop
        the watcher (a thread still inside jax's client as the interpreter finalizes aborts it)."""
        if self.failure is not None:
            self.leave(self.failure.status)
        with contextlib.suppress(Exception):  # "failed" got there first: the watcher exits
            self.client.key_value_set(f"{STOP_KEY}{self.me}", DONE)
        self.watcher.join(LEAVE_WAIT_S)

    def leave(self, status: int) -> NoReturn:
        """Exit now with `status`, skipping the interpreter's teardown: process 0 (the
        coordination service's host) once the others have said they leave, the others after
        saying so, all through jax's shutdown barrier, which they then reach together. Where one
        does not say so within `LEAVE_WAIT_S` (killed, or stuck), process 0 exits without it."""
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            if self.me == 0:
                deadline = time.monotonic() + LEAVE_WAIT_S
                for p in range(1, self.processes):
                    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                    self.client.blocking_key_value_get(f"{LEFT_KEY}{p}", left_ms)
            else:
                self.client.key_value_set(f"{LEFT_KEY}{self.me}", "")
            jax.distributed.shutdown()
        except Exception:  # the wait ran out, or the service is gone: leave as it is
            pass
        os._exit(status)


def _last_output() -> None:
    """Send whatever this process prints from now on to /dev/null, so that the line just printed
    stays its last: a thread that goes on until the process exits would otherwise print after
    it (the progress line of the step in flight, drawn on stderr, came after a stopped process's
    line in 1 of 8 runs of the test)."""
    sys.stdout.flush()
    sys.stderr.flush()
    to_devnull(1, 2)


def _handling_error(thread: int) -> bool:
    """Whether the thread `thread` (`threading.get_ident`) is handling an exception: in an
    `except` or `finally` block, or a `with` block's exit, as the exception propagates."""
    error = sys._current_exceptions().get(thread)
    return (error[1] if isinstance(error, tuple) else error) is not None  # Python 3.11: a tuple


SIGNAL_KEY = "diff_jax/signal/"  # + the run's number in this process (`_runs`), then "request"
# (the first signal's name and process, or "done" at the end) and "at/" + a process index (the
# step that process proposes to stop at)
SIGNAL_MARGIN = 2  # a proposal is the step in flight + this: no process is more than 1 ahead
_runs = [0]  # `agreed_stop`s begun in this process: every process of the job counts the same


@dataclasses.dataclass
class AgreedStop:
    """Where a job stops after a signal (SIGTERM, a first Ctrl-C) that one or more of its
    processes caught, maybe at different steps: every process saves the same step and exits.

    A process that caught one (`caught`, `train_loop._stop_signals`' list) asks the others
    through the coordination service; a watcher thread of each process hears it
    (`requested`). Each then proposes the step in flight plus `SIGNAL_MARGIN` and goes on
    training; once every process has proposed, all stop at the largest proposal. The margin
    covers the processes' skew: a process reads each step's metrics before it starts the next
    but one, so none runs more than one step ahead of another. In a single process the stop is
    the step in flight, as before."""

    client: Any = None  # None: a single process
    me: int = 0
    processes: int = 1
    prefix: str = ""
    requested: str | None = None  # by the watcher: "SIGTERM on process 1"
    proposed: bool = False
    at: int | None = None  # the step every process stops at, once all proposed

    def pending(self, caught: list[str]) -> bool:
        """Whether a stop is under way: this process caught a signal or another one did."""
        return bool(caught) or self.requested is not None

    def why(self, caught: list[str]) -> str:
        """The signal the job stops on: this process's, else the one the watcher heard of."""
        return caught[0] if caught else str(self.requested)

    def reached(self, step: int, caught: list[str]) -> bool:
        """Whether the job stops at `step` (the step in flight, already dispatched): in a
        single process once it caught a signal; in a job once every process has proposed a
        step and `step` is the largest."""
        if not self.pending(caught):
            return False
        if self.client is None:
            return True
        if not self.proposed:
            if caught:  # the first to ask names the signal; the others' asks change nothing
                with contextlib.suppress(Exception):  # ALREADY_EXISTS
                    self.client.key_value_set(f"{self.prefix}request",
                                              f"{caught[0]} on process {self.me}")
            self.client.key_value_set(f"{self.prefix}at/{self.me}", str(step + SIGNAL_MARGIN))
            self.proposed = True
        if self.at is None:
            proposals = self.client.key_value_dir_get(f"{self.prefix}at/")
            if len(proposals) == self.processes:
                self.at = max(int(value) for _, value in proposals)
        return self.at is not None and step >= self.at

    def watch(self) -> None:
        """The watcher thread: wait for the job's request; keep what it names unless it is the
        end of the run ("done")."""
        with contextlib.suppress(Exception):  # the service gone: `stop_together`'s concern
            request = self.client.blocking_key_value_get(f"{self.prefix}request", WATCH_MS)
            if request != DONE:
                self.requested = request


@contextlib.contextmanager
def agreed_stop() -> Iterator[AgreedStop]:
    """An `AgreedStop` for the duration of a training loop, its watcher running in a
    multi-process job. On the way out the request is set to "done" where no process asked (no
    watcher is left inside jax's client)."""
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None or state.num_processes < 2:
        yield AgreedStop()
        return
    _runs[0] += 1
    stop = AgreedStop(state.client, jax.process_index(), jax.process_count(),
                      f"{SIGNAL_KEY}{_runs[0]}/")
    watcher = threading.Thread(target=stop.watch, name="diff_jax-signals", daemon=True)
    watcher.start()
    try:
        yield stop
    finally:
        with contextlib.suppress(Exception):  # a request (or another process's "done") was first
            stop.client.key_value_set(f"{stop.prefix}request", DONE)
        watcher.join(LEAVE_WAIT_S)
