"""Benchmark of the fused differential flash attention against standard-attention routes.

Causal, bfloat16, d = 64 (V 2d = 128 wide), H = 16 DIFF heads, B·T = 32K tokens, T in
{2K, 4K, 8K, 16K}. Variants (ms and TFLOP/s for forward, backward = (fwd+bwd) − fwd, total):
  fused            kernels.diff_attention(impl="pallas"): one kernel, two online softmaxes
  a_two_pallas     FlashDiff_1 style: two standard Pallas attentions with V = 2d, minus λ
  b_cudnn_four     FlashDiff_2 style: the four (Q_c, K_c, V_half) attentions stacked as 4H heads of
                   width d in one jax.nn.dot_product_attention(implementation="cudnn") call
  c_pallas_h128    standard causal attention, H heads × 2d, same Pallas kernel family
  c_cudnn_h128     the same on cuDNN
  d_cudnn_2h64     the paper's Transformer baseline: 2H heads × d on cuDNN
TFLOP/s use each route's own floor count per (query, key) pair and DIFF head (matmuls only):
fused 12d/20d, a 12d/28d, b 16d/40d, c and d 8d/20d (forward/backward), causal pairs T(T+1)/2.
Peak memory of fwd+bwd (compiled temp + arguments + outputs, from XLA's memory analysis) is
reported for the fused kernel and the xla oracle.

Modes: default (GPU benchmark), --check (GPU correctness of the real lowerings vs the oracle),
--tune (GPU block-size sweep at one T), --smoke (tiny shapes, CPU interpreter, for the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels import BlockSizes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LAM = 0.37

# Floor FLOPs per (q, k) pair and DIFF head, in units of d (fwd, bwd).
FLOPS_PER_PAIR = {
    "fused": (12, 20), "a_two_pallas": (12, 28), "b_cudnn_four": (16, 40),
    "c_pallas_h128": (8, 20), "c_cudnn_h128": (8, 20), "d_cudnn_2h64": (8, 20), "xla": (12, 20),
}


@dataclasses.dataclass
class Shape:
    b: int
    t: int
    h: int
    d: int


def _inputs(shape: Shape, dtype, seed: int = 0):
    """q (B,T,2H,d), k (B,T,2H,d), v (B,T,H,2d), dO (B,T,H,2d): random normal, never zeros."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    b, t, h, d = shape.b, shape.t, shape.h, shape.d
    q = jax.random.normal(ks[0], (b, t, 2 * h, d), dtype)
    k = jax.random.normal(ks[1], (b, t, 2 * h, d), dtype)
    v = jax.random.normal(ks[2], (b, t, h, 2 * d), dtype)
    do = jax.random.normal(ks[3], (b, t, h, 2 * d), dtype)
    return q, k, v, do


def variants(block_sizes: BlockSizes | None, interpret, with_cudnn: bool):
    """name -> f(q, k, v, lam) on the differential layouts, each returning (B, T, H, ·)."""

    def fused(q, k, v, lam):
        return kernels.diff_attention(q, k, v, lam, impl="pallas", block_sizes=block_sizes,
                                      interpret=interpret)

    def std_pallas(q, k, v):
        return kernels.dot_product_attention(q, k, v, impl="pallas", block_sizes=block_sizes,
                                             interpret=interpret)

    def a_two_pallas(q, k, v, lam):
        o1 = std_pallas(q[:, :, 0::2], k[:, :, 0::2], v)
        o2 = std_pallas(q[:, :, 1::2], k[:, :, 1::2], v)
        return o1 - lam.astype(o1.dtype) * o2

    def c_pallas_h128(q, k, v, lam):  # H heads of width 2d: q, k viewed (B, T, H, 2d)
        b, t, h2, d = q.shape
        return std_pallas(q.reshape(b, t, h2 // 2, 2 * d), k.reshape(b, t, h2 // 2, 2 * d), v)

    out = {"fused": fused, "a_two_pallas": a_two_pallas, "c_pallas_h128": c_pallas_h128}
    if with_cudnn:
        def cudnn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

        def b_cudnn_four(q, k, v, lam):  # 4H heads of width d in one cuDNN call
            return kernels.diff_attention(q, k, v, lam, impl="cudnn")

        def c_cudnn_h128(q, k, v, lam):
            b, t, h2, d = q.shape
            return cudnn(q.reshape(b, t, h2 // 2, 2 * d), k.reshape(b, t, h2 // 2, 2 * d), v)

        def d_cudnn_2h64(q, k, v, lam):  # 2H heads of width d; V viewed as (B, T, 2H, d)
            b, t, h2, d = q.shape
            return cudnn(q, k, v.reshape(b, t, h2, d)).reshape(b, t, h2 // 2, 2 * d)

        out |= {"b_cudnn_four": b_cudnn_four, "c_cudnn_h128": c_cudnn_h128,
                "d_cudnn_2h64": d_cudnn_2h64}
    return out


def _fwd_and_step(f):
    fwd = jax.jit(f)

    def loss(q, k, v, lam, do):
        return jnp.sum(f(q, k, v, lam).astype(jnp.float32) * do.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return fwd, step


def _time(fn, args, *, reps: int, samples: int) -> float:
    """Median ms per call over `samples` batches of `reps` back-to-back calls (after warm-up)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(times)


def _pairs(shape: Shape) -> float:
    return shape.b * shape.h * shape.t * (shape.t + 1) / 2


def bench_one(name, f, shape: Shape, dtype, *, reps: int, samples: int) -> dict:
    q, k, v, do = _inputs(shape, dtype)
    lam = jnp.float32(LAM)
    fwd, step = _fwd_and_step(f)
    t_fwd = _time(fwd, (q, k, v, lam), reps=reps, samples=samples)
    t_tot = _time(step, (q, k, v, lam, do), reps=reps, samples=samples)
    t_bwd = t_tot - t_fwd
    ff, fb = (c * shape.d * _pairs(shape) for c in FLOPS_PER_PAIR[name])
    return {"variant": name, "T": shape.t, "B": shape.b, "fwd_ms": t_fwd, "bwd_ms": t_bwd,
            "total_ms": t_tot, "fwd_tflops": ff / t_fwd / 1e9, "bwd_tflops": fb / t_bwd / 1e9,
            "total_tflops": (ff + fb) / t_tot / 1e9}


def peak_memory(f, shape: Shape, dtype) -> int | None:
    """Bytes XLA plans for one fwd+bwd step (temp + arguments + outputs), None if unavailable."""
    b, t, h, d = shape.b, shape.t, shape.h, shape.d
    args = (jax.ShapeDtypeStruct((b, t, 2 * h, d), dtype), jax.ShapeDtypeStruct((b, t, 2 * h, d), dtype),
            jax.ShapeDtypeStruct((b, t, h, 2 * d), dtype), jax.ShapeDtypeStruct((), jnp.float32),
            jax.ShapeDtypeStruct((b, t, h, 2 * d), dtype))
    _, step = _fwd_and_step(f)
    try:
        m = step.lower(*args).compile().memory_analysis()
    except Exception as e:  # noqa: BLE001 - report, do not die, on a backend without analysis
        print(f"memory analysis failed: {e!r}"[:300])
        return None
    if m is None:
        return None
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check(block_sizes: BlockSizes | None, interpret) -> list[dict]:
    """Fused fwd + grads (q, k, v, λ) and the standard kernels vs the oracle on fresh inputs."""
    cases = [  # (B, T, H, Hkv, d, causal, segments, dtype, λ)
        (2, 256, 4, 4, 64, True, False, jnp.float32, 0.6),
        (2, 301, 4, 2, 64, True, True, jnp.float32, -0.4),
        (1, 200, 4, 1, 32, False, False, jnp.float32, 0.0),
        (2, 512, 4, 4, 64, True, False, jnp.bfloat16, 0.8),
        (1, 333, 8, 2, 64, True, True, jnp.bfloat16, 0.3),
        (1, 384, 4, 2, 128, True, True, jnp.bfloat16, 0.5),  # d = 128: the 3B config's width
        (1, 257, 2, 2, 128, True, False, jnp.float32, -0.2),
    ]
    rows = []
    for n, (b, t, h, hkv, d, causal, seg, dtype, lam) in enumerate(cases):
        ks = jax.random.split(jax.random.PRNGKey(100 + n), 4)
        q = jax.random.normal(ks[0], (b, t, 2 * h, d), dtype)
        k = jax.random.normal(ks[1], (b, t, 2 * hkv, d), dtype)
        v = jax.random.normal(ks[2], (b, t, hkv, 2 * d), dtype)
        do = jax.random.normal(ks[3], (b, t, h, 2 * d), dtype)
        segs = None
        if seg:
            cut = np.sort(np.random.default_rng(n).integers(1, t, size=2))
            s = np.ones((b, t), np.int32)
            s[:, cut[0]:] = 2
            s[:, cut[1]:] = 0
            segs = jnp.asarray(s)

        def run(impl, q, k, v, lam):
            return kernels.diff_attention(q, k, v, lam, segment_ids=segs, causal=causal, impl=impl,
                                          block_sizes=block_sizes, interpret=interpret)

        def grads(impl):
            up = (lambda x: x.astype(jnp.float32)) if impl == "xla" else (lambda x: x)
            loss = lambda *a: jnp.sum(run(impl, *a).astype(jnp.float32) * do.astype(jnp.float32))  # noqa: E731
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(
                up(q), up(k), up(v), jnp.float32(lam))

        out = jax.jit(lambda *a: run("pallas", *a))(q, k, v, jnp.float32(lam))
        ref = jax.jit(lambda *a: run("xla", *a))(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                   jnp.float32(lam))
        (_, g), (_, gr) = grads("pallas"), grads("xla")
        errs = {"out": _rel(out, ref)} | {f"d{nm}": _rel(a, r) for nm, a, r in
                                           zip("qkvλ", g, gr)}
        finite = bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in (out, *g)))
        rows.append({"case": f"B{b} T{t} H{h} Hkv{hkv} d{d} causal={causal} seg={seg} "
                             f"{jnp.dtype(dtype).name} λ={lam}", **errs, "finite": finite})
        print(rows[-1], flush=True)
    if jax.default_backend() == "gpu":  # standard attention on cuDNN / Pallas with segments
        b, t, hq, hkv, d = 2, 300, 8, 2, 64
        ks = jax.random.split(jax.random.PRNGKey(7), 4)
        q, k, v, do = (jax.random.normal(kk, (b, t, hh, d), jnp.bfloat16)
                       for kk, hh in zip(ks, (hq, hkv, hkv, hq)))
        segs = jnp.asarray(np.repeat([[1] * 100 + [2] * 150 + [0] * 50], b, 0), jnp.int32)
        for impl in ("cudnn", "pallas"):
            def vg(impl, *xs):
                loss = lambda q, k, v: jnp.sum(kernels.dot_product_attention(  # noqa: E731
                    q, k, v, segment_ids=segs, impl=impl).astype(jnp.float32) * do.astype(jnp.float32))
                return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*xs)

            out = kernels.dot_product_attention(q, k, v, segment_ids=segs, impl=impl)
            ref = kernels.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                segment_ids=segs, impl="xla")
            _, g = vg(impl, q, k, v)
            _, gr = vg("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
            finite = bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in (out, *g)))
            rows.append({"case": f"standard {impl} B{b} T{t} Hq{hq} Hkv{hkv} d{d} seg bf16",
                         "out": _rel(out, ref), "dq": _rel(g[0], gr[0]), "dk": _rel(g[1], gr[1]),
                         "dv": _rel(g[2], gr[2]), "finite": finite})
            print(rows[-1], flush=True)
    return rows


def _table(rows: list[dict], cols: list[str]) -> str:
    def fmt(x):
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def environment() -> dict:
    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
            "jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__")
            else None, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    p.add_argument("--check", action="store_true", help="correctness of the kernels vs the oracle")
    p.add_argument("--tune", action="store_true", help="block-size sweep at --tune-t")
    p.add_argument("--tune-t", type=int, default=4096)
    p.add_argument("--bench", action="store_true",
                   help="with --check/--tune: also run the benchmark (with the best tuned config)")
    p.add_argument("--seqs", type=str, default="2048,4096,8192,16384")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64, help="component width d (V is 2d)")
    p.add_argument("--block", type=str, default="",
                   help="bq,bk,bq_bwd,bk_bwd,warps,stages,warps_bwd,stages_bwd")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--out", type=str, default=str(RESULTS))
    p.add_argument("--tag", type=str, default="")
    args = p.parse_args(argv)

    block_sizes = None
    if args.block:
        vals = [int(x) for x in args.block.split(",")]
        block_sizes = BlockSizes(*vals)
    on_gpu = jax.default_backend() == "gpu"
    interpret = None
    env = environment() | {"block_sizes": dataclasses.asdict(block_sizes) if block_sizes else None}
    result: dict = {"env": env}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.check:
        result["check"] = check(block_sizes, interpret)
        print(_table(result["check"], ["case", "out", "dq", "dk", "dv", "dλ", "finite"]))

    if args.tune:
        shape = Shape(args.tokens // args.tune_t, args.tune_t, args.heads, 64)
        configs = [  # bq, bk, bq_bwd, bk_bwd, warps, stages, warps_bwd, stages_bwd
            # A first sweep on an H100 (results/attention_nvidia_h100_sweep1.md) settled the
            # forward at 128, 64, 8 warps, 3 stages; this one varies the backward.
            (128, 64, 64, 64, 8, 3, 4, 2), (128, 64, 64, 64, 8, 3, 4, 3),
            (128, 64, 64, 64, 8, 3, 8, 2), (128, 64, 32, 64, 8, 3, 4, 2),
            (128, 64, 64, 32, 8, 3, 4, 2), (128, 64, 32, 32, 8, 3, 4, 2),
            (128, 64, 64, 64, 8, 3, 4, 1),
        ]
        rows = []
        for cfg in configs:
            bs = BlockSizes(*cfg)
            f = variants(bs, interpret, False)["fused"]
            try:
                r = bench_one("fused", f, shape, jnp.bfloat16, reps=3, samples=5)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"config {cfg} failed: {e!r}"[:400], flush=True)
                continue
            r["config"] = ",".join(map(str, cfg))
            rows.append(r)
            print(r, flush=True)
        result["tune"] = rows
        print(_table(rows, ["config", "fwd_ms", "bwd_ms", "total_ms", "fwd_tflops", "bwd_tflops"]))
        if rows:  # best forward and best backward settings, combined
            f_best = min(rows, key=lambda r: r["fwd_ms"])["config"].split(",")
            b_best = min(rows, key=lambda r: r["bwd_ms"])["config"].split(",")
            best = [int(x) for x in f_best[:2] + b_best[2:4] + f_best[4:6] + b_best[6:8]]
            block_sizes = BlockSizes(*best)
            env["block_sizes"] = dataclasses.asdict(block_sizes)
            print("tuned:", block_sizes, flush=True)

    if args.bench or not (args.check or args.tune):
        if args.smoke:
            seqs, tokens, heads, d, dtype = [40], 80, 2, 16, jnp.float32
            reps, samples = 1, 1
        else:
            seqs = [int(x) for x in args.seqs.split(",")]
            tokens, heads, d, dtype = args.tokens, args.heads, args.head_dim, jnp.bfloat16
            reps, samples = args.reps, args.samples
        fns = variants(block_sizes, interpret, with_cudnn=on_gpu)
        rows, mem = [], []
        for t in seqs:
            shape = Shape(max(1, tokens // t), t, heads, d)
            for name, f in fns.items():
                try:
                    r = bench_one(name, f, shape, dtype, reps=reps, samples=samples)
                except Exception as e:  # noqa: BLE001 - e.g. cuDNN refusing a shape: recorded
                    r = {"variant": name, "T": t, "B": shape.b, "error": repr(e)[:300]}
                rows.append(r)
                print(r, flush=True)
            xla = lambda q, k, v, lam: kernels.diff_attention(q, k, v, lam, impl="xla")  # noqa: E731
            mem.append({"T": t, "B": shape.b, "fused_bytes": peak_memory(fns["fused"], shape, dtype),
                        "xla_bytes": peak_memory(xla, shape, dtype)})
            print(mem[-1], flush=True)
        # Ratios of the fused total time to the comparison routes at each T.
        ratios = []
        for t in seqs:
            by = {r["variant"]: r for r in rows if r["T"] == t and "error" not in r}
            if "fused" not in by:
                continue
            ratio = {"T": t}
            for name in by:
                if name != "fused":
                    ratio[f"fused/{name}"] = by["fused"]["total_ms"] / by[name]["total_ms"]
            ratios.append(ratio)
        result |= {"bench": rows, "memory": mem, "ratios": ratios,
                   "config": {"tokens": tokens, "heads": heads, "d": d, "dtype": jnp.dtype(dtype).name,
                              "causal": True, "lam": LAM, "reps": reps, "samples": samples}}
        print(_table(rows, ["variant", "T", "B", "fwd_ms", "bwd_ms", "total_ms", "fwd_tflops",
                            "bwd_tflops", "total_tflops"]))
        print(_table(ratios, list(ratios[0].keys()) if ratios else ["T"]))
        print(_table(mem, ["T", "B", "fused_bytes", "xla_bytes"]))

    tag = args.tag or ("smoke" if args.smoke else env["device"].replace(" ", "_"))
    stem = out_dir / f"attention_{tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    md = [f"# Attention benchmark ({tag})", "", f"device: {env['device']}, jax {env['jax']}, "
          f"python {env['python']}, {env['date']}", f"block sizes: {env['block_sizes']}", ""]
    if "check" in result:
        md += ["## Correctness (‖out−ref‖/‖ref‖ vs the float32 oracle at HIGHEST)", "",
               _table(result["check"], ["case", "out", "dq", "dk", "dv", "dλ", "finite"]), ""]
    if "tune" in result:
        md += ["## Tuning (fused, bf16, causal)", "",
               _table(result["tune"], ["config", "fwd_ms", "bwd_ms", "total_ms", "fwd_tflops",
                                       "bwd_tflops"]), ""]
    if "bench" in result:
        md += ["## Timings (median ms; TFLOP/s on each route's floor FLOP count)", "",
               _table(result["bench"], ["variant", "T", "B", "fwd_ms", "bwd_ms", "total_ms",
                                        "fwd_tflops", "bwd_tflops", "total_tflops"]), "",
               "## Fused total time over each route's", "",
               _table(result["ratios"], list(result["ratios"][0].keys()) if result["ratios"] else
                      ["T"]), "", "## Planned memory of one fwd+bwd step (bytes)", "",
               _table(result["memory"], ["T", "B", "fused_bytes", "xla_bytes"]), ""]
    stem.with_suffix(".md").write_text("\n".join(md))
    print(f"wrote {stem}.json / .md")
    return result


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    main()
