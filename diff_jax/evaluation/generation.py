"""The `generate` task: decode a prompt with the KV-cache engine and print the text."""

from __future__ import annotations


from diff_jax.data.tokenizer import Encoding, text_prefix
from diff_jax.evaluation.loading import Loaded, text_encoding
from diff_jax.evaluation.options import EvalError, EvalOptions
from diff_jax.evaluation.report import Report
from diff_jax.generate import SamplingConfig, generate


def run(loaded: Loaded, options: EvalOptions) -> Report:
    """Continue `options.prompt` by up to `max_new_tokens` tokens (stops at end-of-text)."""
    enc = text_encoding(loaded)
    ids = text_prefix(enc) + enc.encode_ordinary(options.prompt)
    try:
        sampling = SamplingConfig(options.temperature, options.top_k, options.top_p)
        new = generate(loaded.config.model, loaded.params, [ids], max_new_tokens=options.max_new_tokens,
                       sampling=sampling, seed=options.seed, eos_id=enc.eot_token)[0]
    except ValueError as e:
        raise EvalError(f"generate: {e}") from e
    text, undecodable = _decode(enc, new, ids)
    return Report(
        {"prompt": options.prompt, "completion": text, "prompt_tokens": len(ids),
         "new_tokens": new, "undecodable_tokens": undecodable,
         "stopped_at_eos": bool(new and new[-1] == enc.eot_token),
         "sampling": {"temperature": options.temperature, "top_k": options.top_k,
                      "top_p": options.top_p, "seed": options.seed}},
        [("prompt tokens", str(len(ids))), ("new tokens", str(len(new))),
         *([("undecodable", f"{len(undecodable)} ids left out of the text: no token of "
                            f"{enc.name} has them")] if undecodable else []),
         ("text", options.prompt + text)])


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
