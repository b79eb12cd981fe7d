"""Each Mosaic GPU kernel schedule once, in its own process under a time limit: which ones hang.

A kernel that deadlocks on the GPU (a barrier phase nobody completes, a `setmaxnreg.inc` that
the CTA's register pool cannot satisfy) never returns to Python: a benchmark that meets one
stalls until it is killed and reports nothing. Neither Mosaic GPU's interpreter (no register
file) nor ptxas (no run) shows such a hang. This runs each schedule's forward, or forward and
backward, on small bf16 (one fp16) inputs in a child process and reports, per probe, "ok"
(with the relative errors of the output and of dq, dk, dv against the float32 XLA path), "hang"
(killed at --limit seconds; the child's stacks, dumped at SIGTERM, are in the row's tail) or
"error".

    python benchmarks/mosaic_probe.py [--out DIR] [--limit 45] [--probes a,b]
        [--split-registers K,V]   # the split dK/dV roles' setmaxnreg counts, for a probe of
                                  # a register plan other than flash_mgpu.split_registers

Writes DIR/mosaic_probe.json; prints one line a probe. Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from limited_run import ROOT, Stopped, run_limited

sys.path.insert(0, str(ROOT))

from diff_jax.command import Written, concluded, leave, positive_float  # noqa: E402
from diff_jax.output_dir import write_whole  # noqa: E402

# name: (d, causal, segment ids, backward, Tiles fields over the table's)
PROBES = {
    "fwd-d64": (64, True, False, False, {}),
    "bwd-d64-rows": (64, True, False, True, {"dkv": "rows", "dq": "rows"}),
    "bwd-d64-split": (64, True, False, True, {"dkv": "split"}),
    "bwd-d64-share": (64, True, False, True, {"dkv": "share"}),
    "bwd-d64-splitdq-nopingpong": (64, True, True, True,
                                   {"dkv": "rows", "dq": "split", "pingpong": False}),
    "bwd-d128": (128, True, True, True, {}),
    "bwd-d128-share": (128, True, True, True, {"dkv": "share"}),
    "bwd-d64-fuseddq": (64, True, False, True, {"dkv": "share", "dq": "fused"}),
    "bwd-d128-fuseddq": (128, True, True, True, {"dkv": "share", "dq": "fused"}),
    "bwd-d64-fusedtma": (64, True, True, True, {"dkv": "share", "dq": "fused_tma"}),
    "bwd-d96": (96, True, True, True, {}),
    "bwd-d128-fp16-noncausal": (128, False, False, True, {}),
}


def _child(name: str, split_registers: str | None) -> dict:
    """Run probe `name` here (on the GPU) and return its row."""
    import dataclasses
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, all_threads=True)  # a hang's stacks, at the kill
    import jax
    import jax.numpy as jnp
    import numpy as np

    from diff_jax import kernels
    from diff_jax.kernels import BlockSizes, flash, flash_mgpu, hopper

    if split_registers:
        k_regs, v_regs = (int(x) for x in split_registers.split(","))
        flash_mgpu.split_registers = lambda: {"k": k_regs, "v": v_regs}
    d, causal, seg, backward, fields = PROBES[name]
    dtype = jnp.float16 if "fp16" in name else jnp.bfloat16
    b, t, h, hkv = 2, 384, 4, 2
    tiles = dataclasses.replace(hopper.tiles_for(d, dtype)[0], **fields)
    keys = jax.random.split(jax.random.PRNGKey(len(name)), 4)
    shapes = ((b, t, 2 * h, d), (b, t, 2 * hkv, d), (b, t, hkv, 2 * d), (b, t, h, 2 * d))
    q, k, v, do = (jax.random.normal(key, s, dtype) for key, s in zip(keys, shapes))
    segs = None
    if seg:  # two documents and padding
        segs = jnp.asarray(np.repeat([[1] * 150 + [2] * 200 + [0] * 34], b, 0), jnp.int32)
    lam = jnp.float32(0.4)

    def loss(impl, q, k, v, lam):
        out = kernels.diff_attention(q, k, v, lam, segment_ids=segs, causal=causal, impl=impl,
                                     block_sizes=BlockSizes(mosaic_gpu=tiles))
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    def run(impl, *xs):
        if backward:
            fn = jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2, 3),
                                            has_aux=True))
            (_, out), grads = fn(*xs, lam)
            return [out, *grads[:3]]
        return [jax.jit(lambda *a: loss(impl, *a)[1])(*xs, lam)]

    t0 = time.monotonic()
    got = jax.block_until_ready(run("pallas", q, k, v))
    seconds = time.monotonic() - t0
    ref = run("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
    errs = {}
    for nm, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        errs[nm] = float(np.linalg.norm(a - r) / np.linalg.norm(r))
    backend = ("mosaic_gpu" if jax.default_backend() == "gpu"
               and flash.uses_mosaic_gpu(2, dtype, d, 2 * d) else "not mosaic_gpu")
    finite = all(np.isfinite(np.asarray(x, np.float32)).all() for x in got)
    return {"probe": name, "status": "ok", "backend": backend, "seconds": round(seconds, 1),
            "tiles": dataclasses.asdict(tiles), "finite": bool(finite), **errs}


def probe(name: str, limit: float, split_registers: str | None) -> dict:
    """Run probe `name` in a child process, killed at `limit` seconds (SIGTERM, then SIGKILL)."""
    cmd = [sys.executable, __file__, "--child", name]
    if split_registers:
        cmd += ["--split-registers", split_registers]
    t0 = time.monotonic()
    env = os.environ | {"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out, code = run_limited(cmd, limit, 10.0, env)
    rows = [json.loads(x[6:]) for x in out.splitlines() if x.startswith("PROBE ")]
    row = rows[-1] if rows else {"probe": name, "status": f"error (exit {code})"}
    if code is None:  # past its limit, even where it ended in the grace after SIGTERM
        row["status"] = "hang"
    row |= {"wall_s": round(time.monotonic() - t0, 1), "split_registers": split_registers}
    if row["status"] != "ok":
        row["tail"] = out[-2500:]
    return row


def _register_counts(text: str) -> str:
    """An argparse `type`: --split-registers' K,V, two register counts `setmaxnreg` takes (PTX:
    a multiple of 8 in [24, 256]), kept as the text the child is given. Another was taken: off
    Mosaic GPU its probes ran "ok" without reading it (`0,7` on the CPU), and on Hopper it could
    only fail in each child, after its start-up."""
    if not (re.fullmatch(r"[0-9]+,[0-9]+", text)
            and all(24 <= int(x) <= 256 and int(x) % 8 == 0 for x in text.split(","))):
        raise argparse.ArgumentTypeError(f"expected K,V: two register counts, multiples of 8 in "
                                         f"[24, 256] (what setmaxnreg takes), got {text!r}")
    return text


def main(argv=None) -> int:
    """The command line in the module docstring (`argv`: None reads sys.argv). Exit status 0
    when every probe is "ok", 1 when one hung or failed (the rows say which); 2 on bad input
    (argparse's error line for an argument, one `error:` line for a DIR that cannot be made or
    written), before any probe runs; 130 after Ctrl-C, SIGTERM or SIGHUP (the probes already run
    stay in DIR/mosaic_probe.json, the one in flight stopped with this process: `probe_all`)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--limit", type=positive_float, default=45.0, help="seconds a probe may take")
    p.add_argument("--probes", default=",".join(PROBES))
    p.add_argument("--split-registers", type=_register_counts, default=None,
                   help="K,V: the split dK/dV roles' register counts instead of the kernel's")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # the probed child: a traceback here is its row's tail, read by the parent
        print("PROBE " + json.dumps(_child(args.child, args.split_registers)), flush=True)
        return 0
    names = args.probes.split(",")
    unknown = [x for x in names if x not in PROBES]
    if unknown:
        p.error(f"--probes: unknown {', '.join(unknown)}; expected some of {', '.join(PROBES)}")
    rows: list[dict] = []
    written = Written()
    status = concluded(lambda: probe_all(names, args, rows, written),
                       (f"--out {args.out}", args.out), written=written)
    if status == 0 and any(r["status"] != "ok" for r in rows):
        return 1  # hopper_session's probe stage: "exit 1", and the rows' statuses
    return status


def probe_all(names: list[str], args: argparse.Namespace, rows: list[dict],
              written: Written) -> None:
    """`main`'s work for parsed `args`: each probe of `names` in turn, its row appended to `rows`
    and DIR/mosaic_probe.json written after each (a caller's own limit keeps what was probed;
    counted in `written`), then printed (before, it was printed first: a `| head` gone there
    lost it). A signal that stops this process stops the probe in flight too (`run_limited`),
    whose row ("interrupted", its tail: the stacks it dumped at SIGTERM) is written before
    `Stopped` ends the command."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # first: a DIR that cannot be made ends at once
    for name in names:
        stopped = None
        try:
            row = probe(name, args.limit, args.split_registers)
        except Stopped as e:
            row, stopped = {"probe": name, "status": f"interrupted ({e})",
                            "tail": e.output[-2500:]}, e
        rows.append(row)
        write_whole(out / "mosaic_probe.json", json.dumps(rows, indent=1))
        written.count = len(rows)
        print(json.dumps({k: x for k, x in row.items() if k != "tail"}), flush=True)
        if stopped is not None:
            raise stopped


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
