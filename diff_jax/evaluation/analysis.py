"""The paper's analyses from the model's sown intermediates: `attention` (Table 3), `outliers`
(Table 5) and `quant` (Figure 8).

Attention normalization (`attention`): per layer and head, the map is softmax attention A for the
Transformer, A1 − λ·A2 for DIFF V1 (λ of the layer) and P[2i] − λ_i·P[2i+1] for V2 (λ per token
and head). A differential map's negative entries are set to 0 and each query row is rescaled to
sum to 1 — "normalized attention": the share of a query's positive attention on each key. The
shares are averaged over the query tokens (the question and answer prompt), heads, layers and
samples. `answer` is the answer needle's span, `noise` the rest of the context (haystack and the
other needles); the remainder 1 − answer − noise is on the question itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diff_jax import variants
from diff_jax.attention_op import AttentionOp
from diff_jax.config import ModelConfig
from diff_jax.evaluation import plots
from diff_jax.evaluation.loading import Loaded, text_encoding
from diff_jax.evaluation.options import EvalOptions
from diff_jax.evaluation.report import Report
from diff_jax.evaluation.retrieval import accuracy_grid, cell_samples, niah_lengths
from diff_jax.evaluation.scoring import (counted_nll, eval_length, fewer_rows_note,
                                         held_out_batches, held_out_corpus)
from diff_jax.transformer import DecoderLM, unstacked_layers

TOP_K = (1, 2, 3, 10, 100)


def _capturing(model_cfg: ModelConfig) -> DecoderLM:
    """The model with its attention op capturing logits and maps (the xla path)."""
    return DecoderLM(model_cfg, attention_op=AttentionOp.build(model_cfg, capture=True))


def _intermediates(model_cfg: ModelConfig, params: Any, tokens: jax.Array) -> dict:
    _, state = _capturing(model_cfg).apply({"params": params}, tokens, mutable=["intermediates"])
    return unstacked_layers(state["intermediates"], model_cfg.num_layers)


@functools.partial(jax.jit, static_argnames=("model_cfg",))
def span_shares(model_cfg: ModelConfig, params: Any, tokens: jax.Array,
                spans: jax.Array) -> jax.Array:
    """(layers, 2) float32: the query rows' mean normalized attention on (answer, noise).

    tokens (B, T) int; spans (5,) int = (answer start, answer end, context end, query start,
    query end): answer keys are [answer start, answer end), noise keys the rest of
    [0, context end), query rows [query start, query end). Per layer the per-head maps
    (B, H, T, S) (`Variant.head_maps`) are clipped at 0 and each row rescaled to sum to 1; the
    shares are averaged over the batch, heads and query rows. Tokens after the query end are
    padding, which the causal mask keeps out of the query rows.
    """
    answer_start, answer_end, context_end, query_start, query_end = spans
    inter = _intermediates(model_cfg, params, tokens)
    spec = variants.spec(model_cfg.variant)
    pos = jnp.arange(tokens.shape[1])
    answer = (pos >= answer_start) & (pos < answer_end)
    noise = (pos < context_end) & ~answer
    rows = ((pos >= query_start) & (pos < query_end)).astype(jnp.float32)
    out = []
    for i in range(model_cfg.num_layers):
        m = jnp.maximum(spec.head_maps(inter[f"layers_{i}"]), 0.0)
        m = m / jnp.maximum(m.sum(-1, keepdims=True), 1e-30)  # (B, H, T, S)

        def share(keys: jax.Array) -> jax.Array:
            per_row = jnp.where(keys, m, 0.0).sum(-1).mean(axis=(0, 1))  # (T,)
            return (per_row * rows).sum() / rows.sum()

        out.append(jnp.stack([share(answer), share(noise)]))
    return jnp.stack(out)


def attention(loaded: Loaded, options: EvalOptions) -> Report:
    """Share of the query positions' attention on the answer span vs the rest, per depth."""
    cfg = loaded.config
    length = max(niah_lengths(cfg, options))
    enc = text_encoding(loaded)
    per_depth = []
    for depth in options.depths:
        shares = []
        for sample in cell_samples(enc, options, depth, length):
            tokens, answer_at = sample.sequence(0)
            padded = np.zeros((1, length), np.int32)
            padded[0, :answer_at] = tokens[:answer_at]
            spans = jnp.asarray([sample.needles[0].start, sample.needles[0].end,
                                 len(sample.context), len(sample.context), answer_at])
            shares.append(np.asarray(span_shares(cfg.model, loaded.params, jnp.asarray(padded),
                                                 spans)))
        per_depth.append(np.mean(shares, axis=0))  # (layers, 2)
    per_depth = np.stack(per_depth)  # (depths, layers, 2)
    rows = [{"depth": d, "answer": float(x[:, 0].mean()), "noise": float(x[:, 1].mean()),
             "answer_by_layer": x[:, 0].tolist(), "noise_by_layer": x[:, 1].tolist()}
            for d, x in zip(options.depths, per_depth)]
    return Report(
        {"length": length, "needles": options.needles, "samples": options.samples,
         "seed": options.seed, "normalization": "differential maps clipped at 0, rows rescaled "
         "to sum 1; mean over query tokens, heads, layers, samples", "by_depth": rows,
         "answer": float(per_depth[..., 0].mean()), "noise": float(per_depth[..., 1].mean())},
        [("depth", "answer  noise")]
        + [(f"{r['depth']}%", f"{r['answer']:.3f}   {r['noise']:.3f}") for r in rows]
        + [("average", f"{per_depth[..., 0].mean():.3f}   {per_depth[..., 1].mean():.3f}")])


@functools.partial(jax.jit, static_argnames=("model_cfg",))
def _activations(model_cfg: ModelConfig, params: Any, tokens: jax.Array, segment_ids: jax.Array,
                 positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(|attention logits| (L, B, N, T, S) with −1 on masked entries, |hidden| (L, B, T, E))."""
    _, state = _capturing(model_cfg).apply({"params": params}, tokens, positions=positions,
                                           segment_ids=segment_ids, mutable=["intermediates"])
    inter = unstacked_layers(state["intermediates"], model_cfg.num_layers)
    logits, hidden = [], []
    for i in range(model_cfg.num_layers):
        layer = inter[f"layers_{i}"]
        maps = layer["attn"]["attention"][0]
        value = jnp.abs(maps["logits"])
        if maps["mask"] is not None:
            value = jnp.where(maps["mask"], value, -1.0)
        logits.append(value)
        hidden.append(jnp.abs(layer["hidden"][0].astype(jnp.float32)))
    return jnp.stack(logits), jnp.stack(hidden)


def _stats(values: np.ndarray) -> dict[str, float]:
    top = np.sort(np.partition(values, -min(len(values), max(TOP_K)))[-max(TOP_K):])[::-1]
    return {**{f"top{k}": float(top[k - 1]) for k in TOP_K if k <= len(top)},
            "median": float(np.median(values))}


def outliers(loaded: Loaded, options: EvalOptions) -> Report:
    """Top-1/2/3/10/100 and median of |attention logits| (valid entries) and |hidden states|."""
    cfg = loaded.config
    length = eval_length(cfg, options)
    rows = math.ceil(options.tokens / length)
    batches = held_out_batches(held_out_corpus(loaded), length, min(options.batch_size, rows),
                               math.ceil(rows / min(options.batch_size, rows)))
    logit_values, hidden_values = [], []
    for b in batches:
        logits, hidden = _activations(cfg.model, loaded.params, *(jnp.asarray(b[k]) for k in (
            "tokens", "segment_ids", "positions")))
        logits = np.asarray(logits).ravel()
        logit_values.append(logits[logits >= 0])
        hidden_values.append(np.asarray(hidden).ravel())
    stats = {"attention_logits": _stats(np.concatenate(logit_values)),
             "hidden_states": _stats(np.concatenate(hidden_values))}
    tokens = sum(b["tokens"].size for b in batches)
    cols = [*(f"top{k}" for k in TOP_K), "median"]
    return Report(
        {"length": length, "num_tokens": tokens, **stats},
        [("tokens", f"{tokens:,}"), ("", "  ".join(f"{c:>8}" for c in cols))]
        + [(name, "  ".join(f"{s.get(c, float('nan')):8.3f}" for c in cols))
           for name, s in stats.items()], notes=[loaded.split_note] if loaded.split_note else [])


def quant(loaded: Loaded, options: EvalOptions) -> Report:
    """Held-out perplexity (and niah accuracy with niah=true) with the attention logits
    absmax-quantized to each of `bits` (null: not quantized), on the xla path. The width is a
    traced argument (`DecoderLM.quantized`), so all quantized widths share one compiled program
    per scorer (NLL, retrieval) and shape: with niah=true, 4 programs for any number of widths,
    not 2 per width."""
    cfg = loaded.config
    length = eval_length(cfg, options)
    batches = held_out_batches(held_out_corpus(loaded), length, options.batch_size, options.batches)
    bits: list[int | None] = [None, *options.bits]
    model_cfg = dataclasses.replace(cfg.model, attn_logit_bits=None, attention_impl="xla")
    losses, accuracies = [], []
    for b in bits:
        losses.append(float(counted_nll(model_cfg, loaded.params, batches, b).mean()))
        if options.niah:
            grid, _ = accuracy_grid(model_cfg, loaded.params, text_encoding(loaded),
                                    options, niah_lengths(cfg, options), b)
            accuracies.append(float(grid.mean()))
    ppls = [math.exp(x) for x in losses]
    counted = sum(int(np.count_nonzero(x["loss_mask"])) for x in batches)
    fields: dict[str, Any] = {"length": length, "num_tokens": counted, "bits": bits,
                              "loss": losses, "ppl": ppls}
    if options.niah:
        fields["niah_accuracy"] = accuracies
    table = [("held-out tokens", f"{counted:,}"),
             ("bits", "ppl" + ("     niah" if options.niah else ""))]
    for i, b in enumerate(bits):
        table.append((str(b or "none"),
                      f"{ppls[i]:.3f}" + (f"  {accuracies[i]:.3f}" if options.niah else "")))
    report = Report(fields, table, notes=[loaded.split_note] if loaded.split_note else [])
    # a split too small for batches=: the table said nothing of it, and the JSON's num_tokens only
    asked = options.batches * options.batch_size * length
    report.notes += fewer_rows_note(batches, asked, f"batches·batch_size·length = "
                                                    f"{options.batches}·{options.batch_size}·"
                                                    f"{length} = {asked:,}")
    png = loaded.out_dir / "quant.png"
    series = {"perplexity": ppls[1:]}
    plots.attach(report, png, plots.lines(
        png, options.bits, series, title=f"{cfg.model.variant}: attention-logit quantization",
        xlabel="bits", ylabel="held-out perplexity"))
    return report
