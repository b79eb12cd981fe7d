"""Shared set-up for the training tests: a synthetic token corpus and a tiny config."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diff_jax.config import Config, load_config
from diff_jax.data import TokenCorpus

VOCAB = 64
EOT = VOCAB - 1


def synthetic_corpus(num_docs: int = 120, seed: int = 0) -> TokenCorpus:
    """Documents of 5..80 tokens drawn from a few repeating patterns (learnable), EOT-terminated."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        n = int(rng.integers(5, 80))
        base = int(rng.integers(0, EOT - 8))
        docs.append(np.append((base + np.arange(n) % 8) % EOT, EOT))
    lengths = np.array([len(d) for d in docs])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return TokenCorpus(np.concatenate(docs).astype(np.uint32), starts, VOCAB)


def write_corpus(directory: Path) -> Path:
    synthetic_corpus().save(directory, {"tokenizer": "synthetic"})
    return directory


def tiny_config(corpus_dir: Path, run_dir: Path, *overrides: str) -> Config:
    return load_config(None, [
        "model.vocab_size=64", "model.embed_dim=32", "model.num_layers=2", "model.num_heads=2",
        "model.max_seq_len=64", "train.seq_len=16", "train.batch_size=8", "train.steps=30",
        "train.log_every=1", "train.eval_every=0", f"train.run_dir={run_dir}",
        "data.source=tokens", f"data.paths=[{corpus_dir}]", "data.validation_fraction=0",
        "optim.warmup_steps=5", "optim.lr=1e-2", "checkpoint.every_steps=10", "mesh.data=-1",
        *overrides,
    ])


def process_env(devices: int, **extra: str) -> dict[str, str]:
    """The environment for a JAX process a test starts that must see `devices` CPU devices (the
    pytest processes' eight, where its results are compared bit for bit with theirs; a process
    started with the session's own environment sees one): the session's XLA flags (conftest's
    LLVM level) are kept, and `extra` added."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count=")]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags), **extra)


def xla_out_of_memory() -> jax.errors.JaxRuntimeError:
    """XLA's own out-of-memory error: a 1 PiB array asked of the CPU backend, beyond the 47-bit
    address space, so it fails on any host and however Linux overcommits memory."""
    try:
        jax.block_until_ready(jnp.ones((1 << 50,), jnp.uint8))
    except jax.errors.JaxRuntimeError as e:
        return e
    raise AssertionError("a 1 PiB array was allocated")


def read_out_of_host_memory(message: str):
    """A stand-in for an orbax restore whose read ran out of host memory: Python's MemoryError
    with `message`, wrapped as orbax wraps what tensorstore raised."""
    def restore(self, *args, **kwargs):
        try:
            raise MemoryError(message)
        except MemoryError as e:
            raise Exception("Encountered error while reading array index") from e
    return restore


ROOT = Path(__file__).resolve().parents[1]


def in_a_terminal(args: list[str]) -> tuple[subprocess.Popen, int]:
    """Python run with `args` from the repository root in a session of its own whose controlling
    terminal is a new pty, its stdin, stdout and stderr; returns the process and the terminal's
    master end, which the test reads (`terminal_until`) and closes: the kernel then hangs the
    terminal up and sends SIGHUP to the session's leader, the process, as when a terminal window
    closes or an ssh session drops. Killed after 300 s (a hang guard: reading the terminal then
    fails)."""
    terminal, tty = pty.openpty()
    controlling = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    proc = subprocess.Popen([sys.executable, "-c", controlling, *args], cwd=ROOT, stdin=tty,
                            stdout=tty, stderr=tty, start_new_session=True)
    os.close(tty)
    guard = threading.Timer(300, proc.kill)
    guard.daemon = True
    guard.start()
    return proc, terminal


def terminal_until(terminal: int, pattern: bytes, proc: subprocess.Popen) -> re.Match:
    """The first match of the regular expression `pattern` in what `proc` wrote to `terminal`
    (`in_a_terminal`, or a pipe's read end), read until it appears; fails the test when `proc`
    exits first."""
    seen = b""
    try:
        while not (found := re.search(pattern, seen)):
            if not (chunk := os.read(terminal, 4096)):  # a pipe's end: the process exited
                raise EOFError
            seen += chunk
    except (OSError, EOFError):  # EIO: the process closed the terminal, exiting
        pytest.fail(f"exited {proc.wait()} before writing {pattern!r}: {seen[-3000:]!r}")
    return found


def word_tokenizer(directory: Path, template: bool, config: dict | None = None) -> Path:
    """A word-level tokenizer.json of 8 words with <s> (id 1) and </s> (id 2), whose template
    puts <s> before a text where `template` (as Llama 2's does), and a tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "answer", "is"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    if template:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": "<s>", **(config or {})}))
    return directory


# words whose pieces `sentencepiece_tokenizer` merges, after "b"+"c" first: "abc" encodes as
# "▁a" "bc", "ab" as "▁ab" — a token across the boundary of "ab" + "c"
SENTENCEPIECE_WORDS = ("▁ab", "▁the", "▁capital", "▁of", "▁is", "▁paris", "▁berlin", "▁rome",
                       "▁city", "▁print")


def sentencepiece_tokenizer(directory: Path, legacy: bool = False) -> Path:
    """A Llama-2-style tokenizer.json of 73 ids: a BPE over "▁", a-z and "(),." with merges
    that build `SENTENCEPIECE_WORDS` piece by piece, a Metaspace pre-tokenizer that puts "▁"
    before a text and for each space (so a text encoded alone begins with "▁"), <unk> (id 0),
    <s> (1) and </s> (2), and a template that puts <s> first; with a tokenizer_config.json
    naming them. `legacy`: as Llama 2's own tokenizer.json has it, a normalizer that prepends
    "▁" to every text and replaces each space with "▁", no pre-tokenizer (a text that begins
    with a space encoded alone begins "▁▁": " paris" is "▁" "▁paris")."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "▁",
                                         *"abcdefghijklmnopqrstuvwxyz(),."])}
    merges = [("b", "c")]
    for word in SENTENCEPIECE_WORDS:
        for end in range(2, len(word) + 1):
            merges.append((word[:end - 1], word[end - 1]))
            vocab.setdefault(word[:end], len(vocab))
    vocab["bc"] = len(vocab)
    merges = list(dict.fromkeys(merges))
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    if legacy:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                     normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(),
                                               decoders.Strip(" ", 1, 0)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁",
                                                           prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                             special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)  # a checkpoint's directory, say
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"}))
    return directory
