"""KV-cache decoding equals the full-sequence forward, position by position, for every variant."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from diff_jax import variants
from diff_jax.attention_op import AttentionOp
from diff_jax.config import ModelConfig
from diff_jax.generate import (SamplingConfig, _decode_step, _generate, empty_cache, generate,
                                padded_size, prefill, sample)
from diff_jax.transformer import DecoderLM

V = 61


@functools.cache  # one initialization per model for the module's tests (arrays are immutable)
def _setup(variant: str, **kw):
    cfg = ModelConfig(variant=variant, vocab_size=V, embed_dim=32, num_layers=2,
                      num_heads=4 if variant != "transformer" else 8, num_kv_heads=2,
                      max_seq_len=32, **kw)
    params = nn.meta.unbox(DecoderLM(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    return cfg, params


@pytest.mark.parametrize("variant,extra", [("diff", {}), ("diff", {"gqa_pairing": "naive"}),
                                           ("diff_v2", {}), ("transformer", {})])
def test_cached_logits_equal_full_forward(variant, extra):
    """Prefill ragged prompts, then feed a fixed continuation; compare every step's logits."""
    cfg, params = _setup(variant, **extra)
    rng = np.random.default_rng(1)
    lengths = np.array([3, 7])
    steps = 6
    seqs = rng.integers(1, V, (2, 7 + steps)).astype(np.int32)
    full = np.asarray(jax.jit(DecoderLM(cfg).apply)({"params": params}, jnp.asarray(seqs)))

    model = DecoderLM(cfg, decode=True)
    total = 7 + steps
    cache = empty_cache(model, 2, total)
    prompt = np.where(np.arange(7)[None] < lengths[:, None], seqs[:, :7], 0)
    last, cache = prefill(model, params, cache, jnp.asarray(prompt), jnp.asarray(lengths))
    # Cached vs full-sequence attention differ only in float32 summation order: measured max
    # |diff| 1.5e-7 over all variants (logits |x| <= 0.7, ~2.5 ulp); atol 2e-6 is ~13x that.
    for i in range(2):
        np.testing.assert_allclose(last[i], full[i, lengths[i] - 1], rtol=1e-6, atol=2e-6)
    pos = lengths.copy()
    for _ in range(steps):
        feed = seqs[np.arange(2), pos]
        _, logits, cache = _decode_step(model, params, cache, jnp.asarray(feed), jnp.asarray(pos),
                                        jax.random.key(0), SamplingConfig())
        for i in range(2):
            np.testing.assert_allclose(logits[i], full[i, pos[i]], rtol=1e-6, atol=2e-6)  # as above
        pos = pos + 1


def _uncached_greedy(cfg, params, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` by re-running the full forward (no cache) each step, on
    the sequence so far padded to `max_seq_len` (causal: the padding cannot reach the last
    token's logits; one compiled forward for every length)."""
    apply = jax.jit(DecoderLM(cfg).apply)
    seq = list(prompt)
    for _ in range(n):
        row = np.zeros((1, cfg.max_seq_len), np.int32)
        row[0, :len(seq)] = seq
        logits = apply({"params": params}, jnp.asarray(row))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_greedy_generate_matches_uncached_argmax_loop():
    cfg, params = _setup("diff")
    prompts = [[5, 9, 2], [7, 1, 1, 4, 30]]
    got = generate(cfg, params, prompts, max_new_tokens=5)
    assert got == [_uncached_greedy(cfg, params, p, 5) for p in prompts]


def test_eos_seed_and_errors():
    cfg, params = _setup("transformer")
    greedy = generate(cfg, params, [[3, 4]], max_new_tokens=6)[0]
    last_new = max(j for j in range(6) if greedy[j] not in greedy[:j])  # first occurrence of its token
    stopped = generate(cfg, params, [[3, 4]], max_new_tokens=6, eos_id=greedy[last_new])[0]
    assert stopped == greedy[: last_new + 1]
    hot = SamplingConfig(temperature=1.0, top_k=10, top_p=0.9)
    a = generate(cfg, params, [[3, 4]] * 2, max_new_tokens=8, sampling=hot, seed=7)
    assert a == generate(cfg, params, [[3, 4]] * 2, max_new_tokens=8, sampling=hot, seed=7)
    assert a != generate(cfg, params, [[3, 4]] * 2, max_new_tokens=8, sampling=hot, seed=8)
    with pytest.raises(ValueError, match=r"exceeds model.max_seq_len \(32\)"):
        generate(cfg, params, [[1] * 30], max_new_tokens=3)
    with pytest.raises(ValueError, match="prompt 1 is empty: every prompt needs at least one token"):
        generate(cfg, params, [[3], []], max_new_tokens=3)
    with pytest.raises(ValueError, match="prompts is empty: expected one or more prompts"):
        generate(cfg, params, [], max_new_tokens=3)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match=r"top_k must be an int >= 0, got -1$"):
        SamplingConfig(top_k=-1)
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 1, got 0$"):
        generate(cfg, params, [[3, 4]], max_new_tokens=0)


def test_sampling_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 400)
    draw = lambda s: np.array([int(sample(logits, k, s)[0]) for k in keys[:200]])
    assert set(draw(SamplingConfig(temperature=1.0, top_k=2))) == {0, 1}
    assert set(draw(SamplingConfig(temperature=1.0, top_p=0.7))) == {0, 1}  # 0.5 + 0.3 reaches 0.7
    assert set(draw(SamplingConfig(temperature=1.0, top_p=0.5))) == {0}
    assert int(sample(logits, keys[0], SamplingConfig())[0]) == 0


@pytest.mark.parametrize("temperature", [1e-38, 1e-39, 1e-45])
def test_a_tiny_temperature_draws_the_largest_logit(temperature):
    """As the temperature goes to 0 sampling becomes greedy: logits / T overflowed to inf for
    every positive logit, and categorical drew the first inf (token 0 here, not the argmax 1)."""
    logits = jnp.asarray([[1.0, 5.0, -2.0, 4.5], [-3.0, -1.0, -2.0, -0.5]])
    for k in jax.random.split(jax.random.key(0), 5):
        assert sample(logits, k, SamplingConfig(temperature=temperature)).tolist() == [1, 3]


def _reference_probs(logits: np.ndarray, s: SamplingConfig) -> np.ndarray:
    """Float64: softmax(logits / T), then keep the k most likely tokens (top_k), then the
    smallest most-likely-first prefix whose mass reaches top_p, renormalizing after each."""
    z = logits.astype(np.float64) / s.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_k:
        p[np.argsort(-p)[s.top_k:]] = 0
        p /= p.sum()
    if s.top_p < 1:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]  # mass of the more likely tokens
        p[order[before >= s.top_p]] = 0
        p /= p.sum()
    return p


@pytest.mark.parametrize("sampling", [
    SamplingConfig(temperature=0.5), SamplingConfig(temperature=2.0),
    SamplingConfig(temperature=0.5, top_k=4), SamplingConfig(temperature=2.0, top_p=0.6),
    SamplingConfig(temperature=2.0, top_k=5, top_p=0.7)], ids=str)
def test_sampled_frequencies_match_tempered_softmax(sampling):
    logits = np.array([2.0, -1.0, 0.5, 1.2, -2.0, 0.0, 0.9, -0.4], np.float32)
    n = 4000
    want = _reference_probs(logits, sampling)
    got = np.asarray(jax.jit(sample, static_argnums=2)(
        jnp.asarray(np.tile(logits, (n, 1))), jax.random.key(3), sampling))
    freq = np.bincount(got, minlength=len(logits)) / n
    # filtered tokens are never drawn; the others within 4 binomial standard deviations
    # (sqrt(p (1 - p) / n) <= 0.008), seeded so the draw is fixed
    assert np.all(freq[want == 0] == 0), (freq, want)
    np.testing.assert_array_less(np.abs(freq - want), 4 * np.sqrt(want * (1 - want) / n) + 1e-12)


def test_generation_benchmark_smoke(tmp_path):
    """benchmarks/generate.py measures in a subprocess and writes JSON + markdown."""
    import json

    import generate as bench

    assert bench.main(["--batch", "1", "--prompt", "4", "--new", "2", "--repeats", "1",
                       "--rounds", "1", "--out", str(tmp_path / "gen")]) == 0
    data = json.loads((tmp_path / "gen.json").read_text())
    assert data["results"]["current"]["tokens_per_s"] > 0
    assert "| current |" in (tmp_path / "gen.md").read_text()


def test_generation_benchmark_medians_and_each_tree_runs_its_own_package(tmp_path, monkeypatch):
    """generate.py: a measurement is batch × new tokens over the median of its repeats, the
    result per tree the median over rounds, and each tree's subprocess runs in that tree with
    it on PYTHONPATH (else a baseline tree measures the installed package). A mean, new tokens
    of one row, the best round and a subprocess without the tree's PYTHONPATH passed every
    test. The prompts' ids lie in the model's vocabulary (they were drawn below 50,000
    whatever the vocabulary, which generate refuses for a smaller one)."""
    import json
    import subprocess
    import time
    from pathlib import Path

    import diff_jax.generate
    import generate as bench

    root = Path(__file__).resolve().parents[1]

    clock = [0.0]
    took = iter([50.0, 1.0, 2.0, 9.0, 7.0, 8.0])  # the compiling call, 3 repeats, the loop's 2
    ids, widths = set(), []

    def fake_generate(cfg, params, prompts, max_new_tokens):
        clock[0] += next(took)
        ids.update(x for p in prompts for x in p)
        widths.append({len(p) for p in prompts})
        return [[0] * max_new_tokens for _ in prompts]

    config = tmp_path / "small.yaml"
    config.write_text("model: {vocab_size: 64, embed_dim: 32, num_layers: 1, num_heads: 2}\n")
    monkeypatch.setattr(diff_jax.generate, "generate", fake_generate)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    got = bench.measure(str(config), batch=2, prompt=3, new=5, repeats=3, lengths=3)
    monkeypatch.undo()
    assert (got["first_call_s"], got["median_s"], got["tokens_per_s"]) == (50.0, 2.0, 5.0)
    assert got["loop_s"] == 50.0 + 7.0 + 8.0 and widths == [{3}] * 4 + [{2}, {1}]
    assert 0 <= min(ids) and max(ids) < 64

    calls = []
    rates = {str(root): iter([1.0, 2.0, 9.0]), str(tmp_path): iter([5.0, 4.0, 3.0])}

    def fake_run(cmd, cwd, env, **kw):
        calls.append((str(cwd), env["PYTHONPATH"]))
        out = {"first_call_s": 1.0, "median_s": 1.0, "tokens_per_s": next(rates[str(cwd)]),
               "loop_s": 1.0,
               "times_s": [1.0], "jax": "0", "device": "cpu", "package": str(cwd)}
        return subprocess.CompletedProcess(cmd, 0, json.dumps(out) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    (tmp_path / "diff_jax").mkdir()  # a checkout, for --baseline-tree
    (tmp_path / "diff_jax" / "__init__.py").touch()
    assert bench.main(["--rounds", "3", "--baseline-tree", str(tmp_path),
                       "--out", str(tmp_path / "gen")]) == 0
    result = json.loads((tmp_path / "gen.json").read_text())
    assert calls == [(str(root), str(root)), (str(tmp_path), str(tmp_path))] * 3
    assert result["results"]["current"]["tokens_per_s"] == 2.0
    assert result["results"]["baseline"]["tokens_per_s"] == 4.0


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_a_temperature_that_is_not_a_finite_number_is_refused(temperature):
    """NaN passed `temperature < 0` and sampled garbage (eval.py then blamed the checkpoint for
    the NaN in its JSON); inf divides every logit to 0, sampling uniformly past top_k."""
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingConfig(temperature=temperature)


def test_top_k_above_the_vocabulary_is_refused_naming_it():
    """It failed inside tracing with lax.top_k's message, which names neither top_k nor the
    vocabulary size; top_k equal to the vocabulary keeps every token."""
    cfg, params = _setup("transformer")
    with pytest.raises(ValueError, match=rf"top_k must be <= model.vocab_size \({V}\), got {V + 1}"):
        generate(cfg, params, [[3, 4]], max_new_tokens=2,
                 sampling=SamplingConfig(temperature=1.0, top_k=V + 1))
    every = SamplingConfig(temperature=1.0, top_k=V)
    assert (generate(cfg, params, [[3, 4]], max_new_tokens=4, sampling=every, seed=1)
            == generate(cfg, params, [[3, 4]], max_new_tokens=4,
                        sampling=SamplingConfig(temperature=1.0), seed=1))


@pytest.mark.parametrize("rows,tokens", [(2, 9), (3, 4)])
def test_calls_that_do_not_fit_the_kv_cache_are_refused(rows, tokens):
    """The cache is as long and as wide as the `init` input (2 rows of 8 here): a longer prefill
    or another batch is one error naming both shapes, not a dynamic_update_slice bounds error."""
    cfg, params = _setup("diff")
    model = DecoderLM(cfg, decode=True)
    cache = empty_cache(model, 2, 8)
    with pytest.raises(ValueError, match=rf"KV cache holds 2 rows of 8 positions .* this call "
                                         rf"has {rows} rows of {tokens} tokens"):
        model.apply({"params": params, "cache": cache}, jnp.ones((rows, tokens), jnp.int32),
                    mutable=["cache"])


@pytest.mark.parametrize("capture", [False, True], ids=["decode_attention", "oracle"])
def test_unfilled_cache_entries_holding_nan_do_not_reach_the_logits(capture):
    """A cache whose entries past each row's position hold NaN (an uninitialised, donated or
    reused buffer) decodes as one of zeros: p = 0 masked the scores but not the values, and
    0·NaN is NaN. With `capture` a step decodes through the xla oracle with key segments."""
    cfg, params = _setup("diff")
    model = DecoderLM(cfg, decode=True, attention_op=AttentionOp.build(cfg, capture=capture))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, 12), jnp.int32))["cache"]
    prompt, lengths = jnp.asarray([[5, 9, 2, 0], [7, 1, 1, 4]], jnp.int32), jnp.asarray([3, 4])
    got = []
    for fill in (0.0, jnp.nan):
        cache = jax.tree.map(lambda s: jnp.full(s.shape, fill, s.dtype), shapes)
        _, cache = prefill(model, params, cache, prompt, lengths)
        _, logits, _ = _decode_step(model, params, cache, jnp.asarray([3, 8], jnp.int32), lengths,
                                    jax.random.key(0), SamplingConfig())
        got.append(np.asarray(logits))
    assert np.isfinite(got[1]).all()
    np.testing.assert_array_equal(got[1], got[0])


def test_segment_ids_with_a_kv_cache_are_refused_and_its_layers_need_positions():
    """A decode step ignored them (every entry up to the position was attended), and a prefill
    honoured them only until the next step; the cache keeps no segments, so both are refused,
    whatever their dtype or shape (that error, not the one for mis-shaped segment ids).
    An attention layer with a cache, called on its own, needs the positions to write at (the
    model passes 0..T-1 when given none)."""
    cfg, params = _setup("diff")
    model = DecoderLM(cfg, decode=True)
    cache = empty_cache(model, 2, 8)
    for t in (1, 4):
        for segment_ids in (jnp.ones((2, t), jnp.int32), jnp.ones((2, t), jnp.float32),
                            jnp.ones((2, t + 1), jnp.int32)):
            with pytest.raises(ValueError, match=r"^segment_ids must be None with a KV cache"):
                model.apply({"params": params, "cache": cache}, jnp.ones((2, t), jnp.int32),
                            positions=jnp.zeros((2, t), jnp.int32), segment_ids=segment_ids,
                            mutable=["cache"])
    layer = variants.spec("diff").module(cfg, 0, decode=True)
    x = jnp.zeros((2, 4, cfg.embed_dim))
    variables = layer.init(jax.random.key(0), x, positions=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"decoding needs explicit positions \(B, T\)"):
        layer.apply(variables, x, mutable=["cache"])


@pytest.mark.parametrize("shape", [(2,), (2, 2), (1, 1)])
def test_a_decode_step_whose_positions_are_not_one_per_row_is_refused(shape):
    """A step (T = 1) takes positions (B, 1); (B,) and (B, 2) failed inside RoPE ("RoPE tables
    ... do not fit x"), (1, 1) in the cache write's vmap. One error naming positions and
    (B, T) = (2, 1)."""
    cfg, params = _setup("diff")
    model = DecoderLM(cfg, decode=True)
    cache = empty_cache(model, 2, 8)
    with pytest.raises(ValueError, match=rf"^positions must be \(B, T\) = \(2, 1\) integers "
                                         rf".*, got int32 of shape {re.escape(str(shape))}"):
        model.apply({"params": params, "cache": cache}, jnp.ones((2, 1), jnp.int32),
                    positions=jnp.zeros(shape, jnp.int32), mutable=["cache"])


def test_a_cache_filled_to_max_seq_len_matches_the_full_forward_and_one_more_is_refused():
    """generate's cache holds longest prompt + max_new_tokens entries, at most model.max_seq_len
    (32): a request of exactly 32 fills positions up to 30 (the last new token is not fed back)
    and equals the uncached greedy loop; 33 is refused before anything runs. A hand-driven cache
    of 32 filled to its last entry gives the full forward's logits (float32, rel. error <= 1e-5)."""
    cfg, params = _setup("diff")
    rng = np.random.default_rng(2)
    prompts = [[int(x) for x in rng.integers(1, V, 29)], [5, 9, 2]]
    got = generate(cfg, params, prompts, max_new_tokens=3)
    assert got == [_uncached_greedy(cfg, params, p, 3) for p in prompts]
    with pytest.raises(ValueError, match=r"longest prompt \(30 tokens\) \+ max_new_tokens \(3\) "
                                         r"= 33 exceeds model.max_seq_len \(32\)"):
        generate(cfg, params, [prompts[0] + [1], [5]], max_new_tokens=3)

    seq = jnp.asarray(rng.integers(1, V, (2, 32)), jnp.int32)
    full = np.asarray(jax.jit(DecoderLM(cfg).apply)({"params": params}, seq))
    model = DecoderLM(cfg, decode=True)
    cache = empty_cache(model, 2, 32)
    step = jax.jit(functools.partial(model.apply, mutable=["cache"]))  # one compile per shape
    logits, state = step({"params": params, "cache": cache}, seq[:, :29])
    got = [np.asarray(logits)]
    for p in range(29, 32):
        logits, state = step({"params": params, "cache": state["cache"]}, seq[:, p:p + 1],
                             positions=jnp.full((2, 1), p))
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    assert np.linalg.norm(got - full) / np.linalg.norm(full) <= 1e-5


@pytest.mark.parametrize("variant", ["diff", "transformer"])
def test_a_step_outside_the_cache_gives_nan_logits_for_its_row_only(variant):
    """Positions are traced, so a hand-driven step at a position outside the cache [0, S)
    cannot be an error: its row's logits are NaN (not the finite, wrong result of the clamped
    write onto the last entry), and the other row, at a valid position, is the full forward's."""
    cfg, params = _setup(variant)
    seq = jnp.asarray(np.random.default_rng(3).integers(1, V, (2, 9)), jnp.int32)
    full = np.asarray(jax.jit(DecoderLM(cfg).apply)({"params": params}, seq))
    model = DecoderLM(cfg, decode=True)
    cache = empty_cache(model, 2, 8)  # S = 8
    step = jax.jit(functools.partial(model.apply, mutable=["cache"]))  # one compile per shape
    _, state = step({"params": params, "cache": cache}, seq[:, :7])
    for outside in (8, -1):
        logits, _ = step({"params": params, "cache": state["cache"]}, seq[:, 7:8],
                         positions=jnp.asarray([[7], [outside]]))
        logits = np.asarray(logits)
        assert np.isnan(logits[1]).all(), outside
        np.testing.assert_allclose(logits[0, 0], full[0, 7], rtol=1e-5, atol=1e-5)


def test_uniform_logits_draw_each_step_with_its_own_key_and_keep_token_0():
    """With every parameter zero every logit is 0, so each step draws uniformly over V = 61:
    two consecutive steps of a row agree about once in 61 rows (a step drawn with the previous
    step's key would repeat its token in every row), and the id 0, drawn a few times here, is a
    token like any other (not the −1 that pads a stopped row)."""
    cfg, params = _setup("transformer")
    zeros = jax.tree.map(jnp.zeros_like, params)
    rows = generate(cfg, zeros, [[3]] * 64, max_new_tokens=3,
                    sampling=SamplingConfig(temperature=1.0), seed=0)
    assert [len(r) for r in rows] == [3] * 64
    rows = np.array(rows)
    assert (rows == 0).any()  # this seed draws id 0 (192 draws, P(none) = 4%)
    repeats = (rows[:, 1:] == rows[:, :-1]).sum(axis=0)
    assert np.all(repeats <= 8), repeats  # 64/61 ≈ 1 expected per step pair; 64 with a reused key


def test_a_prefill_as_long_as_the_cache_fits_and_equals_the_full_forward():
    """A prompt of exactly S tokens fits a cache of S positions (only T > S is refused), with
    the full forward's logits (the same computation: float32 rounding only)."""
    cfg, params = _setup("diff")
    seq = jnp.asarray(np.random.default_rng(4).integers(1, V, (2, 8)), jnp.int32)
    full = np.asarray(DecoderLM(cfg).apply({"params": params}, seq))
    model = DecoderLM(cfg, decode=True)
    cache = model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["cache"]  # S = 8
    logits, _ = model.apply({"params": params, "cache": cache}, seq, mutable=["cache"])
    np.testing.assert_allclose(np.asarray(logits), full, rtol=1e-6, atol=2e-6)


def test_a_row_that_stops_at_eos_does_not_stop_the_others():
    """Each row stops after its own first `eos_id`; the others go on to max_new_tokens (or their
    own eos) with the tokens they draw without it (sampled: the initial model's greedy tokens
    repeat the last one, which hides a row that stopped being fed)."""
    cfg, params = _setup("transformer")
    prompts, hot = [[3, 4], [7, 1, 1, 9]], SamplingConfig(temperature=1.0)
    alone = generate(cfg, params, prompts, max_new_tokens=6, sampling=hot, seed=1)
    eos = alone[0][0]
    want = [g[: g.index(eos) + 1] if eos in g else g for g in alone]
    assert len(want[0]) == 1 and len(set(want[1])) > 2, alone  # rows stop at different steps
    assert generate(cfg, params, prompts, max_new_tokens=6, sampling=hot, seed=1, eos_id=eos) == want


@pytest.mark.parametrize("bad", [-1, V])
def test_prompt_ids_outside_the_vocabulary_are_refused_naming_the_prompt(bad):
    """A negative id would wrap around and one >= V embed as NaN under jit: both are refused."""
    cfg, params = _setup("transformer")
    with pytest.raises(ValueError, match=rf"prompt 1 has token ids outside \[0, {V}\)"):
        generate(cfg, params, [[3], [4, bad]], max_new_tokens=2)


def test_quantized_attention_logits_are_refused_with_a_kv_cache():
    """attn_logit_bits' absmax scale spans each whole score map: a decode step saw one query
    row (its own scale), and the prefill's map the other prompts' padding, so one prompt's
    tokens changed with its batch companions and differed from the full forward."""
    cfg, params = _setup("diff", attn_logit_bits=8)
    with pytest.raises(ValueError, match=r"^model\.attn_logit_bits must be null with a KV cache"):
        generate(cfg, params, [[3, 4]], max_new_tokens=2)
    model = DecoderLM(cfg, decode=True, attention_op=AttentionOp.build(cfg).quantized(jnp.int32(8)))
    with pytest.raises(ValueError, match=r"attn_logit_bits must be null with a KV cache"):
        empty_cache(model, 1, 4)


def test_prompts_may_be_arrays_and_ids_that_are_not_ints_are_refused():
    """A (B, T) NumPy or jax array is B prompts; float ids were truncated without a word, an
    array failed on its truth value, a flat list with "no len()", and a float max_new_tokens,
    top_k or seed inside tracing."""
    cfg, params = _setup("transformer")
    want = generate(cfg, params, [[3, 4], [5, 6]], max_new_tokens=3)
    assert generate(cfg, params, np.array([[3, 4], [5, 6]]), max_new_tokens=3) == want
    assert generate(cfg, params, jnp.array([[3, 4], [5, 6]]), max_new_tokens=3) == want
    assert generate(cfg, params, [np.array([3, 4]), (5, 6)], max_new_tokens=np.int64(3)) == want
    for prompts, message in [([[1.7, 2.9]], r"^prompt 0 has a token id that is not an int: 1\.7$"),
                             ([[3], [4, "5"]], r"^prompt 1 has a token id that is not an int: '5'$"),
                             ([3, 4], r"^prompt 0 must be a sequence of token ids, got int$"),
                             (["34"], r"^prompt 0 must be a sequence of token ids, got str$"),
                             (np.array([3, 4]), r"^prompt 0 must be a sequence of token ids"),
                             (7, r"^prompts must be a sequence of token-id sequences, got int$"),
                             ("34", r"^prompts must be a sequence of token-id sequences, got str$")]:
        with pytest.raises(ValueError, match=message):
            generate(cfg, params, prompts, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^max_new_tokens must be an int >= 1, got 3\.0$"):
        generate(cfg, params, [[3, 4]], max_new_tokens=3.0)
    with pytest.raises(ValueError, match=r"^top_k must be an int >= 0, got 2\.5$"):
        SamplingConfig(temperature=1.0, top_k=2.5)


@pytest.mark.parametrize("eos_id", [3.5, V, 2**40, -1, True])
def test_an_eos_id_that_is_no_token_of_the_vocabulary_is_refused(eos_id):
    """3.5 stopped at token 3, 2**40 was an OverflowError, and an id outside the vocabulary never
    stops a row (-1 silently meant none)."""
    cfg, params = _setup("transformer")
    with pytest.raises(ValueError, match=rf"^eos_id must be None or an int in \[0, {V}\) "):
        generate(cfg, params, [[3, 4]], max_new_tokens=2, eos_id=eos_id)


def test_a_whole_config_or_sampling_settings_of_another_type_are_refused_naming_them():
    """A `Config` where its `.model` is meant failed in an AttributeError on its first field, a
    dict of sampling settings likewise; a temperature or top_p given as a string failed in
    math.isfinite or a comparison naming neither, and top_k=True ran as top-1."""
    from diff_jax.config import Config

    cfg, params = _setup("transformer")
    with pytest.raises(TypeError, match=r"^DecoderLM takes a ModelConfig \(a Config's \.model\), "
                                        r"got Config$"):
        generate(Config(model=cfg, train=dataclasses.replace(Config().train, seq_len=16)),
                 params, [[3, 4]], max_new_tokens=2)
    with pytest.raises(TypeError, match=r"^sampling must be a SamplingConfig, got dict$"):
        generate(cfg, params, [[3, 4]], max_new_tokens=2, sampling={"temperature": 1.0})
    for field, value in [("temperature", "0.5"), ("top_p", "0.9"), ("top_k", True)]:
        with pytest.raises(ValueError, match=rf"^{field} must be .*, got {value!r}$"):
            SamplingConfig(**{field: value})


@pytest.mark.parametrize("seed", [-1, 2**32, 2**63, 1.0])
def test_a_seed_outside_32_bits_is_refused(seed):
    """jax.random.key keeps a seed's low 32 bits: seed 2**32 sampled what seed 0 samples, and
    2**63 was an OverflowError."""
    cfg, params = _setup("transformer")
    with pytest.raises(ValueError, match=r"^seed must be an int in \[0, 2\*\*32\), got "):
        generate(cfg, params, [[3, 4]], max_new_tokens=2, sampling=SamplingConfig(1.0), seed=seed)


def test_the_decoding_program_holds_the_kv_cache_once_not_as_an_argument_beside_its_loop_copy():
    """`generate` used to pass the cache's zeros into the jitted decode, where the while loop
    holds its own copy: 2.05 times the cache at the peak (arguments + temporaries, XLA's count
    for this 16.8 MB cache); made inside the program, 1.28 times."""
    cfg = ModelConfig(vocab_size=V, embed_dim=64, num_layers=2, num_heads=2, max_seq_len=4096)
    params = nn.meta.unbox(DecoderLM(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    model, rows, width, new = DecoderLM(cfg, decode=True), 4, 8, 4088
    cache = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((rows, width + new), jnp.int32))
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache["cache"]))
    memory = _generate.lower(model, params, jax.ShapeDtypeStruct((rows, width), jnp.int32),
                             jax.ShapeDtypeStruct((rows,), jnp.int32), jnp.int32(rows),
                             jax.random.key(0), jnp.int32(-1), jnp.int32(new),
                             sampling=SamplingConfig(), new_width=new).compile().memory_analysis()
    assert memory.argument_size_in_bytes < 0.1 * cache_bytes
    assert memory.argument_size_in_bytes + memory.temp_size_in_bytes < 1.5 * cache_bytes


def test_prompts_of_other_lengths_reuse_the_program_of_their_padded_width():
    """A batch is padded to one of four widths a doubling (at least 16, at most max_seq_len −
    max_new_tokens): prompts of 3 to 16 tokens run one compiled program, 17 a second; at the
    prompts' own width a loop over lengths compiled one each. Every row is still the uncached
    greedy loop's."""
    cfg, params = _setup("diff_v2")
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(1, V, n)] for n in (3, 7, 16, 17)]
    before = _generate._cache_size()
    got = [generate(cfg, params, [p], max_new_tokens=4)[0] for p in prompts[:3]]
    assert _generate._cache_size() == before + 1
    got.append(generate(cfg, params, [prompts[3]], max_new_tokens=4)[0])
    assert _generate._cache_size() == before + 2
    assert got == [_uncached_greedy(cfg, params, p, 4) for p in prompts]
    assert [padded_size(n, 1000) for n in (1, 16, 17, 21, 33, 41, 64, 65, 257, 448, 449)] == [
        16, 16, 20, 24, 40, 48, 64, 80, 320, 448, 512]
    assert [padded_size(n, 26) for n in (1, 25, 26)] == [16, 26, 26]  # 28 > 26: capped
    assert padded_size(3, 12) == 12  # max_seq_len − max_new_tokens below 16
    assert [padded_size(n, minimum=1) for n in (1, 2, 7, 8, 9, 11, 16, 17, 33, 100)] == [
        1, 2, 7, 8, 10, 12, 16, 20, 40, 112]


def test_other_batch_sizes_and_max_new_tokens_reuse_a_program_and_padding_changes_no_row():
    """Batches of 9 and 10 prompts run one program (padded to 10 rows), and max_new_tokens 5
    and 9 one loop (16 steps a row, stopped at each call's own count): at their own sizes each
    compiled its own. Padding rows start finished, so they neither add tokens nor keep the loop
    running; a row's sampled tokens do not depend on the rows after it, nor on the padding."""
    cfg, params = _setup("diff")
    rng = np.random.default_rng(6)
    prompts = [[int(x) for x in rng.integers(1, V, n)] for n in rng.integers(2, 9, 10)]
    hot = SamplingConfig(temperature=1.0)
    before = _generate._cache_size()
    nine = generate(cfg, params, prompts[:9], max_new_tokens=5, sampling=hot, seed=3)
    ten = generate(cfg, params, prompts, max_new_tokens=9, sampling=hot, seed=3)
    assert _generate._cache_size() == before + 1
    assert [len(r) for r in nine] == [5] * 9 and [len(r) for r in ten] == [9] * 10
    assert [r[:5] for r in ten[:9]] == nine
    alone = generate(cfg, params, prompts[:1], max_new_tokens=9, sampling=hot, seed=3)
    assert alone == ten[:1]
    greedy = generate(cfg, params, prompts[:9], max_new_tokens=3)
    assert greedy == [_uncached_greedy(cfg, params, p, 3) for p in prompts[:9]]


def test_the_edge_ids_and_lengths_of_the_valid_ranges_are_accepted():
    """Token id 0 in a prompt, eos_id 0 and max_new_tokens 1 lie inside their ranges ([0, V),
    [0, V), >= 1) and are served, not refused. With every parameter zero every logit ties, so
    greedy decoding draws token 0 (argmax's first) at every step: eos_id 0 stops each row after
    its first token."""
    cfg, params = _setup("transformer")
    assert generate(cfg, params, [[0, 5, 0]], max_new_tokens=1) == [
        _uncached_greedy(cfg, params, [0, 5, 0], 1)]
    zeros = jax.tree.map(jnp.zeros_like, params)
    assert generate(cfg, zeros, [[3, V - 1], [0]], max_new_tokens=4) == [[0] * 4] * 2
    assert generate(cfg, zeros, [[3, V - 1], [0]], max_new_tokens=4, eos_id=0) == [[0], [0]]


def test_the_padded_prompts_and_steps_never_make_a_cache_longer_than_max_seq_len(monkeypatch):
    """`generate` pads the prompts' width W and the new tokens' count to sizes of their own, but
    the KV cache `_generate` makes, W + new_width positions a row, stays within model.max_seq_len
    (32 here) for every request that fits, while holding the longest prompt and max_new_tokens
    steps (a spy in place of `_generate`: nothing compiles)."""
    import diff_jax.generate

    cfg, params = _setup("transformer")
    seen = []

    def spy(model, params, tokens, lengths, rows, key, eos_id, max_new_tokens, *, sampling,
            new_width):
        seen.append((tokens.shape, new_width))
        return jnp.full((tokens.shape[0], new_width), -1, jnp.int32)

    monkeypatch.setattr(diff_jax.generate, "_generate", spy)
    for length in range(1, 32):
        for new in range(1, 33 - length):
            seen.clear()
            generate(cfg, params, [[1] * length], max_new_tokens=new)
            [((_, width), new_width)] = seen
            assert width >= length and new_width >= new, (length, new, width, new_width)
            assert width + new_width <= cfg.max_seq_len, (length, new, width, new_width)
