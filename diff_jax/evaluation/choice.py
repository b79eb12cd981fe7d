"""The `choice` task: zero-shot multiple choice by log-likelihood, as the paper's Table 1 scores
ARC, BoolQ, HellaSwag, OBQA, PIQA and WinoGrande (the LM Eval Harness's `acc` and `acc_norm`).

`input=ITEMS.jsonl` holds one item a line: `{"context": str, "choices": [str, ...], "label": int}`
(the index of the right choice). Each choice is scored as the sum of log p(choice tokens | context
tokens), split as the harness splits them (`choice_tokens`): the context's trailing spaces move to
the choice, context + choice is encoded whole with `data.tokenizer`, and the choice's tokens are
those after the context's own encoding (a SentencePiece tokenizer would prefix a choice encoded
alone with "▁"; a token across the boundary has the choice encoded apart, as it reads after other
text: `continuations`, the rule training's prompt/response records follow too); the context
begins with the tokenizer's beginning-of-text where it has one (`text_prefix`), and an empty
context is that alone, else end-of-text. The prediction is the choice of the highest sum
(`accuracy`) and of the highest sum per character of the choice's text (`accuracy_norm`, the
harness's `acc_norm`). The model reads at most `length` tokens of a row, as in the other tasks
and as the harness reads `max_length`: context + choice past `length` + 1 tokens (the last
choice token is read by no position) loses the context's first tokens (`contexts_cut`). An
item's context is read once, into a KV cache, and each choice is fed after it from there
(`continuation_logprobs`); items are scored `batch_size` at a time at one width, so one program
is compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diff_jax.config import ModelConfig
from diff_jax.data.tokenizer import Encoding, continuations, text_prefix
from diff_jax.evaluation.loading import Loaded, text_encoding
from diff_jax.evaluation.options import EvalError, EvalOptions, lone_surrogate
from diff_jax.evaluation.report import Report, progress
from diff_jax.evaluation.scoring import eval_length
from diff_jax.generate import decode_logits, empty_cache, prefill
from diff_jax.transformer import DecoderLM

ITEM_FORMAT = '{"context": str, "choices": [str, ...], "label": int}'


@dataclasses.dataclass(frozen=True)
class Item:
    """One question: its context's token ids, each choice's ids and characters, the answer
    (every choice's context ids are the context's own encoding: `choice_tokens`)."""

    context: tuple[int, ...]
    choices: tuple[tuple[int, ...], ...]
    chars: tuple[int, ...]  # each choice's length in characters (acc_norm's denominator)
    label: int


def read_items(path: Path, loaded: Loaded) -> list[Item]:
    """The items of the JSONL file `path` (`read_jsonl`), encoded with `data.tokenizer`; an
    `EvalError` naming the line for one that is not an item (a benchmark scored on part of its
    items would report another benchmark's accuracy)."""
    enc = text_encoding(loaded)
    items = []
    for n, record in read_jsonl(path, ITEM_FORMAT, _item_problem):
        context, choices = choice_tokens(enc, record["context"], record["choices"])
        if not all(choices):
            raise EvalError(f"input={path}:{n}: a choice adds no token after its context "
                            f"(data.tokenizer={enc.name}); expected {ITEM_FORMAT}")
        items.append(Item(tuple(context), tuple(tuple(c) for c in choices),
                          tuple(len(c) for c in record["choices"]), record["label"]))
    return items


def read_jsonl(path: Path, item_format: str,
               problem: Callable[[Any], str | None]) -> list[tuple[int, Any]]:
    """(line number, record) of each non-blank line of the JSONL file `path` (UTF-8, a
    newline after each); an `EvalError` naming `path` when it is missing or holds no record,
    or naming the line for one that is not UTF-8, not JSON, holds a string that is no Unicode
    text (`lone_surrogate`) or has a `problem`, each ending in
    "expected `item_format`"."""
    if not path.is_file():
        raise EvalError(f"input={path}: no such file; expected a .jsonl file of {item_format}")
    data = path.read_bytes()
    try:  # utf-8-sig: a leading byte-order mark (Windows editors write one) is not text
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise EvalError(f"input={path}:{line}: not UTF-8 ({e.reason} at byte {e.start}); "
                        f"expected {item_format}") from e
    records = []
    # records end at a newline (or CR LF) only, as training's JSONL records do: JSON strings may
    # hold U+2028, U+0085 and the other line boundaries of `str.splitlines` unescaped
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"input={path}:{n}: not JSON ({e.msg}); expected {item_format}") from e
        half = lone_surrogate(record)
        why = (f"not Unicode text (a lone surrogate {half}, half of a UTF-16 pair)" if half
               else problem(record))
        if why is not None:
            raise EvalError(f"input={path}:{n}: {why}; expected {item_format}")
        records.append((n, record))
    if not records:
        raise EvalError(f"input={path}: holds no item; expected one {item_format} a line")
    return records


def choice_tokens(enc: Encoding, context: str,
                  choices: Sequence[str]) -> tuple[list[int], list[list[int]]]:
    """(context ids, each choice's ids) as the LM Eval Harness splits a request: the context's
    trailing whitespace moves to the start of each choice; a choice's ids are those of the
    whole text past the context's own (`continuations`, the context encoded once and the
    choices together, on tokenizer threads); the context's ids begin with the tokenizer's
    `text_prefix`, and a context of no ids (empty, blank, or one the tokenizer drops) is
    end-of-text where there is no prefix. Where the whole's ids do not begin with the context's
    ("foo" + "bar" is one token), the choice is encoded apart, as it reads after other text, so
    that the ids scored always spell context + choice (the harness then scores ids past the
    context's count, which spell another text)."""
    stripped = context.rstrip()
    space = context[len(stripped):]
    heads, tails = continuations(enc, [stripped] * len(choices), [space + c for c in choices])
    return (text_prefix(enc) + heads[0]) or [enc.eot_token], tails


def _item_problem(record: Any) -> str | None:
    """What makes `record` no item, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    missing = [k for k in ("context", "choices", "label") if k not in record]
    if missing:
        return f"no {missing[0]!r}"
    choices, label = record["choices"], record["label"]
    if not isinstance(record["context"], str):
        return "'context' is no string"
    if not (isinstance(choices, list) and len(choices) >= 2
            and all(isinstance(c, str) and c.strip() for c in choices)):
        return "'choices' must be a list of two or more non-blank strings"
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        return f"'label' {label!r} is not the index of one of its {len(choices)} choices"
    return None


def choice_logprobs(model_cfg: ModelConfig, params: Any, items: list[Item], length: int,
                    batch_size: int) -> tuple[list[np.ndarray], int]:
    """(per item, (choices,) float64 sums of log p(choice tokens | context), how many contexts
    were cut so that the model reads at most `length` tokens of a context and its choice),
    scored by `continuation_logprobs`. A context is cut for each choice apart, as the harness
    cuts each request: the choices whose cut contexts are the same share one reading of it."""
    groups, owners, cut = [], [], 0
    for i, item in enumerate(items):
        shared: dict[tuple[int, ...], int] = {}  # cut context -> its group
        for j, choice in enumerate(item.choices):
            if len(choice) > length:
                raise EvalError(f"length={length}: a choice of {len(choice)} tokens leaves no "
                                "room for its context; raise length")
            context = item.context[-(length + 1 - len(choice)):]
            cut += len(context) < len(item.context)
            if context not in shared:
                shared[context] = len(groups)
                groups.append((context, []))
                owners.append((i, []))
            groups[shared[context]][1].append(choice)
            owners[shared[context]][1].append(j)
    with progress(len(groups), "context") as bar:
        logps = continuation_logprobs(model_cfg, params, groups, batch_size, scored=bar.draw)
    per_item = [np.zeros(len(item.choices)) for item in items]
    for (i, choices), group_logps in zip(owners, logps):
        per_item[i][choices] = group_logps.sum(1)
    return per_item, cut


@functools.partial(jax.jit, static_argnames=("model",))
def _continuation_logps(model: DecoderLM, params: Any, contexts: jax.Array, lengths: jax.Array,
                        tails: jax.Array, counts: jax.Array) -> jax.Array:
    """(B, L, M) float32 log p(each continuation token | the context and the continuation's
    tokens before it), 0 past a continuation's count, of the right-padded contexts (B, W) of
    `lengths` (B,) tokens and their L right-padded continuations `tails` (B, L, M) of `counts`
    (B, L) tokens (0: a padding slot, whose values mean nothing).
    The contexts are read once (`prefill`); each continuation is then fed from its context's
    end one token a step (`decode_logits`), writing the cache past the context, where the next
    continuation, starting at the context's end again, never reads it."""
    rows, _, width = tails.shape
    cache = empty_cache(model, rows, contexts.shape[1] + width - 1)
    first, cache = prefill(model, params, cache, contexts, lengths)
    first = jax.nn.log_softmax(first)

    def picked(logp: jax.Array, tokens: jax.Array) -> jax.Array:
        return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]

    def one(cache, tokens_and_count):
        tokens, count = tokens_and_count  # (B, M), (B,)

        def step(cache, s):
            logits, cache = decode_logits(model, params, cache, tokens[:, s], lengths + s)
            logp = picked(jax.nn.log_softmax(logits), tokens[:, s + 1])
            return cache, jnp.where(s + 1 < count, logp, 0.0)

        cache, rest = jax.lax.scan(step, cache, jnp.arange(width - 1))  # (M - 1, B)
        return cache, jnp.concatenate([picked(first, tokens[:, 0])[None], rest]).T

    _, logps = jax.lax.scan(one, cache, (tails.swapaxes(0, 1), counts.T))  # (L, B, M)
    return logps.swapaxes(0, 1)


def continuation_logprobs(model_cfg: ModelConfig, params: Any,
                          groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                          batch_size: int, context_width: int | None = None,
                          scored: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """Per (context ids, continuations' ids) group, (len(continuations), M) float64: each
    continuation's log p(each of its tokens | the context and its tokens before it), 0 past its
    own count (M, the call's longest continuation); the model reads the context and all but
    the continuation's last token (`_continuation_logps`). A row's sum is the continuation's
    log-likelihood (`choice`).

    Each context is read once, into a KV cache, and every continuation of it is fed after it
    from that cache: a group of L continuations costs one forward over its context and their
    tokens one at a time, where a row per continuation read the context L times (icl's labels:
    77 for Banking-77). Groups are scored `batch_size` at a time (the last batch's missing ones
    repeat group 0), contexts right-padded to `context_width` (None: the longest), continuations
    to the longest and to the most of a group, so one program is compiled per call. `scored`,
    where given, is called after each batch with how many groups are scored so far."""
    model = DecoderLM(model_cfg, decode=True)
    width = context_width or max(len(c) for c, _ in groups)
    most = max(len(conts) for _, conts in groups)
    longest = max(len(x) for _, conts in groups for x in conts)
    logps = []
    for start in range(0, len(groups), batch_size):
        batch = list(groups[start: start + batch_size])
        batch += [groups[0]] * (batch_size - len(batch))
        contexts = np.zeros((batch_size, width), np.int32)
        tails = np.zeros((batch_size, most, longest), np.int32)
        counts = np.zeros((batch_size, most), np.int32)
        for r, (context, conts) in enumerate(batch):
            contexts[r, : len(context)] = context
            for j, x in enumerate(conts):
                tails[r, j, : len(x)] = x
                counts[r, j] = len(x)
        got = np.asarray(_continuation_logps(
            model, params, jnp.asarray(contexts), jnp.asarray([len(c) for c, _ in batch], jnp.int32),
            jnp.asarray(tails), jnp.asarray(counts)), np.float64)
        logps += [got[r, : len(conts)] for r, (_, conts) in enumerate(batch[: len(groups) - start])]
        if scored is not None:
            scored(len(logps))
    return logps


def choice_task(loaded: Loaded, options: EvalOptions) -> Report:
    """Accuracy and length-normalized accuracy over the items of `input`."""
    cfg = loaded.config
    length = eval_length(cfg, options, cfg.model.max_seq_len)
    items = read_items(Path(options.input), loaded)
    sums, cut = choice_logprobs(cfg.model, loaded.params, items, length, options.batch_size)
    predicted = [int(np.argmax(s)) for s in sums]
    normalized = [int(np.argmax(s / np.array(item.chars))) for s, item in zip(sums, items)]
    labels = [item.label for item in items]
    n = len(items)
    acc = sum(p == y for p, y in zip(predicted, labels)) / n
    acc_norm = sum(p == y for p, y in zip(normalized, labels)) / n
    chance = float(np.mean([1 / len(item.choices) for item in items]))

    def stderr(p: float) -> float:  # of the mean of n 0/1 outcomes, as the harness reports it
        return math.sqrt(p * (1 - p) / max(n - 1, 1))

    report = Report(
        {"input": str(options.input), "num_items": n, "length": length,
         "accuracy": acc, "accuracy_stderr": stderr(acc), "accuracy_norm": acc_norm,
         "accuracy_norm_stderr": stderr(acc_norm), "chance": chance, "contexts_cut": cut,
         "predictions": predicted, "predictions_norm": normalized,
         "logprobs": [s.tolist() for s in sums]},
        [("items", f"{n:,} ({sum(len(i.choices) for i in items):,} choices; chance "
                   f"{chance:.3f})"),
         ("accuracy", f"{acc:.4f} ± {stderr(acc):.4f}"),
         ("accuracy (per character)", f"{acc_norm:.4f} ± {stderr(acc_norm):.4f}")])
    if cut:
        report.notes.append(f"{cut} context(s) lost their first tokens to fit length={length} "
                            "with a choice")
    return report
