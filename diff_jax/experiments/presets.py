"""Sizes of the replication runs: one shared recipe per preset, three parameter-matched models.

Every model of a preset gets the same data, token budget, optimizer and schedule (the `shared`
overrides); only the attention differs. DIFF V1 has H differential heads (component width
E/(2H)), the Transformer 2H heads of width E/(2H) (the paper's pairing), and DIFF V2 H output
heads whose head width and kv heads are chosen by `diff_jax.variants.v2_shape` to match DIFF V1's
attention parameters as closely as possible. `check_matched` verifies the totals with
`diff_jax.summary`.
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path
from typing import Self

import numpy as np

from diff_jax import variants
from diff_jax.config import Config, DataConfig, load_config
from diff_jax.summary import summarize

VARIANTS = ("diff", "diff_v2", "transformer")
LABELS = {"diff": "DIFF V1", "diff_v2": "DIFF V2", "transformer": "Transformer"}
PARAM_TOLERANCE = 0.005  # the issue's ±0.5%


# What shaped the prepared corpus and a `tokens` source does not read, at its default in each
# run's config: the corpus holds the mixture, and config.yaml should not say otherwise.
CORPUS_ONLY = tuple(f"data.{name}={json.dumps(getattr(DataConfig(), name))}"
                    for name in ("mixture_tokens", "niah_tokens", "niah_doc_tokens", "text_field"))
INITS = ("scaled", "normal")  # `model.output_init`: see `diff_jax.layers.residual_out_std`


def model_overrides(variant: str, embed_dim: int, num_layers: int, diff_heads: int) -> list[str]:
    """The `model.*` overrides of `variant` at the preset's shape: its heads matched to DIFF V1
    with H = `diff_heads` heads (`diff_jax.variants.Variant.matched_heads`)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    heads = variants.spec(variant).matched_heads(embed_dim, diff_heads)
    return [f"model.variant={variant}", f"model.embed_dim={embed_dim}",
            f"model.num_layers={num_layers}", *(f"model.{k}={v}" for k, v in heads.items())]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What every preset fixes: the model shape, the shared training overrides, the inits the
    comparison runs under, the default number of seeds and the budget it is sized for."""

    name: str
    embed_dim: int
    num_layers: int
    diff_heads: int  # H: DIFF V1 heads; the Transformer gets 2H, DIFF V2 H output heads
    shared: tuple[str, ...]  # `section.key=value` overrides given to every model
    inits: tuple[str, ...]  # `model.output_init` values; the first is the preset's own
    seeds: int  # default number of seeds
    budget: str  # what it is sized for, in words

    def overrides(self, variant: str, seed: int, run_dir: Path, init: str | None = None) -> list[str]:
        """The train.py overrides of `variant` at `seed` under `init` (None: the preset's own),
        writing to `run_dir` (OUT/runs/NAME), reading the seed's corpus as the replication
        prepared it once for all its models (OUT/data/corpus-sSEED: `corpus_dir`) and sharing
        compiled programs with the other runs (OUT/compile_cache: `compile_cache_dir`)."""
        init = self.inits[0] if init is None else init
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        return [*self.shared, *model_overrides(variant, self.embed_dim, self.num_layers,
                                               self.diff_heads),
                f"model.output_init={init}", f"train.seed={seed}", f"train.run_dir={run_dir}",
                "data.mixture=null", "data.source=tokens", *CORPUS_ONLY,
                f"data.paths=[{corpus_dir(run_dir.parent.parent, seed)}]",
                f"train.compile_cache_dir={compile_cache_dir(run_dir.parent.parent)}"]

    def corpus_config(self, seed: int) -> Config:
        """The config whose `data` section names the corpus of `seed` (the `shared` overrides and
        the seed, before `overrides` points the runs at the prepared copy)."""
        return load_config(None, [*self.shared, f"train.seed={seed}"])

    def config(self, variant: str, seed: int, run_dir: Path, init: str | None = None,
               sets: tuple[str, ...] = ()) -> Config:
        """The full `Config` of `overrides(variant, seed, run_dir, init)`, then `sets` (an
        ablation's `section.key=value` changes)."""
        return load_config(None, [*self.overrides(variant, seed, run_dir, init), *sets])

    @property
    def seq_len(self) -> int:
        """The training sequence length (`train.seq_len`) of every model of the preset."""
        return self.config("diff", 0, Path("unused")).train.seq_len

    @property
    def steps(self) -> int:
        """The training steps (`train.steps`) of every model of the preset."""
        return self.config("diff", 0, Path("unused")).train.steps

    def with_steps(self, steps: int) -> Self:
        """This recipe with every model trained `steps` steps (`replicate --steps`: is a
        difference a matter of budget?); the learning-rate schedule stretches with them, the
        rest (shapes, data, optimizer, evaluation) stays. Its `budget` says so."""
        if steps == self.steps:
            return self
        return dataclasses.replace(
            self, shared=(*self.shared, f"train.steps={steps}", *self._kept_checkpoints(steps)),
            budget=f"train.steps={steps:,} instead of the preset's {self.steps:,} (--steps); "
                   f"the preset is sized for {self.budget}")

    def _kept_checkpoints(self, steps: int) -> tuple[str, ...]:
        """Overrides that keep the checkpoints the evaluation of `steps` steps reads."""
        return ()


@dataclasses.dataclass(frozen=True)
class Preset(Recipe):
    """A language-modeling replication: held-out loss and the paper's Tables 2, 3, 5, Figure 8."""

    niah_grid: tuple[tuple[int, int], ...]  # (needles N, queried R) per Table 2 column
    niah_lengths: tuple[int, ...]  # context lengths; the last is beyond train.seq_len
    depths: tuple[int, ...]  # answer-needle depths in percent
    samples: int  # niah / attention samples per (depth, length) cell
    attention_needles: int  # N for Table 3
    quant_niah: tuple[int, int]  # (N, R) of the niah accuracy measured per bit width
    eval_batches: int  # held-out batches (of 4 rows) for ppl and quant
    outlier_tokens: int


@dataclasses.dataclass(frozen=True)
class RecallPreset(Recipe):
    """An associative-recall comparison (`diff_jax.recall`): trained on recall samples of
    `train.seq_len − 1` tokens (one sample a row), evaluated on a difficulty grid.

    Training samples (`recall.training_samples`): pairs uniform in 1..max_pairs, a distractor
    share uniform over `train_distractors`, train.steps · train.batch_size of them, from the
    seed's own stream; `train_loss` says which of their targets count in the loss
    (`recall.write_training_corpus`). Grid: every (pairs, distractor share) cell
    at every length, `samples` samples each, all non-distractor pairs queried. Learning curve:
    accuracy on `curve_cell` at the training length at every checkpoint (every
    checkpoint.every_steps steps); "steps to 90%" is the first such step at or above 0.9.
    """

    max_pairs: int
    train_distractors: tuple[float, ...]
    grid_cells: tuple[tuple[int, float], ...]  # (pairs N, distractor share)
    grid_lengths: tuple[int, ...]  # sample lengths; the first is the training length
    samples: int
    curve_cell: tuple[int, float]  # (pairs, distractor share)
    train_loss: str  # "queries": only the query part is a training target; "all": every token

    def _kept_checkpoints(self, steps: int) -> tuple[str, ...]:
        """The learning curve evaluates every checkpoint: keep them all."""
        every = self.config("diff", 0, Path("unused")).checkpoint.every_steps
        return (f"checkpoint.keep={-(-steps // every)}",)


def preset_args(name: str, steps: int | None) -> str:
    """'--preset NAME', with ' --steps N' where `steps` is given and not the preset's own
    (`Recipe.with_steps`)."""
    own = PRESETS[name].steps if name in PRESETS else None
    return f"--preset {name}" + ("" if steps in (None, own) else f" --steps {steps}")


def replicate_command(preset: Recipe, seeds: int) -> str:
    """The command that replicates `preset` over `seeds` seeds under its inits (for a report to
    name: `--inits` where they are not all of the named preset's)."""
    own = PRESETS[preset.name].inits if preset.name in PRESETS else preset.inits
    inits = "" if tuple(preset.inits) == tuple(own) else f" --inits {','.join(preset.inits)}"
    return (f"python -m diff_jax.experiments.replicate {preset_args(preset.name, preset.steps)} "
            f"--seeds {seeds}{inits}")


def corpus_dir(out: Path, seed: int) -> Path:
    """Where a replication in `out` keeps the prepared corpus of `seed` (a recall preset's
    training samples, or a language-modeling preset's whole corpus, validation documents
    included)."""
    return out / "data" / f"corpus-s{seed}"


def compile_cache_dir(out: Path) -> Path:
    """The compilation cache that a replication's runs share (`train.compile_cache_dir`): the
    seeds and inits of one model compile the same programs, so all but the first read them."""
    return out / "compile_cache"


def niah_whole_fraction(doc_tokens: int, seq_len: int) -> float:
    """Expected share of the synthetic retrieval documents that a training row holds whole.

    `niah.training_documents` draws lengths l uniform in [doc_tokens/2, doc_tokens]; a row is a
    window over the document stream (`data.pipeline`), so a document starts at a uniform offset
    and lies whole in a row (its first token an input, its last a target) at L − l + 2 of the L
    offsets. The others are split across rows, and the part holding the question often lacks
    the queried needle.
    """
    lengths = np.arange(doc_tokens // 2, doc_tokens + 1)
    return float(np.mean(np.clip((seq_len - lengths + 2) / seq_len, 0.0, 1.0)))


def check_matched(preset: Preset) -> dict[str, dict]:
    """`diff_jax.summary` of each variant; raises ValueError unless the totals agree within ±0.5%."""
    summaries = {v: summarize(preset.config(v, 0, Path("unused"))) for v in VARIANTS}
    ref = summaries["diff"]["params"]
    for v, s in summaries.items():
        if abs(s["params"] - ref) > PARAM_TOLERANCE * ref:
            raise ValueError(f"{preset.name}: {v} has {s['params']:,} parameters, DIFF V1 "
                             f"{ref:,}: more than {PARAM_TOLERANCE:.1%} apart")
    return summaries


def _shared(*, steps: int, batch: int, seq_len: int, max_seq_len: int, lr: float, warmup: int,
            eval_every: int, log_every: int, data: tuple[str, ...], vocab_size: int = 100_288,
            eval_tokens: int = 32_768) -> tuple[str, ...]:
    """The overrides every model of a preset shares (`vocab_size` must cover `data.tokenizer`'s
    ids; `eval_tokens` are the held-out tokens of each periodic validation)."""
    return (
        f"model.vocab_size={vocab_size}", f"model.max_seq_len={max_seq_len}", "model.dtype=float32",
        f"train.steps={steps}", f"train.batch_size={batch}", f"train.seq_len={seq_len}",
        f"train.eval_every={eval_every}", f"train.eval_tokens={eval_tokens}",
        f"train.log_every={log_every}",
        f"checkpoint.every_steps={eval_every}", "checkpoint.keep=1",
        f"optim.lr={lr}", f"optim.min_lr={lr / 10}", f"optim.warmup_steps={warmup}",
        "optim.b1=0.9", "optim.b2=0.98", "optim.weight_decay=0.05", "optim.schedule=linear",
        *data)


def _installed_packages() -> str:
    """The text and Python sources (.py, .txt, .md) of the packages installed in this
    interpreter's site-packages on the machine that runs the preset (`gpu-medium`'s corpus,
    tokenized there), as `data.paths` globs: named by kind, so that the corpus stays what it
    says whatever other data files the packages ship (botocore's .json.gz, which read as JSON
    Lines, or a .zst that would need zstandard)."""
    root = sysconfig.get_paths()["purelib"]
    return ",".join(f"{root}/**/*{kind}" for kind in (".py", ".txt", ".md"))


def _micro_text() -> str:
    """A few small standard-library modules (the `json` package): quick to tokenize."""
    return str(Path(json.__file__).parent)


PRESETS: dict[str, Preset | RecallPreset] = {
    "micro": Preset(
        name="micro", embed_dim=32, num_layers=2, diff_heads=2,
        shared=_shared(steps=4, batch=8, seq_len=64, max_seq_len=128, lr=3e-3, warmup=1,
                       eval_every=4, log_every=1, eval_tokens=2048,
                       data=("data.mixture=files:0.5,niah:0.5", f"data.paths=[{_micro_text()}]",
                             "data.niah_doc_tokens=384", "data.validation_fraction=0.1")),
        niah_grid=((1, 1), (2, 2)), niah_lengths=(64, 128), depths=(0, 50, 100), samples=1,
        attention_needles=2, quant_niah=(1, 1), eval_batches=1, outlier_tokens=128, seeds=1,
        inits=("scaled",),
        budget="the CI smoke test: a few steps, tiny shapes, < 2 minutes for the whole pipeline"),
    "cpu-small": Preset(
        name="cpu-small", embed_dim=128, num_layers=4, diff_heads=2,
        shared=_shared(steps=300, batch=16, seq_len=256, max_seq_len=512, lr=3e-3, warmup=30,
                       eval_every=100, log_every=10, vocab_size=4097,
                       data=("data.tokenizer=cl100k_first_4096", "data.mixture=stdlib:0.5,niah:0.5",
                             "data.niah_doc_tokens=576", "data.validation_fraction=0.05")),
        niah_grid=((1, 1), (2, 2), (4, 2)), niah_lengths=(256, 512),
        depths=(0, 25, 50, 75, 100), samples=4, attention_needles=4, quant_niah=(2, 2),
        eval_batches=8, outlier_tokens=2048, seeds=3, inits=INITS,
        budget="2 CPU cores: 76 minutes measured for the three seeds of the three models under "
               "both inits, one model at a time, with test runs on the cores part of the time "
               "(193–327 s of training and 19–41 s of evaluation each), 1,228,800 training "
               "tokens per model"),
    "cpu-recall": RecallPreset(
        name="cpu-recall", embed_dim=128, num_layers=2, diff_heads=2,
        shared=_shared(steps=3000, batch=32, seq_len=33, max_seq_len=128, lr=2e-3, warmup=50,
                       eval_every=0, log_every=50, vocab_size=128,
                       data=("data.validation_fraction=0",
                             "checkpoint.every_steps=300", "checkpoint.keep=10")),
        inits=INITS, seeds=3, max_pairs=5, train_distractors=(0.0, 0.25, 0.5),
        grid_cells=((1, 0.0), (2, 0.0), (2, 0.5), (4, 0.0), (4, 0.5)), grid_lengths=(32, 64, 128),
        samples=64, curve_cell=(2, 0.0), train_loss="queries",
        budget="2 CPU cores with --jobs 2: 46 minutes measured for all 18 models (3 variants × "
               "3 seeds × 2 inits; a niced test run shared the cores for most of it); 257–310 s "
               "of training and 15–20 s of evaluation per model on its one core"),
    "gpu-medium": Preset(
        name="gpu-medium", embed_dim=768, num_layers=12, diff_heads=6,
        shared=_shared(steps=1500, batch=32, seq_len=1024, max_seq_len=2048, lr=1e-3,
                       warmup=150, eval_every=500, log_every=20, eval_tokens=262_144,
                       data=("data.mixture=files:0.75,niah:0.25", "data.mixture_tokens=64000000",
                             f"data.paths=[{_installed_packages()}]", "data.niah_doc_tokens=512",
                             "data.validation_fraction=0.01", "data.read_threads=8",
                             "model.dtype=bfloat16", "model.attention_impl=auto")),
        niah_grid=((1, 1), (2, 2), (4, 2), (6, 2)), niah_lengths=(1024, 2048),
        depths=(0, 25, 50, 75, 100), samples=10, attention_needles=4, quant_niah=(4, 2),
        eval_batches=32, outlier_tokens=16384, seeds=3, inits=INITS,
        budget="one H100, per seed and init: 49.2M training tokens per model, each read once, "
               "of a 64M-token mixture: the text and Python sources of the machine's own "
               "installed packages (site-packages, tokenized there) and a quarter synthetic "
               "needles (here, 2 CPU cores: 76M tokens of site-packages .py, .txt and .md in "
               "19,167 files, read and tokenized in 32 s); at the 33.5% "
               "MFU of benchmarks/results/train_step_h100 (the Triton kernel's; on Hopper `auto` "
               "now runs the Mosaic GPU one; 1.03 GFLOP a token) about 2.6 minutes "
               "of training a model, 8 for the three, 11–13 with the corpus and evaluation (an "
               "estimate: not yet run)"),
}
