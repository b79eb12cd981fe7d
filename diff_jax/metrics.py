"""Run metrics: `<run_dir>/metrics.jsonl`, TensorBoard (when installed), progress line, MFU.

Only process 0 writes or prints; other processes get writers that do nothing.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from diff_jax.command import unread
from diff_jax.file_errors import naming
from diff_jax.output_dir import write_whole

# Dense bf16 peak FLOP/s per chip (vendors' datasheets; NVIDIA quotes "with sparsity", twice
# these), matched against `device.device_kind` (lower case, substring; the longest matching key
# wins, so "tpu v5 lite" is never taken for "tpu v5" nor "h100 pcie" for "h100", in any order).
PEAK_FLOPS = {
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,  # v5p reports "TPU v5"
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
    "h100": 989e12,  # SXM ("NVIDIA H100 80GB HBM3")
    "h100 pcie": 756e12,
    "h100 nvl": 835e12,
    "h200": 989e12,
    "h200 nvl": 835e12,
    "a100": 312e12,
    "b200": 2250e12,
}


def peak_flops(device_kind: str) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (e.g. CPU)."""
    kind = device_kind.lower()
    matches = [k for k in PEAK_FLOPS if k in kind]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def mfu(flops_per_token: float, tokens_per_sec: float, device_kind: str, num_devices: int) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s (`flops_per_token` · `tokens_per_sec`, summed over
    all devices) over `num_devices` times one device's `peak_flops`; None when the peak is unknown."""
    peak = peak_flops(device_kind)
    if peak is None:
        return None
    return flops_per_token * tokens_per_sec / (peak * num_devices)


def _plain(x: Any) -> Any:
    """numpy scalars/arrays -> JSON values; non-finite floats -> null."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    x = np.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def drop_rows_after(path: Path, step: int) -> int:
    """Rewrite the JSON-lines file `path` without its rows whose `step` is beyond `step` (and
    without a line that is no JSON text: torn by a kill, or bytes that are not even UTF-8);
    returns how many rows were dropped. The rewrite is atomic."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode()
            row = json.loads(line)
        except ValueError:  # UnicodeDecodeError or JSONDecodeError: a line cut short by a kill
            dropped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_whole(path, "".join(x + "\n" for x in kept))
    return dropped


def _after_earlier_event_files(tb_dir: Path) -> None:
    """Wait until the clock's second is past the creation second of every event file in
    `tb_dir`. TensorBoard reads a run's event files in name order, and a name is
    `events.out.tfevents.SECOND.HOST.PID.N` with N a per-process count that is not zero-padded:
    a writer opened in the same second as an earlier one of the process could sort before it
    (N 10 after 9), and then its restart would be read first and discard nothing."""
    seconds = [part for f in tb_dir.glob("events.out.tfevents.*")
               if (part := f.name.split(".")[3]).isdigit()]
    if seconds:
        time.sleep(max(0.0, max(map(int, seconds)) + 1 - time.time()))


class MetricsWriter:
    """Appends JSON lines (and TensorBoard scalars when `tensorboard` is importable).

    Rows of an earlier invocation beyond `start_step` (the step this one resumes from) are
    dropped first, so every step appears once in `metrics.jsonl`; `dropped` says how many. Event
    files cannot be rewritten, so a resumed writer records a restart (`SessionLog.START` at step
    `start_step + 1`), on which TensorBoard discards the earlier events from that step on.
    """

    def __init__(self, run_dir: str | Path, enabled: bool, start_step: int = 0) -> None:
        self.enabled = enabled
        self.dropped = 0
        self._file: TextIO | None = None
        self._tb = None
        if not enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.dropped = drop_rows_after(Path(run_dir) / "metrics.jsonl", start_step)
        self._file = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
            from tensorboard.compat.proto import event_pb2
        except ImportError:
            return
        tb_dir = Path(run_dir) / "tensorboard"
        _after_earlier_event_files(tb_dir)
        self._tb = EventFileWriter(str(tb_dir))
        if start_step > 0:
            self._tb.add_event(event_pb2.Event(
                wall_time=time.time(), step=start_step + 1,
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` as one JSON line (numpy values made plain, non-finite floats null);
        with TensorBoard, its numeric entries also become scalars at `record["step"]` (a list:
        one scalar `key/layer_i` per element). Does nothing when disabled."""
        if not self.enabled:
            return
        record = _plain(record)
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: the failed flush names no file
            raise naming(e, self._file.name) from e
        if self._tb is not None:
            self._write_tb(record)

    def _write_tb(self, record: dict[str, Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = []
        for key, v in record.items():
            if key == "step" or v is None:
                continue
            items = enumerate(v) if isinstance(v, list) else [(None, v)]
            for i, x in items:
                if isinstance(x, (int, float)):
                    tag = key if i is None else f"{key}/layer_{i}"
                    values.append(summary_pb2.Summary.Value(tag=tag, simple_value=float(x)))
        event = event_pb2.Event(wall_time=time.time(), step=int(record["step"]),
                                summary=summary_pb2.Summary(value=values))
        self._tb.add_event(event)

    def close(self) -> None:
        """Close `metrics.jsonl` and the TensorBoard writer (whichever are open)."""
        try:
            if self._file is not None:
                self._file.close()
        except OSError as e:  # flushing what a failed write left buffered
            raise naming(e, self._file.name) from e
        finally:
            if self._tb is not None:
                self._tb.close()


class Progress:
    """One status line: done/total units, details, ETA (redrawn on a terminal; a line per call
    elsewhere, or at most one per `every_s` seconds where that is set). Training's reads step,
    loss, tokens/s (`update`); eval's long tasks draw theirs (`draw`, and `finish` as their
    `with` block ends, however it ends).

    The ETA is extrapolated from the wall-clock time between the first call and the latest, so
    the first unit of an invocation (which includes compiling) never counts; until two calls
    have been seen it reads `ETA --`.
    """

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None, *,
                 unit: str = "step", every_s: float = 0.0) -> None:
        # sys.stderr looked up now, not at import: it may have been replaced since (tests, tools)
        self.total, self.enabled, self.stream = total, enabled, stream or sys.stderr
        self.unit, self.every_s = unit, every_s
        self.tty = enabled and self.stream.isatty()
        self._first: tuple[int, float] | None = None  # (units done, time) of the first call
        self._shown: float | None = None  # when the last line was written
        self._drawn = 0  # the length of the status line open on the terminal (0: none)

    def update(self, step: int, loss: float, tokens_per_sec: float) -> None:
        """Draw training's line for `step` (steps may be skipped between calls)."""
        self.draw(step, f"loss {loss:.4f}  {tokens_per_sec:,.0f} tok/s")

    def draw(self, done: int, details: str = "") -> None:
        """Draw the line for `done` of the total units, with `details` after the count. Off a
        terminal with `every_s` set, a line is written once `every_s` seconds have passed since
        the first call or the last line, and at the end (`done` = total) only after another:
        a short task writes none, a long one's log shows it advance and finish."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._first is None:
            self._first = (done, now)
        first_done, first_time = self._first
        if not self.tty and self.every_s:
            last = first_time if self._shown is None else self._shown
            if now - last < self.every_s and not (done >= self.total and self._shown is not None):
                return
        eta = "--"
        if done > first_done:
            per_unit = (now - first_time) / (done - first_done)
            eta = _duration(max(self.total - done, 0) * per_unit)
        bar_w = 24
        filled = int(bar_w * done / max(self.total, 1))
        line = "  ".join([f"[{'#' * filled}{'.' * (bar_w - filled)}] {self.unit} {done}/"
                          f"{self.total}", *([details] if details else []), f"ETA {eta}"])
        self._shown = now
        if self.tty:  # padded over a longer line before it ("loss 10.0" then "loss 9.99")
            line, self._drawn = line.ljust(self._drawn), len(line)
            self._write("\r" + line)
        else:
            self._write(line + "\n")

    def finish(self) -> None:
        """End a terminal's status line, so that what is printed next starts a line of its own."""
        if self.tty and self._drawn:
            self._drawn = 0
            self._write("\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        """`finish`, on an error or a Ctrl-C too: its `error:` or `interrupted:` line was
        written onto the end of the status line (`...ETA 1m00sinterrupted: stopped at once`)."""
        self.finish()

    def message(self, text: str) -> None:
        """Print `text` on a line of its own (below the status line where one is open on a
        terminal: no blank line before the first, or between two messages)."""
        if self.enabled:
            opened, self._drawn = self._drawn, 0
            self._write(("\n" if opened else "") + text + "\n")

    def _write(self, text: str) -> None:
        """Write `text` to the stream now; where its pipe's reader is gone (`2>&1 | head`) the
        training loop stops as on SIGTERM, saving the step in flight (`command.unread`)."""
        try:
            self.stream.write(text)
            self.stream.flush()
        except BrokenPipeError as e:
            unread(e)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
