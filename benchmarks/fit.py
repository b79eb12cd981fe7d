"""Which paper configs fit which TPU v5p slices or H100 counts, with the fused kernel and with xla:
AOT on this CPU.

    python benchmarks/fit.py [--target tpu|h100] [--impls pallas xla] [--configs diff-830m ...]
                             [--slices ...]

`--target tpu` (the default) needs libtpu (the `tpu` extra), `--target h100` the CUDA plugin and
ptxas (the `cuda-aot` extra); neither needs the accelerator. Each (config, attention impl) is
compiled on the smallest slice first and on larger ones until it fits; each compile runs in its
own subprocess via `python train.py --config C train.compile_only=true train.compile_topology=T
model.attention_impl=I`, which prints per-device memory (against the device's HBM), per-device
FLOPs of one step (TPU only: XLA has no GPU cost analysis without a GPU) and, for H100s, the
fused kernel's ptxas report. `h100:N` describes N GPUs in one host: the per-GPU memory of a
multi-host run with the same mesh. Writes benchmarks/results/{tpu,gpu}_fit.json (merged with
earlier results) and docs/{tpu,gpu}-fit.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diff_jax.command import Written, concluded, leave, positive_int  # noqa: E402
from diff_jax.output_dir import write_whole  # noqa: E402

CONFIGS = ["diff-830m", "diff-1.4b", "diff-2.8b", "diff-3b", "diff-6.8b", "diff-13.1b"]
SLICES = {"tpu": ["v5p:2x2x2", "v5p:2x2x4", "v5p:4x4x4"],
          "h100": ["h100:8", "h100:16", "h100:32", "h100:64"]}
IMPLS = ["pallas", "xla"]
KNOBS = ["mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1", "model.remat=full"]


def compile_one(config: str, topology: str, impl: str, timeout: int) -> dict:
    cmd = [sys.executable, "train.py", "--config", f"configs/{config}.yaml", *KNOBS,
           f"model.attention_impl={impl}", "train.compile_only=true",
           f"train.compile_topology={topology}"]
    env = dict(os.environ, TPU_WORKER_HOSTNAMES="localhost", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    t0 = time.time()
    key = {"config": config, "topology": topology, "impl": impl}
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**key, "error": f"compile > {timeout}s"}
    out = p.stdout[p.stdout.find("{"):] if p.returncode == 0 else ""
    if not out:
        lines = (p.stderr or p.stdout).strip().splitlines() or ["no output"]
        raised = [x for x in lines if re.match(r"[\w.]+(Error|Exception)\b", x)]
        return {**key, "error": (raised or lines)[-1][:200]}
    return {**json.loads(out), **key, "compile_s": round(time.time() - t0, 1)}


def _verdict(r: dict) -> str:
    if "error" not in r:
        return "yes" if r["fits"] else "no"
    oom = re.search(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM", r["error"])
    if oom:
        return f"no: temporaries alone need {oom[1]} GiB"
    if "Ran out of memory" in r["error"] or "RESOURCE_EXHAUSTED" in r["error"]:
        return "no: out of HBM"
    return f"error: {r['error']}"


def _tflops(r: dict) -> str:
    return f"{r['flops_per_chip'] / 1e12:.1f}" if r.get("flops_per_chip") else "not measured"


def _spills(r: dict) -> str:
    """The fused kernel's ptxas spill stores per kernel (bytes), "none", or "" without a report."""
    kernels = {k["name"].split("_")[2]: k["spill_store_bytes"] for k in r.get("kernels", [])}
    if not kernels:
        return ""
    if not any(kernels.values()):
        return "none"
    return ", ".join(f"{name} {n} B" for name, n in sorted(kernels.items()) if n)


def table(results: list[dict], target: str) -> list[str]:
    last = "kernel spill stores" if target == "h100" else "TFLOP/chip/step"
    lines = ["| config | attention | slice (chips) | args GiB/chip | temp GiB/chip | peak GiB/chip | "
             f"{last} | fits |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['impl']} | {r['topology']} | | | | | {_verdict(r)} |")
            continue
        lines.append(f"| {r['config']} | {r['impl']} | {r['topology']} ({r['devices']}) | "
                     f"{r['argument_gib']:.1f} | {r['temp_gib']:.1f} | {r['peak_gib']:.1f} | "
                     f"{_spills(r) if target == 'h100' else _tflops(r)} | {_verdict(r)} |")
    return lines


HEADERS = {
    "tpu": ["# Which paper configs fit which TPU v5p slices", "",
            "AOT-compiled on a CPU machine with libtpu (`python benchmarks/fit.py`): the full",
            "sharded train step (bf16 compute, f32 params + AdamW state, paper batch and sequence",
            f"length) with `{' '.join(KNOBS)}`, once with the fused kernel",
            "(`model.attention_impl=pallas`, inside the attention op's `shard_map`: what a TPU user",
            "runs) and once with the xla oracle (O(T²) attention temporaries). Each is tried on the",
            "smallest slice first. Peak = arguments + temporaries + outputs − aliased, per chip, from",
            "XLA's memory analysis; v5p has 95 GiB HBM a chip. TFLOP/chip/step is XLA's cost",
            "analysis of the partitioned step (the kernel's calls count their declared cost; the",
            "oracle computes the full T×T scores, the kernel skips causally masked tiles).",
            "Recorded 2026-11-23 with jax 0.10.2 / libtpu of the `tpu` extra: the xla rows were",
            "re-compiled on the slices an earlier xla search had found (its out-of-HBM rows are kept",
            "from that search, which did not try diff-13.1b on v5p:2x2x4).", ""],
    "h100": ["# Which paper configs fit how many H100s", "",
             "AOT-compiled on a CPU machine with the CUDA plugin and ptxas, no GPU (`python",
             "benchmarks/fit.py --target h100`, the `cuda-aot` extra): the full sharded train step",
             "(bf16 compute, f32 params + AdamW state, paper batch and sequence length) with",
             f"`{' '.join(KNOBS)}`, once with the fused kernel",
             "(`model.attention_impl=pallas`: on Hopper the Mosaic GPU kernels at the table's",
             "tiles, compiled through ptxas for sm_90a) and once with the xla oracle (O(T²)",
             "attention temporaries). Each is tried on 8 GPUs first, then 16, 32,",
             "64 (`h100:N`: N GPUs described in one host, the per-GPU memory of a multi-host run",
             "with the same mesh). Peak = arguments + temporaries + outputs − aliased, per GPU, from",
             "XLA's memory analysis, against the H100's 79.1 GiB. The spill column is ptxas's spill",
             "stores per fused-kernel kernel (fwd, dq, dkdv) at that config's head width and shapes.",
             "XLA gives no FLOPs without a GPU. Recorded 2026-11-24 with jax 0.10.2, the CUDA",
             "plugin 0.10.2 and ptxas 13.5.37 of the `cuda-aot` extra; the fused-kernel rows with",
             "the kernel of commit 48e2839 (the xla rows do not involve it).", ""],
}


def main(argv: list[str] | None = None) -> int:
    """The command line in the module docstring (`argv`: None reads sys.argv); its exit status
    (`command.concluded`): 0; 2 on bad input (argparse's usage and error line for an argument,
    one `error:` line for a results file that cannot be read or written); 130 after Ctrl-C or
    once stdout's or stderr's reader is gone (`| head`), in one `interrupted:` line counting
    them: the JSON holds every compile that ended (written whole after each), the markdown is
    written whole or not at all. Measured before: a Ctrl-C while a compile ran was a
    KeyboardInterrupt traceback (exit -2); `| head` a BrokenPipeError traceback at the first
    row's print (exit 1, 120 with stdout block-buffered), which came before that row was
    written."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=sorted(SLICES), default="tpu")
    p.add_argument("--timeout", type=positive_int, default=1800)
    p.add_argument("--configs", nargs="*", choices=CONFIGS, default=CONFIGS)
    p.add_argument("--impls", nargs="*", choices=IMPLS, default=IMPLS)
    p.add_argument("--slices", nargs="*", default=None,
                   help="the slices to try, smallest first (default: the target's)")
    args = p.parse_args(argv)
    slices = SLICES[args.target]
    unknown = [x for x in args.slices or [] if x not in slices]
    if unknown:
        p.error(f"--slices: unknown {', '.join(unknown)} for --target {args.target}; expected "
                f"some of {', '.join(slices)}")
    kind = "tpu" if args.target == "tpu" else "gpu"
    path = ROOT / f"benchmarks/results/{kind}_fit.json"
    written = Written()
    return concluded(lambda: search(args, slices, kind, path, written),
                     (str(path.relative_to(ROOT)), str(path)), written=written)


def search(args: argparse.Namespace, slices: list[str], kind: str, path: Path,
           written: Written) -> None:
    """`main`'s work for parsed `args`: each (config, attention impl) compiled on `slices`,
    smallest first, until it fits; `path` (the `kind`'s results JSON) rewritten after each
    compile (counted in `written`), then docs/{kind}-fit.md, and the table printed."""
    # Rows from before the attention column were compiled with the default, xla (and no FLOPs).
    earlier = [{"impl": "xla", **r} for r in (json.loads(path.read_text()) if path.exists() else [])]
    merged = {(r["config"], r["impl"], r["topology"]): r for r in earlier}

    def order(k: tuple[str, str, str]) -> tuple[int, int, int]:
        return CONFIGS.index(k[0]), IMPLS.index(k[1]), slices.index(k[2])

    for impl in args.impls:
        for config in args.configs:
            for topology in args.slices or slices:  # smallest first, until it fits
                r = compile_one(config, topology, impl, args.timeout)
                merged[(config, impl, topology)] = r
                results = [merged[k] for k in sorted(merged, key=order)]
                write_whole(path, json.dumps(results, indent=1))
                written.count += 1
                print(json.dumps(r), flush=True)  # after: a `| head` gone here keeps the row
                if r.get("fits") or "error" in r and not _verdict(r).startswith("no"):
                    break
    results = [merged[k] for k in sorted(merged, key=order)]
    rows = table(results, args.target)
    write_whole(ROOT / f"docs/{kind}-fit.md", "\n".join(HEADERS[args.target] + rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
