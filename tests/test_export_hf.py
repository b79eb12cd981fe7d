"""The hf-diffllama export loads in transformers' DiffLlamaForCausalLM with our logits (float32)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from diff_jax import export as ex
from diff_jax.config import ModelConfig
from test_export import TOKENS, logits, random_params, write_run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def diff_config(num_kv_heads: int | None, tie: bool) -> ModelConfig:
    # 3 layers so that λ_init differs per layer; H=4 DIFF heads of component width d=8
    return ModelConfig(variant="diff", vocab_size=128, embed_dim=64, num_layers=3, num_heads=4,
                       num_kv_heads=num_kv_heads, tie_embeddings=tie, max_seq_len=64)


def hf_logits(directory, **kwargs) -> np.ndarray:
    model, info = transformers.DiffLlamaForCausalLM.from_pretrained(
        directory, output_loading_info=True, **kwargs)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(TOKENS), dtype=torch.long)).logits
    return out.float().numpy()


@pytest.mark.parametrize("num_kv_heads, tie", [(None, True), (2, False), (1, True)],
                         ids=["mha-tied", "gqa2-untied", "gqa1-tied"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_diffllama_logits_equal_ours_in_float32(num_kv_heads, tie, attn_implementation, tmp_path):
    config = diff_config(num_kv_heads, tie)
    params = random_params(config, seed=3)
    out = ex.export(write_run(tmp_path / "run", config, params), tmp_path / "hf", "hf-diffllama",
                    tokenizer="none")  # vocab 128: cl100k's ids do not fit
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config["num_attention_heads"], hf_config["num_key_value_heads"], hf_config["head_dim"]) == (
        8, 2 * config.kv_heads, 8)
    theirs = hf_logits(out, dtype=torch.float32, attn_implementation=attn_implementation)
    ours = logits(config, params)
    # float32 in both frameworks, rounding only: measured ≤ 4.9e-7 of max|logit| (20×)
    assert np.abs(theirs - ours).max() / np.abs(ours).max() < 1e-5


def test_a_held_lambda_v1_exports_to_diffllama(tmp_path):
    """model.learn_lambda=false computes what DiffLlama computes: its λ vectors (zero at init,
    λ = λ_init; or where train.init_from left them) follow the same formula, so the export is
    not refused and gives our logits."""
    config = dataclasses.replace(diff_config(2, True), learn_lambda=False)
    params = random_params(config, seed=5)
    out = ex.export(write_run(tmp_path / "run", config, params), tmp_path / "hf", "hf-diffllama",
                    tokenizer="none")
    theirs = hf_logits(out, dtype=torch.float32, attn_implementation="eager")
    ours = logits(config, params)
    assert np.abs(theirs - ours).max() / np.abs(ours).max() < 1e-5  # as the test above


def test_diffllama_bfloat16_export_is_close(tmp_path):
    config = diff_config(2, False)
    params = random_params(config, seed=4)
    out = ex.export(write_run(tmp_path / "run", config, params), tmp_path / "hf", "hf-diffllama",
                    dtype="bfloat16", tokenizer="none")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    theirs = hf_logits(out, dtype=torch.bfloat16, attn_implementation="eager")
    ours = logits(config, params)
    # torch rounds weights and activations to bf16 (2^-8 ≈ 3.9e-3 relative each), ours float32:
    # measured 8.8e-3 of max|logit|; 5e-2 is bf16-class (~13 ulps), a wrong tensor gives O(1)
    assert np.abs(theirs - ours).max() / np.abs(ours).max() < 5e-2
