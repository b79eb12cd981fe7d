"""diff_jax.metrics.peak_flops / mfu against the vendors' published dense bf16 peaks per chip, for
the `device_kind` strings jax reports, and MFU against a hand computation; a full disk under
metrics.jsonl is named."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest

from diff_jax import metrics
from diff_jax.metrics import MetricsWriter, mfu, peak_flops

# device_kind (as jax reports it) -> dense bf16 FLOP/s per chip from the vendor's datasheet
# (NVIDIA's "with sparsity" figures halved). Kinds that contain another kind's key ("TPU v5 lite"
# contains "tpu v5", "NVIDIA H100 PCIe" contains "h100") are the ones a first-match lookup gets wrong.
PUBLISHED = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p reports "TPU v5"
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e Trillium
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM: 1,979 TFLOPS with sparsity
    "NVIDIA H100 PCIe": 756e12,  # 1,513 with sparsity
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
}


@pytest.mark.parametrize("kind, expected", list(PUBLISHED.items()))
def test_peak_flops_is_the_published_dense_bf16_peak(kind, expected):
    assert peak_flops(kind) == expected


@pytest.mark.parametrize("kind", ["cpu", "TPU v3", "Tesla V100-SXM2-16GB", ""])
def test_peak_flops_of_an_unknown_device_is_none(kind):
    assert peak_flops(kind) is None
    assert mfu(1e9, 1e5, kind, 8) is None


def test_peak_flops_does_not_depend_on_the_table_order(monkeypatch):
    """The most specific key wins: reversing (or sorting) the table changes no answer."""
    table = dict(metrics.PEAK_FLOPS)
    for order in (list(reversed(table.items())), sorted(table.items()), sorted(table.items(), reverse=True)):
        monkeypatch.setattr(metrics, "PEAK_FLOPS", dict(order))
        assert {k: peak_flops(k) for k in PUBLISHED} == PUBLISHED, order


def test_mfu_is_achieved_over_peak_of_all_devices():
    # 1.2e9 FLOPs/token · 1e5 tokens/s = 1.2e14 FLOP/s over 4 v5e chips (4 · 197e12 = 7.88e14)
    # = 0.15228426...; float64 division: rel 1e-12 is ~4500 ulps of slack, still far below any
    # wrong formula (a missing device count is off by 4x).
    assert mfu(1.2e9, 1e5, "TPU v5 lite", 4) == pytest.approx(1.2e14 / 7.88e14, rel=1e-12)
    assert mfu(1.2e9, 1e5, "TPU v5 lite", 4) == pytest.approx(0.152284264, rel=1e-8)
    # one H100 SXM at 50%: 494.5e12 FLOP/s achieved
    assert mfu(6e8, 494.5e12 / 6e8, "NVIDIA H100 80GB HBM3", 1) == pytest.approx(0.5, rel=1e-12)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_under_metrics_jsonl_names_the_file(tmp_path):
    """A failed write or flush names no file of its own: the writer's errors name metrics.jsonl,
    so train.py's one error line says which file of the run could not be written."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    writer = MetricsWriter(tmp_path, True)
    for failing in (lambda: writer.write({"step": 1, "loss": 1.0}), writer.close):
        with pytest.raises(OSError) as raised:
            failing()
        assert raised.value.errno == errno.ENOSPC
        assert raised.value.filename == str(tmp_path / "metrics.jsonl")


def test_non_finite_metrics_are_written_as_json_null(tmp_path):
    """metrics.jsonl stays strict JSON: NaN and ±inf (Python or NumPy, alone or in a list) are
    null, which every JSON reader parses; json.dumps would write NaN / Infinity."""
    writer = MetricsWriter(tmp_path, True)
    writer.write({"step": 3, "loss": float("inf"), "grad_norm": np.float32(-np.inf),
                  "lambda": np.array([0.5, np.nan], np.float32), "lr": 0.25})
    writer.close()

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    row = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert row == {"step": 3, "loss": None, "grad_norm": None, "lambda": [0.5, None], "lr": 0.25}


def test_a_resume_drops_metrics_lines_that_are_not_utf8_text(tmp_path):
    """Bytes that are no UTF-8 (a disk's torn block, garbage appended) in metrics.jsonl are
    dropped like a line a kill tore, and so are the rows after the step resumed from: a resume
    read the file as text and stopped on a UnicodeDecodeError traceback."""
    rows = [json.dumps({"step": s, "loss": 1.0}).encode() for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join([rows[0], b"\x00\xff garbage", rows[1],
                                                          rows[2], b'{"step": 4, "lo\xe9']))
    assert metrics.drop_rows_after(tmp_path / "metrics.jsonl", 2) == 3
    assert (tmp_path / "metrics.jsonl").read_bytes() == rows[0] + b"\n" + rows[1] + b"\n"


class _Terminal:
    """A stream that says it is a terminal and keeps what is written."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_progress_off_a_terminal_writes_a_line_per_every_s_and_the_end_only_after_one(monkeypatch):
    """Off a terminal with every_s = 30: nothing for the first 30 s after the first call, then a
    line at most every 30 s, and the end's line only where one came before (a short task writes
    none); on a terminal the line is redrawn at every call and `finish` ends it."""
    import io

    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])

    def run(times: list[float], stream) -> None:
        progress = metrics.Progress(len(times), True, stream, unit="prompt", every_s=30)
        for done, t in enumerate(times, 1):
            now[0] = t
            progress.draw(done, f"shots={done}")
        progress.finish()

    out = io.StringIO()
    run([1.0, 20.0, 29.0, 31.0, 45.0, 62.0, 70.0], out)
    assert out.getvalue().splitlines() == [
        f"[{'#' * 13}{'.' * 11}] prompt 4/7  shots=4  ETA 0m30s",  # 30 s after the first
        f"[{'#' * 20}{'.' * 4}] prompt 6/7  shots=6  ETA 0m12s",  # 31 s after that
        f"[{'#' * 24}] prompt 7/7  shots=7  ETA 0m00s"]  # the end, 8 s later
    out = io.StringIO()
    run([1.0, 20.0, 29.0], out)
    assert out.getvalue() == ""
    term = _Terminal()
    run([1.0, 3.0], term)
    assert term.text == ("\r[############............] prompt 1/2  shots=1  ETA --"
                         "\r[########################] prompt 2/2  shots=2  ETA 0m00s\n")
    term = _Terminal()  # a shorter line is padded over the longer one before it
    progress = metrics.Progress(20, True, term)
    now[0] = 100.0
    progress.update(1, 10.0, 50_000.0)
    now[0] = 102.0
    progress.update(2, 9.5, 5.0)
    first, second = term.text.split("\r")[1:]
    assert first == f"[{'#' * 1}{'.' * 23}] step 1/20  loss 10.0000  50,000 tok/s  ETA --"
    assert second == f"[{'#' * 2}{'.' * 22}] step 2/20  loss 9.5000  5 tok/s  ETA 0m36s   "


def test_progress_with_block_ends_the_terminal_line_however_it_ends():
    """A Ctrl-C (or an error) inside `with Progress(...)` ends the status line first, so the
    `interrupted:` or `error:` line printed next starts a line of its own; a block that drew
    nothing writes nothing."""
    term = _Terminal()
    with pytest.raises(KeyboardInterrupt):
        with metrics.Progress(4, True, term, unit="token") as bar:
            bar.draw(1)
            raise KeyboardInterrupt
    assert term.text.startswith("\r[") and term.text.endswith("ETA --\n")
    term = _Terminal()
    with metrics.Progress(4, True, term) as bar:
        pass
    assert term.text == ""


def test_progress_message_on_a_terminal_ends_an_open_status_line_and_no_other(monkeypatch):
    """A message ends the status line drawn before it and starts its own line; one with no
    status line open (the first, or after another message) adds no blank line, and the line
    drawn after it is not padded to the old one's width."""
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: 5.0)
    term = _Terminal()
    progress = metrics.Progress(4, True, term)
    progress.message("run directory: R")
    progress.draw(1, "loss 10.0000  50,000 tok/s")
    progress.message("SIGINT received: finishing")
    progress.message("SIGINT received: saved step 1")
    progress.draw(2)
    progress.finish()
    progress.finish()
    assert term.text == ("run directory: R\n"
                         "\r[######..................] step 1/4  loss 10.0000  50,000 tok/s  ETA --"
                         "\nSIGINT received: finishing\nSIGINT received: saved step 1\n"
                         "\r[############............] step 2/4  ETA 0m00s\n")
