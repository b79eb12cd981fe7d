"""Which paper configs fit which TPU v5p slices, with the fused kernel and with xla: AOT on this CPU.

    python benchmarks/tpu_fit.py [--impls pallas xla] [--configs diff-830m ...] [--slices ...]

Needs libtpu (`pip install "jax[tpu]==<jax version>"`). Each (config, attention impl) is compiled
on the smallest slice first and on larger ones until it fits; each compile runs in its own
subprocess via `python train.py --config C train.compile_only=true train.compile_topology=T
model.attention_impl=I`, which prints per-chip memory (against the chip's HBM) and per-chip FLOPs
of one step. Writes benchmarks/results/tpu_fit.json (merged with earlier results) and
docs/tpu-fit.md.
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
CONFIGS = ["diff-830m", "diff-1.4b", "diff-2.8b", "diff-3b", "diff-6.8b", "diff-13.1b"]
SLICES = ["v5p:2x2x2", "v5p:2x2x4", "v5p:4x4x4"]
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
        return {**key, "error": (p.stderr or p.stdout).strip().splitlines()[-1][:200]}
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


def table(results: list[dict]) -> list[str]:
    lines = ["| config | attention | slice (chips) | args GiB/chip | temp GiB/chip | peak GiB/chip | "
             "TFLOP/chip/step | fits |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['impl']} | {r['topology']} | | | | | {_verdict(r)} |")
            continue
        lines.append(f"| {r['config']} | {r['impl']} | {r['topology']} ({r['devices']}) | "
                     f"{r['argument_gib']:.1f} | {r['temp_gib']:.1f} | {r['peak_gib']:.1f} | "
                     f"{_tflops(r)} | {_verdict(r)} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--configs", nargs="*", default=CONFIGS)
    p.add_argument("--impls", nargs="*", default=IMPLS)
    p.add_argument("--slices", nargs="*", default=SLICES, help="the slices to try, smallest first")
    args = p.parse_args()
    path = ROOT / "benchmarks/results/tpu_fit.json"
    # Rows from before the attention column were compiled with the default, xla (and no FLOPs).
    earlier = [{"impl": "xla", **r} for r in (json.loads(path.read_text()) if path.exists() else [])]
    merged = {(r["config"], r["impl"], r["topology"]): r for r in earlier}

    def order(k: tuple[str, str, str]) -> tuple[int, int, int]:
        return CONFIGS.index(k[0]), IMPLS.index(k[1]), SLICES.index(k[2])

    for impl in args.impls:
        for config in args.configs:
            for topology in args.slices:  # smallest first, until it fits
                r = compile_one(config, topology, impl, args.timeout)
                print(json.dumps(r), flush=True)
                merged[(config, impl, topology)] = r
                results = [merged[k] for k in sorted(merged, key=order)]
                path.write_text(json.dumps(results, indent=1))
                if r.get("fits") or "error" in r and not _verdict(r).startswith("no"):
                    break
    results = [merged[k] for k in sorted(merged, key=order)]
    lines = ["# Which paper configs fit which TPU v5p slices", "",
             "AOT-compiled on a CPU machine with libtpu (`python benchmarks/tpu_fit.py`): the full",
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
             "from that search, which did not try diff-13.1b on v5p:2x2x4).", ""]
    (ROOT / "docs/tpu-fit.md").write_text("\n".join(lines + table(results)) + "\n")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
