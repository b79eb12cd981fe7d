"""Which paper configs fit which TPU v5p slices: AOT-compile the sharded train step on this CPU.

    PYTHONPATH=<dir with libtpu> python benchmarks/tpu_fit.py [--timeout 300]

Needs libtpu (`pip install "jax[tpu]==<jax version>"`). Each (config, slice) compiles in its own
subprocess via `python train.py --config C train.compile_only=true train.compile_topology=T`;
the per-chip peak memory is compared with the chip's HBM. Writes docs/tpu-fit.md and
benchmarks/results/tpu_fit.json (merged with earlier results for other config/slice pairs).
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
SLICES = ["v5p:2x2x2", "v5p:4x4x4"]
KNOBS = ["mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1", "model.remat=full"]


def compile_one(config: str, topology: str, timeout: int) -> dict:
    cmd = [sys.executable, "train.py", "--config", f"configs/{config}.yaml", *KNOBS,
           "train.compile_only=true", f"train.compile_topology={topology}"]
    env = dict(os.environ, TPU_WORKER_HOSTNAMES="localhost", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"config": config, "topology": topology, "error": f"compile > {timeout}s"}
    out = p.stdout[p.stdout.find("{"):] if p.returncode == 0 else ""
    if not out:
        return {"config": config, "topology": topology, "error": (p.stderr or p.stdout).strip().splitlines()[-1][:200]}
    return dict(json.loads(out), config=config, compile_s=round(time.time() - t0, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--configs", nargs="*", default=CONFIGS)
    p.add_argument("--slices", nargs="*", default=SLICES)
    args = p.parse_args()
    path = ROOT / "benchmarks/results/tpu_fit.json"
    merged = {(r["config"], r["topology"]): r for r in (json.loads(path.read_text()) if path.exists() else [])}
    for config in args.configs:
        for topology in args.slices:
            r = compile_one(config, topology, args.timeout)
            print(json.dumps(r), flush=True)
            merged[(config, topology)] = r
            results = [merged[k] for k in sorted(merged, key=lambda k: (CONFIGS.index(k[0]), k[1]))]
            path.write_text(json.dumps(results, indent=1))
    lines = ["# Which paper configs fit which TPU v5p slices", "",
             "AOT-compiled on a CPU machine with libtpu (`python benchmarks/tpu_fit.py`): the full",
             "sharded train step (bf16 compute, f32 params + AdamW state, paper batch and sequence",
             f"length) with `{' '.join(KNOBS)}`. Peak = arguments + temporaries + outputs − aliased,",
             "per chip, from XLA's memory analysis; v5p has 95 GiB HBM a chip.", "",
             "| config | slice (chips) | mesh | args GiB/chip | temp GiB/chip | peak GiB/chip | fits |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            oom = re.search(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM", r["error"])
            verdict = f"no: temporaries alone need {oom[1]} GiB" if oom else f"error: {r['error']}"
            lines.append(f"| {r['config']} | {r['topology']} | fsdp = all chips | | | | {verdict} |")
            continue
        mesh = "×".join(f"{k}={v}" for k, v in r["mesh"].items())
        lines.append(f"| {r['config']} | {r['topology']} ({r['devices']}) | {mesh} | {r['argument_gib']:.1f} | "
                     f"{r['temp_gib']:.1f} | {r['peak_gib']:.1f} | {'yes' if r['fits'] else 'no'} |")
    (ROOT / "docs/tpu-fit.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
