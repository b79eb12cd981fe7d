"""Config loading, `base:` inheritance, overrides, and errors that name the key and the rule."""

import copy
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from diff_jax.config import (CheckpointConfig, Config, ConfigError, DataConfig, DistributedConfig,
                             MeshConfig, ModelConfig, OptimConfig, TrainConfig, dump_config,
                             config_file, from_dict, load_config)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SIZES = ["830m", "1.4b", "2.8b", "6.8b", "13.1b", "3b"]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_config(cfg))
    assert load_config(dumped) == cfg


@pytest.mark.parametrize("size", SIZES)
def test_transformer_twins_double_heads_and_match_otherwise(size):
    diff = load_config(CONFIGS / f"diff-{size}.yaml")
    twin = load_config(CONFIGS / f"transformer-{size}.yaml")
    assert diff.model.variant == "diff" and twin.model.variant == "transformer"
    assert twin.model.num_heads == 2 * diff.model.num_heads
    assert twin.model.resolved_head_dim == diff.model.resolved_head_dim
    assert diff.model.vocab_size == twin.model.vocab_size == 100_288
    for section in ("train", "optim", "mesh", "data", "checkpoint"):
        a, b = getattr(diff, section).__dict__, getattr(twin, section).__dict__
        assert {k: v for k, v in a.items() if k != "run_dir"} == {k: v for k, v in b.items() if k != "run_dir"}


def test_overrides_parse_yaml_values():
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.dtype=bfloat16", "train.steps=7",
                                               "optim.lr=5e-3", "model.num_kv_heads=2"])
    assert cfg.model.dtype == "bfloat16" and cfg.train.steps == 7
    assert cfg.optim.lr == pytest.approx(5e-3) and cfg.model.kv_heads == 2
    assert load_config(None, ["mesh.rules=[[batch, [data, fsdp]], [embed, null]]"]).mesh.rules == (
        ("batch", ("data", "fsdp")), ("embed", None))
    # two logical axes may share a mesh axis (Flax's priority order); an empty list replicates
    assert load_config(None, ["mesh.rules=[[batch, [data, fsdp]], [embed, fsdp], [norm, []]]"]
                       ).mesh.rules == (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("norm", ()))


@pytest.mark.parametrize("overrides,match", [
    (["model.num_haeds=4"], r"model\.num_haeds: unknown key"),
    (["modle.x=1"], r"modle: unknown key"),
    (["model.embed_dim=100", "model.num_heads=4"], r"model\.embed_dim: .*divisible by 2·num_heads"),
    (["model.num_heads=4", "model.num_kv_heads=3"], r"model\.num_kv_heads: .*divisible"),
    (["model.variant=diff_v2", "model.num_heads=4", "model.num_kv_heads=3"], r"model\.num_kv_heads"),
    (["model.variant=gpt"], r"model\.variant: must be one of"),
    (["data.source=mixture"], r"data\.source: must be one of \[.*\], got 'mixture' \(data\.mixture "
                              r"is a key of its own\)$"),
    (["model.embed_dim=1.5"], r"model\.embed_dim: expected an integer"),
    (["model.tie_embeddings=3"], r"model\.tie_embeddings: expected true/false"),
    (["model.head_dim=6", "model.embed_dim=64", "model.num_heads=4"], r"model\.head_dim"),
    (["model.variant=transformer", "model.gqa_pairing=naive"], r"model\.gqa_pairing"),
    (["model.variant=diff_v2", "model.lambda_init=0.5"], r"model\.lambda_init: only variant diff "),
    (["model.lambda_init=1.0"], r"model\.lambda_init: must be in \[0, 1\)"),
    (["model.lambda_init=-0.1"], r"model\.lambda_init: must be in \[0, 1\)"),
    (["model.variant=transformer", "model.head_norm=false"], r"model\.head_norm: only variant diff"),
    (["model.head_norm=false", "model.subln_init=0.1"], r"model\.subln_init: sets the per-head "
                                                        r"norm's scale, which model\.head_norm=false"),
    (["model.v2_head_norm=true"], r"model\.v2_head_norm: only variant diff_v2 takes it"),
    (["model.variant=diff_v2", "model.subln_init=0.1"], r"model\.subln_init: only variant diff, "
                                                         r"or diff_v2 with model\.v2_head_norm"),
    (["model.variant=diff_v2", "model.learn_lambda=false"], r"model\.learn_lambda: only variant "
                                                           r"diff has a layer λ to hold"),
    (["model.learn_lambda=false", "optim.decay_norms_and_lambdas=true"],
     r"optim\.decay_norms_and_lambdas: would decay λ's vectors, which model\.learn_lambda=false"),
    (["train.seq_len=4096"], r"train\.seq_len: must be <= model\.max_seq_len"),
    (["train.batch_size=6", "train.grad_accum=4"], r"train\.grad_accum: must divide"),
    (["mesh.data=-1", "mesh.fsdp=-1"], r"mesh: at most one axis may be -1"),
    (["mesh.rules=[[embed, model]]"], r"mesh\.rules\[embed\]: mesh axis must be one of"),
    (["mesh.rules=[[btach, data]]"], r"mesh\.rules\[btach\]: no module names this logical axis; "
                                     r"the logical axes are \['batch', 'length', 'embed'"),
    (["mesh.rules=[[batch, data], [batch, fsdp]]"], r"mesh\.rules\[batch\]: given twice"),
    (["mesh.rules=[[batch]]"], r"mesh\.rules\[0\]: expected a list of 2 items, got \['batch'\]"),
    (["mesh.rules=[[embed, fsdp, x]]"], r"mesh\.rules\[0\]: expected a list of 2 items"),
    (["mesh.rules=[[3, data]]"], r"mesh\.rules\[0\]\[0\]: expected a string, got 3"),
    (["mesh.rules=[[batch, [data, [fsdp]]]]"], r"mesh\.rules\[batch\]: mesh axis must be one of "
                                              r".* or null \(the whole rule: replicated\), got "
                                              r"\['fsdp'\]$"),
    # jax's sharding failed on these: a KeyError and a DuplicateSpecError traceback at step 1
    (["mesh.rules=[[batch, [data, null]]]"], r"mesh\.rules\[batch\]: mesh axis must be one of "
                                             r".* got None$"),
    (["mesh.rules=[[batch, [data, fsdp]], [embed, [fsdp, fsdp]]]"],
     r"mesh\.rules\[embed\]: names mesh axis 'fsdp' twice in \['fsdp', 'fsdp'\]; a logical axis "
     r"is sharded over each mesh axis at most once$"),
    (["data.mixture=stdlib:.inf,niah:1"], r"data\.mixture: 'stdlib:\.inf': expected SOURCE:WEIGHT "
                                          r".* WEIGHT a finite number > 0"),
    (["optim.min_lr=1.0"], r"optim\.min_lr"),
    (["model.num_layers=0"], r"model\.num_layers: must be in \[1, 2147483647\]"),
    # beyond int32, what JAX computes in: an OverflowError traceback in the first jitted step
    (["model.vocab_size=2147483648"], r"model\.vocab_size: must be in \[1, 2147483647\] \(JAX "
                                      r"computes in int32: token ids, positions and sizes\)$"),
    (["model.max_seq_len=2147483648"], r"model\.max_seq_len: must be in \[1, 2147483647\]"),
    (["model.variant=transformer", "model.head_dim=2147483648"],
     r"model\.head_dim: the \(component\) head dim must be an even number in \[2, 2147483647\] "
     r"\(RoPE rotates pairs; JAX computes in int32\), got 2147483648$"),
    (["model.mlp_dim=2147483648"], r"model\.mlp_dim: must be in \[1, 2147483647\]"),
    (["optim.b1=1.0"], r"optim\.b1/b2: must be in \[0, 1\)"),  # Adam's bias correction 1 - b1^t = 0
    (["optim.b2=1.0"], r"optim\.b1/b2: must be in \[0, 1\)"),
    (["data.validation_fraction=1.0"], r"data\.validation_fraction: must be in \[0, 1\)"),
    (["data.mixture=files:1,tokens:1", "data.paths=/x"],
     r"data\.mixture: files and tokens both read data\.paths"),
    (["train.profile_steps=2", "train.profile_start=0"], r"train\.profile_start: must be >= 1"),
    (["train.compile_slices=0"], r"train\.compile_slices: must be >= 1"),
    (["train.compile_slices=2"], r"train\.compile_slices: only used with train\.compile_topology"),
    (["checkpoint.resume_step=0"], r"checkpoint\.resume_step: must be a positive step"),
    (["train.steps=true"], r"train\.steps: expected an integer, got True"),
    (["optim.lr=.inf"], r"optim\.lr: expected a finite number, got inf"),
    (["optim.eps=.nan"], r"optim\.eps: expected a finite number, got nan"),
    (["model.rope_theta=1e999"], r"model\.rope_theta: expected a finite number"),
    (["optim.eps=-1e-8"], r"optim\.eps: must be >= 0"),
    (["model.init_std=0"], r"model\.init_std: must be positive"),
    (["train.steps=30", "checkpoint.resume_step=30", "checkpoint.discard_later=true"],
     r"checkpoint\.resume_step: 30 with checkpoint\.discard_later=true must be below "
     r"train\.steps=30"),
    (["train.steps"], r"expected section\.key=value"),
    (["train.steps=5", "train.profile_steps=2"],  # profile_start defaults to 10
     r"train\.profile_start: must be <= train\.steps \(5\) when train\.profile_steps > 0"),
    (["distributed.num_processes=2", "distributed.process_id=1"],  # no coordinator: was ignored
     r"distributed\.num_processes: only used with distributed\.coordinator"),
    (["distributed.coordinator=h:1", "distributed.num_processes=2", "distributed.process_id=2"],
     r"distributed\.process_id: must be below distributed\.num_processes \(2\)"),
    # no port: jax's initialize indexed it out (an IndexError traceback); 99999: no such port
    (["distributed.coordinator=host", "distributed.num_processes=1", "distributed.process_id=0"],
     r"distributed\.coordinator: expected HOST:PORT with PORT in \[1, 65535\], got 'host'$"),
    (["distributed.coordinator=host:99999"], r"distributed\.coordinator: expected HOST:PORT"),
    (["distributed.coordinator=:1234"], r"distributed\.coordinator: expected HOST:PORT"),
    (["distributed.coordinator=h:1", "distributed.num_processes=0", "distributed.process_id=0"],
     r"distributed\.num_processes: must be positive"),
    (["distributed.heartbeat_timeout_s=0"], r"distributed\.heartbeat_timeout_s: must be positive"),
    (["distributed.initialization_timeout_s=0"],
     r"distributed\.initialization_timeout_s: must be positive"),
    (["model.num_kv_heads=x"], r"model\.num_kv_heads: expected an integer, got 'x'$"),  # int | None
    (["optim.lr=abc"], r"optim\.lr: expected a number, got 'abc'$"),  # a string, not 1e-4's
    (["model=5"], r"model: expected a mapping, got 5$"),
    # numpy's generators refuse a negative seed, and PRNGKey an integer beyond int64: tracebacks
    (["model.attn_logit_bits=129"], r"model\.attn_logit_bits: must be in \[2, 32\]"),
    (["train.seed=-1"], r"train\.seed: must be in \[0, 2\*\*32\) \(jax\.random\.key keeps 32"),
    # jax.random.key keeps a seed's low 32 bits: 2**32 initialized the model seed 0 does
    (["train.seed=4294967296"], r"train\.seed: must be in \[0, 2\*\*32\)"),
    (["data.split_seed=-1"], r"data\.split_seed: must be >= 0$"),
    (["train.seed=99999999999999999999999"],
     r"train\.seed: expected an integer of at most 64 bits, got 99999999999999999999999$"),
    # beyond int32, optax's step count: the schedule was an OverflowError traceback at step 1
    (["train.steps=2147483648"], r"train\.steps: must be <= 2147483647 \(optax counts steps in "
                                 r"int32\)$"),
    (["optim.warmup_steps=2147483648"], r"optim\.warmup_steps: must be in \[0, 2147483647\]"),
    (["train.steps=-99999999999999999999999"], r"train\.steps: expected an integer of at most 64 "
                                               r"bits, got -99999999999999999999999$"),
    (["train.steps=5", "train.steps.x=1"], r"override 'train\.steps\.x=1': steps is not a section$"),
    # Path("") is the working directory: the run trained into it
    (["train.run_dir=''"], r"train\.run_dir: '' is empty; name the run's directory$"),
    (["train.init_from=' '"], r"train\.init_from: ' ' is empty; name an export, a run or a step "
                              r"directory \(or null: a fresh init\)$"),
    (["train.compile_cache_dir=''"], r"train\.compile_cache_dir: '' is empty; name a directory "
                                     r"\(or null: no compilation cache\)$"),
    # each range rule's first value outside it (`test_each_rule_accepts_the_edge_of_its_range`
    # has the last one inside)
    (["model.rope_theta=0"], r"model\.rope_theta: must be positive$"),
    (["model.norm_eps=0"], r"model\.norm_eps: must be positive$"),
    (["model.loss_chunk=-1"], r"model\.loss_chunk: must be >= 0"),
    (["model.num_kv_heads=0"], r"model\.num_kv_heads: must be positive$"),  # not a ZeroDivisionError
    (["model.embed_dim=72"], r"model\.head_dim: the \(component\) head dim must be an even number "
                             r".* got 9$"),  # 72 / (2·4): RoPE rotates pairs
    (["model.variant=transformer", "model.head_dim=7"], r"model\.head_dim: .* even number .* got 7$"),
    (["model.mlp_dim=0"], r"model\.mlp_dim: must be in \[1, 2147483647\]"),
    (["model.attn_logit_bits=1"], r"model\.attn_logit_bits: must be in \[2, 32\]"),  # 0 levels
    (["model.attention_impl=cudnn"], r"model\.attention_impl: cudnn runs bfloat16 only"),
    (["model.subln_init=0"], r"model\.subln_init: must be a finite number > 0$"),
    (["mesh.fsdp=0"], r"mesh\.fsdp: must be positive or -1 \(the rest\)$"),
    (["optim.lr=0"], r"optim\.lr: must be positive$"),
    (["optim.min_lr=-1e-4"], r"optim\.min_lr: must be in \[0, optim\.lr\]$"),
    (["optim.decay_steps=1"], r"optim\.decay_steps: must be in \[2, 2147483647\] or null"),
    (["optim.schedule=constant", "optim.decay_steps=10"],
     r"optim\.decay_steps: has nothing to decay with optim\.schedule=constant"),
    (["optim.warmup_steps=30", "optim.decay_steps=271"],  # train.steps=300
     r"optim\.decay_steps: 271 plus optim\.warmup_steps=30 is more than train\.steps=300"),
    (["optim.weight_decay=-0.1"], r"optim\.weight_decay: must be >= 0$"),
    (["optim.clip_norm=-1"], r"optim\.clip_norm: must be >= 0 \(0 disables clipping\)$"),
    (["data.read_threads=0"], r"data\.read_threads: must be positive$"),
    (["data.niah_tokens=0"], r"data\.niah_tokens: must be positive$"),
    (["data.mixture_tokens=0"], r"data\.mixture_tokens: must be positive"),
    (["data.niah_doc_tokens=383"], r"data\.niah_doc_tokens: must be >= 384"),
    (["data.prompt_field=''"], r"data\.prompt_field: must be a JSONL field name other than "
                               r"data\.text_field \('text'\), or null$"),
    (["data.prompt_field=text"], r"data\.prompt_field: must be a JSONL field name other than"),
    (["data.mixture=files:1", "data.paths=/x", "data.prompt_field=p"],
     r"data\.prompt_field: a mixture takes only sources whose every token is a target"),
    (["data.source=files"], r"data\.paths: data\.source=files needs at least one path$"),
    (["data.mixture=files:1,stdlib:1"], r"data\.paths: data\.mixture's files needs at least one "
                                        r"path$"),
    (["data.mixture=stdlib:0,niah:1"], r"data\.mixture: 'stdlib:0': expected SOURCE:WEIGHT"),
    (["data.mixture=stdlib:1,stdlib:1"], r"data\.mixture: names a source twice$"),
    (["data.paths=null"], r"data\.paths: expected a list, got None$"),
    (["train.eval_batches=0"], r"train\.eval_batches: must be positive$"),
    (["train.eval_batches=2", "train.eval_tokens=100"],
     r"train\.eval_batches: set train\.eval_tokens only"),
    (["train.eval_every=-1"], r"train\.eval_every: must be >= 0 \(0 disables\)$"),
    (["train.profile_steps=-1"], r"train\.profile_steps: must be >= 0"),
    (["train.compile_topology=v5p:4x4x4"], r"train\.compile_topology: only used with "
                                           r"train\.compile_only=true$"),
    (["checkpoint.every_steps=0"], r"checkpoint\.every_steps: must be positive$"),
    (["checkpoint.discard_later=true"], r"checkpoint\.discard_later: only used with "
                                        r"checkpoint\.resume_step$"),
    (["distributed.coordinator=h:0"], r"distributed\.coordinator: expected HOST:PORT with PORT in "
                                      r"\[1, 65535\], got 'h:0'$"),
    (["distributed.coordinator=h:65536"], r"distributed\.coordinator: expected HOST:PORT"),
    (["distributed.coordinator=h:1", "distributed.num_processes=2", "distributed.process_id=-1"],
     r"distributed\.process_id: must be >= 0$"),
])
def test_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(CONFIGS / "tiny.yaml", overrides)


@pytest.mark.parametrize("overrides,key,value", [
    (["model.attn_logit_bits=2"], "model.attn_logit_bits", 2),
    (["model.attn_logit_bits=32"], "model.attn_logit_bits", 32),
    (["model.attn_logit_bits=8", "model.attention_impl=auto"], "model.attention_impl", "auto"),
    (["model.attention_impl=cudnn", "model.dtype=bfloat16"], "model.attention_impl", "cudnn"),
    (["model.lambda_init=0"], "model.lambda_init", 0.0),
    (["optim.min_lr=3e-3"], "optim.min_lr", 3e-3),  # = tiny.yaml's optim.lr: no decay
    (["optim.decay_steps=2"], "optim.decay_steps", 2),
    (["optim.warmup_steps=30", "optim.decay_steps=270"], "optim.decay_steps", 270),  # = 300 steps
    (["optim.b1=0", "optim.b2=0"], "optim.b1", 0.0),
    (["optim.weight_decay=0"], "optim.weight_decay", 0.0),
    (["optim.clip_norm=0"], "optim.clip_norm", 0.0),  # 0: no clipping
    (["data.validation_fraction=0"], "data.validation_fraction", 0.0),
    (["data.prefetch=0"], "data.prefetch", 0),
    (["data.source=niah", "data.niah_doc_tokens=384"], "data.niah_doc_tokens", 384),
    (["data.source=files", "data.paths= a , b ,"], "data.paths", ("a", "b")),  # "a,b" ok
    (["train.steps=2147483647"], "train.steps", 2147483647),
    (["train.eval_every=0"], "train.eval_every", 0),  # 0 disables
    (["train.profile_steps=2", "train.profile_start=300"], "train.profile_start", 300),
    (["train.compile_only=true", "train.compile_topology=v5p:4x4x4"], "train.compile_topology",
     "v5p:4x4x4"),
    (["distributed.coordinator=h:65535"], "distributed.coordinator", "h:65535"),
    (["distributed.coordinator=h:1", "distributed.num_processes=2", "distributed.process_id=1"],
     "distributed.process_id", 1),
    (["train.seq_len=512"], "train.seq_len", 512),  # = model.max_seq_len
])
def test_each_rule_accepts_the_edge_of_its_range(overrides, key, value):
    """The last value inside each range rule loads (`test_errors_name_the_key` has the first
    one outside): the bounds are the documented ones, not one step tighter."""
    section, field = key.split(".")
    assert getattr(getattr(load_config(CONFIGS / "tiny.yaml", overrides), section), field) == value


@pytest.mark.parametrize("override,match", [
    # `train.init_from=$CKPT` with the variable unset: it was YAML's null, the default, and the
    # run trained from a fresh init without a word
    ("train.init_from=", r"train\.init_from: '' is empty; name an export, a run or a step "
                         r"directory \(or null: a fresh init\)$"),
    ("train.compile_cache_dir=", r"train\.compile_cache_dir: '' is empty; name a directory"),
    ("train.run_dir=", r"train\.run_dir: '' is empty; name the run's directory$"),  # not "got None"
    ("model.num_kv_heads=", r"model\.num_kv_heads: expected an integer, got ''$"),
])
def test_an_empty_override_is_the_empty_string_not_null(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(CONFIGS / "tiny.yaml", [override])
    assert load_config(CONFIGS / "tiny.yaml", ["train.init_from=null"]).train.init_from is None


@pytest.mark.parametrize("overrides", [
    ["data.paths=/nope"],
    ["data.source=niah", "data.paths=/nope"],
    ["data.source=files", "data.mixture=stdlib:0.5,niah:0.5", "data.paths=/nope"],
])
def test_paths_that_nothing_reads_are_refused(overrides):
    with pytest.raises(ConfigError, match=r"data\.paths: \['/nope'\] is set but "
                       r"data\.(source|mixture)=.* reads no paths"):
        load_config(CONFIGS / "tiny.yaml", overrides)
    for readers in (["data.source=files"], ["data.source=tokens"], ["data.mixture=files:1,niah:1"],
                    ["data.source=stdlib", "data.mixture=tokens:1,stdlib:1"]):
        assert load_config(None, [*readers, "data.paths=/nope"]).data.paths == ("/nope",)


def test_data_settings_the_sources_do_not_read_are_said_not_refused():
    """data.* settings set away from their defaults that the chosen sources never read: one line
    each (train.py prints them), the config still loads; the same values where they are read, or
    left at their defaults, say nothing."""
    unread = load_config(None, ["data.mixture_tokens=1000", "data.niah_tokens=5000",
                                "data.niah_doc_tokens=400", "data.text_field=body"]).data.unread()
    assert unread == [
        "data.mixture_tokens=1000: not used, since data.mixture is not set",
        "data.niah_tokens=5000: not used, since niah is not the only data source",
        "data.niah_doc_tokens=400: not used, since no data source is niah",
        "data.text_field=body: not used, since no data source is files (.jsonl or .parquet records)"]
    mixed = load_config(None, ["data.mixture=stdlib:1,niah:1", "data.niah_tokens=5000",
                               "data.mixture_tokens=1000", "data.niah_doc_tokens=400"]).data
    assert mixed.unread() == [unread[1]]  # with stdlib in the mix, niah's share sizes it
    for read in (["data.source=niah", "data.niah_tokens=5000", "data.niah_doc_tokens=400"],
                 ["data.source=files", "data.paths=/x", "data.text_field=body"],
                 ["data.mixture=files:1,niah:1", "data.paths=/x", "data.text_field=body"]):
        assert load_config(None, read).data.unread() == []
    assert load_config(CONFIGS / "tiny.yaml").data.unread() == []
    assert load_config(None, ["data.prompt_field=p"]).data.unread() == [
        "data.prompt_field=p: not used, since no data source is files (.jsonl or .parquet records; "
        "a prepared corpus holds its loss mask)"]


def test_a_bare_name_is_a_shipped_config_unless_a_file_has_it(tmp_path, monkeypatch):
    """An installed diff-jax has no configs/ folder beside the caller: `--config diff-830m.yaml`
    (or `diff-830m`) names the shipped one. A file of that name in the working directory comes
    first, a path with a folder is only that path (one ending in a shipped config's name is
    refused naming it), and a name found nowhere is one line that lists the shipped configs."""
    monkeypatch.chdir(tmp_path)
    shipped = load_config(CONFIGS / "diff-830m.yaml")
    assert load_config("diff-830m.yaml") == shipped
    assert load_config("diff-830m", ["train.steps=7"]) == load_config(
        CONFIGS / "diff-830m.yaml", ["train.steps=7"])
    assert config_file("tiny-transformer").resolve() == (CONFIGS / "tiny-transformer.yaml").resolve()
    (tmp_path / "diff-830m.yaml").write_text("base: " + str(CONFIGS / "diff-830m.yaml") +
                                             "\nmodel:\n  num_layers: 2\n")
    assert load_config("diff-830m.yaml").model.num_layers == 2  # the working directory's file
    assert load_config("diff-830m").model.num_layers == 24  # no file is named `diff-830m`
    with pytest.raises(ConfigError, match=r"^config file not found: .*sub/mine\.yaml$"):
        load_config("sub/mine.yaml")
    # the docs' configs/NAME away from a clone: still only that path, and the name to give
    with pytest.raises(ConfigError, match=r"^config file not found: .*/configs/diff-830m\.yaml "
                                          r"\(diff-830m\.yaml, a shipped config, is named "
                                          r"without a folder\)$"):
        load_config("configs/diff-830m.yaml")
    with pytest.raises(ConfigError, match=r"sub/tiny \(tiny\.yaml, a shipped config, is named"):
        load_config("sub/tiny")
    with pytest.raises(ConfigError) as e:
        load_config("diff-83m.yaml")
    assert str(e.value).startswith(f"config file not found: {tmp_path / 'diff-83m.yaml'} (nor is "
                                   "diff-83m.yaml a shipped config: diff-1.4b.yaml, ")
    assert "diff-830m.yaml, " in str(e.value) and str(e.value).endswith("transformer-830m.yaml)")


def test_a_base_names_a_shipped_config_as_config_does(tmp_path, monkeypatch):
    """`base: diff-830m.yaml` (or `diff-830m`) in a user's file with no such file beside it is the
    shipped config, as `--config diff-830m.yaml` is (it was "config file not found"); a file beside
    it comes first, and a name found in neither place is one line naming the file, `base` and the
    shipped configs."""
    monkeypatch.chdir(tmp_path)  # and no file of the name in the working directory either
    mine = tmp_path / "mine.yaml"
    for base in ("diff-830m.yaml", "diff-830m"):
        mine.write_text(f"base: {base}\nmodel:\n  num_layers: 2\n")
        assert load_config(mine) == load_config(CONFIGS / "diff-830m.yaml", ["model.num_layers=2"])
    mine.write_text("base: diff-830m.yaml\nmodel:\n  num_layers: 2\n")
    (tmp_path / "diff-830m.yaml").write_text("base: tiny\ntrain:\n  steps: 3\n")
    assert load_config(mine) == load_config(CONFIGS / "tiny.yaml",  # the file beside it
                                            ["model.num_layers=2", "train.steps=3"])
    mine.write_text("base: diff-83m.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(mine)
    assert str(e.value).startswith(f"{mine}: base: config file not found: "
                                   f"{tmp_path / 'diff-83m.yaml'} (nor is diff-83m.yaml a shipped "
                                   "config: diff-1.4b.yaml, ")
    assert "\n" not in str(e.value) and str(e.value).endswith("transformer-830m.yaml)")
    mine.write_text("base: configs/tiny.yaml\n")  # a folder: only that path, as with --config
    with pytest.raises(ConfigError, match=rf"^{mine}: base: config file not found: "
                                          rf"{tmp_path / 'configs' / 'tiny.yaml'} \(tiny\.yaml, a "
                                          r"shipped config, is named without a folder\)$"):
        load_config(mine)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "child.yaml").write_text("base: sub/nope.yaml\n")  # it named the missing file only
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'child.yaml'}: base: config file not "
                                          rf"found: {tmp_path / 'sub' / 'nope.yaml'}$"):
        load_config(tmp_path / "child.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML: expected ',' or '\]', but "
                       r"got '<stream end>' at line 2, column 1$"):  # one line, naming the place
        load_config(bad)
    with pytest.raises(ConfigError, match=r"override 'train\.steps=\[': value: not valid YAML: "
                       r".* at line 1, column 2$"):
        load_config(None, ["train.steps=["])
    empty = tmp_path / "empty.yaml"
    empty.write_text("# model:\n#   embed_dim: 64\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml: the config file holds no settings"):
        load_config(empty)
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(loop)
    (tmp_path / "sub").mkdir()
    based = tmp_path / "based.yaml"
    based.write_text("base: sub\n")  # a base that is a directory, as --config DIR
    with pytest.raises(ConfigError, match=r"sub: is a directory; expected a YAML config file"):
        load_config(based)
    deep = tmp_path / "deep.yaml"  # PyYAML's parser recursed into a RecursionError traceback
    deep.write_text("a: " + "[" * 600 + "]" * 600 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.yaml: nested too deeply to read \(PyYAML "
                       r"recurses per level, past Python's recursion limit\)$"):
        load_config(deep)
    with pytest.raises(ConfigError, match=r"override 'train\.steps=\[\[.*': value: nested too "
                       r"deeply to read"):
        load_config(None, ["train.steps=" + "[" * 600 + "]" * 600])
    listed = tmp_path / "listed.yaml"
    listed.write_text("- model\n- train\n")
    with pytest.raises(ConfigError, match=r"listed\.yaml: the top level must be a mapping of "
                       r"sections$"):
        load_config(listed)
    listed.write_text("model:\n  ? [a, b]\n  : 1\n")  # a list as a key: PyYAML's own refusal
    with pytest.raises(ConfigError, match=r"listed\.yaml: not valid YAML: found unhashable key "
                       r"at line 2, column 5$"):
        load_config(listed)
    for base in ("3", "[a.yaml]"):
        based.write_text(f"base: {base}\n")
        with pytest.raises(ConfigError, match=r"based\.yaml: base: expected the path of a YAML "
                           r"config file, got (3|\['a\.yaml'\])$"):
            load_config(based)


def test_a_key_given_twice_is_refused(tmp_path):
    dup = tmp_path / "dup.yaml"  # PyYAML alone keeps the second `model:`, dropping embed_dim
    dup.write_text("model:\n  embed_dim: 64\ntrain:\n  steps: 5\nmodel:\n  num_layers: 2\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml: not valid YAML: key 'model' is given twice "
                       r"in one mapping at line 5, column 1$"):
        load_config(dup)
    dup.write_text("model:\n  embed_dim: 64\n  embed_dim: 128\n")
    with pytest.raises(ConfigError, match=r"key 'embed_dim' is given twice .* at line 3"):
        load_config(dup)
    merged = tmp_path / "merged.yaml"  # a YAML merge key's values may be overridden
    merged.write_text("model:\n  <<: {embed_dim: 64, num_layers: 3}\n  embed_dim: 128\n")
    assert load_config(merged).model.embed_dim == 128


def test_a_config_file_that_is_not_utf8(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"model:\n  \x80\xff\n")
    with pytest.raises(ConfigError, match=r"binary\.yaml: cannot read the config file: "
                       r"UnicodeDecodeError"):
        load_config(binary)

def test_derived_sizes():
    m = ModelConfig(embed_dim=3072, num_heads=12)
    assert m.resolved_head_dim == 128 and m.resolved_mlp_dim == 8192
    assert ModelConfig(embed_dim=128).resolved_mlp_dim == 384  # 8·128/3 = 341.3, rounded up
    # the older train.eval_batches counts batches of batch_size rows of seq_len tokens
    assert load_config(None, ["train.eval_batches=3", "train.batch_size=4",
                              "train.seq_len=16"]).train.eval_tokens == 3 * 4 * 16
    # mixture weights are shares: 1:3 is a quarter and three quarters
    assert load_config(None, ["data.mixture=stdlib:1,niah:3"]).data.mixture_weights == (
        ("stdlib", 0.25), ("niah", 0.75))
    assert ModelConfig(variant="transformer", embed_dim=3072, num_heads=24).resolved_head_dim == 128
    assert ModelConfig(variant="diff_v2", embed_dim=256, num_heads=4, head_dim=48).resolved_head_dim == 48
    # rounded up, not to the nearest: 8·64/3 = 170.7 is 1.33 multiples of 128
    assert ModelConfig(embed_dim=64).resolved_mlp_dim == 256
    assert ModelConfig(embed_dim=64, mlp_dim=100).resolved_mlp_dim == 100  # a set one as it is
    # the naive GQA pairing exists only under GQA; without it the two compute alike
    assert ModelConfig(gqa_pairing="naive", num_kv_heads=2).resolved_gqa_pairing == "naive"
    assert ModelConfig(gqa_pairing="naive").resolved_gqa_pairing == "flash"


def test_difference_names_the_first_key_computed_differently_other_value_first():
    """`ModelConfig.difference`: None for two configs of one function (an mlp_dim set to its
    derived default included), else (key, the other's value, this one's) as overrides write them."""
    base = ModelConfig(embed_dim=64)
    assert base.difference(ModelConfig(embed_dim=64, mlp_dim=256, dtype="bfloat16")) is None
    assert base.difference(ModelConfig(embed_dim=64, mlp_dim=128)) == ("model.mlp_dim", "128", "256")
    held = ModelConfig(embed_dim=64, lambda_init=0.5)
    assert held.difference(base) == ("model.lambda_init", "null", "0.5")
    assert ModelConfig(embed_dim=64, tie_embeddings=False).difference(base) == (
        "model.tie_embeddings", "true", "false")


@pytest.mark.parametrize("value", [None, True, False, 3, 0.5, "bfloat16", [1, 2], ("a", None, True),
                                   [["batch", ["data", "fsdp"]], ["embed", None]]])
def test_override_value_is_read_back_by_parse_override_as_it_was(value):
    from diff_jax.config import override_value, parse_override

    keys, parsed = parse_override(f"model.x={override_value(value)}")
    assert keys == ["model", "x"]
    expected = list(value) if isinstance(value, tuple) else value
    assert parsed == expected and type(parsed) is type(expected)


def test_an_overrides_key_is_read_without_the_spaces_around_it():
    assert load_config(None, [" train.steps =7"]).train.steps == 7
    with pytest.raises(ConfigError, match=r"^override 'tiny\.yaml': expected section\.key=value "
                                          r"\(a config file is given as --config FILE\)$"):
        load_config(None, ["tiny.yaml"])
    with pytest.raises(ConfigError, match=r"^override '=tiny\.yaml': expected section\.key=value$"):
        load_config(None, ["=tiny.yaml"])  # an `=`: no file name meant


def test_coerce_takes_64_bit_integers_and_a_unions_first_error():
    from diff_jax.config import coerce

    assert coerce(2**63 - 1, int, "k") == 2**63 - 1 and coerce(-2**63, int, "k") == -2**63
    for beyond in (2**63, -2**63 - 1):
        with pytest.raises(ConfigError, match=rf"^k: expected an integer of at most 64 bits, got "
                                              rf"{beyond}$"):
            coerce(beyond, int, "k")
    # data.paths: tuple[str, ...] | str, whose first alternative names the item at fault
    with pytest.raises(ConfigError, match=r"^data\.paths\[1\]: expected a string, got 1$"):
        DataConfig(source="files", paths=["a", 1])


def test_a_model_section_alone_names_its_keys_as_the_whole_config_does():
    from diff_jax.config import model_config_from_dict

    assert model_config_from_dict({"embed_dim": 64}) == ModelConfig(embed_dim=64)
    with pytest.raises(ConfigError, match=r"^model\.embed_dim: expected an integer, got 'x'$"):
        model_config_from_dict({"embed_dim": "x"})


def test_a_whole_config_where_a_section_is_taken_is_a_type_error_naming_the_section():
    from diff_jax.config import check_section

    check_section(ModelConfig(), ModelConfig, "DecoderLM")
    with pytest.raises(TypeError, match=r"^DecoderLM takes a ModelConfig \(a Config's \.model\), "
                                        r"got Config$"):
        check_section(Config(), ModelConfig, "DecoderLM")
    with pytest.raises(TypeError, match=r"^make_mesh takes a MeshConfig \(a Config's \.mesh\), got "
                                        r"dict$"):
        check_section({}, MeshConfig, "make_mesh")


def test_dump_config_writes_sections_and_keys_in_declaration_order():
    import yaml

    dumped = yaml.safe_load(dump_config(load_config(CONFIGS / "tiny.yaml")))
    assert list(dumped) == [f.name for f in dataclasses.fields(Config)]
    assert list(dumped["model"]) == [f.name for f in dataclasses.fields(ModelConfig)]


def test_a_home_relative_run_dir_is_expanded(monkeypatch, tmp_path):
    # the shell does not expand `~` in `train.run_dir=~/x`; eval.py and data.paths do
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["train.run_dir=~/runs/a", "train.init_from=~/export",
                             "train.compile_cache_dir=~/.cache/xla"])
    assert cfg.train.run_dir == str(tmp_path / "runs" / "a")
    assert cfg.train.init_from == str(tmp_path / "export")
    assert cfg.train.compile_cache_dir == str(tmp_path / ".cache" / "xla")


@pytest.mark.parametrize("field,value", [("dtype", "float16"), ("gqa_pairing", "Naive"),
                                         ("remat", "some"), ("output_init", "xavier"),
                                         ("attention_impl", "triton")])
def test_model_config_built_in_python_checks_its_choices(field, value):
    """A ModelConfig made in Python (the library API, hf_import) refuses a value outside a
    field's choices as the YAML path does, instead of running e.g. gqa_pairing="Naive" as flash
    or output_init="xavier" as normal."""
    with pytest.raises(ConfigError, match=rf"model\.{field}: must be one of \[.*\], got '{value}'"):
        ModelConfig(**{field: value})



def test_model_config_built_in_python_names_an_unknown_variant_and_the_known_ones():
    """The variant is looked up before the fields are coerced: a ConfigError, not the registry's
    KeyError."""
    with pytest.raises(ConfigError, match=r"^model\.variant: unknown variant 'gpt'; known: diff, "
                                          r"diff_v2, transformer$"):
        ModelConfig(variant="gpt")


@pytest.mark.parametrize("field,value,says", [
    ("tie_embeddings", "false", "expected true/false, got 'false'"),  # ran as true
    ("learn_lambda", "no", "expected true/false, got 'no'"),  # ran as true
    ("vocab_size", True, "expected an integer, got True"),  # ran with a vocabulary of 1
    ("embed_dim", 64.0, "expected an integer, got 64.0"),  # failed deep in jax
    ("num_heads", "2", "expected an integer, got '2'"),  # TypeError: '<' between int and str
    ("init_std", float("inf"), "expected a finite number, got inf"),  # initialized inf weights
])
def test_model_config_built_in_python_checks_every_fields_type(field, value, says):
    """Every field of a ModelConfig made in Python is checked as the YAML path checks it (before,
    only the fields with a fixed set of choices were): one ConfigError naming the field."""
    with pytest.raises(ConfigError, match=rf"^model\.{field}: {re.escape(says)}$"):
        ModelConfig(**{field: value})


def test_model_config_built_in_python_takes_numpy_numbers_as_python_ones():
    config = ModelConfig(embed_dim=np.int64(64), num_heads=np.int32(2), rope_theta=np.float32(500))
    assert (config.embed_dim, config.num_heads, config.rope_theta) == (64, 2, 500.0)
    assert type(config.embed_dim) is int and type(config.rope_theta) is float
    assert config == ModelConfig(embed_dim=64, num_heads=2, rope_theta=500)


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "optim": OptimConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "mesh": MeshConfig, "distributed": DistributedConfig}

# (section, field, a value a config file or an override may give): each refused; what the
# section built in Python did with it before
BAD_SECTION_VALUES = [
    ("model", "vocab_size", True),  # (already checked: the one mechanism)
    ("train", "steps", "10"),  # TypeError: '>' between str and int
    ("train", "steps", True),  # trained 1 step
    ("train", "batch_size", 2.5),  # "train.grad_accum: must divide train.batch_size (2.5)"
    ("train", "seed", 2**70),  # (refused before too, by the range rule: the 64-bit one is first)
    ("train", "run_dir", 3),  # AttributeError: 'int' object has no attribute 'strip'
    ("train", "compile_only", "false"),  # ran as true: compiled and did not train
    ("train", "log_every", -1),  # (refused before too)
    ("optim", "lr", True),  # trained at lr 1
    ("optim", "lr", "fast"),  # TypeError
    ("optim", "b1", float("nan")),  # "optim.b1/b2: must be in [0, 1)"
    ("optim", "clip_norm", float("inf")),  # ran unclipped
    ("optim", "warmup_steps", 1.5),  # ran
    ("optim", "schedule", "cosin"),  # ran the constant schedule
    ("data", "read_threads", True),  # taken as 1 thread
    ("data", "validation_fraction", "half"),  # TypeError
    ("data", "paths", [1]),  # AttributeError
    ("data", "prefetch", -1),  # (refused before too)
    ("checkpoint", "every_steps", 2.5),  # ran
    ("checkpoint", "async_save", "no"),  # saved asynchronously
    ("checkpoint", "keep", 0),  # (refused before too)
    ("mesh", "data", 1.0),  # ran, a float axis size
    ("mesh", "tensor", "2"),  # TypeError
    ("mesh", "fsdp", -2),  # (refused before too)
    ("distributed", "heartbeat_timeout_s", 1.5),  # ran
    ("distributed", "coordinator", 5),  # AttributeError: no rpartition
    ("distributed", "heartbeat_timeout_s", 0),  # (refused before too)
]


@pytest.mark.parametrize("section,field,value", BAD_SECTION_VALUES,
                         ids=[f"{s}.{f}={v!r}" for s, f, v in BAD_SECTION_VALUES])
def test_a_section_built_in_python_refuses_what_a_config_file_refuses(section, field, value):
    """Every section's fields are checked by `config.coerce` as ModelConfig's were: a value
    refused in a config file or an override is refused in Python with the same one line."""
    with pytest.raises(ConfigError) as from_file:
        from_dict({section: {field: value}})
    with pytest.raises(ConfigError) as in_python:
        SECTIONS[section](**{field: value})
    assert str(in_python.value) == str(from_file.value)
    assert str(in_python.value).startswith(f"{section}.{field}")


def test_a_section_built_in_python_is_coerced_as_a_config_file_coerces_it():
    """What the YAML path converts, Python gets converted too (before, lr="1e-3" was a
    TypeError and a section given as a mapping an AttributeError in Config's checks); a
    whole Config where a section is meant, and a section replaced with a bad value, are one
    ConfigError naming the field."""
    given = {"optim": {"lr": "1e-3", "clip_norm": 1}, "train": {"steps": np.int64(7)},
             "mesh": {"rules": [["batch", ["data"]]]}}
    built = Config(**{name: SECTIONS[name](**values) for name, values in given.items()})
    assert built == from_dict(given) == Config(**given)
    assert built.optim.lr == 1e-3 and type(built.optim.clip_norm) is float
    assert built.train.steps == 7 and type(built.train.steps) is int
    assert built.mesh.rules == (("batch", ("data",)),)
    with pytest.raises(ConfigError, match=r"^model: expected a ModelConfig, got a Config$"):
        Config(model=Config())
    with pytest.raises(ConfigError, match=r"^train: expected a mapping, got 3$"):
        Config(train=3)
    with pytest.raises(ConfigError, match=r"^train\.steps: expected an integer, got '7'$"):
        dataclasses.replace(built.train, steps="7")


def test_apply_overrides_leaves_the_callers_dict_as_it_was():
    """It returns a changed copy: the dict it was given, nested sections included, is not
    touched (its sections were shared with the copy, so an override changed both)."""
    from diff_jax.config import apply_overrides

    data = {"model": {"num_layers": 2, "rules": [["batch", ["data"]]]}, "train": {"steps": 5}}
    before = copy.deepcopy(data)
    out = apply_overrides(data, ["model.num_layers=4", "train.steps=7", "optim.lr=0.1"])
    assert out["model"]["num_layers"] == 4 and out["train"]["steps"] == 7
    assert out["optim"] == {"lr": 0.1} and data == before


def test_coerce_refuses_an_annotation_it_does_not_know():
    """A field annotated with a type `coerce` has no rule for (a dict) is a ConfigError naming
    the key, not a value passed through unchecked."""
    from diff_jax.config import coerce

    with pytest.raises(ConfigError, match=r"model\.extra: unsupported type <class 'dict'>$"):
        coerce({}, dict, "model.extra")


def test_a_blank_or_directory_base_is_one_line_naming_the_file_that_names_it(tmp_path):
    """`base: ''` was the file's own folder ("DIR: is a directory", naming neither the file nor
    `base`; `--config ''` named the working directory so), and `base: sub`, a directory, named
    only the directory; each is one line naming the file and its `base`."""
    (tmp_path / "sub").mkdir()
    mine = tmp_path / "mine.yaml"
    empty = "the config file's name is empty; expected a YAML config file or a shipped config's name"
    for base, error in (("''", empty), ("' '", empty),
                        ("sub", f"{tmp_path / 'sub'}: is a directory; expected a YAML config "
                                "file")):
        mine.write_text(f"base: {base}\n")
        with pytest.raises(ConfigError) as e:
            load_config(mine)
        assert str(e.value) == f"{mine}: base: {error}"
    with pytest.raises(ConfigError) as e:
        load_config("")
    assert str(e.value) == empty


def test_a_directory_named_as_a_shipped_config_does_not_hide_it(tmp_path, monkeypatch):
    """A bare name names a file or else the shipped config: a directory of that name (a run's,
    an export's) is no file, and `--config tiny` beside a `tiny/` directory, or `base: tiny` in a
    file beside one, was "tiny: is a directory" where the shipped tiny.yaml was meant."""
    monkeypatch.chdir(tmp_path)
    shipped = load_config(CONFIGS / "tiny.yaml")
    for name in ("tiny", "tiny.yaml"):
        (tmp_path / name).mkdir()
        assert load_config(name) == shipped
        (tmp_path / "mine.yaml").write_text(f"base: {name}\n")
        assert load_config(tmp_path / "mine.yaml") == shipped
    (tmp_path / "runs").mkdir()  # no shipped config of the name: still refused, naming it
    with pytest.raises(ConfigError) as e:
        load_config("runs")
    assert str(e.value) == f"{tmp_path / 'runs'}: is a directory; expected a YAML config file"


def test_a_local_file_named_as_a_shipped_config_may_start_from_it(tmp_path):
    """A diff-830m.yaml of one's own with `base: diff-830m.yaml` (or `base: diff-830m`) starts
    from the shipped config of that name: it was a `base` chain looping back to itself. A base
    naming the file itself where no shipped config has that name still loops."""
    mine = tmp_path / "tiny.yaml"
    for base in ("tiny.yaml", "tiny"):
        mine.write_text(f"base: {base}\ntrain:\n  steps: 7\n")
        got = load_config(mine)
        shipped = load_config("tiny")
        assert got.train.steps == 7 and got.model == shipped.model
    own = tmp_path / "own.yaml"
    own.write_text("base: own.yaml\n")
    with pytest.raises(ConfigError, match=r"own\.yaml: `base` chain loops back to this file$"):
        load_config(own)
    # the file named with a folder is that file, shipped name or not: a loop, not "not found"
    mine.write_text(f"base: ../{tmp_path.name}/tiny.yaml\n")
    with pytest.raises(ConfigError, match=r"tiny\.yaml: `base` chain loops back to this file$"):
        load_config(mine)
