"""What the distribution installs: one top-level package, `diff_jax`.

The attention kernels live in the repository's top-level kernels/ folder and install as
`diff_jax.kernels` (diff_jax/kernels links to the folder). A top-level `kernels` package would be
Hugging Face's `kernels` distribution's import name, which transformers >= 5.25 requires and
imports: installing both would put two packages in one site-packages folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL_IMPORT = re.compile(r"^\s*(?:from\s+kernels(?:\.\w+)*\s+import|import\s+kernels\b)", re.M)


def _sources() -> list[Path]:
    """Every Python file of the project (diff_jax/kernels, the link, read once as kernels/)."""
    files = [ROOT / "train.py", ROOT / "eval.py"]
    for folder in ("diff_jax", "kernels", "tests", "benchmarks"):
        files += [p for p in (ROOT / folder).rglob("*.py")
                  if not p.relative_to(ROOT).as_posix().startswith("diff_jax/kernels/")]
    return files


def test_nothing_imports_the_kernels_folder_as_a_top_level_package():
    """Code (and code held in strings, such as the GPU session's environment probe) imports the
    kernels as `diff_jax.kernels`, and the kernels import each other relatively: an installed
    diff-jax has no `kernels` to import, and from a clone the folder would be a second copy of
    every kernel module under another name."""
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
             for p in _sources() for text in [p.read_text()]
             for m in TOP_LEVEL_IMPORT.finditer(text)]
    assert not found, found
    assert len(_sources()) > 100  # the walk saw the project


def test_diff_jax_kernels_is_the_kernels_folder():
    from diff_jax import kernels

    link = ROOT / "diff_jax" / "kernels"
    assert link.is_symlink() and link.resolve() == (ROOT / "kernels").resolve()
    assert Path(kernels.__file__).resolve() == (ROOT / "kernels" / "__init__.py").resolve()


def test_diff_jax_configs_is_the_configs_folder():
    """The shipped configs (`--config diff-830m.yaml` where diff-jax is installed) are the
    repository's configs/ folder, linked as the train.py and eval.py modules are not: those are
    diff_jax.train and diff_jax.eval, which the clone's two scripts run."""
    from diff_jax.config import SHIPPED_CONFIGS

    link = ROOT / "diff_jax" / "configs"
    assert link.is_symlink() and link.resolve() == (ROOT / "configs").resolve()
    assert SHIPPED_CONFIGS.resolve() == (ROOT / "configs").resolve()
    for script in ("train", "eval"):
        text = (ROOT / f"{script}.py").read_text()
        assert f"from diff_jax.{script} import main\n" in text and text.count("\n") < 13, text


def test_diff_jax_kernels_imports_without_flax():
    """`diff_jax.kernels` needs only jax: diff_jax's own names (DecoderLM, load_config, ...) are
    read from their modules on first use (the jax 0.11 kernel check runs in a venv with jax
    alone), and they still import as before."""
    code = ("import sys\nfrom diff_jax import kernels\nassert 'flax' not in sys.modules\n"
            "assert 'kernels' not in sys.modules\n"
            "from diff_jax import DecoderLM, load_config\nimport diff_jax\n"
            "assert 'DecoderLM' in dir(diff_jax) and 'flax' in sys.modules\n"
            "try:\n    diff_jax.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True,
                         text=True, env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                                         "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "module 'diff_jax' has no attribute 'no_such_name'"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of the project (its files, not the clone's)."""
    try:
        setuptools = tuple(int(x) for x in version("setuptools").split(".")[:2])
    except PackageNotFoundError:  # a Python 3.12 venv has none
        setuptools = (0, 0)
    if setuptools < (77, 0):
        pytest.skip("building needs setuptools >= 77 (pyproject's build-system)")
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("kernels", "configs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    shutil.copytree(ROOT / "diff_jax", src / "diff_jax", symlinks=True, ignore=ignore)
    # Not from the clone's root (nor with it on PYTHONPATH): Hugging Face's `kernels`, where
    # installed, adds an egg_info writer to every setuptools build, which would import the
    # folder kernels/ under its name.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    (built,) = (tmp_path / "dist").glob("diff_jax-*.whl")
    return built


def test_the_wheel_installs_diff_jax_alone(wheel):
    """No top-level `kernels`; the kernels and their tile table under diff_jax/kernels, the
    configs under diff_jax/configs (the links' files, not links)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["diff_jax"]
        table = z.read("diff_jax/kernels/tuning/mosaic_gpu.json")
        tiny = z.read("diff_jax/configs/tiny.yaml")
    assert all(n.startswith(("diff_jax/", "diff_jax-")) for n in names), names
    kernels = {n.removeprefix("diff_jax/kernels/") for n in names
               if n.startswith("diff_jax/kernels/") and n.endswith(".py")}
    assert kernels == {p.name for p in (ROOT / "kernels").glob("*.py")}
    assert table == (ROOT / "kernels" / "tuning" / "mosaic_gpu.json").read_bytes()
    configs = {n.removeprefix("diff_jax/configs/") for n in names
               if n.startswith("diff_jax/configs/")}
    assert configs == {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert tiny == (ROOT / "configs" / "tiny.yaml").read_bytes()


def test_the_installed_package_trains_and_evaluates_without_a_clone(wheel, tmp_path):
    """The wheel's files alone (unpacked, as pip installs a pure-Python wheel), run from an
    empty directory: `python -m diff_jax.train` with its default config and a shipped config's
    name, then `python -m diff_jax.eval` on the run. Before, the two commands were the clone's
    train.py and eval.py and the configs were not installed: a pip user had neither. Their usage
    lines name `python -m`, not the clone's scripts."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {"PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}

    def run(*args: str) -> str:
        """stdout and stderr of `python ARGS` (progress and the `done:` line are on stderr)."""
        out = subprocess.run([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:]
        return out.stdout

    # usage lines that name these commands (argparse's default named the file, `train.py`)
    assert run("-m", "diff_jax.train", "--help").startswith("usage: python -m diff_jax.train ")
    assert run("-m", "diff_jax.eval", "--help").startswith(
        "Evaluate a checkpoint: python -m diff_jax.eval task=NAME ")
    where = run("-c", "import diff_jax.train as t; print(t.__file__, t.DEFAULT_CONFIG)")
    assert where.split() == [str(site / "diff_jax" / "train.py"),
                             str(site / "diff_jax" / "configs" / "tiny.yaml")]
    assert '"params": 833608704' in run("-m", "diff_jax.summary", "--config", "diff-830m")
    small = ["model.num_layers=1", "model.embed_dim=64", "train.seq_len=32",
             "train.batch_size=2", "train.steps=1", "train.eval_every=0"]
    trained = run("-m", "diff_jax.train", *small, "train.run_dir=run")
    assert trained.splitlines()[-1].startswith("done: step 1, loss "), trained
    run("-m", "diff_jax.eval", "task=generate", "train.run_dir=run", "prompt=def",
        "max_new_tokens=2")
    result = json.loads((cwd / "run" / "eval" / "generate.json").read_text())
    assert (result["step"], result["prompt"], len(result["new_tokens"])) == (1, "def", 2)
