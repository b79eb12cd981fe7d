"""Associative-recall samples (`diff_jax.recall`), their training corpus, and `eval.py task=recall`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from diff_jax import recall
from diff_jax.data import PackedRows, load
from diff_jax.evaluation import recall as recall_task
from diff_jax.evaluation.options import EvalError, EvalOptions


def _sample(seed: int, *, length: int = 64, pairs: int = 6, queries: int = 3,
            share: float = 0.5) -> recall.RecallSample:
    return recall.make_sample(recall.eval_rng(seed), length=length, pairs=pairs, queries=queries,
                              distractor_share=share)


def test_queries_repeat_their_pair_and_the_answer_is_its_value():
    s = _sample(0)
    assert s.tokens.shape == (64,) and s.tokens[s.context_end] == recall.QUERY
    triples = [tuple(s.tokens[p: p + 3]) for p in s.pair_starts]
    assert list(s.pair_starts) == sorted(s.pair_starts)  # indexed in context order
    for r, i in enumerate(s.queried):
        q = s.query_start + 3 * r
        assert tuple(s.tokens[q: q + 3]) == triples[i]
        assert s.answer_positions[r] == q + 2 and s.answers[r] == triples[i][2]
    keys = [t[:2] for t in triples]
    assert len(set(keys)) == 6 and len({t[2] for t in triples}) == 6
    assert all(np.isin([t[0] for t in triples], recall.KEY_FIRST))
    assert all(np.isin([t[1] for t in triples], recall.KEY_SECOND))
    assert all(np.isin([t[2] for t in triples], recall.VALUES))


def test_distractors_share_exactly_one_key_token_with_a_queried_key():
    s = _sample(1, pairs=8, queries=4)
    assert s.distractor.sum() == recall.num_distractors(8, 0.5) == 4
    keys = [tuple(s.tokens[p: p + 2]) for p in s.pair_starts]
    queried = {keys[i] for i in s.queried}
    assert not any(s.distractor[i] for i in s.queried)
    for i in np.flatnonzero(s.distractor):
        assert any(sum(a == b for a, b in zip(keys[i], q)) == 1 for q in queried)


def test_the_haystack_is_one_counting_run_around_the_triples():
    """The context's non-triple tokens count through the haystack alphabet, and the triples are
    spread through them: with 77 haystack tokens around 3 triples, every one of the 4 gaps
    (before, between, after the triples) holds some in each of 5 seeds' samples (an empty gap
    has chance (3/4)^77). All the haystack in one gap before contiguous triples passed."""
    for seed in range(2, 7):
        s = _sample(seed, length=96, pairs=3, queries=3, share=0.0)
        in_pair = np.zeros(96, bool)
        for p in s.pair_starts:
            in_pair[p: p + 3] = True
        hay = s.tokens[: s.context_end][~in_pair[: s.context_end]]
        assert len(hay) == s.context_end - 9 and np.isin(hay, recall.HAYSTACK).all()
        steps = (np.diff(hay - recall.HAYSTACK[0]) % len(recall.HAYSTACK))
        assert (steps == 1).all()
        bounds = np.r_[0, np.repeat(s.pair_starts, 2) + [0, 3] * 3, s.context_end]
        gaps = bounds[1::2] - bounds[::2]  # haystack tokens before, between and after the triples
        assert (gaps > 0).all() and gaps.sum() == 77, (seed, gaps)


def test_more_queries_than_pairs_repeat_them_and_bad_sizes_are_refused():
    s = _sample(3, pairs=2, queries=5, share=0.0)
    assert sorted(set(s.queried.tolist())) == [0, 1] and len(s.queried) == 5
    with pytest.raises(ValueError, match="too short"):
        _sample(0, length=20, pairs=6)
    with pytest.raises(ValueError, match="not a distractor"):
        _sample(0, pairs=1, share=0.5 + 1e-9)  # rounds to one distractor of one pair
    with pytest.raises(ValueError, match="values differ"):
        _sample(0, length=400, pairs=len(recall.VALUES) + 1, queries=1, share=0.0)


class _Draws:
    """A generator that fails the test after `limit` draws instead of looping for ever."""

    def __init__(self, rng: np.random.Generator, limit: int):
        self.rng, self.left = rng, limit

    def __getattr__(self, name):
        def draw(*args, **kwargs):
            self.left -= 1
            assert self.left >= 0, "make_sample kept drawing: it would never finish"
            return getattr(self.rng, name)(*args, **kwargs)
        return draw


def test_more_distractors_than_a_queried_key_has_near_duplicates_are_refused():
    # one queried key (a, b) has 15 + 15 keys sharing exactly one token; 31 distractors cannot differ
    with pytest.raises(ValueError, match="31 distractors need as many keys sharing one token"):
        recall.make_sample(_Draws(recall.eval_rng(0), 10_000), length=200, pairs=32, queries=1,
                           distractor_share=31 / 32)
    s = recall.make_sample(recall.eval_rng(0), length=200, pairs=32, queries=2,
                           distractor_share=30 / 32)  # two queried keys leave room for 30
    assert s.distractor.sum() == 30


def _evaluated(needles: int, queries: int, length: int = 32,
               samples: int = 500) -> list[recall.RecallSample]:
    """The samples `eval.py task=recall` scores in one cell (seed 0, no distractors)."""
    return recall_task.cell_samples(EvalOptions(task="recall", needles=needles, queries=queries,
                                                distractors=0.0, samples=samples), length)


def _keys(samples: list[recall.RecallSample]) -> list[list[tuple[int, ...]]]:
    """Per sample, its context's keys (a, b), sorted."""
    return [sorted(map(tuple, s.tokens[s.pair_starts[:, None] + [0, 1]].tolist()))
            for s in samples]


def test_samples_are_deterministic_and_training_never_reproduces_an_evaluation_item():
    """Samples are a function of their seed; none of 3000 training samples of length 32 is one
    the task evaluates (`cell_samples`, the task's own sampler) in its cells of 1 or 2 pairs at
    that length; and each cell draws from a stream of its own, so cells that differ only in
    their queries or length do not start with the same keys (one stream for every cell of a
    seed, where every cell's first sample has the same keys, passed every test: the evaluated
    items were built here, not by the task)."""
    np.testing.assert_array_equal(_sample(5).tokens, _sample(5).tokens)
    assert not np.array_equal(_sample(5).tokens, _sample(6).tokens)
    train = recall.training_samples(recall.train_rng(0), count=3000, length=32, max_pairs=2,
                                    distractor_shares=(0.0,))
    seen = {s.tokens.tobytes() for s in train}
    assert len(seen) == len(train)
    cells = {(n, r): _evaluated(n, r) for n in (1, 2) for r in range(1, n + 1)}
    evaluated = [s for samples in cells.values() for s in samples]
    assert not seen & {s.tokens.tobytes() for s in evaluated}
    assert _keys(cells[2, 1][:1]) != _keys(cells[2, 2][:1])
    firsts = {tuple(_keys(_evaluated(1, 1, length, samples=1))[0]) for length in range(32, 48)}
    assert len(firsts) > 8  # 16 lengths' first keys, of 256 possible
    # Same generator settings, other seed domain: the streams differ from the first draw on.
    a = recall.training_samples(recall.train_rng(0), count=1, length=32, max_pairs=2,
                                distractor_shares=(0.0,))[0]
    b = recall.training_samples(recall.eval_rng(0), count=1, length=32, max_pairs=2,
                                distractor_shares=(0.0,))[0]
    assert not np.array_equal(a.tokens, b.tokens)


def test_training_corpus_puts_one_sample_in_each_row(tmp_path):
    samples = recall.training_samples(recall.train_rng(1), count=20, length=32, max_pairs=5,
                                      distractor_shares=(0.0, 0.5))
    recall.write_training_corpus(tmp_path / "c", samples, {"seed": 1})
    corpus = load(tmp_path / "c")
    assert corpus.vocab_size == recall.VOCAB_SIZE and corpus.num_docs == 20
    rows = PackedRows(corpus, 33, seed=0, shuffle=False)
    for j in (0, 7, 18):
        row = rows[j]
        np.testing.assert_array_equal(row["tokens"], np.append(samples[j].tokens, recall.EOT))
        assert (row["segment_ids"] == 1).all() and row["positions"][0] == 0


def test_query_loss_mask_counts_exactly_the_query_part(tmp_path):
    samples = recall.training_samples(recall.train_rng(2), count=12, length=32, max_pairs=5,
                                      distractor_shares=(0.0, 0.5))
    recall.write_training_corpus(tmp_path / "q", samples, {"seed": 2}, loss="queries")
    recall.write_training_corpus(tmp_path / "a", samples, {"seed": 2})
    rows = PackedRows(load(tmp_path / "q"), 33, seed=0, shuffle=False)
    assert len(rows) == len(samples) - 1  # the last row would need one token past the end
    for j, s in enumerate(samples[: len(rows)]):
        # target i is token i + 1: it counts from the first query's key token to the end-of-text;
        # the row's last target is the next sample's first token, which does not count
        expected = np.r_[np.arange(1, 33) >= s.query_start, False].astype(np.int32)
        np.testing.assert_array_equal(rows[j]["loss_mask"], expected)
        assert rows[j]["loss_mask"][s.answer_positions - 1].all()
        assert not rows[j]["loss_mask"][: s.context_end].any()
    plain = load(tmp_path / "a")
    assert plain.loss_mask is None
    assert PackedRows(plain, 33, seed=0, shuffle=False)[3]["loss_mask"].all()
    with pytest.raises(ValueError, match="loss must be one of"):
        recall.write_training_corpus(tmp_path / "x", samples, {}, loss="answers")


def test_recall_options_are_checked():
    with pytest.raises(EvalError, match="distractors"):
        EvalOptions(task="recall", distractors=1.0)
    assert EvalOptions(task="recall", needles=4, queries=2, distractors=0.5).distractors == 0.5


def test_recall_task_refuses_queries_that_would_repeat_a_pair():
    # 4 pairs, half distractors: 2 can be queried; a third query would repeat one of them, whose
    # value then stands in the prompt (the earlier query's triple) and would count as retrieved
    options = EvalOptions(task="recall", needles=4, queries=3, distractors=0.5, samples=2)
    with pytest.raises(EvalError, match=r"queries=3 exceeds the 2 of needles=4 .*queries <= 2"):
        recall_task.cell_samples(options, 48)
    # every pair a distractor: not "pass queries <= 0", itself refused
    with pytest.raises(EvalError, match=r"^recall: distractors=0\.9 leaves none of needles=4 to "
                                        r"query; lower distractors or raise needles$"):
        recall_task.cell_samples(dataclasses.replace(options, distractors=0.9, queries=1), 48)
    samples = recall_task.cell_samples(dataclasses.replace(options, queries=2), 48)
    assert all(sorted(s.queried.tolist()) == sorted(set(s.queried.tolist())) for s in samples)


def test_attention_shares_read_query_0s_key_rows_over_its_pair_and_the_context(monkeypatch):
    """The spans handed to span_shares, found from the tokens alone: the answer is the context
    triple whose key is query 0's (a, b), the context ends at QUERY, and the rows are query 0's
    two key tokens (not its value, which would see the answer as a token of the query)."""
    seen = []
    monkeypatch.setattr(recall_task, "span_shares",
                        lambda cfg, params, tokens, spans: seen.append(np.asarray(spans))
                        or np.zeros((1, 2)))
    samples = [_sample(seed) for seed in range(3)]
    recall_task.attention_shares(None, None, samples)
    for s, spans in zip(samples, seen):
        query = int(np.flatnonzero(s.tokens == recall.QUERY)[0])
        a, b = s.tokens[query + 1: query + 3]
        pair = [p for p in range(query) if s.tokens[p] == a and s.tokens[p + 1] == b]
        assert len(pair) == 1
        assert spans.tolist() == [pair[0], pair[0] + 3, query, query + 1, query + 3]


def test_the_task_reports_each_lengths_means_over_its_samples(tmp_path, monkeypatch, capsys):
    """recall_task from stubbed scorers: per length, the accuracy is the share of all its queries
    hit and the answer / noise shares the means over its 4 samples of each sample's (answer,
    noise) pair. A mean over each pair instead (sample 0's (answer + noise) / 2 reported as the
    answer share) passed every test: the pipeline only checks answer + noise <= 1. A model of
    exactly the task's 98 ids is scored (refusing it passed every test: theirs have 128), one
    of 97 refused. Progress (a line a length here, no interval) counts the lengths."""
    from diff_jax.config import Config, ModelConfig, TrainConfig
    from diff_jax.evaluation import report
    from diff_jax.evaluation.loading import Loaded

    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0)

    shares = {48: np.array([[0.1, 0.5], [0.3, 0.7], [0.2, 0.6], [0.4, 0.2]]),
              96: np.array([[0.0, 1.0], [0.0, 0.8], [0.2, 0.6], [0.2, 0.6]])}
    hit = {48: np.array([[True, False], [True, True], [False, False], [True, True]]),
           96: np.zeros((4, 2), bool)}
    monkeypatch.setattr(recall_task, "attention_shares",
                        lambda cfg, params, samples: shares[len(samples[0].tokens)])
    monkeypatch.setattr(recall_task, "hits", lambda cfg, params, samples, batch: hit[
        len(samples[0].tokens)])
    cfg = Config(model=ModelConfig(vocab_size=recall.VOCAB_SIZE), train=TrainConfig(seq_len=48))
    options = EvalOptions(task="recall", needles=4, queries=2, distractors=0.5, lengths=(48, 96),
                          samples=4)
    fields = recall_task.recall_task(Loaded(cfg, None, "stub", 0, tmp_path), options).fields
    assert fields["lengths"] == [48, 96] and fields["accuracy"] == [0.625, 0.0]
    assert fields["answer_share"] == pytest.approx([0.25, 0.1], abs=1e-12)
    assert fields["noise_share"] == pytest.approx([0.5, 0.75], abs=1e-12)
    assert [line.split("]")[1].split("  ETA")[0] for line in
            capsys.readouterr().err.splitlines()] == [" length 1/2  length 48",
                                                      " length 2/2  length 96"]
    small = dataclasses.replace(cfg, model=ModelConfig(vocab_size=recall.VOCAB_SIZE - 1))
    with pytest.raises(EvalError, match=r"model.vocab_size \(97\) is smaller than the task's 98"):
        recall_task.recall_task(Loaded(small, None, "stub", 0, tmp_path), options)
