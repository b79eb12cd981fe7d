"""Reference state_dict <-> diff-jax parameters, and the run-reference command."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numpy_reference as npr
from diff_jax.config import ModelConfig
from diff_jax.interop import from_reference, reference_shapes, to_reference

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("cfg", [
    ModelConfig(variant="diff", embed_dim=64, num_heads=4, num_kv_heads=2),
    ModelConfig(variant="diff_v2", embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=8),
    ModelConfig(variant="transformer", embed_dim=64, num_heads=8, num_kv_heads=4),
], ids=["v1", "v2", "baseline"])
def test_round_trip_is_identity(cfg):
    sd = npr.random_state_dict(reference_shapes(cfg), seed=0)
    back = to_reference(from_reference(sd, cfg), cfg)
    assert set(back) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k])
    params = from_reference(sd, cfg)
    np.testing.assert_array_equal(params["q_proj"]["kernel"], sd["q_proj.weight"].T)


def test_bad_state_dict_names_the_key():
    cfg = ModelConfig(variant="diff", embed_dim=64, num_heads=4)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=0)
    with pytest.raises(KeyError, match="subln.weight"):
        from_reference({k: v for k, v in sd.items() if k != "subln.weight"}, cfg)
    with pytest.raises(ValueError, match=r"k_proj.weight: expected shape \(64, 64\)"):
        from_reference({**sd, "k_proj.weight": sd["k_proj.weight"][:8]}, cfg)


def test_keys_the_variant_does_not_have_are_refused_naming_them():
    """A tensor of another variant (DIFF V2's lambda_proj in a DIFF V1 state dict) or a misspelt
    name is an error, not silently dropped."""
    cfg = ModelConfig(variant="diff", embed_dim=64, num_heads=4)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=0)
    with pytest.raises(KeyError, match=r"unexpected keys .* for diff: \['lambda_proj.weight'\]"):
        from_reference({**sd, "lambda_proj.weight": np.zeros((4, 64), np.float32)}, cfg)


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def _run(in_path, out_path):
    return subprocess.run([sys.executable, "-m", "diff_jax.interop", "run-reference", in_path,
                           str(out_path)], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("variant,pairing", [("v1", "flash"), ("v1", "naive"), ("v2", None)])
def test_run_reference_reproduces_numpy(tmp_path, variant, pairing):
    e, h, kv, t = 64, 4, 2, 10
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, t, e)).astype(np.float32)
    if variant == "v1":
        cfg = ModelConfig(variant="diff", embed_dim=e, num_heads=h, num_kv_heads=kv)
        d = cfg.resolved_head_dim
        extra = dict(depth=np.array(5), gqa_pairing=np.array(pairing))
    else:
        d = 12
        cfg = ModelConfig(variant="diff_v2", embed_dim=e, num_heads=h, num_kv_heads=kv, head_dim=d)
        extra = dict(head_dim=np.array(d))
    sd = npr.random_state_dict(reference_shapes(cfg), seed=7)
    # Tables from arbitrary angles: the command must use exactly the tables it is given.
    angles = rng.uniform(-3, 3, size=(t, d // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    in_path = _npz(tmp_path / "in.npz", x=x, rope_cos=cos, rope_sin=sin, variant=np.array(variant),
                   embed_dim=np.array(e), num_heads=np.array(h), num_kv_heads=np.array(kv), **extra, **sd)
    proc = _run(in_path, tmp_path / "out.npz")
    assert proc.returncode == 0, proc.stderr
    out = np.load(tmp_path / "out.npz")["output"]
    if variant == "v1":
        ref, *_ = npr.diff_v1(sd, x, cos.astype(np.float64), sin.astype(np.float64), num_heads=h,
                              num_kv_heads=kv, depth=5, pairing=pairing)
    else:
        ref = npr.diff_v2(sd, x, cos.astype(np.float64), sin.astype(np.float64), num_heads=h,
                          num_kv_heads=kv, head_dim=d)
    assert out.shape == (2, t, e) and out.dtype == np.float32
    assert npr.rel_err(out, ref) < 2e-6


def _malformed_base() -> dict:
    cfg = ModelConfig(variant="diff", embed_dim=64, num_heads=4)
    sd = npr.random_state_dict(reference_shapes(cfg), seed=0)
    return dict(x=np.zeros((1, 4, 64), np.float32), rope_cos=np.ones((4, 4), np.float32),
                rope_sin=np.zeros((4, 4), np.float32), variant=np.array("v1"), embed_dim=np.array(64),
                num_heads=np.array(4), num_kv_heads=np.array(4), depth=np.array(0),
                gqa_pairing=np.array("flash"), **sd)


def _without(key):
    return lambda base: {k: v for k, v in base.items() if k != key}


def _with(**arrays):
    return lambda base: {**base, **arrays}


@pytest.mark.parametrize("edit, error", [
    (_without("lambda_q2"), "IN.npz is missing reference tensor(s) ['lambda_q2']"),
    (_without("depth"), "IN.npz is missing the scalar 'depth'"),
    (_with(depth=np.array([0, 1])), "depth: expected a scalar, got shape (2,)"),
    (_with(variant=np.array("v3")), "variant: expected 'v1' or 'v2', got 'v3'"),
    (_with(gqa_pairing=np.array("zigzag")), "gqa_pairing: expected 'flash' or 'naive', got 'zigzag'"),
    # sizes no module has: named by the IN.npz scalar (depth), or as the scalars' module (it was
    # "model.num_layers: must be in [1, ...]")
    (_with(depth=np.array(-1)), "depth: expected the layer index, an integer >= 0, got -1"),
    (_with(num_heads=np.array(3), num_kv_heads=np.array(2)),
     "{in_path}: its scalars describe no v1 attention module: model.num_kv_heads: "),
    (_without("x"), "IN.npz is missing 'x' (expected shape (B, T, embed_dim))"),
    (_with(x=np.zeros((4, 64), np.float32)), "x: expected shape (B, T, 64), got (4, 64)"),
    (_with(rope_cos=np.ones((4, 3), np.float32)), "rope_cos: expected shape (4, 4), got (4, 3)"),
    (_without("rope_sin"), "IN.npz is missing 'rope_sin' (expected shape (4, 4))"),
    (_with(**{"v_proj.weight": np.zeros((3, 64), np.float32)}), "v_proj.weight: expected shape (64, 64)"),
    # was numpy's "Object arrays cannot be loaded when allow_pickle=False", naming no array
    (_with(x=np.array([None, 1], dtype=object)), "x: an object array, which IN.npz cannot hold"),
])
def test_run_reference_malformed_input_is_one_error_line(tmp_path, capsys, edit, error):
    """Bad input: exit status 2, as every command's (it was 1), and one `error:` line naming the
    array or scalar and what was expected; no OUT.npz."""
    from diff_jax.interop import main

    in_path = _npz(tmp_path / "bad.npz", **edit(_malformed_base()))
    assert main(["run-reference", in_path, str(tmp_path / "out.npz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {error.format(in_path=in_path)}") and err.count("\n") == 1, err
    assert not (tmp_path / "out.npz").exists()


def test_run_reference_names_an_input_that_is_no_npz_archive(tmp_path, capsys):
    """A text file was numpy's pickle refusal, naming no file; an empty or cut-short file and a
    single .npy array raised a traceback (a bare array has no `with` or `files`)."""
    from diff_jax.interop import main

    (tmp_path / "text.npz").write_text("not an archive\n")
    (tmp_path / "empty.npz").write_bytes(b"")
    np.save(tmp_path / "one.npy", np.zeros(3))
    whole = Path(_npz(tmp_path / "whole.npz", **_malformed_base())).read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    assert main(["run-reference", str(tmp_path / "nope.npz"), str(tmp_path / "out.npz")]) == 2
    assert capsys.readouterr().err == (  # it was the bare "[Errno 2] No such file or directory"
        f"error: IN.npz: {tmp_path / 'nope.npz'}: No such file or directory\n")
    for path, says in [(tmp_path / "text.npz", "not a NumPy .npz archive (np.savez writes one)"),
                       (tmp_path / "empty.npz", "not a NumPy .npz archive (np.savez writes one)"),
                       (tmp_path / "cut.npz", "not a NumPy .npz archive (np.savez writes one)"),
                       (tmp_path / "one.npy", "a single .npy array, not an .npz archive")]:
        assert main(["run-reference", str(path), str(tmp_path / "out.npz")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: {says}") and err.count("\n") == 1, err
    assert not (tmp_path / "out.npz").exists()


def test_help_is_the_usage_and_exit_0(capsys):
    """`--help` answers as every other command's does (usage on stdout, status 0); a wrong
    command line stays a usage error (status 2)."""
    from diff_jax.interop import main

    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m diff_jax.interop run-reference")
    assert main(["run-reference", "IN.npz"]) == 2
    assert capsys.readouterr().err.startswith("usage: ")
