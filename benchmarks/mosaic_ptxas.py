"""Registers and spills of the Mosaic GPU kernels for sm_90a, per head width and tiles: on a CPU.

    pip install -e ".[cuda-aot]"   # the CUDA plugin and ptxas; no GPU
    python benchmarks/mosaic_ptxas.py [--dims 64 96 128] [--out OUT]

Each kernel (forward, dQ, dK/dV) is compiled for one H100 described to XLA without a GPU
(`diff_jax.aot.gpu_devices`), through Mosaic GPU's lowering and ptxas, as a GPU run compiles it;
`kernels.ptxas` reads ptxas's report. Swept per d (bf16, causal): the table's tiles (`kernels.hopper`)
with and without segment ids, every forward (block_kv, stages, pingpong) and every backward
(block_kv_dq, block_q_dkv, dK/dV and dQ schedules, with and without segment ids: training's
packed documents carry them) that `--tune` would try on a GPU. Tiles that shared
memory refuses are recorded as such. Writes OUT.json and OUT.md (default OUT:
benchmarks/results/mosaic_ptxas_sm90a_jaxVERSION). ptxas's spill bytes count every spill
instruction once; the SASS step loops (with nvdisasm, the `cuda-aot` extra) say which run every
kv or q step: per loop, instructions / wgmmas / local stores / local loads. The table's tiles
should spill nothing, and nothing in a step loop above all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diff_jax.platforms import default_to_cpu_without_accelerators  # noqa: E402

default_to_cpu_without_accelerators()  # before jax is imported (diff_jax/platforms.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from diff_jax.aot import gpu_devices  # noqa: E402
from diff_jax.command import Written, concluded, leave, positive_int  # noqa: E402
from diff_jax.kernels import flash_mgpu, hopper, ptxas  # noqa: E402
from diff_jax.output_dir import write_whole  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / f"mosaic_ptxas_sm90a_jax{jax.__version__}"
COLS = ["d", "case", "tiles", "seg", "kernel", "registers", "spill_store_bytes",
        "spill_load_bytes", "step_loops", "notes", "error"]


def _loops_text(report: ptxas.KernelReport) -> str | None:
    """"instructions/wgmmas/STL/LDL" per step loop, "; "-joined; None without SASS."""
    if report.loops is None:
        return None
    return "; ".join(f"{x.instructions}/{x.wgmmas}/{x.spill_stores}/{x.spill_loads}"
                     for x in report.loops) or "none"


def cases(d: int) -> list[tuple[str, object, bool, tuple[str, ...]]]:
    """(case, tiles, has_seg, parts) to compile at head width d."""
    base, _ = hopper.tiles_for(d, jnp.bfloat16, kind="")
    out = [("table", base, seg, ("fwd", "bwd")) for seg in (False, True)]
    out += [("fwd", dataclasses.replace(base, block_kv=bk, stages=st, pingpong=pp), False, ("fwd",))
            for bk in (64, 128) for st in (2, 3) for pp in (True, False)]
    out += [("bwd", dataclasses.replace(base, block_kv_dq=a, block_q_dkv=c, dkv=s, dq=q), seg,
             ("bwd",))
            for seg in (False, True) for a in (64, 128) for c in (64, 128)
            for s in flash_mgpu.DKV_SCHEDULES if s != "auto" for q in flash_mgpu.DQ_SCHEDULES
            # dQ fused: in the share kernel only (jax >= 0.11), with no dQ tile to vary
            if q not in flash_mgpu.FUSED
            or (flash_mgpu.FUSED_DQ and s == "share" and a == base.block_kv_dq)]
    out += [("table, split dQ", dataclasses.replace(base, dq="split"), seg, ("bwd",))
            for seg in (False, True)]
    out += [("table, share dK/dV", dataclasses.replace(base, dkv="share"), seg, ("bwd",))
            for seg in (False, True)]
    if flash_mgpu.FUSED_DQ:
        out += [(f"table, {dq} dQ", dataclasses.replace(base, dkv="share", dq=dq), seg,
                 ("bwd",)) for dq in flash_mgpu.FUSED for seg in (False, True)]
    return out


def ptxas_version() -> str:
    """The ptxas that Mosaic GPU runs (the nvidia-cuda-nvcc wheel's), its version line."""
    try:
        import nvidia.cu13

        exe = Path(nvidia.cu13.__path__[0]) / "bin" / "ptxas"
        return subprocess.run([exe, "--version"], capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1]
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return f"unknown ({type(e).__name__})"


def sweep(dims: list[int]) -> list[dict]:
    """One row per (case, kernel), or per refused case; printed as it goes."""
    devices = gpu_devices("h100:1")
    rows = []
    for d in dims:
        for case, tiles, seg, parts in cases(d):
            row = {"d": d, "case": case, "tiles": hopper.tiles_text(tiles), "seg": seg}
            t0 = time.perf_counter()
            try:
                reports = ptxas.mosaic_kernels(devices, d, tiles, has_seg=seg, parts=parts)
            except ValueError as e:  # the shared-memory plan refuses these tiles
                rows.append(row | {"error": str(e)})
                print(f"d={d} {case} {row['tiles']}: refused", flush=True)
                continue
            for r in reports:
                rows.append(row | {"kernel": r.name.removesuffix("_mosaic_gpu_kernel"),
                                   "registers": r.registers,
                                   "spill_store_bytes": r.spill_store_bytes,
                                   "spill_load_bytes": r.spill_load_bytes,
                                   "step_loops": _loops_text(r), "loop_spills": r.loop_spills,
                                   "notes": "; ".join(r.notes)})
            print(f"d={d} {case} {row['tiles']} seg={seg}: "
                  + ", ".join(f"{r.name.split('_')[2]} {r.registers} regs "
                              f"{r.spill_store_bytes}/{r.spill_load_bytes} B spilled, "
                              f"{r.loop_spills} a step"
                              for r in reports)
                  + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
    return rows


def markdown(rows: list[dict], env: dict) -> str:
    """OUT.md: the table's tiles per d first (and with the split dQ, the share dK/dV, the
    fused dQs), then every case."""
    table = [f"- d = {r['d']}, seg = {r['seg']}"
             f"{'' if r['case'] == 'table' else ', ' + r['case'].removeprefix('table, ')}: "
             f"{r['kernel']} "
             + (f"spills {r['spill_store_bytes']} / {r['spill_load_bytes']} bytes, "
                f"{r['loop_spills']} spill instructions a step"
                if r.get("spill_store_bytes") or r.get("spill_load_bytes") else "no spills")
             + (f" ({r['notes']})" if r.get("notes") else "")
             for r in rows if r["case"].startswith("table") and "kernel" in r]
    body = ["| " + " | ".join(str(r.get(c, "")) for c in COLS) + " |" for r in rows]
    return "\n".join([
        f"# Mosaic GPU kernels: ptxas registers and spills for {env['arch']}", "",
        f"{env['target']}, compiled on {env['host']} without a GPU "
        f"(`python benchmarks/mosaic_ptxas.py`); jax {env['jax']}, ptxas {env['ptxas']}; "
        f"{env['date']}.", "",
        "## The table's tiles", "", *table, "",
        "## Every case", "",
        "registers: a thread's at launch (the compute warpgroups then raise theirs with "
        "setmaxnreg, and ptxas allocates within that share); spill bytes: ptxas's spill "
        "stores / loads, each spill instruction counted once; step_loops: per innermost loop "
        "that issues wgmmas (a kv or q step), its instructions / wgmmas / local-memory stores / "
        "local-memory loads, run every step; notes: ptxas's \"Potential Performance Loss\" "
        "notes.", "",
        "| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS), *body]) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line in the module docstring (`argv`: None reads sys.argv). Exit status 0; 2
    on bad input (a --out that cannot be written: one `error:` line); 130 after Ctrl-C."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=positive_int, nargs="+", default=[64, 96, 128])
    parser.add_argument("--out", type=Path, default=OUT,
                        help="writes OUT.json and OUT.md, replacing them (default: %(default)s)")
    args = parser.parse_args(argv)
    written = Written()
    return concluded(lambda: report(args.dims, args.out, written),
                     (f"--out {args.out}", str(args.out.parent)), written=written)


def report(dims: list[int], out: Path, written: Written) -> None:
    """`main`'s work: the sweep over `dims`, written to OUT.json and OUT.md."""
    out.parent.mkdir(parents=True, exist_ok=True)  # before the sweep: a bad --out ends at once
    rows = sweep(dims)
    env = {"arch": "sm_90a", "target": gpu_devices("h100:1")[0].device_kind,
           "host": f"a CPU ({platform.machine()})", "jax": jax.__version__,
           "ptxas": ptxas_version(), "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    out_json, out_md = Path(f"{out}.json"), Path(f"{out}.md")  # OUT may hold dots
    write_whole(out_json, json.dumps({"env": env, "rows": rows}, indent=1))
    write_whole(out_md, markdown(rows, env))
    written.whole = True
    print(f"wrote {out_json} and {out_md}")


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
