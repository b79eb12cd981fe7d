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

# Dense bf16 peak FLOP/s per chip, matched against `device.device_kind` (lower case, substring).
PEAK_FLOPS = {
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
    "h100": 989e12,
    "h200": 989e12,
    "a100": 312e12,
    "b200": 2250e12,
}


def peak_flops(device_kind: str) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (e.g. CPU)."""
    kind = device_kind.lower()
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def mfu(flops_per_token: float, tokens_per_sec: float, device_kind: str, num_devices: int) -> float | None:
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


class MetricsWriter:
    """Appends JSON lines (and TensorBoard scalars when `tensorboard` is importable)."""

    def __init__(self, run_dir: str | Path, enabled: bool) -> None:
        self.enabled = enabled
        self._file: TextIO | None = None
        self._tb = None
        if not enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
            self._tb = EventFileWriter(str(Path(run_dir) / "tensorboard"))
        except ImportError:
            self._tb = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = _plain(record)
        self._file.write(json.dumps(record) + "\n")
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
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """One status line: step, loss, tokens/s, ETA (redrawn on a terminal, a line per log otherwise)."""

    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stderr) -> None:
        self.total, self.enabled, self.stream = total, enabled, stream
        self.tty = enabled and stream.isatty()

    def update(self, step: int, loss: float, tokens_per_sec: float, step_time: float) -> None:
        if not self.enabled:
            return
        eta = max(self.total - step, 0) * step_time
        bar_w = 24
        done = int(bar_w * step / max(self.total, 1))
        line = (f"[{'#' * done}{'.' * (bar_w - done)}] step {step}/{self.total}  loss {loss:.4f}  "
                f"{tokens_per_sec:,.0f} tok/s  ETA {_duration(eta)}")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + text + "\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
