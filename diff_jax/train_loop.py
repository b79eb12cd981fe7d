"""The training loop: distributed set-up, mesh, data, state (init or resume), jitted steps, logging.

`run(config)` is what `python train.py` calls. It resumes from the newest checkpoint in
`<train.run_dir>/checkpoints` that verifies (or `checkpoint.resume_step`), saves every
`checkpoint.every_steps`, at the end and on SIGTERM/SIGINT/SIGHUP (the current step finishes
first; in a multi-process job every process saves the step they agree on, `peers.AgreedStop`).
A step is saved only when its loss, its updated parameters and optimizer state, and the loss of
the updated parameters on the step's batch are all finite; otherwise the run stops without saving,
naming the last good checkpoint. `config.yaml` is written (whole or not at all) only once the
resume checks pass, and `metrics.jsonl` rows beyond the step resumed from are dropped (they are
run again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from diff_jax import checkpoint, data, optim, peers
from diff_jax.command import (EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NON_FINITE, failed,
                              let_go, not_ignored, off_the_terminal)
from diff_jax.config import (Config, ConfigError, DistributedConfig, TrainConfig, dump_config,
                             from_dict)
from diff_jax.data.heldout import HeldOut
from diff_jax.data.tokenizer import encoding, identity
from diff_jax.device_memory import DeviceMemoryError, devices_here, fit_or_explain, train_advice
from diff_jax.export.init_from import initial_params, starting_point
from diff_jax.metrics import MetricsWriter, Progress, mfu
from diff_jax.file_errors import describe
from diff_jax.output_dir import write_whole
from diff_jax.platforms import use_compile_cache
from diff_jax.sharding import ShardingError, check_process_rows, make_mesh
from diff_jax.step import TrainState, build_steps
from diff_jax.summary import flops_per_token


LOCK_FILE = "train.lock"  # in train.run_dir: held by the training process while it runs


class NonFiniteLossError(RuntimeError):
    """The loss or the updated state became NaN/inf; the run stopped without saving that step."""


# What a training command reports in one line instead of a traceback (`report`).
BAD_INPUT = (ConfigError, data.DataError, ShardingError, checkpoint.CheckpointError,
             DeviceMemoryError)
RUN_ERRORS = (*BAD_INPUT, OSError, NonFiniteLossError)


def report(error: BaseException, named: list[tuple[str, str]]) -> int:
    """Print `error` (one of `RUN_ERRORS`) as one `error:` line on stderr and return the exit
    status: 2 bad input (a model or batch that does not fit the devices' memory too; a file-system
    error labelled by the user's path it concerns, `file_errors.describe` over `named`), 1 a run
    that diverged. Checkpoints already saved are complete either way."""
    text = describe(error, named) if isinstance(error, OSError) else str(error)
    checkpoint.quiet_abandoned_io()  # the process exits next: this line stays the last
    return failed(text, exit_status(error))


def exit_status(error: BaseException) -> int:
    """The status `train.py` exits with after `error` escaped `run`: `report`'s for
    `RUN_ERRORS`, 130 for Ctrl-C, else 1 (Python's, after the traceback)."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, NonFiniteLossError):
        return EXIT_NON_FINITE
    return EXIT_BAD_INPUT if isinstance(error, RUN_ERRORS) else 1


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How a `run` call ended: the step reached, why it stopped, and its last loss."""

    step: int  # optimizer steps done (the latest checkpoint's step)
    status: str  # "done" | "interrupted" (signal) | "already done"
    loss: float | None  # the loss of the last step this invocation ran


def initialize_distributed(cfg: DistributedConfig) -> None:
    """`jax.distributed.initialize`: explicit from `distributed.*`, else auto-detected (TPU pods,
    SLURM, …), else single-process, with `distributed.heartbeat_timeout_s`, and stopped in one
    line where the job's processes have not all connected within
    `distributed.initialization_timeout_s` (`peers.connected_within`). Must run before any other
    JAX call."""
    timeouts = dict(heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
                    initialization_timeout=cfg.initialization_timeout_s + peers.CONNECT_MARGIN_S)
    with peers.connected_within(cfg.initialization_timeout_s):
        if cfg.coordinator is not None:
            try:
                jax.distributed.initialize(coordinator_address=cfg.coordinator,
                                           num_processes=cfg.num_processes,
                                           process_id=cfg.process_id, **timeouts)
            except ValueError as e:  # e.g. no num_processes and no cluster to read it from
                raise ConfigError(f"distributed.coordinator={cfg.coordinator}: {e} (set distributed"
                                  ".num_processes=N and distributed.process_id=I)") from e
            return
        try:
            jax.distributed.initialize(**timeouts)
        except ValueError as e:  # no cluster detected: a single process
            if "coordinator_address" not in str(e):
                raise
        except RuntimeError as e:  # JAX already in use in this process (a library caller): keep it
            if "must be called before" not in str(e):
                raise


STOP_AT_ONCE = "SIGINT again"  # in `_stop_signals`' list: Ctrl-C was pressed a second time


@contextlib.contextmanager
def _stop_signals(say: Callable[[str], None]) -> Iterator[list[str]]:
    """Catches SIGTERM/SIGINT/SIGHUP/SIGPIPE into a flag list for the duration (main thread
    only), saying what happens next. A SIGHUP (the terminal closed) is a SIGTERM, once stdout
    and stderr are off the hung-up terminal (`off_the_terminal`), where the lines that follow
    failed with EIO; before it was caught here Python's default action ended the run at once
    (exit -1), losing every step since the last periodic save. A SIGPIPE (`command.unread`: the
    progress line's write failed, the reader of `2>&1 | head` gone) is a SIGTERM too, once the
    pipe is let go of (`command.let_go`): the write's BrokenPipeError ended the run with exit 1,
    nothing saved (measured: `train.py 2>&1 | head -3`, metrics up to step 3, no checkpoint).
    One where neither stdout nor stderr lost its reader since (another pipe's, or the kernel's
    for the same write, taken already) changes nothing. A second SIGINT (Ctrl-C pressed again)
    raises KeyboardInterrupt at once: the step in flight is not saved, a save already handed to orbax's writer still commits (closing
    the checkpoint manager waits for it; one cut inside the save call itself is dropped), and the
    checkpoints already committed stay as they are. It also
    appends `STOP_AT_ONCE`, which the loop raises on where Python swallowed the handler's
    exception (a handler that runs inside a gc callback, such as jax's, only prints it)."""
    caught: list[str] = []

    def handler(signum: int, _frame: Any) -> None:
        off_the_terminal(signum)
        if signum == signal.SIGPIPE and not let_go():
            return
        if signum == signal.SIGINT and caught:
            caught.append(STOP_AT_ONCE)
            raise KeyboardInterrupt
        caught.append(signal.Signals(signum).name)
        say(f"{caught[0]} received: finishing the step in flight, then saving it and exiting"
            + (" (Ctrl-C again stops without saving the step in flight; a save already handed "
               "to the checkpoint writer completes first)" if signum == signal.SIGINT
               else ""))

    previous = {s: signal.signal(s, handler)
                for s in not_ignored((signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                      signal.SIGPIPE))}
    try:
        yield caught
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _claim_run_dir(run_dir: str, main: bool) -> Iterator[None]:
    """Hold an exclusive lock on `run_dir/train.lock` (process 0; created with the directory)
    for the duration, or raise ConfigError naming the process that holds it: two trainers in
    one run directory would overwrite each other's checkpoints and metrics. The kernel drops
    the lock when its holder exits, even on SIGKILL."""
    if not main:
        yield
        return
    path = Path(run_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise ConfigError(f"train.run_dir={run_dir} is in use by another training process "
                              f"(pid {holder}); wait for it to end or choose another "
                              "train.run_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield  # closing the file releases the lock


def _recorded(config: Config) -> Config:
    """The config as `config.yaml` records it: without the one-off resume choices
    (`checkpoint.resume_step`, `checkpoint.discard_later`), so re-running from the record
    resumes from the newest step instead of deleting checkpoints again."""
    return dataclasses.replace(config, checkpoint=dataclasses.replace(
        config.checkpoint, resume_step=None, discard_later=False))


def _changes(before: Any, after: Any, prefix: str, keys: Iterable[str] | None = None) -> list[str]:
    """`prefix.key before → after` for each field of the dataclasses `before` and `after` (or
    of `keys`) that differs."""
    names = keys if keys is not None else [f.name for f in dataclasses.fields(after)]
    return [f"{prefix}.{k} {getattr(before, k)!r} → {getattr(after, k)!r}" for k in names
            if getattr(before, k) != getattr(after, k)]


def resume_notes(saved: dict, config: Config, step: int, data_then: dict | None = None,
                 data_now: dict | None = None) -> list[str]:
    """Lines that say how `config` differs from `saved` (the config dict checkpoint `step` was
    written with) where the difference changes what the resumed steps do, since the checkpoint
    holds a data position and an optimizer step count, not the settings they count in: the data
    order (`train.batch_size`, `seq_len`, `seed`, the `data.*` the sources read, but not
    `data.read_threads` or `prefetch`), the training split's contents under the same settings
    (`data_then`, the fingerprint the step was saved with, None for a step that predates it,
    against `data_now`: files edited or a corpus prepared again), the layers' layout
    (`model.scan_layers`, which `checkpoint.restore` converted) and the learning-rate schedule
    and optimizer (`train.steps`, `optim.*`). Empty when they agree (or `saved` does not
    parse)."""
    try:
        old = from_dict(saved)
    except ConfigError:
        return []
    notes = []
    read = [f.name for f in dataclasses.fields(config.data)  # what decides the rows' order
            if f.name not in (*config.data.READING, *config.data.unused())
            and not (f.name == "tokenizer" and _tokenizer_moved(data_then, data_now))]
    data_order = (_changes(old.train, config.train, "train", ("batch_size", "seq_len", "seed"))
                  + _changes(old.data, config.data, "data", read))
    if data_order:
        notes.append(f"resumed with other data settings than step {step} was saved with "
                     f"({', '.join(data_order)}): the saved data position counts in the old "
                     "order, so the rows from here differ from an uninterrupted run's under either "
                     "setting (documents may repeat or be skipped)")
    elif data_then is not None and data_now is not None and _data_differs(data_then, data_now):
        cause = ("the tokenizer changed" if _tokenizer_changes(data_then, data_now)
                 else "the sources' contents changed")
        notes.append(f"resumed on other training data than step {step} was saved with, under the "
                     f"same data settings ({_data_change(data_then, data_now)}): {cause}, so the "
                     "saved data position counts rows of the old split and the rows from here "
                     "differ from an uninterrupted run's (documents may repeat or be skipped)")
    if old.model.scan_layers != config.model.scan_layers:
        now = "stacked for the scan" if config.model.scan_layers else "sliced into one per layer"
        notes.append(f"resumed with model.scan_layers={str(config.model.scan_layers).lower()}, "
                     f"where step {step} was saved with "
                     f"{str(old.model.scan_layers).lower()}: its parameters and optimizer state "
                     f"were {now}; the model computes the same function (to float32 rounding)")
    schedule_changes = (_changes(old.train, config.train, "train", ("steps",))
                        + _changes(old.optim, config.optim, "optim"))
    if schedule_changes:
        lr_old = float(optim.schedule(old.optim, old.train.steps)(step))
        lr_new = float(optim.schedule(config.optim, config.train.steps)(step))
        notes.append(f"resumed with other optimizer settings than step {step} was saved with "
                     f"({', '.join(schedule_changes)}): the learning rate of step {step + 1} is "
                     f"{lr_new:.3g} (the saved run's schedule: {lr_old:.3g})")
    return notes


def _data_differs(then: Any, now: dict) -> bool:
    """Whether the training-data record `then` (a step's) and `now` differ in what both record
    (a step saved before the records held the tokenizer's keys compares the corpus's alone), but
    for the tokenizer's name: the path as given, which the data settings compare, and a
    tokenizer.json moved is the same tokenizer (`_tokenizer_moved`)."""
    if not isinstance(then, dict):
        return then != now
    return any(then[k] != now[k] for k in then.keys() & now.keys() - {"tokenizer"})


def _tokenizer_moved(then: Any, now: dict | None) -> bool:
    """Whether the training-data records `then` (a step's) and `now` name one Hugging Face
    tokenizer by two paths: its files moved, the same tokenizer.json, end- and
    beginning-of-text (`tokenizer.identity`)."""
    return (isinstance(then, dict) and now is not None
            and "tokenizer_sha256" in then.keys() & now.keys()
            and not _tokenizer_changes(then, now))


# a Hugging Face tokenizer's keys in a training-data record, as a resume note names their change
TOKENIZER_KEYS = {"tokenizer_sha256": "tokenizer.json SHA-256", "tokenizer_eot": "end-of-text id",
                  "tokenizer_prefix": "beginning-of-text ids"}


def _tokenizer_changes(then: Any, now: dict) -> list[str]:
    """`tokenizer.json SHA-256 a… → b…`, `end-of-text id c → d`, `beginning-of-text ids [e] →
    []` for each Hugging Face tokenizer key (`TOKENIZER_KEYS`) that the training-data records
    `then` (a step's) and `now` both hold and that differs."""
    if not isinstance(then, dict):
        return []
    changes = []
    for key, name in TOKENIZER_KEYS.items():
        if key in then and key in now and then[key] != now[key]:
            was, is_ = then[key], now[key]
            if key == "tokenizer_sha256":
                was, is_ = f"{str(was)[:12]}…", f"{str(is_)[:12]}…"
            changes.append(f"{name} {was} → {is_}")
    return changes


def _data_change(then: dict, now: dict) -> str:
    """`documents a → b, tokens c → d, SHA-256 e… → f…` of two training-data records (the
    counts only where they differ; then the tokenizer's keys that both record and that changed:
    `_tokenizer_changes`); a record of another form is named as it is."""
    try:
        parts = [f"{k} {then[k]:,} → {now[k]:,}" for k in ("documents", "tokens")
                 if then[k] != now[k]]
        parts.append(f"SHA-256 {then['sha256'][:12]}… → {now['sha256'][:12]}…")
        return ", ".join(parts + _tokenizer_changes(then, now))
    except (KeyError, TypeError, ValueError):
        return f"recorded {then!r}"


def _global(local: data.Batch, sharding: NamedSharding) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def _check_vocab_size(config: Config, data_vocab_size: int | None) -> None:
    """A ConfigError unless the model's embedding has a row for every id of the data (None:
    not known yet)."""
    if data_vocab_size is not None and data_vocab_size > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {config.model.vocab_size} is smaller than the "
                          f"data's vocabulary ({data_vocab_size} ids)")


def run(config: Config) -> RunResult:
    """Train (or resume) `config` to `train.steps`. Raises `DeviceMemoryError` where the model
    or the step does not fit in device memory; the checkpoints already committed are kept. In a
    multi-process job an error here stops the other processes too (`peers.stop_together`)."""
    initialize_distributed(config.distributed)
    advice = train_advice(config, "the training run", devices_here()) + (
        f"; train.compile_only=true reports the step's memory per device; the checkpoints already "
        f"committed in {config.train.run_dir}/checkpoints are kept")
    with peers.stop_together(exit_status), fit_or_explain(advice):
        return _run(config)


def _run(config: Config) -> RunResult:
    """`run` past the distributed set-up."""
    t = config.train
    use_compile_cache(t.compile_cache_dir)
    main = jax.process_index() == 0
    progress = Progress(t.steps, main)
    progress.message(f"run directory: {Path(t.run_dir).resolve()}")
    _check_vocab_size(config, data.known_vocab_size(config.data))  # before tokenizing anything
    # fine-tuning's parameters, read and checked (their model, their tokenizer) before any data
    # is read, so that a refusal does not wait for a corpus to be tokenized; not where the run
    # has checkpoints, whose resume ignores them
    start_from = (starting_point(t.init_from, config.model, config.data.tokenizer)
                  if t.init_from is not None and not checkpoint.committed_steps(t.run_dir)
                  else None)
    steps = build_steps(config, make_mesh(config.mesh))
    # the tokenizer as the data is read with it: `encoding` reads a tokenizer.json edited while
    # a corpus is tokenized again, which the record must not name
    trained_with = identity(encoding(config.data.tokenizer))
    inputs = data.build(config.data, t.seq_len, t.batch_size, t.eval_tokens if t.eval_every else 0,
                        t.seed, jax.process_index(), jax.process_count())
    _check_vocab_size(config, inputs.corpus.vocab_size)
    # saved with every step, compared on resume; eval and export read text with its tokenizer
    training_data = {**inputs.corpus.fingerprint(), **trained_with}
    if t.eval_every and config.data.validation_fraction == 0:
        progress.message(f"train.eval_every={t.eval_every}: no validation, since "
                         "data.validation_fraction=0 holds no documents out")
    for line in config.data.unread():
        progress.message(line)
    if inputs.corpus.skipped:  # of text read now; a prepared corpus's are in its notes
        progress.message(f"data: skipped {len(inputs.corpus.skipped)} file(s) or record(s), "
                         f"first: {inputs.corpus.skipped[0]}")
    for note in inputs.corpus.notes:
        progress.message(note)
    flops = flops_per_token(config.model, t.seq_len)

    with steps.context(), _claim_run_dir(t.run_dir, main), checkpoint.quiet_interrupts():
        step_fn, eval_fn, bsh = steps.train, steps.eval, steps.batch_sharding
        check_process_rows(bsh, t.batch_size, t.seq_len)
        # closed on every way out (it waits for an async save to commit first), a refusal too
        with checkpoint.manager(t.run_dir, config.checkpoint) as mngr:
            resumed, state, saved = checkpoint.resume(mngr, config.checkpoint, steps.abstract,
                                                      inputs.train, config.model, progress.message)
            if resumed is not None:
                progress.message(f"resumed from step {resumed} ({t.run_dir}/checkpoints)")
                if t.init_from is not None:  # a run's checkpoints win over its starting point
                    progress.message(f"train.init_from={t.init_from} ignored: resuming from step "
                                     f"{resumed}")
                if resumed < t.steps:  # a finished run changes nothing: no notes on what changes
                    for note in resume_notes(saved["config"], config, resumed,
                                             saved["training_data"], training_data):
                        progress.message(note)
            else:
                state = steps.init(jax.random.PRNGKey(t.seed))
                if t.init_from is not None:  # fine-tuning: parameters from an export or another run
                    state = state.replace(params=initial_params(
                        t.init_from if start_from is None else start_from, config.model,
                        steps.shardings.params, config.data.tokenizer))
                    progress.message(f"parameters initialized from {t.init_from}")
            start_from = None  # the state's parameters now: not held through training
            start = resumed or 0
            if start >= t.steps:  # the run's record stays as it was
                progress.message(f"already at step {start} >= train.steps={t.steps}; nothing to do")
                return RunResult(start, "already done", None)
            if main:  # only now: a refused resume leaves the run's record as it was
                write_whole(Path(t.run_dir) / "config.yaml", dump_config(_recorded(config)))
            writer = MetricsWriter(t.run_dir, main, start_step=start)
            if writer.dropped:
                progress.message(f"metrics.jsonl: dropped {writer.dropped} row(s) after step "
                                 f"{start} (those steps run again)")
            validation = [_global(b, bsh) for b in inputs.validation.batches]
            loop = _Loop(config, mngr, writer, progress, step_fn, eval_fn, validation, flops, bsh,
                         held_out=inputs.validation, training_data=training_data)
            try:
                with _stop_signals(progress.message) as caught, peers.agreed_stop() as stop:
                    result = loop.run(state, inputs.train, start, caught, stop)
            finally:
                writer.close()
            if caught and result.status == "done":  # caught after the last step's check (in
                # its save's wait, say): every step is saved, and the caller stops as for one
                # caught in training; once the handler is restored the caller's own one takes it
                progress.message(f"{caught[0]} received: saved step {result.step}, exiting")
                return dataclasses.replace(result, status="interrupted")
            return result


@dataclasses.dataclass
class _Loop:
    config: Config
    mngr: Any
    writer: MetricsWriter
    progress: Progress
    step_fn: Any
    eval_fn: Any
    validation: list[dict[str, jax.Array]]
    flops_per_token: float
    batch_sharding: NamedSharding
    held_out: HeldOut  # what the validation batches cover: counted tokens per batch, documents
    training_data: dict[str, Any]  # the training split's fingerprint, saved with each step

    def run(self, state: TrainState, it: Any, start: int, caught: list[str],
            stop: peers.AgreedStop) -> RunResult:
        """Steps start + 1 .. train.steps on the host batches of `it`: logs, validates and saves
        at boundaries; after a signal (its name appended to `caught`, or one another process of
        the job caught) saves the step `stop` agrees on and returns."""
        trace = _Trace.of(self.config.train, start, self.progress.message)
        try:
            return self._steps(state, it, start, caught, stop, trace)
        finally:  # a run that ends inside the window (signal, error) still writes its trace
            trace.stop()

    def _steps(self, state: TrainState, it: Any, start: int, caught: list[str],
               stop: peers.AgreedStop, trace: _Trace) -> RunResult:
        """The loop of `run`, tracing the steps of `trace`'s window."""
        t, ck = self.config.train, self.config.checkpoint
        tokens_per_step = t.batch_size * t.seq_len
        pending: tuple[int, Any, float] | None = None
        last_time, window = time.perf_counter(), _Window()
        loss = None
        for s in range(start + 1, t.steps + 1):
            trace.before(s)
            checkpoint.check_saves(self.mngr)  # an async save that failed stops the run now
            t0 = time.perf_counter()
            local = next(it)
            wait = time.perf_counter() - t0
            batch = _global(local, self.batch_sharding)
            state, metrics = self.step_fn(state, batch)
            done = [pending] if pending else []
            pending = (s, metrics, wait)
            boundary = (s == t.steps or s % ck.every_steps == 0 or stop.pending(caught)
                        or (t.eval_every and s % t.eval_every == 0))
            if boundary:
                done.append(pending)
                pending = None
            for step, m, w in done:
                m = jax.device_get(m)
                now = time.perf_counter()
                window.add(now - last_time, w)
                last_time = now
                loss = float(m["loss"])
                if not math.isfinite(loss):
                    self._diverged(f"loss ({loss}) at step {step}")
                # metrics rows on the log grid (and step 1), as an uninterrupted run writes
                # them; the first step after a resume updates only the progress line
                row = step % t.log_every == 0 or step == t.steps or step == 1
                if row or step == start + 1:
                    self._log(step, m, window, tokens_per_step, row=row)
            # after the previous step's metrics are read: waiting for this step first would
            # count its time as the previous step's and leave it none (tokens/s in the millions)
            trace.after(s, metrics)
            if not boundary:
                continue
            if t.eval_every and (s % t.eval_every == 0 or s == t.steps) and self.validation:
                val = self.held_out.mean([float(self.eval_fn(state.params, b))
                                          for b in self.validation])
                tokens, docs = self.held_out.tokens, self.held_out.documents
                self.writer.write({"step": s, "val_loss": val, "val_tokens": tokens,
                                   "val_documents": docs})
                self.progress.message(f"step {s}: validation loss {val:.4f} ({tokens:,} held-out "
                                      f"tokens from {docs:,} document{'s' * (docs != 1)})")
            # the handler's KeyboardInterrupt was swallowed: stop before saving (after a signal
            # every step is a boundary, so the step in flight gets here and is not saved)
            if STOP_AT_ONCE in caught:
                raise KeyboardInterrupt
            stopping = stop.reached(s, caught)
            if s % ck.every_steps == 0 or s == t.steps or stopping:
                self._check_saveable(s, state, batch)
                checkpoint.save(self.mngr, s, state, it, self.config, self.training_data)
            if stopping:
                checkpoint.wait(self.mngr)
                self.progress.message(f"{stop.why(caught)} received: saved step {s}, exiting")
                return RunResult(s, "interrupted", loss)
            # the next step's time starts here: validation and saving are not a step's time
            last_time = time.perf_counter()
        checkpoint.wait(self.mngr)  # "done" only once the last checkpoint has committed
        self.progress.message(f"done: step {t.steps}, loss {loss:.4f}")
        return RunResult(t.steps, "done", loss)

    def _check_saveable(self, step: int, state: TrainState, batch: dict[str, jax.Array]) -> None:
        """Stop (`NonFiniteLossError`) unless the state after `step` is finite and its parameters
        give a finite loss on the step's batch: the loss logged for a step is computed before its
        update, so it cannot vouch for the parameters that would be saved."""
        if not _all_finite(state):
            self._diverged(f"parameters or optimizer state after the update at step {step}")
        after = float(self.eval_fn(state.params, batch))
        if not math.isfinite(after):
            self._diverged(f"loss ({after}) of the parameters updated at step {step}")

    def _diverged(self, what: str) -> None:
        """Raise `NonFiniteLossError` for `what`, naming the last checkpoint saved (every saved
        step passed `_check_saveable`, and a resume starts from the newest one)."""
        checkpoint.wait(self.mngr)
        last = self.mngr.latest_step()
        if last is None:
            good = "no checkpoint has been saved, so there is none to resume from"
        else:
            good = (f"the last good checkpoint is step {last} (re-run with a lower optim.lr to "
                    f"resume from it, or pick an earlier one with checkpoint.resume_step=N "
                    f"checkpoint.discard_later=true)")
        raise NonFiniteLossError(f"non-finite {what}; stopped without saving it; {good}")

    def _log(self, step: int, m: dict, window: _Window, tokens_per_step: int, row: bool) -> None:
        """Update the progress line with the window's mean speed; with `row`, also write the
        step's metrics row."""
        step_time, wait = window.mean()
        tps = tokens_per_step / step_time if step_time > 0 else 0.0
        if row:
            dev = jax.devices()[0]
            record = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                      "tokens_per_sec": tps, "step_time_s": step_time, "data_wait_s": wait,
                      "mfu": mfu(self.flops_per_token, tps, dev.device_kind, jax.device_count())}
            if "lambda" in m:
                record["lambda"] = m["lambda"]
            self.writer.write(record)
        self.progress.update(step, float(m["loss"]), tps)
        window.reset()


_leaf_finite = jax.jit(lambda x: jnp.all(jnp.isfinite(x)))  # compiled once per shape and sharding


def _all_finite(state: TrainState) -> bool:
    """Every floating-point value of the parameters and optimizer state is finite (one array at
    a time: many collective programs in flight at once can deadlock XLA's CPU collectives)."""
    leaves = [x for x in jax.tree.leaves((state.params, state.opt_state))
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return all([bool(_leaf_finite(x)) for x in leaves])


@dataclasses.dataclass
class _Trace:
    """The `jax.profiler` trace of steps `first`..`last` into `directory`, clipped to the steps
    an invocation runs: it starts before the first of them this invocation runs (so a run
    resumed inside the window traces the rest of it) and stops after the last, or at `stop`
    when the loop ends sooner (the end of `train.steps`, a signal, an error)."""

    first: int
    last: int
    directory: Path
    python: bool = False  # `train.profile_python`: JAX's Python tracer too
    active: bool = False

    @classmethod
    def of(cls, t: TrainConfig, start: int, say: Callable[[str], None]) -> _Trace:
        """The window of `train.profile_start` / `profile_steps` (`t`) for an
        invocation that continues after step `start`; empty without `profile_steps`. Says so
        through `say` when the whole window was run before `start`."""
        if not t.profile_steps:
            return cls(0, -1, Path(t.run_dir) / "profile")
        first, last = t.profile_start, t.profile_start + t.profile_steps - 1
        if last <= start:
            say(f"train.profile_start={first}, profile_steps={t.profile_steps}: those steps ran "
                f"before step {start}, which this run resumes from; no trace")
        return cls(max(first, start + 1), min(last, t.steps), Path(t.run_dir) / "profile",
                   t.profile_python)

    def before(self, step: int) -> None:
        """Start tracing if `step` is the first step of the window."""
        if step == self.first and step <= self.last:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = int(self.python)
            jax.profiler.start_trace(str(self.directory), profiler_options=options)
            self.active = True

    def after(self, step: int, outputs: Any) -> None:
        """Stop tracing once `step`, the last of the window, has computed `outputs`."""
        if step == self.last:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        """Stop the trace if one is running (writing it to `directory`)."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


class _Window:
    """Mean step time and data wait since the last log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new window (after a log line)."""
        self.times: list[float] = []
        self.waits: list[float] = []

    def add(self, step_time: float, wait: float) -> None:
        """Count one step: its wall-clock seconds and the seconds it waited for data."""
        self.times.append(step_time)
        self.waits.append(wait)

    def mean(self) -> tuple[float, float]:
        """(mean step seconds, mean data-wait seconds) of the window."""
        return float(np.mean(self.times)), float(np.mean(self.waits))
