"""AOT compilation of the sharded train step: per-device memory reflects the sharding rules."""

from __future__ import annotations

import jax
import pytest

from diff_jax.aot import GiB, compile_train_step, topology_devices
from diff_jax.config import ConfigError, load_config
from diff_jax.summary import abstract_params

MODEL = ["model.vocab_size=512", "model.embed_dim=64", "model.num_layers=2", "model.num_heads=2",
         "model.max_seq_len=64", "train.seq_len=16", "train.batch_size=8"]


def test_fsdp_divides_the_state_across_devices():
    config = load_config(None, MODEL + ["mesh.data=8"])
    state_bytes = 3 * 4 * sum(x.size for x in jax.tree.leaves(abstract_params(config.model)))
    replicated = compile_train_step(config)
    sharded = compile_train_step(load_config(None, MODEL + ["mesh.data=1", "mesh.fsdp=8"]))
    assert replicated["devices"] == sharded["devices"] == 8
    assert sharded["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert replicated["argument_gib"] * GiB >= state_bytes  # params + Adam moments on every device
    assert sharded["argument_gib"] * GiB < state_bytes / 4  # ~1/8 of it, plus the batch


def test_unknown_topology_is_a_config_error():
    with pytest.raises(ConfigError, match="train.compile_topology='v0x:9'"):
        topology_devices("v0x:9")
