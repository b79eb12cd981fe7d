"""Parameter counts of the paper's configs and the FLOPs formula, checked by hand."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from diff_jax.config import Config, ModelConfig, TrainConfig, load_config
from diff_jax.summary import flops_per_token, main, summarize
from diff_jax.transformer import DecoderLM

ROOT = Path(__file__).resolve().parent.parent
NAMED = {"830m": 830e6, "1.4b": 1.4e9, "2.8b": 2.8e9, "6.8b": 6.8e9, "13.1b": 13.1e9}


@pytest.mark.parametrize("size", list(NAMED) + ["3b"])
def test_paper_sizes(size):
    diff = summarize(load_config(ROOT / f"configs/diff-{size}.yaml"))
    twin = summarize(load_config(ROOT / f"configs/transformer-{size}.yaml"))
    if size in NAMED:
        assert abs(diff["params"] / NAMED[size] - 1) < 0.03
    assert abs(diff["params"] / twin["params"] - 1) < 0.001
    assert diff["flops_per_token"] == twin["flops_per_token"]
    m = load_config(ROOT / f"configs/diff-{size}.yaml").model
    e, f, L = m.embed_dim, m.resolved_mlp_dim, m.num_layers
    # By hand: 4E² attention (MHA) + 3EF SwiGLU + 2E norms per layer, + 2 d-vectors·2 + 2d norm for DIFF.
    d = m.resolved_head_dim
    per_layer = 4 * e * e + 3 * e * f + 2 * e + 4 * d + 2 * d
    assert diff["params"] == L * per_layer + e + m.vocab_size * e
    assert diff["params_embedding"] == m.vocab_size * e


def test_flops_formula_by_hand():
    m = ModelConfig(vocab_size=1000, embed_dim=64, num_layers=2, num_heads=2, mlp_dim=128)
    t = 32
    n_matmul = 2 * (4 * 64 * 64 + 3 * 64 * 128) + 1000 * 64
    attn = 6 * 2 * (t + 1) / 2 * (64 + 64)
    assert flops_per_token(m, t) == pytest.approx(6 * n_matmul + attn)



def test_flops_count_the_parameters_init_returns_boxed_as_the_abstract_ones():
    """`params` boxed with their logical axes (`init`'s) were counted as no matmul at all: the
    kernels sit one level below a box, whose path ends in its `value`, so only the tied
    embedding's E·V was counted (49,920 against 836,352 FLOPs here)."""
    for untied in (False, True):
        m = ModelConfig(vocab_size=64, embed_dim=64, num_layers=2, num_heads=2, max_seq_len=32,
                        tie_embeddings=not untied)
        boxed = jax.eval_shape(DecoderLM(m).init, jax.random.key(0),
                               jnp.zeros((1, 1), jnp.int32))["params"]
        assert flops_per_token(m, 32, boxed) == flops_per_token(m, 32)

def test_an_untied_head_is_counted_once_in_flops_and_in_the_embedding_parameters():
    """Untied, the LM head is its own (E, V) parameter: the FLOPs count E·V once (as for a tied
    head, which reuses the embedding), and the embedding parameters are embed + lm_head."""
    m = ModelConfig(vocab_size=1000, embed_dim=64, num_layers=2, num_heads=2, mlp_dim=128,
                    tie_embeddings=False)
    t = 32
    n_matmul = 2 * (4 * 64 * 64 + 3 * 64 * 128) + 1000 * 64
    attn = 6 * 2 * (t + 1) / 2 * (64 + 64)
    assert flops_per_token(m, t) == pytest.approx(6 * n_matmul + attn)
    s = summarize(Config(model=m, train=TrainConfig(seq_len=t)))
    assert s["params_embedding"] == 2 * 1000 * 64
    assert s["params_non_embedding"] == 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64 + 6 * 16) + 64
    assert s["params"] == s["params_embedding"] + s["params_non_embedding"]


def test_lambda_init_per_layer_follows_the_schedule_or_model_lambda_init():
    m = ModelConfig(vocab_size=1000, embed_dim=64, num_layers=3, num_heads=2)
    scheduled = summarize(Config(model=m, train=TrainConfig(seq_len=32)))["lambda_init"]
    assert scheduled == pytest.approx([0.8 - 0.6 * math.exp(-0.3 * i) for i in range(3)])
    fixed = summarize(Config(model=dataclasses.replace(m, lambda_init=0.5),
                             train=TrainConfig(seq_len=32)))["lambda_init"]
    assert fixed == [0.5, 0.5, 0.5]


def test_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "diff_jax.summary", "configs/diff-1.4b.yaml"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert {"params", "params_embedding", "flops_per_token", "lambda_init"} <= set(data)
    assert len(data["lambda_init"]) == 24 and data["lambda_init"][0] == pytest.approx(0.2)
    bad = subprocess.run([sys.executable, "-m", "diff_jax.summary", "configs/diff-1.4b.yaml",
                          "model.num_heads=7"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "model.embed_dim" in bad.stderr


def test_cli_takes_the_config_as_train_py_does(capsys):
    """`--config FILE` (overrides before or after it) reads as the positional CONFIG does."""
    config = str(ROOT / "configs/tiny.yaml")
    runs = [[config, "model.num_layers=3"], ["--config", config, "model.num_layers=3"],
            ["model.num_layers=3", "--config", config]]
    for argv in runs:
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out)["layers"] == 3
    assert main(["model.num_layers=3"]) == 2
    assert "no config file" in capsys.readouterr().err


def test_abstract_params_inside_a_mesh_context():
    """The training loop computes FLOPs with a mesh and rules active: no eager sharding constraint."""
    import jax
    from flax import linen as nn

    from diff_jax.config import MeshConfig
    from diff_jax.sharding import make_mesh
    from diff_jax.summary import abstract_params

    m = ModelConfig(vocab_size=64, embed_dim=32, num_layers=1, num_heads=2)
    outside = flops_per_token(m, 16)
    with jax.set_mesh(make_mesh(MeshConfig())), nn.logical_axis_rules(MeshConfig().rules):
        assert flops_per_token(m, 16) == outside
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        leaves = jax.tree.leaves(abstract_params(m, sharding))
    assert all(leaf.dtype == jax.numpy.float32 and leaf.sharding == sharding for leaf in leaves)


def test_counts_do_not_depend_on_the_attention_implementation():
    """A GPU config summarized on a CPU machine: cudnn is not resolved for the parameter shapes."""
    config = load_config(ROOT / "configs/tiny.yaml", ["model.dtype=bfloat16"])
    cudnn = load_config(ROOT / "configs/tiny.yaml", ["model.dtype=bfloat16",
                                                     "model.attention_impl=cudnn"])
    assert summarize(cudnn) == summarize(config)
