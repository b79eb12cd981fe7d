"""results.json, results.md and the PNGs of a language-modeling replication (`Preset`): the
paper's Tables 2, 3, 5 and Figure 8 in the paper's layout, ours (mean ± sample standard deviation
over seeds) beside the paper's (`paper`), under each init; every claim is a paired difference
against the Transformer with its spread over seeds (`stats.paired`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from diff_jax.config import ConfigError
from diff_jax.data import corpus as token_corpus
from diff_jax.experiments import paper, plots
from diff_jax.experiments.init_scale import ROWS, residual_writes
from diff_jax.experiments.layout import (device_line, eval_json, field, is_a, parse_json,
                                         read_corpus_meta, read_eval, read_wall, run_devices,
                                         run_dir)
from diff_jax.experiments.presets import (LABELS, VARIANTS, Preset, corpus_dir,
                                          niah_whole_fraction, replicate_command)
from diff_jax.experiments.stats import describe, mean_std, paired, stats
from diff_jax.output_dir import write_whole

STATS = ("top1", "top2", "top3", "top10", "top100", "median")
BITS = ("none", 16, 8, 6, 4)


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """(training log lines, validation lines) of RUN/metrics.jsonl. ConfigError naming the file
    and line of one that is not a JSON object with an integer step (cut short, edited by hand),
    or the file when it holds no training line (a trained run logs its first step)."""
    path = run / "metrics.jsonl"
    lines = []
    for i, text in enumerate(path.read_bytes().splitlines(), 1):
        if text.strip():
            row = parse_json(text, f"{path}: line {i}", "a JSON object of one step's metrics")
            if not is_a(row.get("step"), int):
                raise ConfigError(f"{path}: line {i}: step must be an integer, got "
                                  f"{row.get('step')!r}")
            lines.append(row)
    train = [x for x in lines if "loss" in x]
    if not train:
        raise ConfigError(f"{path}: holds no training line (one with a loss; a trained run logs "
                          "its first step)")
    return train, [x for x in lines if "val_loss" in x]


# what results.json's `corpus` takes from a corpus's meta.json (`replicate.prepare_corpus`)
CORPUS_FIELDS = {"paths": (list, "a list"), "num_docs": (int, "an integer"),
                 "num_tokens": (int, "an integer"), "train_tokens": (int, "an integer"),
                 "train_rows": (int, "an integer"), "rows_read": (int, "an integer"),
                 "unigram_loss": ((int, float), "a number")}


def corpus_meta(out: Path, seed: int) -> dict[str, Any]:
    """The `CORPUS_FIELDS` of the meta.json of `seed`'s corpus in `out`; ConfigError naming the
    file and the first field it lacks (a corpus prepared before the field existed) or holds of
    another type."""
    meta, path = read_corpus_meta(corpus_dir(out, seed)), corpus_dir(out, seed) / "meta.json"
    return {key: field(meta, path, key, kind, what) for key, (kind, what) in CORPUS_FIELDS.items()}


def model_results(preset: Preset, run: Path) -> dict[str, Any]:
    """One trained model's numbers, from its eval JSONs and metrics.jsonl."""
    train, val = read_metrics(run)
    ppl = read_eval(eval_json(run, "ppl"))
    niah = {f"N{n}R{r}": read_eval(eval_json(run, f"niah-N{n}R{r}")) for n, r in preset.niah_grid}
    attention = read_eval(eval_json(run, "attention"))
    outliers = read_eval(eval_json(run, "outliers"))
    quant = read_eval(eval_json(run, "quant"))
    wall = read_wall(run)
    return {
        "loss": ppl["loss"], "ppl": ppl["ppl"], "heldout_tokens": ppl["num_tokens"],
        "heldout_documents": ppl["num_documents"],
        "final_train_loss": train[-1]["loss"],
        "final_val_loss": val[-1]["val_loss"] if val else math.nan,
        # the periodic validations: held-out loss at each validation step, and their token count
        "val_loss_at": val_loss_at(val),
        "val_tokens": val[-1]["val_tokens"] if val else 0,
        # per (N, R): accuracy per context length (mean over depths), and the depth × length grid
        "niah": {k: np.mean(v["accuracy"], axis=0).tolist() for k, v in niah.items()},
        "niah_grid": {k: v["accuracy"] for k, v in niah.items()},
        "attention": {"answer": [r["answer"] for r in attention["by_depth"]],
                      "noise": [r["noise"] for r in attention["by_depth"]]},
        "outliers": {k: [outliers[k][s] for s in STATS] for k in ("attention_logits", "hidden_states")},
        "quant": {"ppl": quant["ppl"], "niah_accuracy": quant["niah_accuracy"]},
        "wall_s": {"train": wall.get("train_s", 0.0),
                   "eval": sum(v for k, v in wall.items() if k.startswith("eval_"))},
    }


def collect(preset: Preset, seeds: int, out: Path, init: str) -> dict[str, Any]:
    """Per variant under `init`: every seed's `model_results` and their element-wise mean/std."""
    results = {}
    for v in VARIANTS:
        per_seed = [model_results(preset, run_dir(out, v, s, init)) for s in range(seeds)]
        results[v] = {"seeds": per_seed, "stats": stats(per_seed)}
    return results


def _span(result: dict[str, Any], key: str) -> str:
    """The integer `key` of every seed of one model: '12' when they agree, else '10–12'."""
    values = [s[key] for s in result["seeds"]]
    lo, hi = min(values), max(values)
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return [line(header), line(["---"] * len(header)), *(line(r) for r in rows)]


def _direction(p: dict[str, Any], paper_sign: int) -> str:
    """The paper's direction (sign of DIFF − Transformer) set beside a paired difference that
    lies outside its seed spread; nothing for one that does not."""
    if not p["outside_spread"]:
        return ""
    same = (p["mean"] > 0) == (paper_sign > 0)
    return " — the paper's direction" if same else " — the opposite of the paper's direction"


def claims(results: dict[str, Any]) -> list[tuple[str, int, dict[str, dict[str, Any]]]]:
    """(claim, paper's sign of DIFF − Transformer, {DIFF variant: `paired` against the
    Transformer}) for each paper claim, from one init's `collect`."""
    def per_seed(v: str, f: Any) -> list[float]:
        return [float(f(s)) for s in results[v]["seeds"]]

    measures = [
        ("held-out loss (paper: DIFF lower at matched size)", -1, lambda s: s["loss"]),
        ("Table 2: niah accuracy over the grid at the training length (paper: DIFF higher)", 1,
         lambda s: np.mean([x[0] for x in s["niah"].values()])),
        ("Table 3: attention share on the answer (paper: DIFF higher)", 1,
         lambda s: np.mean(s["attention"]["answer"])),
        ("Table 3: attention share on the noise (paper: DIFF lower)", -1,
         lambda s: np.mean(s["attention"]["noise"])),
        ("Table 5: top-1 |attention logit| (paper: DIFF lower)", -1,
         lambda s: s["outliers"]["attention_logits"][0]),
        ("Table 5: top-1 |hidden state| (paper: DIFF lower)", -1,
         lambda s: s["outliers"]["hidden_states"][0]),
        ("Figure 8: relative perplexity increase at 4-bit logits (paper: DIFF lower)", -1,
         lambda s: s["quant"]["ppl"][-1] / s["quant"]["ppl"][0] - 1),
    ]
    base = {name: per_seed("transformer", f) for name, _, f in measures}
    return [(name, sign, {v: paired(per_seed(v, f), base[name]) for v in ("diff", "diff_v2")})
            for name, sign, f in measures]


def val_loss_at(val: list[dict]) -> dict[str, float]:
    """{step: held-out loss} of a run's validation lines (`read_metrics`)."""
    return {str(x["step"]): x["val_loss"] for x in val}


def val_gaps_between(a: list[dict], b: list[dict], *more: list[dict]) -> dict[str, dict[str, Any]]:
    """{step: `paired` validation loss of `a` − `b` (per-seed results with `val_loss_at`, same
    seed order)} at each step every seed of a, b and `more` logged, in step order."""
    logged = [set(s["val_loss_at"]) for seeds in (a, b, *more) for s in seeds]
    steps = sorted(set.intersection(*logged), key=int)
    return {step: paired([s["val_loss_at"][step] for s in a], [s["val_loss_at"][step] for s in b])
            for step in steps}


def val_gaps(results: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{DIFF variant: {step: `paired` held-out loss against the Transformer}} at each periodic
    validation step that every seed of every model logged (in step order), from one init's
    `collect`: how the loss difference moves as training goes on."""
    seeds = {v: results[v]["seeds"] for v in VARIANTS}
    return {v: val_gaps_between(seeds[v], seeds["transformer"], *seeds.values())
            for v in ("diff", "diff_v2")}


def gap_cell(p: dict[str, Any]) -> str:
    """A `paired` result as a table cell: "+0.80 (+0.76 to +0.86)", with " *" when zero lies
    outside the seed spread (a single seed: the value alone)."""
    if p["n"] == 1:
        return f"{p['mean']:+.3f}"
    star = " *" if p["outside_spread"] else ""
    return f"{p['mean']:+.3f} ({p['min']:+.3f} to {p['max']:+.3f}){star}"


def claim_lines(results: dict[str, Any]) -> list[str]:
    """One line per claim and DIFF variant: the paired difference and, only where it lies
    outside its seed spread, how its sign compares with the paper's."""
    return [f"- {name}, {LABELS[v]} − Transformer: {describe(p)}{_direction(p, sign)}."
            for name, sign, per_variant in claims(results) for v, p in per_variant.items()]


def val_section(res: dict[str, Any]) -> list[str]:
    """The periodic validations of one init's models: held-out loss at each validation step and
    the paired DIFF − Transformer difference there; nothing when the runs validated never."""
    gaps = val_gaps(res)
    steps = list(gaps["diff"])
    if not steps:
        return []
    tokens = res["transformer"]["seeds"][0]["val_tokens"]
    rows = [[LABELS[v]] + [mean_std(res[v]["stats"]["val_loss_at"][s], 3) for s in steps]
            for v in VARIANTS]
    rows += [[f"{LABELS[v]} − Transformer"] + [gap_cell(gaps[v][s]) for s in steps]
             for v in ("diff", "diff_v2")]
    return ["### Held-out loss during training", "",
            f"The periodic validations (`train.eval_every`): {tokens:,} held-out tokens in rows "
            "spread over the validation split, the same tokens at every step and for every model "
            "of a seed. Differences are paired by seed: mean (min to max over seeds), * where "
            "every seed has the same sign.", "",
            *_table(["model", *(f"step {s}" for s in steps)], rows), ""]


def init_rows(out: Path, seq_len: int) -> np.ndarray:
    """(init_scale.ROWS, seq_len) int32: the first tokens of seed 0's corpus in the replication
    `out`, on which every model of it (and of its ablations) is measured at initialization."""
    rows = token_corpus.load(corpus_dir(out, 0)).tokens[:ROWS * seq_len]
    return np.asarray(rows, np.int32).reshape(ROWS, seq_len)


def init_scale_table(models: list[tuple[str, dict[str, Any]]], seq_len: int,
                     source: str = "seed 0's corpus") -> list[str]:
    """Markdown: per (name, `init_scale.residual_writes` result), what the model writes into the
    residual stream, measured on the first `init_scale.ROWS` rows of `seq_len` tokens of
    `source`."""
    cells = lambda xs: ", ".join(f"{x:.4f}" for x in xs)  # noqa: E731
    return [f"RMS over the first {ROWS} rows of {seq_len} tokens of {source}, in each model "
            "freshly initialized with key 0 (`diff_jax.experiments.init_scale`); the token "
            "embedding is the only token-specific signal at that point. Per layer, first to "
            "last.", "",
            *_table(["model", "token embedding", "attention output", "MLP output"],
                    [[name, f"{scale['embed']:.4f}", cells(scale["attn"]), cells(scale["ffn"])]
                     for name, scale in models]), ""]


def init_scale_section(data: dict[str, Any], init: str) -> list[str]:
    """What each model writes into the residual stream at initialization under `init`."""
    scale = data["init_scale"][init]
    return ["### At initialization: what each sublayer adds to the residual stream", "",
            *init_scale_table([(LABELS[v], scale[v]) for v in VARIANTS], data["seq_len"])]


def init_section(preset: Preset, data: dict[str, Any], init: str) -> list[str]:
    """The tables of one init: held-out loss, Tables 2, 3, 5, Figure 8 and the claims."""
    res, lengths = data["results"][init], list(preset.niah_lengths)
    lines = [f"## Init `{init}`", "", "### Language modeling (held-out)", "",
             *_table(["model", "held-out loss", "perplexity", "held-out tokens (documents)",
                      "train loss (last logged batch)", "train wall (s)", "eval wall (s)"],
                     [[LABELS[v], mean_std(res[v]["stats"]["loss"], 3),
                       mean_std(res[v]["stats"]["ppl"], 1),
                       f"{res[v]['seeds'][0]['heldout_tokens']:,} ({_span(res[v], 'heldout_documents')})",
                       mean_std(res[v]["stats"]["final_train_loss"], 3),
                       mean_std(res[v]["stats"]["wall_s"]["train"], 0),
                       mean_std(res[v]["stats"]["wall_s"]["eval"], 0)] for v in VARIANTS]),
             "", *val_section(res), *init_scale_section(data, init),
             "### Table 2: multi-needle retrieval accuracy", "",
             f"N needles, R of them queried; answer needle at depths {list(preset.depths)}%, "
             f"{preset.samples} samples per cell; a query counts when greedy decoding gives the "
             f"number. Ours at each context length (training length {preset.seq_len}; "
             f"{lengths[-1]} is beyond it, RoPE extrapolated); paper at 4K.", ""]
    rows = []
    for v in VARIANTS:
        for j, length in enumerate(lengths):
            rows.append([f"{LABELS[v]} (ours, {length})"]
                        + [mean_std(res[v]["stats"]["niah"][f"N{n}R{r}"][j])
                           for n, r in preset.niah_grid])
    for v in ("transformer", "diff"):
        ref = dict(zip(map(tuple, paper.TABLE2["columns"]), paper.TABLE2[v]))
        rows.append([f"{LABELS[v]} (paper, 4K)"]
                    + [f"{ref[(n, r)]:.2f}" if (n, r) in ref else "—" for n, r in preset.niah_grid])
    lines += [*_table(["model", *(f"N={n}, R={r}" for n, r in preset.niah_grid)], rows), ""]

    depths = list(preset.depths)
    lines += ["### Table 3: attention allocation", "",
              f"Normalized attention of the question tokens on the answer needle vs the rest of the "
              f"context (noise), N={preset.attention_needles}, length {preset.seq_len}, per answer "
              "depth (differential maps clipped at 0 and renormalized; see "
              "`eval.py task=attention`).", ""]
    header = ["model", *(f"answer {d}%" for d in depths), *(f"noise {d}%" for d in depths)]
    rows = [[f"{LABELS[v]} (ours)"] + [mean_std(s) for s in res[v]["stats"]["attention"]["answer"]]
            + [mean_std(s) for s in res[v]["stats"]["attention"]["noise"]] for v in VARIANTS]
    for v in ("transformer", "diff"):
        ref = paper.TABLE3[v]
        rows.append([f"{LABELS[v]} (paper)"]
                    + [f"{ref[k][paper.TABLE3['depths'].index(d)]:.2f}"
                       if d in paper.TABLE3["depths"] else "—" for k in ("answer", "noise")
                       for d in depths])
    lines += [*_table(header, rows), ""]

    lines += ["### Table 5: activation outliers", "",
              f"Largest and median |attention logits| (valid entries) and |hidden states| over "
              f"{preset.outlier_tokens:,} held-out tokens.", ""]
    rows = []
    for act, name in (("attention_logits", "attention logits"), ("hidden_states", "hidden states")):
        for v in VARIANTS:
            rows.append([name, f"{LABELS[v]} (ours)"]
                        + [mean_std(s) for s in res[v]["stats"]["outliers"][act]])
        for v in ("transformer", "diff"):
            rows.append([name, f"{LABELS[v]} (paper)"] + [f"{x:.1f}" for x in paper.TABLE5[act][v]])
    lines += [*_table(["activation", "model", *(s.replace("top", "top-") for s in STATS)], rows), ""]

    n, r = preset.quant_niah
    lines += ["### Figure 8: attention-logit quantization", "",
              f"Absmax post-training quantization of the attention logits. Ours: held-out "
              f"perplexity over the quant task's own sample ({preset.eval_batches} batches of 4 "
              f"rows of {preset.seq_len} tokens, {preset.eval_batches * 4 * preset.seq_len:,} "
              f"token positions, fewer than the language-modeling table's, hence other values) "
              f"and niah accuracy (N={n}, R={r}, length {preset.seq_len}) per bit width. Paper: "
              f"{paper.FIGURE8}", ""]
    rows = []
    for v in VARIANTS:
        q = res[v]["stats"]["quant"]
        rows.append([f"{LABELS[v]} perplexity"] + [mean_std(s, 1) for s in q["ppl"]])
        rows.append([f"{LABELS[v]} niah accuracy"] + [mean_std(s) for s in q["niah_accuracy"]])
    lines += [*_table(["model", *(f"{b} bits" if b != "none" else "float" for b in BITS)], rows), ""]
    lines += ["### Claims", "",
              "Each claim as a paired difference (same seed, same data order) against the "
              "Transformer, with its spread over seeds; a direction is stated only where every "
              "seed agrees in sign.", "", *claim_lines(res), ""]
    return lines


def markdown(preset: Preset, data: dict[str, Any]) -> str:
    """results.md: the setup, then per init the paper's tables with ours beside them, the
    claims, the init gaps and the plots."""
    seeds = len(data["seeds"])
    spread = (f"mean ± sample standard deviation over {seeds} seeds" if seeds > 1
              else "one seed (no spread: no difference below can be told from seed noise)")
    models, corpus = data["models"], data["corpus"]
    lines = [
        f"# Replication at small scale: `{preset.name}` preset", "",
        f"Generated by `{replicate_command(preset, seeds)}`. Ours: {spread}, under the inits "
        f"{', '.join(f'`{i}`' for i in preset.inits)} (`model.output_init`). Paper: the 3B "
        "models of Ye et al. (ICLR 2025), transcribed from the paper (its Appendix B models).", "",
        f"Setup: {data['train_tokens']:,} training tokens per model ({data['steps']} steps × "
        f"{data['batch_size']} × {data['seq_len']}), `data.mixture={data['data_mixture']}`, "
        f"`{data['tokenizer']}` tokenizer (model vocabulary {data['vocab_size']:,}), identical data "
        "order, optimizer and schedule for all three models, hyperparameters fixed before any "
        f"comparison. Sized for: {preset.budget}.", "",
        *device_line(data),
        f"Corpus (seed 0, prepared once for all models): {corpus['num_docs']:,} documents, "
        f"{corpus['num_tokens']:,} tokens"
        + (f" (`data.paths`: {', '.join(f'`{p}`' for p in corpus['paths'])})" if corpus["paths"] else "")
        + f"; each model reads {corpus['rows_read']:,} of the training split's "
        f"{corpus['train_rows']:,} rows once, so no training text is read twice. Unigram loss "
        f"(the validation split's tokens under the training split's token frequencies): "
        f"{corpus['unigram_loss']:.2f} nats"
        + (f" (each seed's corpus: {min(data['unigram_loss'].values()):.2f}–"
           f"{max(data['unigram_loss'].values()):.2f})." if seeds > 1 else "."), "",
        f"Synthetic retrieval documents are {data['niah_doc_tokens'] // 2}–{data['niah_doc_tokens']} "
        f"tokens long; {data['niah_whole_in_row']:.0%} of them are expected to lie whole in one "
        f"training row of {data['seq_len']} tokens (`presets.niah_whole_fraction`).", "",
        *_table(["model", "params", "non-embedding", "heads", "kv heads", "head dim"],
                [[LABELS[v], f"{m['params']:,}", f"{m['non_embedding_params']:,}", str(m["heads"]),
                  str(m["kv_heads"]), str(m["head_dim"])] for v, m in models.items()]), "",
    ]
    for init in preset.inits:
        lines += init_section(preset, data, init)
    if data["init_gap"]:
        a, b = preset.inits[1], preset.inits[0]
        lines += ["## Init gaps", "",
                  *(f"- {LABELS[v]}, held-out loss `{a}` − `{b}` init: {describe(p)}."
                    for v, p in data["init_gap"].items()), ""]
    lines += ["## Plots", "", *(f"![{p}]({p})" for p in data["plots"]), ""]
    return "\n".join(lines)


def _mean_curve(logs: list[list[dict]], key: str) -> tuple[list[int], list[float]]:
    """(steps every log has, mean of `key` over the logs at those steps)."""
    steps = sorted(set.intersection(*(set(x["step"] for x in log) for log in logs)))
    return steps, np.mean([[dict((x["step"], x[key]) for x in log)[s] for s in steps]
                           for log in logs], 0).tolist()


def _plots(preset: Preset, data: dict[str, Any], out: Path, seeds: int, init: str) -> list[str]:
    """The PNGs of the preset's own init (its first); the names of those drawn."""
    res = data["results"][init]
    logs = {v: [read_metrics(run_dir(out, v, s, init)) for s in range(seeds)] for v in VARIANTS}
    curves = {v: {"train": _mean_curve([t for t, _ in lg], "loss")} for v, lg in logs.items()}
    for v, lg in logs.items():
        if all(val for _, val in lg):
            curves[v]["validation"] = _mean_curve([val for _, val in lg], "val_loss")
    grids = {v: {f"N={n}, R={r}": np.mean([s["niah_grid"][f"N{n}R{r}"] for s in res[v]["seeds"]], 0)
                 for n, r in preset.niah_grid} for v in VARIANTS}
    increase = {v: np.mean([np.asarray(s["quant"]["ppl"]) / s["quant"]["ppl"][0] - 1
                            for s in res[v]["seeds"]], 0) for v in VARIANTS}
    accuracy = {v: [s["mean"] for s in res[v]["stats"]["quant"]["niah_accuracy"]] for v in VARIANTS}
    lam_logs = [[x for x in t if "lambda" in x] for t, _ in logs["diff"]]
    lam_steps, _ = _mean_curve(lam_logs, "step")
    lam = np.mean([[dict((x["step"], x["lambda"]) for x in t)[s] for s in lam_steps]
                   for t in lam_logs], 0)
    drawn = {
        "loss_curves.png": plots.loss_curves(out / "loss_curves.png", curves, LABELS),
        "niah_heatmaps.png": plots.niah_heatmaps(out / "niah_heatmaps.png", grids, LABELS,
                                                 list(preset.depths), list(preset.niah_lengths)),
        "quantization.png": plots.quantization(out / "quantization.png",
                                               ["float" if b == "none" else str(b) for b in BITS],
                                               increase, accuracy, LABELS),
        "lambda.png": plots.lambdas(out / "lambda.png", lam_steps, lam),
    }
    return [name for name, ok in drawn.items() if ok]


def init_gaps(preset: Preset, results: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """Per model: the paired difference of its held-out loss (same seed, same data), second
    init minus first; {} for a preset with one init. `results[init][variant]["seeds"]` as
    `collect` gives them."""
    if len(preset.inits) < 2:
        return {}
    a, b = preset.inits[1], preset.inits[0]
    return {v: paired([s["loss"] for s in results[a][v]["seeds"]],
                      [s["loss"] for s in results[b][v]["seeds"]]) for v in VARIANTS}


def write(preset: Preset, seeds: int, out: Path, summaries: dict[str, dict]) -> dict[str, Any]:
    """Collect every run's numbers, write OUT/results.json, OUT/results.md and the PNGs."""
    results = {init: collect(preset, seeds, out, init) for init in preset.inits}
    own = results[preset.inits[0]]
    cfg = preset.corpus_config(0)
    corpus = corpus_meta(out, 0)
    keys = ("heads", "kv_heads", "head_dim", "flops_per_token")
    device, devices = run_devices(preset.inits, seeds, out)
    data = {
        "preset": preset.name, "budget": preset.budget, "seeds": list(range(seeds)),
        "inits": list(preset.inits),
        "steps": cfg.train.steps, "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
        "train_tokens": cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len,
        "data_mixture": cfg.data.mixture, "tokenizer": cfg.data.tokenizer,
        "corpus": corpus,
        "unigram_loss": {str(s): corpus_meta(out, s)["unigram_loss"] for s in range(seeds)},
        "vocab_size": cfg.model.vocab_size, "niah_doc_tokens": cfg.data.niah_doc_tokens,
        "niah_whole_in_row": niah_whole_fraction(cfg.data.niah_doc_tokens, cfg.train.seq_len),
        "device": device,
        "models": {v: {"params": summaries[v]["params"],
                       "non_embedding_params": summaries[v]["params_non_embedding"],
                       "devices": devices[v],
                       "heldout_tokens": own[v]["seeds"][0]["heldout_tokens"],
                       "heldout_loss": own[v]["stats"]["loss"],
                       "heldout_loss_by_init": {i: results[i][v]["stats"]["loss"] for i in results},
                       **{k: summaries[v][k] for k in keys}} for v in VARIANTS},
        "niah": {"grid": [list(x) for x in preset.niah_grid], "lengths": list(preset.niah_lengths),
                 "depths": list(preset.depths), "samples": preset.samples},
        "quant_bits": list(BITS),
        "outlier_stats": list(STATS),
        "paper": {"table2": paper.TABLE2, "table3": paper.TABLE3, "table5": paper.TABLE5,
                  "figure8": paper.FIGURE8},
        "results": results,
        "claims": {init: [{"claim": name, "paper_sign": sign, **per_variant}
                          for name, sign, per_variant in claims(results[init])] for init in results},
        "val_gap": {init: val_gaps(results[init]) for init in results},
        "init_gap": init_gaps(preset, results),
    }
    rows = init_rows(out, cfg.train.seq_len)
    data["init_scale"] = {init: {v: residual_writes(preset.config(v, 0, run_dir(out, v, 0, init),
                                                                  init).model, rows)
                                 for v in VARIANTS} for init in preset.inits}
    data["plots"] = _plots(preset, data, out, seeds, preset.inits[0])
    write_whole(out / "results.json", json.dumps(data, indent=1) + "\n")
    write_whole(out / "results.md", markdown(preset, data))
    return data
