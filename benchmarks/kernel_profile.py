"""Each Mosaic GPU kernel's own time under Nsight Compute: where a forward + backward goes.

    python benchmarks/kernel_profile.py --out DIR [--head-dims 128,64] [--t 4096] [--limit 110]

For each head width and schedule (`SCHEDULES`: the table's tiles, and dQ fused into the share
dK/dV kernel with atomic or TMA reduce-adds; a schedule whose tiles the shared-memory plan
refuses at that d is a row saying so) a child process (`--run D SCHEDULE`) runs the fused
kernel's gradient step (its forward, then the backward kernels) at attention.py's benchmark shape (bf16, causal, λ = LAM,
B·T = --tokens, H = --heads), `--reps` + 1 times, under

    ncu --clock-control none --cache-control none --print-units base --csv
        --metrics gpu__time_duration.sum -k regex:diff_flash --log-file LOG

ncu serializes the kernels it profiles and times each alone, at the clocks the GPU runs (the device
notes ask for `--clock-control none`) and with the caches as the step leaves them. Per kernel
(diff_flash_fwd, _dq, _dkdv, _dkdvdq) the first launch is dropped (module load) and the median of
the rest kept; `bwd_ms` sums the backward kernels. The step's XLA work around the kernels (δ, casts,
padding) is not counted. Writes DIR/kernel_profile.json (rows, and each child's ncu log) and
DIR/kernel_profile.md. A row whose child fails, runs past --limit, or finds no ncu (or one that
cannot read the GPU's counters: on gVisor ncu fails with "LibraryNotLoaded") records why; so does
one that --budget (seconds for all rows) leaves no --limit for. Should this process be killed
(SIGKILL: nothing it can pass on), ncu dies with it (`limited_run.run_limited`) and so does the
profiled program, ncu's child (it watches this process: `limited_run.dies_with`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

from limited_run import ROOT, Stopped, dies_with, run_limited

sys.path.insert(0, str(ROOT))

from diff_jax.command import (Written, concluded, leave, positive_float,  # noqa: E402
                              positive_int, positive_ints)
from diff_jax.output_dir import write_whole  # noqa: E402

METRIC = "gpu__time_duration.sum"
KERNEL = re.compile(r"(diff_flash_[a-z]+)")  # the kernel of a launch's name (any suffixes)
UNIT_MS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}
# name: the Tiles fields over the table's (`kernels.hopper`) for d
SCHEDULES = {"table": {}, "fused": {"dkv": "share", "dq": "fused", "block_q_dkv": 64},
             "fused_tma": {"dkv": "share", "dq": "fused_tma", "block_q_dkv": 64}}
BACKWARD = ("diff_flash_dq", "diff_flash_dkdv", "diff_flash_dkdvdq")


def parse_ncu(text: str) -> dict[str, list[float]]:
    """kernel -> its launches' durations in ms, in launch order, from an ncu --csv log (its
    "ID",... header row onwards; ==PROF== lines and the program's output before it are
    skipped). A unit outside `UNIT_MS` is a ValueError naming it."""
    lines = text.splitlines()
    start = next((n for n, x in enumerate(lines) if x.startswith('"ID"')), None)
    out: dict[str, list[float]] = {}
    if start is None:
        return out
    for row in csv.DictReader(lines[start:]):
        found = KERNEL.search(row.get("Kernel Name") or "")
        if row.get("Metric Name") != METRIC or found is None:
            continue
        unit = row.get("Metric Unit", "")
        if unit not in UNIT_MS:
            raise ValueError(f"ncu log: {METRIC} in unit {unit!r}, expected one of "
                             f"{', '.join(UNIT_MS)}")
        out.setdefault(found[1], []).append(float(row["Metric Value"].replace(",", ""))
                                            * UNIT_MS[unit])
    return out


def summarize(launches: dict[str, list[float]]) -> dict:
    """{kernel: median ms of its launches after the first}, with `bwd_ms` (the backward
    kernels) and `total_ms`; a kernel launched once only is left out."""
    medians = {name: statistics.median(ms[1:]) for name, ms in launches.items() if len(ms) > 1}
    bwd = sum(ms for name, ms in medians.items() if name in BACKWARD)
    return {"kernels_ms": medians, "bwd_ms": bwd, "total_ms": sum(medians.values())}


def tiles_of(d: int, schedule: str):
    """The Tiles of `schedule` at d (bf16), checked by the shared-memory plan (a ValueError
    naming the tile that does not fit)."""
    import jax.numpy as jnp

    from diff_jax.kernels import flash_mgpu, hopper

    tiles = dataclasses.replace(hopper.tiles_for(d, jnp.bfloat16)[0], **SCHEDULES[schedule])
    flash_mgpu.warpgroups(d, tiles)
    return tiles


def _child(d: int, schedule: str, args) -> None:
    """The profiled program: `--reps` + 1 gradient steps of the fused kernel (on the GPU)."""
    import jax
    import jax.numpy as jnp

    from attention import LAM, Shape, _fwd_and_step, _inputs, variants
    from diff_jax.kernels import BlockSizes, hopper

    tiles = tiles_of(d, schedule)
    print(f"d={d} {schedule}: {hopper.tiles_text(tiles)}", flush=True)
    shape = Shape(args.tokens // args.t, args.t, args.heads, d)
    f = variants(BlockSizes(mosaic_gpu=tiles), None, with_cudnn=False)["fused"]
    _, step = _fwd_and_step(f)
    q, k, v, do = _inputs(shape, jnp.bfloat16)
    for _ in range(args.reps + 1):
        jax.block_until_ready(step(q, k, v, jnp.float32(LAM), do))


def profile(d: int, schedule: str, args, out: Path) -> dict:
    """One (d, schedule) row: the child under ncu, its log parsed and summarized."""
    row = {"d": d, "schedule": schedule, "T": args.t}
    try:
        tiles_of(d, schedule)
    except ValueError as e:
        return row | {"error": f"refused: {e}"}
    ncu = shutil.which("ncu")
    if ncu is None:
        return row | {"error": "ncu not on PATH"}
    log = out / f"ncu_d{d}_{schedule}.csv"
    cmd = [ncu, "--clock-control", "none", "--cache-control", "none", "--print-units", "base",
           "--csv", "--metrics",
           METRIC, "-k", "regex:diff_flash", "--log-file", str(log), sys.executable,
           str(Path(__file__).resolve()), "--run", str(d), schedule, "--t", str(args.t),
           "--tokens", str(args.tokens), "--heads", str(args.heads), "--reps", str(args.reps),
           "--dies-with", str(os.getpid())]
    t0 = time.monotonic()
    text, code = run_limited(cmd, args.limit, 10.0, os.environ | {"PYTHONUNBUFFERED": "1"})
    row["seconds"] = round(time.monotonic() - t0, 1)
    row["ncu_log"] = log.read_text()[-20000:] if log.exists() else None
    if code != 0:
        status = f"timeout after {args.limit:.0f} s" if code is None else f"exit {code}"
        return row | {"error": f"{status}: {text[-1500:]}"}
    try:  # the CSV is in the log; were it printed instead, it is in the output
        launches = parse_ncu(row["ncu_log"] or "") or parse_ncu(text)
    except ValueError as e:
        return row | {"error": str(e)}
    if not launches:
        return row | {"error": f"no {METRIC} rows for diff_flash kernels in the ncu log; "
                               f"output: {text[-1500:]}"}
    return row | {"launches": {k: len(x) for k, x in launches.items()}, **summarize(launches)}


def markdown(rows: list[dict]) -> str:
    """One line per row: each kernel's median ms, the backward's and the total."""
    lines = ["# Mosaic GPU kernels under Nsight Compute (gpu__time_duration, median)", ""]
    for r in rows:
        head = f"- d = {r['d']}, {r['schedule']}, T = {r['T']}: "
        if "error" in r:
            lines.append(head + "not measured: " + r["error"].splitlines()[0][:300])
            continue
        kernels = ", ".join(f"{k.removeprefix('diff_flash_')} {ms:.3f} ms"
                            for k, ms in r["kernels_ms"].items())
        lines.append(head + f"{kernels}; backward {r['bwd_ms']:.3f} ms, total "
                            f"{r['total_ms']:.3f} ms")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """The command line in the module docstring (`argv`: None reads sys.argv). Exit status 0,
    each row that was not measured saying why; 2 on bad input (argparse's error line for an
    argument, one `error:` line for a DIR that cannot be made or written), before any child
    runs; 130 after Ctrl-C, SIGTERM or SIGHUP (the rows already measured stay in
    DIR/kernel_profile.json, the child in flight stopped with this process: `profile_all`)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--head-dims", type=positive_ints, default="128,64")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--t", type=positive_int, default=4096)
    p.add_argument("--tokens", type=positive_int, default=32768)
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--reps", type=positive_int, default=3)
    p.add_argument("--limit", type=positive_float, default=90.0, help="seconds a child may take")
    p.add_argument("--budget", type=positive_float, default=None,
                   help="seconds for all rows: a row that would start with less than --limit "
                        "left is recorded as skipped")
    p.add_argument("--run", nargs=2, metavar=("D", "SCHEDULE"), help=argparse.SUPPRESS)
    p.add_argument("--dies-with", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    schedules = args.schedules.split(",")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        p.error(f"--schedules: unknown {', '.join(unknown)}; expected some of "
                f"{', '.join(SCHEDULES)}")
    if args.tokens % args.t:  # B = tokens / T sequences: another was rounded down unsaid
        p.error(f"--tokens {args.tokens}: expected a multiple of --t {args.t} (whole sequences)")
    if args.run:  # the profiled child: a traceback here is its row's error, read by the parent
        if args.dies_with is not None:  # the kernel_profile.py that ran ncu: gone, so is this
            dies_with(args.dies_with)
        _child(int(args.run[0]), args.run[1], args)
        return 0
    # The parent checks each row's tiles for the attached GPU's kind, which starts jax's CUDA
    # backend here: by default that claims 75% of the GPU's memory for the whole run, beside the
    # child that ncu profiles. Without preallocation the parent holds only its CUDA context.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax.numpy as jnp

    from diff_jax.kernels import hopper

    untabled = hopper.untabled(args.head_dims, jnp.bfloat16)
    if untabled:  # before any child: each schedule's row was a refusal, after the others ran
        p.error(f"--head-dims {','.join(map(str, args.head_dims))}: {untabled}")
    written = Written()
    return concluded(lambda: profile_all(args, schedules, written),
                     (f"--out {args.out}", str(args.out)), written=written)


def profile_all(args: argparse.Namespace, schedules: list[str], written: Written) -> None:
    """`main`'s work for parsed `args`: a row per head width and schedule, each written to
    DIR/kernel_profile.json as it ends (counted in `written`), then printed (before, it was
    printed first: a `| head` gone there lost it), then DIR/kernel_profile.md. A signal that
    stops this process stops the child in flight too (`run_limited`), whose row (its output)
    is written, with the markdown, before `Stopped` ends the command."""
    args.out.mkdir(parents=True, exist_ok=True)  # first: a DIR that cannot be made ends at once
    rows = []
    start = time.monotonic()
    for d in args.head_dims:
        for schedule in schedules:
            left = None if args.budget is None else args.budget - (time.monotonic() - start)
            stopped = None
            if left is not None and left < args.limit:
                rows.append({"d": d, "schedule": schedule, "T": args.t,
                             "error": f"skipped: {left:.0f} s of --budget left"})
            else:
                try:
                    rows.append(profile(d, schedule, args, args.out))
                except Stopped as e:
                    stopped = e
                    rows.append({"d": d, "schedule": schedule, "T": args.t,
                                 "error": f"interrupted ({e}): {e.output[-1500:]}"})
            write_whole(args.out / "kernel_profile.json", json.dumps(rows, indent=1))
            written.count = len(rows)
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
            if stopped is not None:
                write_whole(args.out / "kernel_profile.md", markdown(rows))
                raise stopped
    write_whole(args.out / "kernel_profile.md", markdown(rows))


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
