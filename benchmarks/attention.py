"""Benchmark of the fused differential flash attention against standard-attention routes.

Causal, bfloat16, d ∈ --head-dims (64 and 128 by default; V is 2d wide), H = 16 DIFF heads,
B·T = 32K tokens, T in {2K, 4K, 8K, 16K}. Variants (ms and TFLOP/s for forward, backward =
(fwd+bwd) − fwd, total):
  fused            kernels.diff_attention(impl="pallas"): one kernel, two online softmaxes (on
                   Hopper the Mosaic GPU kernel; env.fused_backend says which ran)
  fused_triton     the same operator forced onto the Triton kernel (the pre-Hopper fallback)
  cudnn_2h_d       the paper's Transformer baseline: 2H heads × d on cuDNN
  cudnn_h_2d       standard causal attention, H heads × 2d, on cuDNN
  cudnn_four       FlashDiff_2 style: the four (Q_c, K_c, V_half) attentions stacked as 4H heads
                   of width d in one jax.nn.dot_product_attention(implementation="cudnn") call
  tokamax_two      FlashDiff_1 style: two Tokamax Mosaic attentions with V = 2d, minus λ (tokamax
                   is imported lazily; absent, the row records why)
  a_two_pallas     FlashDiff_1 style with this repo's standard Pallas kernel (--smoke, CPU)
  c_pallas_h128    standard attention H × 2d with this repo's Pallas kernel (--smoke, CPU)
TFLOP/s use each route's own floor count per (query, key) pair and DIFF head (matmuls only):
fused 12d/20d, two calls 12d/28d, four calls 16d/40d, standard 8d/20d (forward/backward), causal
pairs T(T+1)/2. Peak memory of fwd+bwd (compiled temp + arguments + outputs, from XLA's memory
analysis) is reported for the fused kernel and the xla oracle. The JSON's `summary` gives, per d
at T = 4096, the fused total time over the cuDNN baseline and over two Tokamax calls, and the
fused forward and backward TFLOP/s.

Modes: default / --bench (GPU benchmark), --check (GPU correctness of the real lowerings vs the
float64 NumPy reference, `kernels.float64_reference`, computed on the host; each row's `ok` says
whether every error is within `CHECK_TOLERANCE`), --tune (GPU sweep
of the Mosaic kernel's tiles at --tune-t; --tune-write records the best per d in
kernels/tuning/mosaic_gpu.json), --smoke (tiny shapes, CPU interpreter, for the tests).
--deadline stops starting new measurements after that many seconds (recorded), as does SIGTERM
(the measurement in flight finishes; the JSON and markdown are written). On a GPU, --check's
cases and each length's --bench rows are lowered first and compile on the host's cores
(--compile-threads, `CompileAhead`), as do each --tune phase's settings, then run one at a
time: on the H100 a check case took about 35 s and a bench row 7 s, nearly all of it
compiling, one program after another.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import faulthandler
import json
import os
import platform
import re
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diff_jax.platforms import default_to_cpu_without_accelerators  # noqa: E402

default_to_cpu_without_accelerators()  # before jax is imported (diff_jax/platforms.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from diff_jax import kernels  # noqa: E402
from diff_jax.attention import HeadLayout  # noqa: E402
from diff_jax.command import Written, concluded, leave, positive_int, positive_ints  # noqa: E402
from diff_jax.config import ModelConfig  # noqa: E402
from diff_jax.kernels import BlockSizes, flash, flash_mgpu, float64_reference, hopper  # noqa: E402
from diff_jax.output_dir import write_whole  # noqa: E402
from diff_jax.variants import DIFF  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LAM = 0.37

# Floor FLOPs per (q, k) pair and DIFF head, in units of d (fwd, bwd).
FLOPS_PER_PAIR = {
    "fused": (12, 20), "fused_triton": (12, 20), "a_two_pallas": (12, 28),
    "tokamax_two": (12, 28), "cudnn_four": (16, 40), "c_pallas_h128": (8, 20),
    "cudnn_h_2d": (8, 20), "cudnn_2h_d": (8, 20), "xla": (12, 20),
}
# the summary's routes first (a --deadline cuts the rest of a T's rows)
GPU_VARIANTS = ("fused", "cudnn_2h_d", "tokamax_two", "cudnn_h_2d", "cudnn_four", "fused_triton")
CPU_VARIANTS = ("fused", "a_two_pallas", "c_pallas_h128")
SUMMARY_T = 4096


class Deadline:
    """Seconds left before `limit` (None: no limit); stages check it before starting work.
    `stop` (a signal handler) makes it pass at once."""

    def __init__(self, limit: float | None):
        self.end = None if limit is None else time.monotonic() + limit

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() > self.end

    def stop(self, *_) -> None:
        self.end = time.monotonic() - 1.0


def _diff_layout(h: int, d: int, hkv: int | None = None) -> HeadLayout:
    """DIFF V1's head layout (its spec, `diff_jax.variants.DIFF`) at H heads of component width d
    and Hkv kv heads (None: H)."""
    config = ModelConfig(variant="diff", embed_dim=DIFF.sub_heads * h * d, num_heads=h,
                         num_kv_heads=hkv)  # DIFF V1's d is always E / (sub_heads · H)
    return DIFF.layout(config)


@dataclasses.dataclass
class Shape:
    """A DIFF attention problem: batch B, length T, H heads of component width d, Hkv kv heads
    (None: H)."""

    b: int
    t: int
    h: int
    d: int
    hkv: int | None = None

    def operands(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of the DIFF op's q (B, T, 2H, d), k (B, T, 2Hkv, d), v (B, T, Hkv, 2d)
        and of its output dO (B, T, H, 2d), from DIFF V1's head layout."""
        lay, b, t = _diff_layout(self.h, self.d, self.hkv), self.b, self.t
        return ((b, t, lay.q_heads, lay.head_dim), (b, t, lay.k_heads, lay.head_dim),
                (b, t, lay.v_heads, lay.v_width), (b, t, lay.op_heads, lay.v_width))


def _inputs(shape: Shape, dtype, seed: int = 0):
    """q (B,T,2H,d), k (B,T,2Hkv,d), v (B,T,Hkv,2d), dO (B,T,H,2d): random normal, never zeros."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return tuple(jax.random.normal(key, s, dtype) for key, s in zip(ks, shape.operands()))


def _tokamax_attend():
    """tokamax's Mosaic attention (q, k, v) -> out (V of any width), or why it cannot run."""
    try:
        import tokamax
    except Exception as e:  # noqa: BLE001 - absent or broken: the row records why
        return None, f"tokamax not importable: {e!r}"[:200]

    def attend(q, k, v):
        return tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic")

    return attend, None


def variants(block_sizes: BlockSizes | None, interpret, with_cudnn: bool,
             triton_blocks: BlockSizes | None = None):
    """name -> f(q, k, v, lam) on the differential layouts, each returning (B, T, H, ·); a value
    that is a string is the reason the variant cannot run here. `block_sizes` go to "fused"
    (whichever kernel the dispatch picks), `triton_blocks` to "fused_triton"."""

    def fused(q, k, v, lam):
        return kernels.diff_attention(q, k, v, lam, impl="pallas", block_sizes=block_sizes,
                                      interpret=interpret)

    def fused_triton(q, k, v, lam):
        return flash.flash_attention(q, k, v, lam, num_components=2, causal=True, backend="gpu",
                                     block_sizes=triton_blocks, interpret=interpret)

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

    out = {"fused": fused, "fused_triton": fused_triton, "a_two_pallas": a_two_pallas,
           "c_pallas_h128": c_pallas_h128}
    if with_cudnn:
        def cudnn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

        def cudnn_four(q, k, v, lam):  # 4H heads of width d in one cuDNN call
            return kernels.diff_attention(q, k, v, lam, impl="cudnn")

        def cudnn_h_2d(q, k, v, lam):
            b, t, h2, d = q.shape
            return cudnn(q.reshape(b, t, h2 // 2, 2 * d), k.reshape(b, t, h2 // 2, 2 * d), v)

        def cudnn_2h_d(q, k, v, lam):  # 2H heads of width d; V viewed as (B, T, 2H, d)
            b, t, h2, d = q.shape
            return cudnn(q, k, v.reshape(b, t, h2, d)).reshape(b, t, h2 // 2, 2 * d)

        out |= {"cudnn_four": cudnn_four, "cudnn_h_2d": cudnn_h_2d, "cudnn_2h_d": cudnn_2h_d}
        attend, why = _tokamax_attend()
        if attend is None:
            out["tokamax_two"] = why
        else:
            def tokamax_two(q, k, v, lam):
                o1 = attend(q[:, :, 0::2], k[:, :, 0::2], v)
                o2 = attend(q[:, :, 1::2], k[:, :, 1::2], v)
                return o1 - lam.astype(o1.dtype) * o2

            out["tokamax_two"] = tokamax_two
    return out


def _fwd_and_step(f):
    fwd = jax.jit(f)

    def loss(q, k, v, lam, do):
        return jnp.sum(f(q, k, v, lam).astype(jnp.float32) * do.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return fwd, step


def _lowered(f, shape: Shape, dtype) -> tuple[Any, Any]:
    """`f`'s forward and fwd+bwd step (`_fwd_and_step`) lowered on `shape`'s operands in
    `dtype`: two `jax.stages.Lowered`."""
    fwd, step = _fwd_and_step(f)
    q, k, v, do = (jax.ShapeDtypeStruct(s, dtype) for s in shape.operands())
    lam = jax.ShapeDtypeStruct((), jnp.float32)
    return fwd.lower(q, k, v, lam), step.lower(q, k, v, lam, do)


class CompileAhead:
    """Programs compiled on a pool of threads while the caller lowers the next ones: XLA and
    Mosaic GPU compile without holding the GIL, so a batch's compiles overlap on the host's
    cores (four Mosaic GPU forward kernels compiled for an H100 on a 2-core CPU: 3.4 s one after
    another, 1.9 s on 2 threads). Lowering (tracing) stays in the caller's thread, where the
    warnings it raises are caught; the caller runs and times the programs afterwards, one at a
    time, with no compile beside them."""

    def __init__(self, threads: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)

    def submit(self, lowered) -> Callable[[], Any]:
        """A thunk that waits for `lowered` (a `jax.stages.Lowered`) compiled and returns it,
        or raises what its compile raised."""
        return self.pool.submit(lowered.compile).result

    def programs(self, f, shape: Shape, dtype) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """`f`'s forward and fwd+bwd step (as `bench_one` times them) lowered here on `shape`'s
        operands in `dtype`, compiling in the pool: a `submit` thunk each."""
        fwd, step = _lowered(f, shape, dtype)
        return self.submit(fwd), self.submit(step)

    def close(self) -> None:
        """Drop the compiles not started (a deadline passed); those running finish."""
        self.pool.shutdown(wait=False, cancel_futures=True)


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


def bench_one(name, f, shape: Shape, dtype, *, reps: int, samples: int,
              keep_outputs: bool = False, programs: tuple[Callable, Callable] | None = None) -> dict:
    """Times of `f`'s forward and forward + backward on `shape`; with `keep_outputs`, also
    `outputs`: (out, dq, dk, dv, dλ) from those compiled functions (for `tune`'s agreement check,
    at no extra compile). `programs`: the two compiled ahead (`CompileAhead.programs`), else
    they compile at their first call."""
    q, k, v, do = _inputs(shape, dtype)
    lam = jnp.float32(LAM)
    fwd, step = _fwd_and_step(f) if programs is None else (programs[0](), programs[1]())
    t_fwd = _time(fwd, (q, k, v, lam), reps=reps, samples=samples)
    t_tot = _time(step, (q, k, v, lam, do), reps=reps, samples=samples)
    t_bwd = t_tot - t_fwd
    ff, fb = (c * shape.d * _pairs(shape) for c in FLOPS_PER_PAIR[name])
    row = {"variant": name, "d": shape.d, "T": shape.t, "B": shape.b, "fwd_ms": t_fwd,
           "bwd_ms": t_bwd,
           "total_ms": t_tot, "fwd_tflops": ff / t_fwd / 1e9, "bwd_tflops": fb / t_bwd / 1e9,
           "total_tflops": (ff + fb) / t_tot / 1e9}
    if keep_outputs:
        row["outputs"] = (fwd(q, k, v, lam), *step(q, k, v, lam, do))
    return row


def step_compiler(f, shape: Shape, dtype,
                  ahead: CompileAhead | None = None) -> Callable[[], Any]:
    """A thunk returning `f`'s fwd+bwd step compiled on `shape` (for `peak_memory`, which
    reports what it raises): compiling in `ahead`'s pool from now, else at the call."""

    def compile_here():
        return _lowered(f, shape, dtype)[1].compile()

    if ahead is None:
        return compile_here
    try:
        return ahead.submit(_lowered(f, shape, dtype)[1])
    except Exception:  # noqa: BLE001 - refused at lowering: compile_here raises it again
        return compile_here


def peak_memory(compiled_step: Callable[[], Any]) -> int | None:
    """Bytes XLA plans for one fwd+bwd step (temp + arguments + outputs), None if unavailable.
    `compiled_step`: a thunk returning the compiled step (`step_compiler`, or the step a bench
    row compiled ahead and timed: `CompileAhead.programs`' second thunk, no second compile)."""
    try:
        m = compiled_step().memory_analysis()
    except Exception as e:  # noqa: BLE001 - report, do not die, on a backend without analysis
        print(f"memory analysis failed: {e!r}"[:300])
        return None
    if m is None:
        return None
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


# The largest ‖kernel − oracle‖ / ‖oracle‖ a --check row may show for out, dq, dk, dv and dλ,
# by the inputs' dtype (dλ too: its cotangent keeps it from cancelling, `_lambda_conditioned`).
# float32 runs TF32 matmuls on the GPU (an H100 measured ≤ 5.4e-4, dλ ≤ 3.2e-3 on random
# cotangents, against the float32 xla oracle it was checked against then:
# benchmarks/results/attention_nvidia_h100_d128check.md); bfloat16 measured ≤ 2.6e-3, under the
# 2e-2 tests/test_kernels.py holds bf16 to; float16 has 3 more mantissa bits: 8 times tighter
# (as tests/test_kernels_mgpu.py holds its float16 cases).
CHECK_TOLERANCE = {"float32": 5e-3, "bfloat16": 2e-2, "float16": 2.5e-3}


def _within(errs: dict[str, float], finite: bool, dtype) -> bool:
    """Whether a --check row passes: finite, and each relative error (NaN fails) within
    `CHECK_TOLERANCE` of `dtype`."""
    tol = CHECK_TOLERANCE[jnp.dtype(dtype).name]
    return finite and all(e <= tol for e in errs.values())


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# (B, T, H, Hkv, d, causal, segments, dtype, λ[, Mosaic Tiles fields]): the cases the Mosaic
# kernel takes on Hopper (bf16/fp16, d ∈ {64, 96, 128}) first, then the Triton ones (float32,
# d = 32), so a --deadline skips the fallback (measured on an H100 before) and not the new
# kernel. First the schedules no GPU has run (the "share" dK/dV kernel, with dQ fused into it
# at d = 64 and 128, atomics then TMA reduce-adds, and with a dQ kernel at 128: a 15-minute
# session's check reaches about four cases), then the table's tiles at d = 64 and 128 (checked
# on an H100). The six with Tiles fields run the dK/dV and dQ schedules the table does not pick
# at their d ("rows" and "share" dK/dV, "split", "fused" and "fused_tma" dQ) and the forward
# without ping-pong, so `--tune` compares only checked schedules.
CHECK_CASES = [
    # atomic and TMA reduce-adds run only on the GPU (a read, add and write in the interpreter)
    (1, 333, 8, 2, 64, True, True, jnp.bfloat16, 0.3, {"dkv": "share", "dq": "fused"}),
    (1, 384, 4, 2, 128, True, True, jnp.bfloat16, 0.5, {"dkv": "share", "dq": "fused"}),
    (1, 333, 8, 2, 64, True, True, jnp.bfloat16, 0.3, {"dkv": "share", "dq": "fused_tma"}),
    (1, 384, 4, 2, 128, True, True, jnp.bfloat16, 0.5, {"dkv": "share"}),
    (2, 512, 4, 4, 64, True, False, jnp.bfloat16, 0.8),
    (1, 384, 4, 2, 128, True, True, jnp.bfloat16, 0.5),  # d = 128: the 3B config's width
    (1, 333, 8, 2, 64, True, True, jnp.bfloat16, 0.3),
    (1, 333, 8, 2, 64, True, True, jnp.bfloat16, 0.3,
     {"dkv": "rows", "pingpong": False, "dq": "split"}),
    (1, 384, 4, 2, 128, True, True, jnp.bfloat16, 0.5,
     {"dkv": "rows", "pingpong": False, "dq": "split"}),
    (1, 300, 4, 2, 96, False, True, jnp.bfloat16, -0.7),  # d = 96: the 830M config's width
    (2, 1000, 4, 1, 128, False, False, jnp.float16, 0.0),
    (1, 1024, 2, 2, 64, True, False, jnp.float16, 1.2),
    (2, 256, 4, 4, 64, True, False, jnp.float32, 0.6),
    (2, 301, 4, 2, 64, True, True, jnp.float32, -0.4),
    (1, 200, 4, 1, 32, False, False, jnp.float32, 0.0),
    (1, 257, 2, 2, 128, True, False, jnp.float32, -0.2),
]


def _lambda_conditioned(g, q, k, v, causal: bool, segs) -> jax.Array:
    """The --check cotangent dO = G + O2·‖G‖/‖O2‖ in G's dtype, O2 the second softmax's output
    (`float64_reference.second_softmax_output`, on the host).

    With a random G alone, dλ = −Σ dO·O2 sums ~5·10⁵ terms that cancel (Σ|terms| ≈ 10⁴·|dλ| for
    `CHECK_CASES[4]`), so rounding O2 to bf16 — the residual every fused kernel keeps, as the
    reference's autograd keeps its second FlashAttention output — moves dλ by 4% (measured: the
    float64 dλ of O2 rounded to bf16 is 3.912 against 4.085), more than any kernel error the
    check is after. Along O2 the sum no longer cancels: that rounding moves it by 6e-6, and a 1%
    error in dλ shows. Padding rows (segment 0) have O2 = 0 and keep G.
    """
    f32 = [np.asarray(x, np.float32) for x in (q, k, v, g)]
    o2 = float64_reference.second_softmax_output(
        *f32[:3], causal=causal, seg=None if segs is None else np.asarray(segs))
    do = f32[3] + o2 * (np.linalg.norm(f32[3]) / np.linalg.norm(o2))
    return jnp.asarray(do, g.dtype)


def _check_case(n: int, block_sizes: BlockSizes | None, interpret,
                compile_program: Callable[[Any], Callable[[], Any]]) -> dict:
    """`CHECK_CASES[n]` lowered: its row so far ("case", "backend") and, unless lowering the
    kernel's route failed (then "error"), under "run" a thunk that gets its program compiled
    (`compile_program(lowered)` is a thunk returning it) and returns (out, grads) of the kernel
    and of the oracle, `kernels.float64_reference` on the same input values;
    "deprecations": the DeprecationWarnings lowering raised."""
    b, t, h, hkv, d, causal, seg, dtype, lam, *fields = CHECK_CASES[n]
    fields = fields[0] if fields else {}
    label = (f"B{b} T{t} H{h} Hkv{hkv} d{d} causal={causal} seg={seg} "
             f"{jnp.dtype(dtype).name} λ={lam}" + "".join(f" {k}={x}" for k, x in fields.items()))
    sizes = block_sizes
    if fields:  # this case's Mosaic schedules, on the given (or the table's) tiles
        sizes = block_sizes or BlockSizes()
        tiles = sizes.mosaic_gpu or hopper.tiles_for(d, dtype)[0]
        sizes = dataclasses.replace(sizes, mosaic_gpu=dataclasses.replace(tiles, **fields))
    q, k, v, g = _inputs(Shape(b, t, h, d, hkv), dtype, seed=100 + n)
    segs = None
    if seg:
        cut = np.sort(np.random.default_rng(n).integers(1, t, size=2))
        s = np.ones((b, t), np.int32)
        s[:, cut[0]:] = 2
        s[:, cut[1]:] = 0
        segs = jnp.asarray(s)
    do = _lambda_conditioned(g, q, k, v, causal, segs)

    def lowered():  # the kernel's route: (output, gradients of q, k, v, λ) in one program
        def loss(*a):
            out = kernels.diff_attention(*a, segment_ids=segs, causal=causal, impl="pallas",
                                         block_sizes=sizes, interpret=interpret)
            return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

        args = (q, k, v, jnp.float32(lam))
        program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        return compile_program(program.lower(*args)), args

    def run(route):
        compiled, args = route
        (_, out), g = compiled()(*args)
        return out, g

    def oracle():  # the same inputs' values in float64, on the host
        f32 = [np.asarray(x, np.float32) for x in (q, k, v, do)]
        return float64_reference.diff_attention(
            *f32[:3], lam, f32[3], causal=causal, seg=None if segs is None else np.asarray(segs))

    backend = ("mosaic_gpu" if jax.default_backend() == "gpu"
               and flash.uses_mosaic_gpu(2, dtype, d, v.shape[-1]) else "triton")
    row = {"case": label, "backend": backend}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            kernel = lowered()
        except Exception as e:  # noqa: BLE001 - a failing case is a row, not the end
            return row | {"error": repr(e)[:500]}
    row["deprecations"] = "; ".join(sorted({str(w.message)[:120] for w in caught
                                            if issubclass(w.category, DeprecationWarning)}))
    return row | {"run": lambda: (run(kernel), oracle()), "dtype": dtype}


def check(block_sizes: BlockSizes | None, interpret,
          deadline: Deadline | None = None, threads: int = 1) -> list[dict]:
    """Fused fwd + grads (q, k, v, λ) vs the float64 NumPy reference (on the host) and the
    standard kernels vs the xla oracle, on fresh inputs (`CHECK_CASES`, in order, until
    `deadline`) and a cotangent under which dλ does not cancel (`_lambda_conditioned`).

    Each row names the kernel the dispatch picked ("mosaic_gpu" on Hopper for bf16/fp16 at
    d ∈ {64, 96, 128}, else "triton") and the DeprecationWarnings its lowering raised. Off
    Hopper the cases with Tiles fields are two more cases. With `threads` > 1 every case is
    lowered first and the programs compile on that many threads (`CompileAhead`), then the
    cases run in order; with 1 each case compiles when it runs.
    """
    ahead = CompileAhead(threads) if threads > 1 else None
    compile_program = ahead.submit if ahead is not None else (lambda low: low.compile)

    def lowered_cases():
        for n in range(len(CHECK_CASES)):
            if deadline is not None and deadline.passed():
                yield {"case": f"{n}", "error": "skipped: deadline"}
                continue
            print(f"lowering case {n}", flush=True)
            yield _check_case(n, block_sizes, interpret, compile_program)

    cases = lowered_cases() if ahead is None else list(lowered_cases())
    rows = []
    for case in cases:
        if "run" in case and deadline is not None and deadline.passed():
            case = {"case": case["case"], "error": "skipped: deadline"}
        if "run" not in case:
            rows.append(case)
            print(rows[-1], flush=True)
            continue
        print(f"case: {case['case']}", flush=True)  # before it compiles or runs: a hang says which
        try:
            (out, g), (ref, gr) = case.pop("run")()
        except Exception as e:  # noqa: BLE001 - a failing case is a row, not the end
            rows.append({"case": case["case"], "backend": case["backend"],
                         "error": repr(e)[:500]})
            print(rows[-1], flush=True)
            continue
        errs = {"out": _rel(out, ref)} | {f"d{nm}": _rel(a, r) for nm, a, r in
                                           zip("qkvλ", g, gr)}
        finite = bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in (out, *g)))
        deprecations, dtype = case.pop("deprecations"), case.pop("dtype")
        rows.append(case | errs | {"finite": finite, "ok": _within(errs, finite, dtype),
                                   "deprecations": deprecations})
        print(rows[-1], flush=True)
    if ahead is not None:
        ahead.close()
    if jax.default_backend() == "gpu":  # standard attention on cuDNN / Pallas with segments
        b, t, hq, hkv, d = 2, 300, 8, 2, 64
        ks = jax.random.split(jax.random.PRNGKey(7), 4)
        q, k, v, do = (jax.random.normal(kk, (b, t, hh, d), jnp.bfloat16)
                       for kk, hh in zip(ks, (hq, hkv, hkv, hq)))
        segs = jnp.asarray(np.repeat([[1] * 100 + [2] * 150 + [0] * 50], b, 0), jnp.int32)
        for impl in ("cudnn", "pallas"):
            if deadline is not None and deadline.passed():  # past it, a stage limit is a hang
                rows.append({"case": f"standard {impl}", "error": "skipped: deadline"})
                continue

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
            errs = {"out": _rel(out, ref), "dq": _rel(g[0], gr[0]), "dk": _rel(g[1], gr[1]),
                    "dv": _rel(g[2], gr[2])}
            rows.append({"case": f"standard {impl} B{b} T{t} Hq{hq} Hkv{hkv} d{d} seg bf16",
                         **errs, "finite": finite, "ok": _within(errs, finite, jnp.bfloat16)})
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
            # the runtime XLA runs on: e.g. the CUDA version on a GPU, "cpu" here
            "platform_version": getattr(dev.client, "platform_version", None),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


CHECK_COLS = ["case", "backend", "out", "dq", "dk", "dv", "dλ", "finite", "ok", "deprecations",
              "error"]
TUNE_COLS = ["d", "stage", "tiles", "dkv", "fwd_ms", "total_ms", "fwd_tflops", "bwd_tflops",
             "vs_first", "error"]
BENCH_COLS = ["variant", "d", "T", "B", "fwd_ms", "bwd_ms", "total_ms", "fwd_tflops", "bwd_tflops",
              "total_tflops", "error"]


def _ratios(rows: list[dict]) -> list[dict]:
    """Fused total time over each other route's, per (d, T)."""
    out = []
    for d, t in sorted({(r["d"], r["T"]) for r in rows}):
        by = {r["variant"]: r for r in rows if (r["d"], r["T"]) == (d, t) and "error" not in r}
        if "fused" in by:
            out.append({"d": d, "T": t} | {f"fused/{n}": by["fused"]["total_ms"] / r["total_ms"]
                                            for n, r in by.items() if n != "fused"})
    return out


def _ratio_cols(ratios: list[dict]) -> list[str]:
    cols = ["d", "T"]
    for r in ratios:
        cols += [c for c in r if c not in cols]
    return cols


def summary(rows: list[dict], env: dict, dims: list[int], t: int) -> dict:
    """{"device", "jax", "dNN": {fused_over_cudnn_baseline, fused_over_tokamax_two_calls,
    fwd_tflops, bwd_tflops, ...}} at sequence length t; a missing route gives None and why."""
    out: dict = {"device": env["device"], "jax": env["jax"], "T": t}
    for d in dims:
        by = {r["variant"]: r for r in rows if (r["d"], r["T"]) == (d, t)}
        fused = by.get("fused", {})
        entry: dict = {"fused_backend": env["fused_backend"].get(d)}

        def over(name):
            other = by.get(name, {})
            if "total_ms" in fused and "total_ms" in other:
                return fused["total_ms"] / other["total_ms"]
            entry[f"why_no_{name}"] = other.get("error") or fused.get("error") or "not run"
            return None

        entry |= {"fused_over_cudnn_baseline": over("cudnn_2h_d"),
                  "fused_over_tokamax_two_calls": over("tokamax_two"),
                  "fused_over_triton": over("fused_triton"),
                  "fwd_tflops": fused.get("fwd_tflops"), "bwd_tflops": fused.get("bwd_tflops")}
        out[f"d{d}"] = entry
    return out


def _fused_backend(dims: list[int], dtype) -> dict[int, str]:
    """The kernel impl="pallas" runs per head width d here ("mosaic_gpu", "triton", or the CPU
    interpreter's "triton-interpret")."""
    if jax.default_backend() != "gpu":
        return {d: "triton-interpret" for d in dims}
    return {d: "mosaic_gpu" if flash.uses_mosaic_gpu(2, dtype, d, _diff_layout(1, d).v_width)
            else "triton" for d in dims}


def _gpu_name(kind: str) -> str:
    """The table's GPU key for a device_kind: "NVIDIA H100 80GB HBM3" -> "H100"."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", kind)
    return m.group(1) if m else kind


# How far the outputs and gradients of two tile settings may differ (relative norm) in `tune`:
# the same bf16 computation summed in another order differs by ~1e-3; a masking or indexing bug
# of one setting (the interpreter covers small shapes only) differs by far more.
TUNE_AGREEMENT = 3e-2


class _Width:
    """One head width's tuning: its shape (bf16, causal, T = --tune-t), its rows, and the outputs
    of its first setting that ran, which every later one must match to `TUNE_AGREEMENT`.
    `ahead`: a `CompileAhead` that compiles a phase's settings together (None: one by one)."""

    def __init__(self, d: int, args, deadline: Deadline, rows: list[dict],
                 ahead: CompileAhead | None = None):
        self.d, self.deadline, self.rows = d, deadline, rows  # rows: every width's, as they ran
        self.shape = Shape(max(1, args.tokens // args.tune_t), args.tune_t, args.heads, d)
        self.base = hopper.tiles_for(d, jnp.bfloat16)[0]
        self.ahead = ahead
        self.first: list = []
        self.tried: set[str] = set()  # resolved tiles already measured (or refused)

    def run(self, stage: str, *settings) -> None:
        """Measure each of `settings` (Tiles; once: one that resolves to a setting measured
        before is skipped) and append its row: times, or the error (shared memory refuses the
        tiles, a failed compile, disagreement with the first setting, the deadline). With
        `ahead`, all are lowered and compile together first, then run in order."""
        slots = []  # per setting in order: its finished row, or (row, f, programs) to run
        for tiles in settings:
            r = {"d": self.d, "stage": stage, "tiles": hopper.tiles_text(tiles)}
            if self.deadline.passed():
                slots.append(r | {"error": "skipped: deadline"})
                continue
            refused = None
            try:
                split = flash_mgpu.warpgroups(self.d, tiles)[2]
            except ValueError as e:  # shared memory does not hold them: nothing to compile
                refused, key = repr(e)[:300], r["tiles"]
            else:
                r["dkv"] = ("share" if tiles.dkv == "share" else "split") if split else "rows"
                key = hopper.tiles_text(dataclasses.replace(tiles, dkv=r["dkv"]))
            if key in self.tried:
                continue
            self.tried.add(key)
            if refused is not None:
                slots.append(r | {"error": refused})
                continue
            f = variants(BlockSizes(mosaic_gpu=tiles), None, with_cudnn=False)["fused"]
            programs = None
            if self.ahead is not None:
                try:
                    programs = self.ahead.programs(f, self.shape, jnp.bfloat16)
                except Exception as e:  # noqa: BLE001 - a config that does not lower
                    slots.append(r | {"error": repr(e)[:300]})
                    continue
            slots.append((r, f, programs))
        for slot in slots:
            if isinstance(slot, dict):
                self.rows.append(slot)
            elif self.deadline.passed():
                self.rows.append(slot[0] | {"error": "skipped: deadline"})
            else:
                self._measure(*slot)

    def _measure(self, r: dict, f, programs) -> None:
        print(f"tune d={self.d} {r['stage']}: {r['tiles']}", flush=True)  # before it runs
        try:
            m = bench_one("fused", f, self.shape, jnp.bfloat16, reps=3, samples=3,
                          keep_outputs=True, programs=programs)
        except Exception as e:  # noqa: BLE001 - a config that does not compile or run
            self.rows.append(r | {"error": repr(e)[:300]})
            return
        r |= {k: m[k] for k in ("fwd_ms", "total_ms", "fwd_tflops", "bwd_tflops")}
        if not self.first:
            self.first.append(m["outputs"])
            self.rows.append(r | {"vs_first": 0.0})
            return
        r["vs_first"] = max(_rel(a, b) for a, b in zip(m["outputs"], self.first[0]))
        if not r["vs_first"] <= TUNE_AGREEMENT:  # NaN disagrees too
            r["error"] = (f"disagrees with the first setting of d={self.d}: max relative "
                          f"difference of out, dq, dk, dv, dλ {r['vs_first']:.3g} > "
                          f"{TUNE_AGREEMENT}")
        self.rows.append(r)

    def fastest(self, with_dq_kernel: bool = False):
        """The Tiles of the fastest agreeing row by total time (with `with_dq_kernel`, among
        those with a dQ kernel), its dK/dV schedule resolved; None before one ran."""
        ok = [r for r in self.rows if r["d"] == self.d and "error" not in r and not (
            with_dq_kernel and hopper.parse_tiles(r["tiles"]).dq in flash_mgpu.FUSED)]
        if not ok:
            return None
        best = min(ok, key=lambda r: r["total_ms"])
        return dataclasses.replace(hopper.parse_tiles(best["tiles"]), dkv=best["dkv"])


def _tune_plan(w: _Width):
    """One width's settings, a phase each `next` (a generator), each phase on the fastest
    agreeing setting so far by total time (a phase varies only its own fields):
      table     the table's tiles, the setting every later one must agree with;
      fused     dQ fused into the "share" dK/dV kernel (one backward kernel): atomics at
                block_q_dkv 64 and 128, TMA reduce-adds at 64 (a row records shared memory's
                refusal at d = 128);
      fwd       the forward's (block_kv, stages), then the fastest with ping-pong switched;
      bwd       (block_kv_dq, block_q_dkv) with a dQ kernel: on the fastest setting that has one
                (or the table's schedule with the "rows" dQ kernel) with the fastest forward's
                fields;
      schedule  the fastest with a dQ kernel under each dK/dV schedule it does not run, then
                the fastest of those under the other dQ kernel schedule."""
    w.run("table", w.base)
    yield
    best = w.fastest() or w.base
    w.run("fused", *(dataclasses.replace(best, dkv="share", dq=dq, block_q_dkv=bq)
                     for dq, bq in (("fused", 64), ("fused", 128), ("fused_tma", 64))))
    yield
    best = w.fastest() or w.base
    w.run("fwd", *(dataclasses.replace(best, block_kv=bk, stages=st)
                   for bk in (64, 128) for st in (2, 3)))
    best = w.fastest()
    if best is not None:
        w.run("fwd", dataclasses.replace(best, pingpong=not best.pingpong))
    yield
    best = w.fastest() or w.base
    two = w.fastest(with_dq_kernel=True) or dataclasses.replace(best, dkv="auto", dq="rows")
    two = dataclasses.replace(two, block_kv=best.block_kv, stages=best.stages,
                              pingpong=best.pingpong)
    w.run("bwd", *(dataclasses.replace(two, block_kv_dq=a, block_q_dkv=c)
                   for a in (64, 128) for c in (64, 128)))
    yield
    two = w.fastest(with_dq_kernel=True)
    if two is not None:
        w.run("schedule", *(dataclasses.replace(two, dkv=other) for other in
                            flash_mgpu.DKV_SCHEDULES if other not in ("auto", two.dkv)))
        two = w.fastest(with_dq_kernel=True)
        w.run("schedule", dataclasses.replace(two, dq="rows" if two.dq == "split" else "split"))


def tune(head_dims: list[int], args, deadline: Deadline) -> list[dict]:
    """Bounded sweep of the Mosaic kernel's tiles (bf16, causal, T = --tune-t): a greedy descent
    per head width (`_tune_plan`), phase-major across the widths, so that a deadline leaves
    every width its first phases (the table's tiles and the fused dQ) rather than one width
    all of them. Tiles that shared memory refuses are rows that say so; a setting whose output
    and gradients differ from its width's first setting's by more than `TUNE_AGREEMENT`
    (`vs_first`) is an error row and cannot win. --tune-write stores the fastest per d in the
    table. Rows in the order they ran. With --compile-threads > 1 a phase's settings compile
    together (`CompileAhead`) before they run."""
    rows: list[dict] = []
    ahead = CompileAhead(args.compile_threads) if args.compile_threads > 1 else None
    widths = [_Width(d, args, deadline, rows, ahead) for d in head_dims]
    plans = [_tune_plan(w) for w in widths]
    while plans:  # phase k of every width, then phase k + 1
        for plan in list(plans):
            try:
                next(plan)
            except StopIteration:
                plans.remove(plan)
    if ahead is not None:
        ahead.close()
    for w in widths:
        best = w.fastest()
        if best is not None and args.tune_write:
            kind = _gpu_name(hopper.device_kind())
            hopper.record(kind, w.d, jnp.bfloat16, best, f"benchmarks/attention.py --tune, "
                          f"T={args.tune_t}, {environment()['date']}")
            print(f"recorded {kind} d={w.d}: {best}", flush=True)
    return rows


def _triton_blocks(text: str) -> BlockSizes:
    """An argparse `type`: --block's comma list of BlockSizes' first fields."""
    sizes = positive_ints(text)
    fields = [f.name for f in dataclasses.fields(BlockSizes) if f.name != "mosaic_gpu"]
    if len(sizes) > len(fields):
        raise argparse.ArgumentTypeError(f"expected at most {len(fields)} sizes "
                                         f"({','.join(fields)}), got {text!r}")
    return BlockSizes(*sizes)


def _untaken_head_dims(args: argparse.Namespace) -> str | None:
    """Why a width of --head-dims has no kernel to run in the modes `args` ask for, or None.
    --tune starts each width from its row of the Mosaic GPU table (`_Width.base`: without one
    it ended in a traceback); --bench (not --smoke, whose shapes are its own) runs "fused" on
    the table's tiles, else on Triton's defaults, which take d a multiple of 16 in [16, 256]
    (`flash.supports_head_dim`): another width was recorded as a refused row per route and
    length, after compiling the others (d = 72 on the CPU). --check's cases are its own."""
    if args.tune:
        return hopper.untabled(args.head_dims, jnp.bfloat16)
    if args.smoke or (args.check and not args.bench):
        return None
    untaken = [d for d in args.head_dims if not flash.supports_head_dim(d)]
    table = hopper.untabled(untaken, jnp.bfloat16)
    return table and (f"{table}, and the Triton kernel takes d a multiple of 16 in "
                      f"[16, {flash.MAX_HEAD_DIM}]")


def main(argv=None) -> dict:
    """The command line in the module docstring (`argv`: None reads sys.argv): the modes it
    asks for; returns what the JSON holds. `command` ends it as a command line."""
    return measured(arguments(argv))


def command(argv=None) -> int:
    """`main` as the command line, ended as every command is (`command.concluded`): exit
    status 0; 2 on bad input (argparse's usage and error line; one `error:` line for an --out
    that cannot be made or written); 130 after Ctrl-C or once stdout's or stderr's reader is
    gone (`| head`), in one `interrupted:` line: it stops at once, its JSON and markdown each
    written whole or not at all. Measured with --smoke before: a Ctrl-C while it compiled was a
    KeyboardInterrupt traceback (exit -2), `| head` a BrokenPipeError traceback at the first
    row's print (exit 1; 120 with stdout block-buffered), nothing written. SIGTERM keeps the
    deadline's handler (what was measured is written, exit 0)."""
    args = arguments(argv)
    written = Written()
    return concluded(lambda: measured(args, written), (f"--out {args.out}", args.out),
                     written=written)


def arguments(argv=None) -> argparse.Namespace:
    """The parsed command line (`argv`: None reads sys.argv); argparse's usage and error line,
    exit status 2, for one no measurement could take."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    p.add_argument("--check", action="store_true",
                   help="correctness of the kernels vs the float64 reference")
    p.add_argument("--tune", action="store_true", help="block-size sweep at --tune-t")
    p.add_argument("--tune-t", type=positive_int, default=4096)
    p.add_argument("--bench", action="store_true",
                   help="with --check/--tune: also run the benchmark (with the best tuned config)")
    p.add_argument("--tune-write", action="store_true",
                   help="record the tuned tiles in kernels/tuning/mosaic_gpu.json")
    p.add_argument("--seqs", type=positive_ints, default="2048,4096,8192,16384")
    p.add_argument("--tokens", type=positive_int, default=32768)
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--head-dims", type=positive_ints, default="64,128",
                   help="component widths d (V is 2d)")
    p.add_argument("--variants", type=str, default="",
                   help=f"comma list (default on GPU: {','.join(GPU_VARIANTS)})")
    p.add_argument("--block", type=_triton_blocks, default=None,
                   help="Triton tiles of fused_triton: bq,bk,bq_bwd,bk_bwd,warps,stages,warps_bwd,"
                        "stages_bwd")
    p.add_argument("--reps", type=positive_int, default=5)
    p.add_argument("--samples", type=positive_int, default=7)
    p.add_argument("--compile-threads", type=positive_int, default=None,
                   help="threads that compile a batch of --check cases or of one length's "
                        "--bench rows before they run (default: the host's cores on a GPU, "
                        "else 1: each compiles at its first call)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after which no new measurement starts (skips are recorded)")
    p.add_argument("--out", type=str, default=str(RESULTS))
    p.add_argument("--tag", type=str, default="")
    args = p.parse_args(argv)
    uneven = [t for t in dict.fromkeys([*args.seqs, args.tune_t]) if args.tokens % t]
    if uneven:  # B = tokens / T at every T (B·T fixed): another was rounded down unsaid
        p.error(f"--tokens {args.tokens}: expected a multiple of every sequence length (--seqs, "
                f"--tune-t), not of {', '.join(map(str, uneven))}")
    untaken = _untaken_head_dims(args)
    if untaken:  # before anything compiles: each such row was a refusal, after the others
        p.error(f"--head-dims {','.join(map(str, args.head_dims))}: {untaken}")
    return args


def measured(args: argparse.Namespace, written: Written | None = None) -> dict:
    """`main`'s work for parsed `args`, under the deadline and its SIGTERM handler; `written`
    says when the JSON and markdown are in place (`command.concluded`)."""
    if args.compile_threads is None:
        args.compile_threads = (len(os.sched_getaffinity(0)) if jax.default_backend() == "gpu"
                                else 1)
    deadline = Deadline(args.deadline)
    # SIGTERM (the GPU session's stage limit) stops starting measurements; the one in flight
    # finishes and what was measured is written, as at --deadline.
    before = signal.signal(signal.SIGTERM, deadline.stop)
    # A hung kernel never returns to Python, where `deadline.stop` would run: at SIGTERM every
    # thread's stack goes to stderr first (in C), so the log names the call that hangs.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    try:
        return _modes(args, deadline, written or Written())
    finally:
        faulthandler.unregister(signal.SIGTERM)
        signal.signal(signal.SIGTERM, before)


def _modes(args, deadline: Deadline, written: Written) -> dict:
    """`main`'s work for parsed `args`: the modes asked for, then the JSON and markdown
    (`written`), then the benchmark's tables (before, they were printed first: a `| head` gone
    there lost every measurement)."""
    triton_blocks = args.block
    on_gpu = jax.default_backend() == "gpu"
    head_dims = args.head_dims
    env = environment() | {"triton_block_sizes": dataclasses.asdict(triton_blocks)
                           if triton_blocks else None,
                           "fused_backend": _fused_backend(head_dims, jnp.bfloat16)}
    result: dict = {"env": env}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.check:
        result["check"] = check(None, None, deadline, args.compile_threads)
        print(_table(result["check"], CHECK_COLS))

    if args.tune:
        result["tune"] = tune(head_dims, args, deadline)
        print(_table(result["tune"], TUNE_COLS))

    if args.bench or not (args.check or args.tune):
        if args.smoke:
            seqs, tokens, heads, dims, dtype = [40], 80, 2, [16], jnp.float32
            reps, samples = 1, 1
        else:
            seqs = args.seqs
            tokens, heads, dims, dtype = args.tokens, args.heads, head_dims, jnp.bfloat16
            reps, samples = args.reps, args.samples
        env["fused_backend"] = _fused_backend(dims, dtype)
        names = (args.variants.split(",") if args.variants
                 else GPU_VARIANTS if on_gpu else CPU_VARIANTS)
        fns = variants(None, None, with_cudnn=on_gpu, triton_blocks=triton_blocks)
        rows, mem = [], []
        t_sum = SUMMARY_T if not args.smoke else seqs[0]
        ahead = CompileAhead(args.compile_threads) if args.compile_threads > 1 else None

        def xla(q, k, v, lam):
            return kernels.diff_attention(q, k, v, lam, impl="xla")

        # per d at the summary's T: thunks of the fused and xla steps whose planned memory is
        # read at the end (the fused one is the step its bench row compiled, when compiled ahead)
        steps: dict[int, dict[str, Callable[[], Any]]] = {}
        for t in sorted(seqs, key=lambda x: x != t_sum):  # the summary's T first
            # one length's rows: lowered (and, with compile threads, compiling) first, then
            # timed one by one in this order
            batch = []
            for d in dims:
                shape = Shape(max(1, tokens // t), t, heads, d)
                for name in names:
                    f = fns.get(name, f"unknown here (on_gpu={on_gpu})")
                    r = {"variant": name, "d": d, "T": t, "B": shape.b}
                    if isinstance(f, str):
                        r["error"] = f
                    elif ahead is not None and not deadline.passed():
                        try:
                            r["programs"] = ahead.programs(f, shape, dtype)
                        except Exception as e:  # noqa: BLE001 - e.g. tiles refused
                            r["error"] = repr(e)[:300]
                    batch.append((r, f, shape))
                    if t == t_sum and name == "fused" and "programs" in r:
                        steps.setdefault(d, {})["fused"] = r["programs"][1]
                if t == t_sum and not deadline.passed():
                    if "fused" not in steps.get(d, {}):
                        steps.setdefault(d, {})["fused"] = step_compiler(fns["fused"], shape,
                                                                         dtype, ahead)
                    steps[d]["xla"] = step_compiler(xla, shape, dtype, ahead)
            for r, f, shape in batch:
                programs = r.pop("programs", None)
                if "error" not in r and deadline.passed():
                    r["error"] = "skipped: deadline"
                elif "error" not in r:
                    try:
                        r = bench_one(r["variant"], f, shape, dtype, reps=reps, samples=samples,
                                      programs=programs)
                    except Exception as e:  # noqa: BLE001 - e.g. cuDNN refusing a shape
                        r["error"] = repr(e)[:300]
                rows.append(r)
                print(r, flush=True)
        for d, step in steps.items():
            if not deadline.passed():
                mem.append({"d": d, "T": t_sum, "B": max(1, tokens // t_sum),
                            "fused_bytes": peak_memory(step["fused"]),
                            "xla_bytes": peak_memory(step["xla"])})
                print(mem[-1], flush=True)
        if ahead is not None:
            ahead.close()
        ratios = _ratios(rows)
        result |= {"bench": rows, "memory": mem, "ratios": ratios,
                   "summary": summary(rows, env, dims, t_sum),
                   "config": {"tokens": tokens, "heads": heads, "head_dims": dims,
                              "dtype": jnp.dtype(dtype).name, "causal": True, "lam": LAM,
                              "reps": reps, "samples": samples}}

    tag = args.tag or ("smoke" if args.smoke else env["device"].replace(" ", "_"))
    stem = out_dir / f"attention_{tag}"
    write_whole(stem.with_suffix(".json"), json.dumps(result, indent=1, default=str))
    md = [f"# Attention benchmark ({tag})", "", f"device: {env['device']}, jax {env['jax']}, "
          f"python {env['python']}, {env['date']}; fused kernel by d: {env['fused_backend']}", ""]
    if "check" in result:
        md += ["## Correctness (‖out−ref‖/‖ref‖ vs the float64 NumPy reference; standard "
               "attention vs the float32 xla oracle at HIGHEST)", "",
               "`ok`: finite and every error within "
               + ", ".join(f"{t:g} in {n}" for n, t in CHECK_TOLERANCE.items())
               + " (dλ's cotangent has a component along O2, so that its sum does not cancel).",
               "", _table(result["check"], CHECK_COLS), ""]
    if "tune" in result:
        md += ["## Tuning of the Mosaic GPU kernel's tiles (bf16, causal)", "",
               _table(result["tune"], TUNE_COLS), ""]
    if "bench" in result:
        md += ["## Summary (T = 4096)", "", "```json", json.dumps(result["summary"], indent=1),
               "```", "", "## Timings (median ms; TFLOP/s on each route's floor FLOP count)", "",
               _table(result["bench"], BENCH_COLS), "", "## Fused total time over each route's",
               "", _table(result["ratios"], _ratio_cols(result["ratios"])), "",
               "## Planned memory of one fwd+bwd step (bytes)", "",
               _table(result["memory"], ["d", "T", "B", "fused_bytes", "xla_bytes"]), ""]
    write_whole(stem.with_suffix(".md"), "\n".join(md))
    written.whole = True
    if "bench" in result:
        print(_table(result["bench"], BENCH_COLS))
        print(_table(result["ratios"], _ratio_cols(result["ratios"])))
        print(json.dumps(result["summary"], indent=1))
    print(f"wrote {stem}.json / .md")
    return result


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    leave(command())  # after Ctrl-C without the interpreter's teardown (diff_jax.command)
