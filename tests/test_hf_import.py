"""Import of local DiffLlamaForCausalLM / LlamaForCausalLM checkpoints (diff_jax.export.hf_import):
per-token log-probabilities from `eval.py task=score` equal torch's, import -> export -> import is
the identity, and what cannot be mapped exactly is refused with the reason."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from diff_jax import export as ex
from diff_jax.evaluation import EvalError
from diff_jax.evaluation import run as eval_run
from diff_jax.export.__main__ import main as export_main
from diff_jax.export.hf_import import import_hf, main
from diff_jax.export.safetensors_io import read_safetensors
from diff_jax.export.tokenizer import TOKENIZER_FILES

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
# |Δ log p| ≤ LOGP_RTOL·(1 + |log p|) against the torch model run in float64: our float32 rounding
# alone (a few ulps of the logits, whose size grows with |log p|); measured at most 4.2e-6 here.
# Two float32 forward passes differ by more (up to 2.1e-5 with transformers 5.23's two-call
# DiffLlama attention), so the reference is float64, not torch's float32.
LOGP_RTOL = 1e-5
CASES = {  # name: (architecture, attention heads, kv heads, tied embeddings, rope theta)
    "diffllama-mha": ("diffllama", 8, 8, False, 10_000.0),
    "diffllama-gqa": ("diffllama", 8, 4, True, 500_000.0),
    "llama-gqa": ("llama", 4, 2, False, 10_000.0),
}


def hf_model(name: str, seed: int = 0):
    """A random small float32 torch model of CASES[name], every parameter perturbed so that norms,
    λ and RoPE-sensitive rows all matter (std 0.3: log-probabilities far from uniform)."""
    kind, heads, kv, tie, theta = CASES[name]
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                  tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": theta})
    if kind == "diffllama":
        model = transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = 0.3 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if pname.endswith("norm.weight") else noise)
    return model.eval()


def save_hf(name: str, directory: Path, seed: int = 0):
    model = hf_model(name, seed)
    model.save_pretrained(directory)
    return model


def torch_logprobs(model, ids: np.ndarray) -> np.ndarray:
    """log p(ids[t+1] | ids[:t+1]) (T−1,) float64 from the torch model, run in float64 (the
    model is converted in place)."""
    with torch.no_grad():
        logits = model.double()(torch.tensor(ids[None], dtype=torch.long)).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        return logp[:-1].gather(1, torch.tensor(ids[1:, None], dtype=torch.long))[:, 0].numpy()


def eval_score(checkpoint: Path, ids: np.ndarray, tmp_path: Path) -> np.ndarray:
    """Per-token log-probabilities from `eval.py task=score checkpoint=...` (the library call)."""
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / "logp.npy"
    report = json.loads(eval_run(["task=score", f"checkpoint={checkpoint}", f"input={tmp_path / 'ids.npy'}",
                                  f"output={out}", f"out_dir={tmp_path / 'eval'}"]).read_text())
    assert report["num_scored"] == len(ids) - 1
    return np.load(out)


@pytest.mark.parametrize("name", list(CASES))
def test_imported_model_scores_like_torch(name, tmp_path):
    model = save_hf(name, tmp_path / "hf")
    out = import_hf(tmp_path / "hf", tmp_path / "ours")
    config, _ = ex.load(out)
    kind, heads, kv, tie, theta = CASES[name]
    expected_heads = (heads // 2, kv // 2) if kind == "diffllama" else (heads, kv)
    assert (config.variant, config.num_heads, config.kv_heads, config.tie_embeddings, config.rope_theta) == (
        "diff" if kind == "diffllama" else "transformer", *expected_heads, tie, theta)
    ids = np.random.default_rng(1).integers(0, VOCAB, 64).astype(np.int32)  # the whole context
    ours = eval_score(out, ids, tmp_path)
    theirs = torch_logprobs(model, ids)
    assert theirs.std() > 0.5 and theirs.mean() < -np.log(VOCAB) + 0.5  # far from uniform: sensitive
    diff = np.abs(ours - theirs)
    print(f"{name}: max |Δ log p| {diff.max():.2e}, max rel {(diff / np.abs(theirs)).max():.2e}, "
          f"log p in [{theirs.min():.1f}, {theirs.max():.1f}]")
    assert np.all(diff <= LOGP_RTOL * (1 + np.abs(theirs)))


def test_bfloat16_checkpoint_imports_exactly(tmp_path):
    model = hf_model("diffllama-gqa", seed=3).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    stored, _ = read_safetensors(tmp_path / "hf" / "model.safetensors")
    assert str(stored["model.embed_tokens.weight"].dtype) == "bfloat16"
    out = import_hf(tmp_path / "hf", tmp_path / "ours")
    _, params = ex.load(out)
    np.testing.assert_array_equal(params["embed"], stored["model.embed_tokens.weight"].astype(np.float32))
    ids = np.random.default_rng(4).integers(0, VOCAB, 64).astype(np.int32)
    # the same bf16 values computed in float64 (reloaded: `.double()` would keep RoPE frequencies
    # rounded to bf16 by `.to(torch.bfloat16)`)
    reloaded = transformers.DiffLlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    theirs = torch_logprobs(reloaded.eval(), ids)
    ours = eval_score(out, ids, tmp_path)
    assert np.all(np.abs(ours - theirs) <= LOGP_RTOL * (1 + np.abs(theirs)))


@pytest.mark.parametrize("name", ["diffllama-mha", "diffllama-gqa"])
def test_import_export_import_is_the_identity(name, tmp_path):
    save_hf(name, tmp_path / "hf", seed=2)
    first = import_hf(tmp_path / "hf", tmp_path / "first")
    exported = ex.export(first, tmp_path / "exported", "hf-diffllama", tokenizer="none")
    original, _ = read_safetensors(tmp_path / "hf" / "model.safetensors")
    again, _ = read_safetensors(exported / "model.safetensors")
    assert again.keys() == original.keys()
    for k, v in original.items():  # the HF tensors themselves come back bit for bit
        np.testing.assert_array_equal(again[k], v, err_msg=k)
    second = import_hf(exported, tmp_path / "second")
    (c1, p1), (c2, p2) = ex.load(first), ex.load(second)
    assert c1 == c2
    jax.tree.map(np.testing.assert_array_equal, p1, p2)


def test_an_import_exports_without_tokenizer_files_unless_one_is_named(tmp_path, capsys):
    """An import records no data.tokenizer (its vocabulary is its own tokenizer's): its
    hf-diffllama export wrote cl100k's tokenizer files and eos id without a word when the
    vocabulary was large enough (and was refused for cl100k's ids when it was not); now it
    writes none unless --tokenizer names one, where the import recorded none (its HF_DIR held no
    tokenizer.json), and says so."""
    save_hf("diffllama-mha", tmp_path / "hf", seed=2)
    first = import_hf(tmp_path / "hf", tmp_path / "first")
    capsys.readouterr()
    plain = ex.export(first, tmp_path / "plain", "hf-diffllama")
    assert not any((plain / f).exists() for f in TOKENIZER_FILES)
    assert json.loads((plain / "config.json").read_text()).get("eos_token_id") is None
    assert capsys.readouterr().out == (
        f"note: no tokenizer files written: {first} records no tokenizer (no run's "
        "data.tokenizer, none it was trained with); pass --tokenizer with the one it was "
        "trained with\n")
    with pytest.raises(ex.ExportError, match=rf"^--tokenizer cl100k_first_256: its ids reach 256 "
                                             rf"but model.vocab_size is {VOCAB}; pass --tokenizer"):
        ex.export(first, tmp_path / "named", "hf-diffllama", tokenizer="cl100k_first_256")


def test_an_import_exports_the_tokenizer_it_recorded_while_that_file_is_unchanged(tmp_path, capsys):
    """An import records its HF_DIR's usable tokenizer.json (`trained_tokenizer`); exported again
    as hf-diffllama without --tokenizer, it wrote no tokenizer (the default was the run's
    data.tokenizer, which an import has none of). Now the default is that file where it is
    there and unchanged (`tokenizer.mismatch`): copied, its end-of-text the eos_token_id. Edited
    since, or gone: no tokenizer files, and one line saying why and what to pass."""
    from training_fixtures import sentencepiece_tokenizer

    hf = tmp_path / "hf"
    save_hf("diffllama-mha", hf, seed=2)
    sentencepiece_tokenizer(hf)  # 73 ids, within the model's VOCAB
    first = import_hf(hf, tmp_path / "first")
    capsys.readouterr()
    out = ex.export(first, tmp_path / "out", "hf-diffllama")
    assert capsys.readouterr().out == ""
    for name in TOKENIZER_FILES[:2]:
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    trained = json.loads((first / "export.json").read_text())["trained_tokenizer"]
    assert json.loads((out / "export.json").read_text())["trained_tokenizer"] == trained

    file = hf / "tokenizer.json"
    file.write_text(file.read_text() + "\n")  # the same tokenizer, another file
    now = hashlib.sha256(file.read_bytes()).hexdigest()
    edited = ex.export(first, tmp_path / "edited", "hf-diffllama")
    assert not any((edited / f).exists() for f in TOKENIZER_FILES)
    assert capsys.readouterr().out == (
        "note: no tokenizer files written (by default --tokenizer is the tokenizer the "
        f"parameters were trained with): {first} was trained with the Hugging Face tokenizer "
        f"{hf.resolve()} (tokenizer.json SHA-256 {trained['tokenizer_sha256'][:12]}…) but "
        f"--tokenizer {hf.resolve()} is that file changed since (SHA-256 {now[:12]}… now); set "
        "--tokenizer to that tokenizer.json\n")
    file.unlink()
    assert export_main([str(first), "--format", "hf-diffllama", "--out",
                        str(tmp_path / "gone")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "note: no tokenizer files written (by default --tokenizer is the tokenizer the "
        f"parameters were trained with): {first} was trained with the tokenizer {hf.resolve()}, "
        f"which cannot be read now (no such file ({hf.resolve()} holds no tokenizer.json)); set "
        "--tokenizer to that tokenizer.json")
    assert not any((tmp_path / "gone" / f).exists() for f in TOKENIZER_FILES)


@pytest.mark.parametrize("name", ["llama-gqa", "diffllama-gqa"])
def test_sharded_checkpoint_imports_like_the_single_file(name, tmp_path):
    """Real checkpoints come as shards listed in model.safetensors.index.json: the import reads
    every shard and gives bit for bit the parameters of the same model saved as one file."""
    model = hf_model(name, seed=5)
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="64KB")
    sharded = tmp_path / "sharded"
    assert not (sharded / "model.safetensors").exists()
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 3, shards
    single_names = set(read_safetensors(tmp_path / "single" / "model.safetensors")[0])
    assert set(weight_map) == single_names
    c1, p1 = ex.load(import_hf(tmp_path / "single", tmp_path / "from-single"))
    c2, p2 = ex.load(import_hf(sharded, tmp_path / "from-sharded"))
    assert c1 == c2
    assert jax.tree.structure(p1) == jax.tree.structure(p2)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    (sharded / shards[1]).unlink()  # a shard the index lists is needed, not skipped
    with pytest.raises(ex.ExportError, match=rf"{shards[1]}: missing"):
        import_hf(sharded, tmp_path / "incomplete")


def test_cli_imports_prints_how_to_fine_tune_and_refuses_overwriting(tmp_path, capsys):
    save_hf("llama-gqa", tmp_path / "hf")
    out = tmp_path / "ours"
    assert main([str(tmp_path / "hf"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"train.init_from={out}" in printed and "model.variant=transformer" in printed
    # commands an installed diff-jax runs too: it has no train.py or eval.py to run
    evaluate, fine_tune = printed.splitlines()[1:]
    assert evaluate == f"evaluate:  python -m diff_jax.eval task=ppl checkpoint={out}"
    assert fine_tune.startswith("fine-tune: python -m diff_jax.train model.variant=transformer ")
    # a run directory of its own: the config file's may hold a run, which would resume instead
    assert printed.rstrip().endswith(f"train.init_from={out} train.run_dir=runs/ours-finetune")
    assert json.loads((out / "export.json").read_text())["format"] == "orbax-params"
    assert main([str(tmp_path / "hf"), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([str(tmp_path / "hf"), "--out", str(out), "--overwrite"]) == 0
    capsys.readouterr()
    blocked = tmp_path / "a-file" / "ours"
    (tmp_path / "a-file").write_text("not a directory")
    assert main([str(tmp_path / "hf"), "--out", str(blocked)]) == 2
    assert capsys.readouterr().err == (f"error: --out {blocked}: {tmp_path / 'a-file'}: File "
                                       "exists and is not a directory\n")


def test_a_tokenizer_whose_ids_fill_the_vocabulary_exactly_is_the_checkpoints_own(tmp_path):
    """`own_encoding`: a tokenizer.json of 73 ids (0-72) fits a vocab_size of 73; one id fewer
    in the model and it is refused, naming the file, the largest id and the vocab_size."""
    from diff_jax.config import ModelConfig
    from diff_jax.export.hf_import import own_encoding
    from training_fixtures import sentencepiece_tokenizer

    sentencepiece_tokenizer(tmp_path)
    enc, unusable = own_encoding(tmp_path, ModelConfig(vocab_size=73, embed_dim=64, num_heads=2))
    assert enc.n_vocab == 73 and enc.name == str(tmp_path.resolve()) and unusable is None
    enc, unusable = own_encoding(tmp_path, ModelConfig(vocab_size=72, embed_dim=64, num_heads=2))
    assert enc is None and unusable == (f"{tmp_path.resolve() / 'tokenizer.json'}: its ids reach "
                                        "72, past the model's vocab_size 72")


def test_an_hf_dir_with_its_tokenizer_gets_commands_that_read_text_with_it(tmp_path, capsys):
    """A tokenizer.json beside the checkpoint whose ids fit the model: the printed commands pass
    `data.tokenizer=HF_DIR` (absolute), and the evaluate command's tokenizer is the one that
    reads a prompt (`task=generate`: its token count is the word-level tokenizer's). One whose
    ids do not fit: a note says the commands read text with cl100k, and why."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from diff_jax.export.tokenizer import build_tokenizer

    hf = tmp_path / "hf"
    save_hf("llama-gqa", hf)
    words = ["<unk>", "</s>", "hello", "world", *(f"w{i}" for i in range(VOCAB - 4))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    out = tmp_path / "ours"
    assert main([str(hf), "--out", str(out)]) == 0
    evaluate, fine_tune = capsys.readouterr().out.splitlines()[1:]
    assert evaluate == (f"evaluate:  python -m diff_jax.eval task=ppl checkpoint={out} "
                        f"data.tokenizer={hf.resolve()}")
    assert f" data.tokenizer={hf.resolve()} train.run_dir=runs/ours-finetune" in fine_tune
    report = json.loads(eval_run(["task=generate", f"checkpoint={out}", "prompt=hello w3 world",
                                  "max_new_tokens=2", f"data.tokenizer={hf.resolve()}",
                                  f"out_dir={tmp_path / 'eval'}"]).read_text())
    assert report["prompt_tokens"] == 3 and all(t < VOCAB for t in report["new_tokens"])
    # the import records that tokenizer: text read with another one is refused, naming it
    trained = json.loads((out / "export.json").read_text())["trained_tokenizer"]
    assert trained["tokenizer"] == str(hf.resolve()) and trained["tokenizer_eot"] == 1
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text((hf / "tokenizer.json").read_text().replace('"w3"',
                                                                                     '"w3x"'))
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(EvalError, match=rf"^{out} was trained with the Hugging Face tokenizer "
                                        rf"{hf.resolve()} \(tokenizer.json SHA-256 "
                                        rf"{trained['tokenizer_sha256'][:12]}…\) but "
                                        rf"data.tokenizer={other} is another; set data.tokenizer "
                                        "to that tokenizer.json$"):
        eval_run(["task=generate", f"checkpoint={out}", "prompt=hello", f"data.tokenizer={other}"])

    build_tokenizer("cl100k_first_1000").save(str(hf / "tokenizer.json"))  # 1,001 ids
    (hf / "tokenizer_config.json").unlink()
    assert main([str(hf), "--out", str(out), "--overwrite"]) == 0
    printed = capsys.readouterr().out
    assert (f"note: the commands below read text with cl100k, not the checkpoint's tokenizer "
            f"({hf.resolve() / 'tokenizer.json'}: its ids reach 1000, past the model's vocab_size "
            f"{VOCAB})") in printed
    assert "data.tokenizer" not in printed


@pytest.mark.parametrize("name", ["llama-gqa", "diffllama-gqa"])
def test_eval_with_a_llama_tokenizer_reads_text_as_transformers_and_scores_as_torch(name, tmp_path,
                                                                                    capsys):
    """An import with a Llama-2-style tokenizer beside it (<s> before a text, "▁" for a space),
    evaluated with the data.tokenizer its printed command names, against transformers' tokenizer
    and the torch model run in float64: task=choice's sums are torch's over <s> + context + choice
    split as lm-eval's `_encode_pair` splits them (with add_bos_token=True; an empty context is
    <s>), its accuracies those of these sums; where a token spans the boundary ("ab" + "c" is
    "▁a" "bc"), the choice's ids are those transformers decodes to context + choice after the
    context's. task=score's log-probs are torch's over transformers' ids of the text;
    task=generate's greedy tokens are torch's `generate`."""
    from training_fixtures import sentencepiece_tokenizer

    hf, out, work = tmp_path / "hf", tmp_path / "ours", tmp_path / "eval"
    model = save_hf(name, hf)
    sentencepiece_tokenizer(hf)
    assert main([str(hf), "--out", str(out)]) == 0
    flag = f"data.tokenizer={hf.resolve()}"
    assert flag in capsys.readouterr().out.splitlines()[1]
    tok = transformers.AutoTokenizer.from_pretrained(hf)

    def run(*args: str) -> dict:
        report = eval_run([*args, f"checkpoint={out}", flag, f"out_dir={work}"])
        return json.loads(report.read_text())

    items = [{"context": "the capital of paris is", "choices": [" berlin", " the city of rome"],
              "label": 1},
             {"context": "the city is ", "choices": ["paris", "rome", "the capital"], "label": 0},
             {"context": "", "choices": ["paris", "the capital"], "label": 1},
             {"context": "ab", "choices": ["c", " c"], "label": 0},
             {"context": "café 日本 is", "choices": [" rome", " of", " a", " the", " print(x)"],
              "label": 4}]  # <unk>s
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    got = run("task=choice", f"input={tmp_path / 'items.jsonl'}", "batch_size=4")
    sums = []
    for item in items:
        sums.append([])
        for choice in item["choices"]:
            context = item["context"].rstrip()
            choice = item["context"][len(context):] + choice
            if not context:
                head, tail = [tok.bos_token_id], tok(choice, add_special_tokens=False)["input_ids"]
            else:
                head, whole = tok(context)["input_ids"], tok(context + choice)["input_ids"]
                tail = whole[len(head):]
                if whole[:len(head)] != head:  # "ab" + "c": "c" after "▁ab"
                    assert (context, choice) == ("ab", "c")
                    tail = tok.convert_tokens_to_ids(["c"])
                    assert tok.decode(head + tail, skip_special_tokens=True) == context + choice
            assert head[0] == tok.bos_token_id == 1
            sums[-1].append(torch_logprobs(model, np.array(head + tail))[-len(tail):].sum())
    for ours, theirs in zip(got["logprobs"], sums):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    labels = np.array([i["label"] for i in items])
    argmax = [int(np.argmax(s)) for s in sums]
    per_char = [int(np.argmax(np.array(s) / [len(c) for c in i["choices"]]))
                for s, i in zip(sums, items)]
    assert got["predictions"] == argmax and got["predictions_norm"] == per_char
    assert got["accuracy"] == np.mean(argmax == labels)
    assert got["accuracy_norm"] == np.mean(per_char == labels)

    text = "the capital of paris is the city of paris, print(rome)"
    (tmp_path / "t.txt").write_text(text)
    run("task=score", f"input={tmp_path / 't.txt'}", f"output={tmp_path / 'logp.npy'}")
    ids = np.array(tok(text)["input_ids"])
    theirs = torch_logprobs(model, ids)
    assert ids[0] == 1
    assert np.all(np.abs(np.load(tmp_path / "logp.npy") - theirs) <= LOGP_RTOL * (1 + np.abs(theirs)))

    prompt = tok("the capital of", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                max_new_tokens=5, eos_token_id=2, pad_token_id=2)
    greedy = greedy[0, prompt.shape[1]:]
    generated = run("task=generate", "prompt=the capital of", "max_new_tokens=5")
    assert generated["prompt_tokens"] == prompt.shape[1]
    assert generated["new_tokens"] == greedy.tolist()  # no end-of-text among them


@pytest.mark.parametrize("name", ["absent", "a-file"])
def test_cli_and_import_hf_refuse_an_hf_dir_that_is_not_a_directory_alike(tmp_path, capsys, name):
    hf_dir = tmp_path / name
    if name == "a-file":
        hf_dir.write_text("not a checkpoint")
    line = f"{hf_dir}: not a directory (HF_DIR is a local save_pretrained directory)"
    with pytest.raises(ex.ExportError) as raised:
        import_hf(hf_dir, tmp_path / "ours")
    assert str(raised.value) == line
    assert main([str(hf_dir), "--out", str(tmp_path / "ours")]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"
    assert not (tmp_path / "ours").exists()


@pytest.fixture(scope="module")
def saved_diffllama(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hf")
    save_hf("diffllama-gqa", directory)
    return directory


@pytest.mark.parametrize("edit, reason", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling .* is set"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type is 'yarn'"),
    ({"attention_bias": True}, "attention_bias is true"),
    ({"mlp_bias": True}, "mlp_bias is true"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    ({"num_attention_heads": 4, "num_key_value_heads": 1}, r"num_key_value_heads \(1\) must both be even"),
    ({"num_key_value_heads": 6}, r"num_attention_heads \(8\) is not a multiple of "
                                 r"num_key_value_heads \(6\);"),  # in the file's own terms
    ({"head_dim": 16}, r"head_dim \(16\) · num_attention_heads \(8\) != hidden_size \(64\)"),
    ({"model_type": "mistral"}, "model_type 'mistral' cannot be imported"),
    ({"architectures": ["DiffLlamaForSequenceClassification"]}, "only DiffLlamaForCausalLM"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor is 0.5"),
    ({"attention_dropout": 0.1}, "attention_dropout is 0.1"),
    ({"sliding_window": 16}, "sliding_window is set"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers must be a positive integer, got '2'"),
    # more layers than the tensors hold: 10**30 of them filled the memory listing their names
    ({"num_hidden_layers": 3}, "num_hidden_layers is 3 but the checkpoint holds the tensors of 2 "
                               "layers"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_theta must be a positive number, got 0"),
    ({"rms_norm_eps": -1e-5}, r"rms_norm_eps must be a positive number, got -1e-05"),
    ({"hidden_size": 24, "head_dim": 3}, r"gives an invalid diff-jax model config: model.head_dim: .* got 3"),
    # fields of the wrong JSON type: a TypeError traceback, or read as another value ("false" tied)
    ({"model_type": ["diffllama"]}, r"model_type \['diffllama'\] cannot be imported"),
    ({"model_type": {}}, r"model_type \{\} cannot be imported"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be a boolean, got 'false'"),
    ({"attention_bias": "false"}, "attention_bias must be a boolean, got 'false'"),
    ({"use_sliding_window": 0}, "use_sliding_window must be a boolean, got 0"),
    ({"attention_dropout": []}, r"attention_dropout must be a number, got \[\]"),
    ({"architectures": 0}, "architectures must be a list of strings, got 0"),
    ({"partial_rotary_factor": True}, "partial_rotary_factor must be a number, got True"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
     "rope_parameters.rope_theta must be a positive number, got '1e4'"),
    ({"initializer_range": "0.02"}, "initializer_range must be a number, got '0.02'"),
])
def test_configs_without_an_exact_equivalent_are_refused(edit, reason, saved_diffllama, tmp_path):
    hf_dir = tmp_path / "edited"
    shutil.copytree(saved_diffllama, hf_dir)
    config = json.loads((hf_dir / "config.json").read_text()) | edit
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ex.ExportError, match=rf"edited/config.json: .*{reason}") as info:
        import_hf(hf_dir, tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_config_field_of_the_wrong_type_in_one_line(tmp_path, capsys):
    """model_type as a list was a TypeError traceback (exit 1): now the error line, exit 2."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": ["llama"]}))
    assert main([str(hf_dir), "--out", str(tmp_path / "ours")]) == 2
    assert capsys.readouterr().err == (
        f"error: {hf_dir / 'config.json'}: model_type ['llama'] cannot be imported; supported: "
        "['diffllama', 'llama'] (DiffLlamaForCausalLM, LlamaForCausalLM)\n")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("kind", ["llama", "diffllama"])
def test_keys_absent_from_config_json_take_the_transformers_class_defaults(kind):
    """A config.json without num_key_value_heads, head_dim, rms_norm_eps or tie_word_embeddings
    (older checkpoints and hand-written configs lack them) means what transformers' config class
    defaults it to; an explicit head_dim other than hidden_size / heads is kept (Llama only)."""
    from diff_jax.export.hf_import import model_config_from_hf

    minimal = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=8, max_position_embeddings=64)
    n = 2 if kind == "diffllama" else 1  # DiffLlama's heads are halves of ours
    for given in (minimal, minimal | {"num_key_value_heads": 4}):
        theirs = {"llama": transformers.LlamaConfig, "diffllama": transformers.DiffLlamaConfig}[kind](**given)
        ours = model_config_from_hf({"model_type": kind, **given}, "config.json")
        assert (n * ours.num_heads, n * ours.kv_heads, ours.resolved_head_dim, ours.norm_eps) == (
            theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim, theirs.rms_norm_eps)
        assert ours.norm_eps == {"llama": 1e-6, "diffllama": 1e-5}[kind]
        assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 10_000.0
        assert ours.tie_embeddings is theirs.tie_word_embeddings is False  # lm_head.weight is read
    if kind == "llama":
        wide = model_config_from_hf({"model_type": kind, **minimal, "head_dim": 32}, "config.json")
        assert wide.resolved_head_dim == 32 and wide.num_heads == 8


def test_rotary_frequency_buffers_of_older_checkpoints_are_dropped(saved_diffllama, tmp_path):
    """`rotary_emb.inv_freq` (saved by older transformers) is recomputed from rope_theta: the
    checkpoint imports to the same parameters as without it."""
    from diff_jax.export.hf_import import read_hf
    from diff_jax.export.safetensors_io import write_safetensors

    hf_dir = tmp_path / "with-inv-freq"
    shutil.copytree(saved_diffllama, hf_dir)
    tensors, _ = read_safetensors(hf_dir / "model.safetensors")
    inv_freq = 1.0 / 500_000.0 ** (np.arange(0, 8, 2, dtype=np.float32) / 8)
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq for i in range(2)}
    write_safetensors(hf_dir / "model.safetensors", tensors | buffers, {"format": "pt"})
    jax.tree.map(np.testing.assert_array_equal, read_hf(hf_dir).params, read_hf(saved_diffllama).params)


def test_checkpoints_that_do_not_match_their_config_are_refused(saved_diffllama, tmp_path):
    hf_dir = tmp_path / "edited"
    shutil.copytree(saved_diffllama, hf_dir)
    tensors, _ = read_safetensors(hf_dir / "model.safetensors")
    from diff_jax.export.safetensors_io import write_safetensors

    def rewrite(changed: dict) -> None:
        write_safetensors(hf_dir / "model.safetensors", changed, {"format": "pt"})

    rewrite(tensors | {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
    with pytest.raises(ex.ExportError, match=r"tensor 'model.layers.0.self_attn.q_proj.bias' .* no place"):
        import_hf(hf_dir, tmp_path / "out")
    rewrite(tensors | {"lm_head.weight": tensors["model.embed_tokens.weight"] + 1})
    with pytest.raises(ex.ExportError, match="tie_word_embeddings is true but lm_head.weight differs"):
        import_hf(hf_dir, tmp_path / "out")
    rewrite({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.lambda_k2"})
    with pytest.raises(ex.ExportError, match=r"model.layers.1.self_attn.lambda_k2: missing"):
        import_hf(hf_dir, tmp_path / "out")
    rewrite(tensors | {"model.norm.weight": np.ones(32, np.float32)})
    with pytest.raises(ex.ExportError, match=r"'?norm.weight'? has shape \(32,\) but the config gives \(64,\)"):
        import_hf(hf_dir, tmp_path / "out")
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(ex.ExportError, match=r"no model.safetensors or model.safetensors.index.json"):
        import_hf(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fine_tuning_starts_from_the_imported_parameters(tmp_path):
    from diff_jax import train_loop
    from diff_jax.config import ConfigError
    from diff_jax.export.hf_import import finetune_overrides
    from diff_jax.export.init_from import check_same_model
    from training_fixtures import VOCAB as DATA_VOCAB, tiny_config, write_corpus

    hf_config = transformers.LlamaConfig(
        vocab_size=DATA_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(hf_config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    model.save_pretrained(tmp_path / "hf")
    out = import_hf(tmp_path / "hf", tmp_path / "imported")
    imported_config, imported = ex.load(out)
    lr = 1e-3
    # how the run computes is the config file's: model.scan_layers: true there is kept
    assert not [o for o in finetune_overrides(imported_config, out) if "scan_layers" in o]
    config = tiny_config(write_corpus(tmp_path / "corpus"), tmp_path / "run",
                         *finetune_overrides(imported_config, out), "train.steps=1", f"optim.lr={lr}",
                         "optim.warmup_steps=0", "checkpoint.async_save=false")
    assert config.train.init_from == str(out)
    result = train_loop.run(config)
    assert result.step == 1 and np.isfinite(result.loss)
    _, tuned = ex.load(tmp_path / "run")

    def moved(a, b) -> float:
        return float(np.abs(np.asarray(a) - np.asarray(b)).max())

    steps = jax.tree.leaves(jax.tree.map(moved, tuned, imported))
    assert 0 < max(steps) <= 2 * lr  # one AdamW step away from the imported parameters
    # a config whose model computes differently is refused, naming the field
    other = tiny_config(tmp_path / "corpus", tmp_path / "run2", f"train.init_from={out}")
    with pytest.raises(ConfigError, match=r"train.init_from: .* model.variant=transformer but the "
                                          r"config gives diff"):
        check_same_model(imported_config, other.model, str(out))


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hf")
    save_hf("llama-gqa", directory)
    return directory


def _rewrite(hf_dir: Path, edit) -> None:
    from diff_jax.export.safetensors_io import write_safetensors

    tensors, _ = read_safetensors(hf_dir / "model.safetensors")
    write_safetensors(hf_dir / "model.safetensors", edit(tensors), {"format": "pt"})


def _shard_with_extra_name(hf_dir: Path) -> None:
    names = read_safetensors(hf_dir / "model.safetensors")[0]
    (hf_dir / "model.safetensors").rename(hf_dir / "model-1.safetensors")
    weight_map = dict.fromkeys([*names, "model.extra.weight"], "model-1.safetensors")
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _index_naming_a_number(hf_dir: Path) -> None:
    names = read_safetensors(hf_dir / "model.safetensors")[0]
    (hf_dir / "model.safetensors").unlink()
    weight_map = dict.fromkeys(names, 1)
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _index_without_weight_map(hf_dir: Path) -> None:
    (hf_dir / "model.safetensors").unlink()
    (hf_dir / "model.safetensors.index.json").write_text("{}")


Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("kind, edit, error", [
    ("diffllama", lambda d: (d / "config.json").unlink(),
     "{d}/config.json: missing; HF_DIR must be a local save_pretrained directory"),
    ("diffllama", lambda d: (d / "config.json").write_text("{"), "{d}/config.json: not valid JSON: "),
    ("diffllama", lambda d: (d / "config.json").write_text("[]"),
     "{d}/config.json: expected a JSON object"),
    ("diffllama", _index_without_weight_map,
     "{d}/model.safetensors.index.json: not a safetensors index with a weight_map: 'weight_map'"),
    ("diffllama", _index_naming_a_number,  # was a TypeError: Path / int
     "{d}/model.safetensors.index.json: weight_map's values must be shard file names, got 1"),
    ("diffllama", _shard_with_extra_name,
     "{d}/model.safetensors.index.json: 'model.extra.weight' is listed but in none of its shards"),
    ("diffllama", lambda d: _rewrite(d, lambda t: t | {"model.norm.weight": np.ones(64, np.int32)}),
     "{d}: model.norm.weight has dtype int32; expected one of ['bfloat16', 'float16', 'float32', "
     "'float64']"),
    ("diffllama", lambda d: _rewrite(d, lambda t: t | {Q0: t[Q0][:32]}),
     f"{{d}}: {Q0}: shape (32, 64), expected (64, 64) for 8 heads of width 8"),
    ("llama", lambda d: _rewrite(d, lambda t: t | {Q0: t[Q0][:32]}),
     f"{{d}}: {Q0}: shape (32, 64), expected (64, 64) for 4 heads of width 16"),
])
def test_an_hf_dir_that_cannot_be_read_is_one_error_naming_the_file(kind, edit, error, saved_diffllama,
                                                                    saved_llama, tmp_path):
    hf_dir = tmp_path / "edited"
    shutil.copytree({"diffllama": saved_diffllama, "llama": saved_llama}[kind], hf_dir)
    edit(hf_dir)
    with pytest.raises(ex.ExportError, match=re.escape(error.format(d=hf_dir))) as raised:
        import_hf(hf_dir, tmp_path / "out")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_a_tied_checkpoint_that_also_saves_its_lm_head_imports(saved_diffllama, tmp_path):
    """tie_word_embeddings with lm_head.weight saved (equal to the embedding): the same parameters
    as without it."""
    from diff_jax.export.hf_import import read_hf

    hf_dir = tmp_path / "with-head"
    shutil.copytree(saved_diffllama, hf_dir)
    _rewrite(hf_dir, lambda t: t | {"lm_head.weight": t["model.embed_tokens.weight"]})
    jax.tree.map(np.testing.assert_array_equal, read_hf(hf_dir).params, read_hf(saved_diffllama).params)
