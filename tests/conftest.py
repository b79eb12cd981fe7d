"""Test set-up: 8 fake CPU devices (before JAX initializes) so sharding tests need no hardware,
and XLA's quicker LLVM level.

The eight devices are a JAX setting of the pytest processes (`jax_num_cpu_devices`), not an
environment variable: the `train.py`, `eval.py` and benchmark processes tests start, and the
workers `replicate --jobs` spawns, see one CPU device, as on a user's CPU machine. A test that
needs more in a process it starts gives it `training_fixtures.process_env(N)`."""

import gc
import importlib
import os
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import pytest

# About half the suite's time is XLA compiling small programs, on 2 cores shared by 2 workers:
# - LLVM -O1 (its default is -O2). Measured side by side (2026-11-29): compile-heavy tests 70 s
#   against 86 s, a tiny model's init 3.2 s against 4.2 s to compile, while the tiny config's
#   train step runs as fast (1.95 s against 1.98 s, benchmarks/train_step.py); -O0 compiled
#   faster still but ran that step in 4.2 s.
# - XLA:CPU's older elemental emitters instead of its fusion emitters, and single-threaded Eigen
#   matmuls (each worker has one core). A tiny model's train step compiles in 2.0-2.4 s against
#   2.8-3.3 s. test_sharding, test_attention_op and test_generate with -n 2, alternated with the
#   flags and without (2026-11-29): 185 and 185 s against 222 and 215 s wall (351 and 350 s
#   against 417 and 408 s CPU); Eigen's flag alone: 221 and 203 s against 232 and 212 s.
# The whole suite passes with these flags as without; processes the tests start inherit them.
# jaxlib 0.11's XLA has only the fusion emitters and refuses the flag that turns them off.
_FLAGS = ["--xla_backend_optimization_level=1", "--xla_cpu_multi_thread_eigen=false"]
if tuple(int(x) for x in version("jaxlib").split(".")[:2]) < (0, 11):
    _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", " ".join(_FLAGS))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU tests only compile (AOT, with the `tpu` extra): let libtpu load even when another
# process on the machine holds its lockfile (e.g. a training run in the same environment).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# One XLA compilation cache for the session (JAX's persistent cache, programs that took ≥ 1 s to
# compile): the pytest process makes it before it starts its xdist workers, which inherit it, as
# do the train.py / eval.py processes tests start, so a train step one test compiled is read back
# by the next test that compiles the same one. A test that sets its own `train.compile_cache_dir`
# is put back by `_compile_cache_as_it_was`. A JAX_COMPILATION_CACHE_DIR already set is used as is.
_SESSION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="diff_jax_tests_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_CACHE


def _hugging_face_kernels_first() -> None:
    """Import Hugging Face's `kernels` distribution, where installed, before any test imports
    transformers (>= 5.25 imports it). `python -m pytest` puts the repository root on sys.path,
    where the top-level kernels/ folder would be found under that name instead; installed, this
    project's kernels are `diff_jax.kernels` and nothing imports them as `kernels`."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("kernels")
    except PackageNotFoundError:
        return
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:  # a broken install: transformers' own import then says what is missing
        pass
    finally:
        sys.path[:] = saved


_hugging_face_kernels_first()

import jax  # noqa: E402  (after the environment above; its backend starts at the first use)

# A fresh train.py process on one device against eight, the tests' tiny config for one step:
# 18.2–18.4 s against 24.3–24.6 s (2 cores, 2026-11-29): no 8-way partitioning to compile, no
# replica slices for orbax to copy.
jax.config.update("jax_num_cpu_devices", 8)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Collect the garbage once more, then freeze the heap (`gc.freeze`), before an xdist worker
    reports its session finished. After that report pytest collects 5 times (its cleanup of
    unraisable exceptions), each time through the whole heap that jax's caches grew over the
    worker's tests (test_generate, test_model and test_attention_op with -n 1: 823k objects,
    0.6 s a collection), while the controller tells the worker to end; execnet sends a worker
    still busy 5 s later a SIGINT. Its KeyboardInterrupt, where it landed in jax's
    `_xla_gc_callback`, was the PytestUnraisableExceptionWarning printed after the last test in
    5 of 9 whole-suite runs (2026-12-06/07); elsewhere it went unseen. Frozen, those collections
    pass over what is made after this hook alone (the same tests: 8k objects, 0.00 s)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """The session's compilation cache goes with the process that made it."""
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """A small real-text corpus for `data.source=files`: 60 pydoc topics as .txt files (about
    60k cl100k tokens), where a test needs real text but not the whole stdlib corpus."""
    from pydoc_data.topics import topics

    out = tmp_path_factory.mktemp("text")
    for k in sorted(topics)[:60]:
        (out / f"{k}.txt").write_text(topics[k])
    return out


@pytest.fixture(autouse=True)
def _compile_cache_as_it_was():
    """A run with `train.compile_cache_dir` (a replication's runs have one) points JAX's
    compilation cache there for its whole process: the next test starts with the cache as it was."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        compilation_cache.set_cache_dir(before)
        compilation_cache.reset_cache()


@pytest.fixture
def compile_cache(tmp_path):
    """A directory for `train.compile_cache_dir`, with every compile cached however quick (JAX
    skips those under a second; `_compile_cache_as_it_was` puts the cache back afterwards)."""
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield tmp_path / "xla"
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
