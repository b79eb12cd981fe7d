"""Find and load what eval.py evaluates: a training checkpoint (with its saved config) or an
exported parameters-only directory, with the command line's config overrides applied."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import linen as nn
from jax.sharding import Mesh

from diff_jax import checkpoint
from diff_jax.checkpoint import CheckpointError
from diff_jax.config import (Config, ConfigError, MeshConfig, ModelConfig, TrainConfig,
                             apply_overrides, from_dict, is_blank_path, parse_override)
from diff_jax.data import encoding
from diff_jax.data.tokenizer import Encoding, mismatch, recorded_identity
from diff_jax.evaluation.options import EvalError, EvalOptions
from diff_jax.export import ExportError
from diff_jax.export.sources import (EVAL_DIR, LOADABLE, abstract_params, locate, read_source,
                                     shardings_of)
from diff_jax.file_errors import describe
from diff_jax.platforms import use_compile_cache
from diff_jax.sharding import Rules, make_mesh, mesh_shape
from diff_jax.transformer import in_compute_dtype, in_layout, in_layout_placed


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What a task evaluates: the config, the parameters, and where they came from and go."""

    config: Config  # the saved config with the overrides applied
    # the parameters on this process's first device, or sharded over `mesh`: float32, the
    # matmul kernels, embedding and head in model.dtype (`in_compute_dtype`)
    params: Any
    source: str  # what was loaded (for the report)
    step: int | None  # the training step (an export's where it records it, else None)
    out_dir: Path  # where the task writes its outputs
    # why held-out text may not be the run's validation documents (an export that records no
    # data section of its run), for the tasks that read held-out text to report; else None
    split_note: str | None = None
    # the `tokenizer.identity` the parameters were trained with, where recorded (a checkpoint's
    # training data, an export's `trained_tokenizer`), which `text_encoding` holds data.tokenizer to
    trained_tokenizer: dict[str, Any] | None = None
    # the mesh the parameters are sharded over and the task runs on (`config.mesh`: eval's
    # mesh.* over this process's devices); None: this process's first device
    mesh: Mesh | None = None

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The mesh and `config.mesh.rules` as the context the task's programs are traced and
        run in (the model's logical-axis constraints and the attention op read them); nothing
        without a mesh."""
        if self.mesh is None:
            yield
            return
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.config.mesh.rules):
            yield


def text_encoding(loaded: Loaded) -> Encoding:
    """The encoding of `data.tokenizer` that the tasks read and write text with; `EvalError`
    when it is not the tokenizer the parameters were trained with: where recorded
    (`Loaded.trained_tokenizer`: another tiktoken encoding, another tokenizer.json or an edited
    one, another end- or beginning-of-text; checked first, since the message names the one to
    pass), or where its ids do not all fit `model.vocab_size`."""
    config = loaded.config
    enc = encoding(config.data.tokenizer)
    check_trained_tokenizer(loaded, enc)
    if enc.n_vocab > config.model.vocab_size:
        raise EvalError(f"data.tokenizer={config.data.tokenizer}: its {enc.n_vocab:,} ids do not "
                        f"fit model.vocab_size ({config.model.vocab_size:,}); pass the tokenizer "
                        "the model was trained with")
    return enc


def check_trained_tokenizer(loaded: Loaded, enc: Encoding) -> None:
    """`EvalError` where `enc` (data.tokenizer's, which the tasks read text and held-out text
    with) is not the tokenizer the parameters were trained with, where that is recorded
    (`Loaded.trained_tokenizer`; `tokenizer.mismatch`)."""
    if loaded.trained_tokenizer is not None:
        problem = mismatch(loaded.trained_tokenizer, enc, loaded.source, "trained")
        if problem is not None:
            raise EvalError(problem)


def _use_compile_cache(config: Config) -> None:
    """Serve what eval compiles from here on from the run's `train.compile_cache_dir` (a
    replication's runs share one), as its training did; one that cannot be made here (a run
    copied from another machine) is a warning, and eval compiles without it."""
    cache = config.train.compile_cache_dir
    try:
        use_compile_cache(cache)
    except OSError as e:
        where = describe(e, [(f"train.compile_cache_dir={cache}", str(cache))])
        print(f"warning: {where}; evaluating without the compilation cache", file=sys.stderr)


def _last_override(overrides: Sequence[str], dotted: str) -> Any:
    """The value the last of `overrides` (key=value texts) gives the `dotted` key; None when
    none names it."""
    found = None
    for text in overrides:
        keys, value = parse_override(text)
        if ".".join(keys) == dotted:
            found = value
    return found


def eval_mesh(overrides: Sequence[str]) -> tuple[Mesh | None, Rules]:
    """(mesh, rules) eval runs on: `mesh.*` as given in `overrides` over the defaults
    (`MeshConfig`: data=-1, fsdp=1, tensor=1, the default rules), the mesh over this process's
    devices, or None (this process's first device) where `overrides` name no `mesh.*` key. The
    run's own mesh section is not used: it describes the devices it trained on. `ShardingError`
    where the sizes do not fit the devices; `ConfigError` for a value that is no mesh setting."""
    config, named = _eval_mesh_config(overrides)
    return (make_mesh(config) if named else None), config.rules


def _eval_mesh_config(overrides: Sequence[str]) -> tuple[MeshConfig, bool]:
    """(the `mesh.*` of `overrides` over the defaults, whether they name any)."""
    named = [text for text in overrides if parse_override(text)[0][0] == "mesh"]
    return from_dict(apply_overrides(Config().to_dict(), named)).mesh, bool(named)


def eval_devices(overrides: Sequence[str]) -> tuple[str, str | None]:
    """(the devices eval runs on as the memory advice names them, how to spread the task over
    more of them or None where none are left), for `EvalOptions.memory_advice`."""
    n, platform = jax.local_device_count(), jax.local_devices()[0].platform
    mesh, named = _eval_mesh_config(overrides)
    if not named:
        if n == 1:
            return f"1 {platform} device(s)", None
        return (f"1 of the {n} {platform} devices here",
                f"shard the parameters over all {n} with mesh.data=1 mesh.fsdp=-1")
    sizes = mesh_shape(mesh, n)
    split = sizes["fsdp"] * sizes["tensor"]
    spread = (f"shard the parameters over more of them (mesh.fsdp × mesh.tensor = {split} of "
              f"{n})") if split < n else None
    shape = ", ".join(f"{axis}={size}" for axis, size in sizes.items())
    return f"{n} {platform} device(s) (mesh {shape})", spread


def _eval_mesh_section(saved: dict) -> dict:
    """The saved config `saved` with the defaults for its mesh section, which eval's `mesh.*`
    overrides apply to (`eval_mesh`)."""
    return {**saved, "mesh": Config().to_dict()["mesh"]}


def _placed(params: Any, config: Config, mesh: Mesh | None) -> Any:
    """`params` (float32 jax arrays) as the tasks read them: in `config.model`'s layer layout
    (`in_layout`; with a mesh, each array on its sharding over it, one parameter's stack of
    layers converted at a time: `in_layout_placed`), those the model reads in `model.dtype`
    stored in it (`in_compute_dtype`)."""
    if mesh is None:
        params = in_layout(params, config.model)
    else:
        target = abstract_params(config.model, mesh, config.mesh.rules)
        params = in_layout_placed(params, config.model, shardings_of(target))
    return in_compute_dtype(params, config.model)


def _check_same_model(saved: ModelConfig, config: ModelConfig, what: str) -> None:
    """`EvalError` naming the first field (`ModelConfig.difference`) in which an override makes
    `config` another model than `saved`, the model whose parameters `what` holds. Where the
    shapes still match (RoPE θ, λ_init, the GQA pairing) the task ran and reported another
    model's numbers under this checkpoint's name (measured: `model.gqa_pairing=naive` on a
    flash-paired GQA run, ppl loss 11.5535 for 11.5542), as neither training (on resume) nor
    `train.init_from` lets happen; where they do not, this names the override, not a tensor."""
    differs = config.difference(saved)
    if differs is not None:
        key, theirs, ours = differs
        raise EvalError(f"{key}={ours}: {what} holds a model with {key}={theirs}, and its "
                        f"parameters compute only that model; leave {key} out to evaluate it")


def load(options: EvalOptions, overrides: Sequence[str]) -> Loaded:
    """Load `checkpoint=PATH` (else `train.run_dir=RUN`), step `options.step` or the latest."""
    key = "checkpoint" if options.checkpoint else "train.run_dir"  # what the user named it by
    run_dir = _last_override(overrides, "train.run_dir")
    if options.checkpoint and run_dir is not None:  # checkpoint= would win without a word
        raise EvalError(f"checkpoint={options.checkpoint} and train.run_dir={run_dir} both name "
                        "what to evaluate; give one of them")
    location = options.checkpoint or run_dir
    if location is None:
        raise EvalError("name what to evaluate: train.run_dir=RUN or checkpoint=PATH")
    if is_blank_path(str(location)):
        raise EvalError(f"{key}={location}: empty; name a run directory (or checkpoint=PATH)")
    path = Path(str(location)).expanduser().resolve()
    if not path.exists():
        raise CheckpointError(f"{key}={location}: {path} does not exist")
    location = locate(path)
    if location is None:
        raise CheckpointError(f"{key}={path}: neither a run directory nor an export; "
                              f"expected {LOADABLE}")
    mesh, rules = eval_mesh(overrides)
    if location.export is not None:
        return _load_export(path, key, options, overrides, mesh, rules)
    step = options.step
    if location.step is not None:
        if step is not None and step != location.step:
            raise EvalError(f"step={step} contradicts {key}={path}")
        step = location.step
    run_dir = location.run_dir  # `restore_inference` names what is missing
    # A relative run_dir saved in the config would resolve against the current directory.
    overrides = [*overrides, f"train.run_dir={run_dir}"]
    config: list[Config] = []

    def target(saved: dict) -> Any:
        config.append(from_dict(apply_overrides(_eval_mesh_section(saved), overrides)))
        try:
            trained = from_dict(saved).model
        except ConfigError:  # a config of an older diff-jax: its shapes are checked after this
            trained = None
        if trained is not None:
            _check_same_model(trained, config[0].model, f"{key}={path}")
        _use_compile_cache(config[0])  # before the parameters' checksums compile
        model = config[0].model  # read in the layout it was saved in (model.scan_layers)
        if trained is not None:
            model = dataclasses.replace(model, scan_layers=trained.scan_layers)
        return abstract_params(model, mesh, rules)

    def ask_for(other: int) -> str:  # a step directory's name would contradict step=N
        way = (f"{key}={run_dir / 'checkpoints' / str(other)}" if location.step is not None
               else f"step={other}")
        return f"evaluate the newest with {way}"

    named = step is not None  # step=N or a step directory, not whichever step is the latest
    step, _, params, training_data = checkpoint.restore_inference(run_dir, step, target, ask_for)
    params = _placed(params, config[0], mesh)
    # a named step's results beside, not over, the latest step's (which a rerun would replace)
    default = run_dir / EVAL_DIR / f"step-{step}" if named else run_dir / EVAL_DIR
    out_dir = Path(options.out_dir) if options.out_dir else default
    return Loaded(config[0], params, f"{run_dir}/checkpoints/{step}", step, out_dir,
                  trained_tokenizer=recorded_identity(training_data), mesh=mesh)


def _load_export(path: Path, key: str, options: EvalOptions, overrides: Sequence[str],
                 mesh: Mesh | None, rules: Rules) -> Loaded:
    """An export directory (`diff_jax.export.sources`), named by the argument `key`: its model
    config and parameters (placed on `mesh` by `rules`: `eval_mesh`), its run's data section,
    train.seed and train.seq_len where recorded (so the held-out split is the run's), the rest
    the defaults; the overrides on top."""
    try:
        source = read_source(path, mesh, rules)
    except (OSError, ExportError) as e:
        raise CheckpointError(f"{key}={path}: {e}") from e
    if options.step not in (None, source.step):  # an export holds one step's parameters
        of = f" of step {source.step}" if source.step is not None else ""
        raise EvalError(f"step={options.step}: {key}={path} is an export{of}, which holds no "
                        "other step; evaluate the run's step with train.run_dir=RUN "
                        f"step={options.step}, or leave step out")
    # Without the run's train.seq_len the default evaluation length must fit the model.
    seq_len = min(TrainConfig().seq_len, source.config.max_seq_len)
    saved = Config(model=source.config, train=TrainConfig(seq_len=seq_len)).to_dict()
    for section, values in (source.run or {}).items():
        saved[section].update(values)
    try:
        from_dict(saved)  # what the export recorded must make a config by itself
    except ConfigError as e:
        raise CheckpointError(f"{key}={path}: the run's config recorded in export.json: {e}") from e
    config = from_dict(apply_overrides(saved, overrides))
    _check_same_model(source.config, config.model, f"{key}={path}")
    _use_compile_cache(config)
    target = abstract_params(config.model)
    params = _placed(source.params, config, mesh)
    checkpoint.check_shapes(checkpoint.tree_shapes(params), checkpoint.tree_shapes(target),
                            f"{key}={path}: ")
    out_dir = Path(options.out_dir) if options.out_dir else path / EVAL_DIR
    note = None
    if "train" not in (source.run or {}):
        note = ("the export records no data section of its run (written before exports did, or "
                "imported): the held-out text is the split that data.* as given here draws, "
                "not necessarily documents the model never trained on")
    return Loaded(config, params, str(path), source.step, out_dir, note, source.trained_tokenizer,
                  mesh)
