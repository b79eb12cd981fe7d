"""The `generate` task: continue a prompt, or every prompt of a JSONL file, with the KV-cache
engine, and report the text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from diff_jax.data.tokenizer import Encoding, text_prefix
from diff_jax.evaluation.choice import read_jsonl
from diff_jax.evaluation.loading import Loaded, text_encoding
from diff_jax.evaluation.options import EvalError, EvalOptions
from diff_jax.evaluation.report import Report, progress
from diff_jax.generate import SamplingConfig, generate

PROMPT_FORMAT = '{"prompt": str}'


def run(loaded: Loaded, options: EvalOptions) -> Report:
    """Continue `options.prompt`, or each prompt of `options.input`, by up to `max_new_tokens`
    tokens (a continuation stops at end-of-text)."""
    if options.input is not None:
        return _prompt_file(loaded, options)
    enc = text_encoding(loaded)
    ids = text_prefix(enc) + enc.encode_ordinary(options.prompt)
    new = _continue(loaded, options, [ids], options.seed, enc.eot_token)[0]
    fields = _continuation(enc, options.prompt, ids, new)
    return Report(
        {**fields, "sampling": _sampling_fields(options)},
        [("prompt tokens", str(len(ids))), ("new tokens", str(len(new))),
         *([("undecodable", f"{len(fields['undecodable_tokens'])} ids left out of the text: no "
                            f"token of {enc.name} has them")]
           if fields["undecodable_tokens"] else []),
         ("text", options.prompt + fields["completion"])])


def batch_seed(seed: int, batch: int) -> int:
    """The sampling seed of the `batch`-th batch of a prompt file, drawn from (`seed`, `batch`):
    one seed for every batch would give row r of each batch the same random draws."""
    return int(np.random.SeedSequence([seed, batch]).generate_state(1)[0])


def _prompt_file(loaded: Loaded, options: EvalOptions) -> Report:
    """Every prompt of the JSONL file `options.input`, `batch_size` at a time in the file's
    order, batch k sampled with `batch_seed(seed, k)`."""
    enc = text_encoding(loaded)
    path = Path(options.input)
    records = read_jsonl(path, PROMPT_FORMAT, _prompt_problem)
    prompts = [(n, r["prompt"], text_prefix(enc) + enc.encode_ordinary(r["prompt"]))
               for n, r in records]
    room = loaded.config.model.max_seq_len - options.max_new_tokens
    for n, _, ids in prompts:
        if len(ids) > room:
            raise EvalError(f"input={path}:{n}: the prompt's {len(ids):,} tokens + "
                            f"max_new_tokens={options.max_new_tokens} exceed model.max_seq_len "
                            f"({loaded.config.model.max_seq_len}); shorten it or lower "
                            "max_new_tokens")
    done = []
    with progress(len(prompts), "prompt") as bar:
        for k, start in enumerate(range(0, len(prompts), options.batch_size)):
            batch = prompts[start: start + options.batch_size]
            news = _continue(loaded, options, [ids for _, _, ids in batch],
                             batch_seed(options.seed, k), enc.eot_token)
            done += [{"line": n, **_continuation(enc, text, ids, new)}
                     for (n, text, ids), new in zip(batch, news)]
            bar.draw(len(done))
    stopped = sum(c["stopped_at_eos"] for c in done)
    undecodable = sum(len(c["undecodable_tokens"]) for c in done)
    first = done[0]
    return Report(
        {"input": str(path), "num_prompts": len(done), "batch_size": options.batch_size,
         "sampling": _sampling_fields(options), "completions": done},
        [("prompts", f"{len(done):,} from {path}, {options.batch_size} a batch"),
         ("new tokens", f"{sum(len(c['new_tokens']) for c in done):,} in all, "
                        f"{stopped:,} continuations stopped at end-of-text"),
         *([("undecodable", f"{undecodable} ids left out of the texts: no token of "
                            f"{enc.name} has them")] if undecodable else []),
         (f"text (line {first['line']})", first["prompt"] + first["completion"]),
         ("completions", "every prompt's, in the JSON")])


def _prompt_problem(record: Any) -> str | None:
    """Why a JSONL record is no prompt, or None."""
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        return "not an object with a string \"prompt\""
    if not record["prompt"]:
        return "the prompt is empty"
    return None


def _continue(loaded: Loaded, options: EvalOptions, prompts: list[list[int]], seed: int,
              eos_id: int) -> list[list[int]]:
    """The engine's new tokens for `prompts` (token ids), sampled as `options` asks with
    `seed`, each stopped after `eos_id`; its `ValueError` (a prompt too long for the model) as
    an `EvalError`."""
    try:
        return generate(loaded.config.model, loaded.params, prompts,
                        max_new_tokens=options.max_new_tokens,
                        sampling=SamplingConfig(options.temperature, options.top_k, options.top_p),
                        seed=seed, eos_id=eos_id)
    except ValueError as e:
        raise EvalError(f"generate: {e}") from e


def _sampling_fields(options: EvalOptions) -> dict[str, Any]:
    """The report's `sampling` fields."""
    return {"temperature": options.temperature, "top_k": options.top_k, "top_p": options.top_p,
            "seed": options.seed}


def _continuation(enc: Encoding, prompt: str, ids: list[int], new: list[int]) -> dict[str, Any]:
    """A continuation's JSON fields: the prompt, its text and ids, what was left out of it."""
    text, undecodable = _decode(enc, new, ids)
    return {"prompt": prompt, "completion": text, "prompt_tokens": len(ids), "new_tokens": new,
            "undecodable_tokens": undecodable,
            "stopped_at_eos": bool(new and new[-1] == enc.eot_token)}


def _decode(enc: Encoding, ids: list[int], context: list[int]) -> tuple[str, list[int]]:
    """(text, the ids left out of it): the text `ids` add after `context` (the prompt's ids).
    The ids that are no token of `enc` (the embedding's padding rows past its vocabulary, and
    the gaps below `n_vocab` between cl100k's ordinary and special tokens, 100256 and
    100261–100275) are left out, as is end-of-text; a sampled one made tiktoken's decode raise
    KeyError. The rest is decoded together after the context, whose own text is then cut off
    (bytes that are no UTF-8 become U+FFFD): a Hugging Face decoder reads a token by what
    precedes it, and alone a SentencePiece "▁word" or a WordPiece "word" loses the space before
    it, which joined the prompt's last word to the completion's first."""
    known, undecodable = [], []
    for t in ids:
        if t == enc.eot_token:
            continue
        try:
            enc.decode_single_token_bytes(t)
            known.append(t)
        except KeyError:
            undecodable.append(t)
    head, whole = enc.decode(context), enc.decode([*context, *known])
    return (whole[len(head):] if whole.startswith(head) else enc.decode(known)), undecodable
