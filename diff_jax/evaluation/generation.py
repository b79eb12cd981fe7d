"""The `generate` task: decode a prompt with the KV-cache engine and print the text."""

from __future__ import annotations

from diff_jax.evaluation.loading import Loaded, text_encoding
from diff_jax.evaluation.options import EvalError, EvalOptions
from diff_jax.evaluation.report import Report
from diff_jax.generate import SamplingConfig, generate


def run(loaded: Loaded, options: EvalOptions) -> Report:
    """Continue `options.prompt` by up to `max_new_tokens` tokens (stops at end-of-text)."""
    enc = text_encoding(loaded.config)
    ids = enc.encode_ordinary(options.prompt)
    try:
        sampling = SamplingConfig(options.temperature, options.top_k, options.top_p)
        new = generate(loaded.config.model, loaded.params, [ids], max_new_tokens=options.max_new_tokens,
                       sampling=sampling, seed=options.seed, eos_id=enc.eot_token)[0]
    except ValueError as e:
        raise EvalError(f"generate: {e}") from e
    text = enc.decode([t for t in new if t < enc.n_vocab and t != enc.eot_token])
    return Report(
        {"prompt": options.prompt, "completion": text, "prompt_tokens": len(ids),
         "new_tokens": new, "stopped_at_eos": bool(new and new[-1] == enc.eot_token),
         "sampling": {"temperature": options.temperature, "top_k": options.top_k,
                      "top_p": options.top_p, "seed": options.seed}},
        [("prompt tokens", str(len(ids))), ("new tokens", str(len(new))),
         ("text", options.prompt + text)])
