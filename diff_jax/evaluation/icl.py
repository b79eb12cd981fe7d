"""The `icl` task: many-shot in-context classification, the paper's Section 3.5 — accuracy as
the demonstrations fill the context (Figure 6) and its spread over their orders (Figure 7).

`input=DATA.jsonl` holds one example a line, `{"text": str, "label": str}` (TREC, TREC-fine,
Banking-77 or Clinic-150 converted to it, say); its labels are the distinct labels of the file.
A prompt is `shots` demonstrations, each `DEMO_FORMAT`, then a test item's `QUERY_FORMAT`, and
the prediction is what greedy decoding constrained to the labels answers (`constrained_greedy`),
the protocol the paper follows (Bertsch et al., 2024, after Ratner et al.'s restricted
decoding): from the prompt, each step takes the most probable of the tokens that continue some
label still possible, until one label is left. A label's tokens are its continuation " LABEL"
as the `choice` task splits it (`choice_tokens`); a label whose tokens begin another's is
followed by `STOP`'s first token, as it reads after the label (what ends a label in a
demonstration), so that decoding can stop there. Greedy is not the label of the highest summed
log-probability: with labels "card arrival" and "top up", a prompt that makes " card" likely
answers a card label even where " top up" has the higher total.

Which examples (`deal`): the file's examples are shuffled by `seed` and dealt round-robin over
the labels (in the order each first appears in the shuffle); the first `test_items` dealt are
the test items, the rest the demonstrations, and a shot count k shows the first k of them. So
the two are disjoint, every shot count shows those of the smaller counts and more, and each is
as balanced over the labels as the file allows: k demonstrations show min(k, labels) labels,
and on the test items a constant answer scores about the chance the report gives, 1 / labels.

Orders (`arranged`): each of `orders` prompts of a shot count shows its k demonstrations in a
permutation seeded by (seed, k, order) — `arrangement=random`, Figure 7 (a) — or with the
labels taking turns, in a random order of the labels — `alternating`, Figure 7 (b)'s examples
"arranged alternately by class" — or grouped by label, the groups and each group's
demonstrations in a random order — `grouped`, Bertsch et al.'s harder sorted setting; every
order is scored on the same test items. A prompt and a label must fit
`length` + 1 tokens (the label's last token is read by no position); `shots` unset is 1, 2, 4,
... while they fit and the demonstrations last (Figure 6's sweep). Each order's prompts, one a
test item, are scored `batch_size` at a time (`continuation_logprobs`: each prompt read once,
every label's tokens fed after it from the KV cache, which gives each step's log-probabilities
of every label's next token at once), right-padded to the longest prompt of their shot count:
one program a shot count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diff_jax.data.tokenizer import Encoding, continuations
from diff_jax.evaluation.choice import choice_tokens, continuation_logprobs, read_jsonl
from diff_jax.evaluation.loading import Loaded, text_encoding
from diff_jax.evaluation.options import EvalError, EvalOptions
from diff_jax.evaluation.report import Report, progress
from diff_jax.evaluation.scoring import eval_length

EXAMPLE_FORMAT = '{"text": str, "label": str}'
DEMO_FORMAT = "{text}\nLabel: {label}\n\n"  # one demonstration
QUERY_FORMAT = "{text}\nLabel:"  # the test item, which each label " {label}" continues
STOP = DEMO_FORMAT.split("{label}")[1]  # what follows a label in a demonstration


@dataclasses.dataclass(frozen=True)
class Example:
    """One line of the input: its line number, text and label."""

    line: int
    text: str
    label: str


@dataclasses.dataclass(frozen=True)
class Prompts:
    """One shot count's prompts: per order, its demonstrations (indices of the examples, in the
    prompt's order) and its groups (prompt ids, every label's ids, `stopped`), one a test item,
    labels in the file's order; the longest prompt's tokens, and with its longest label's."""

    demos: list[list[int]]
    groups: list[list[tuple[Sequence[int], list[Sequence[int]]]]]
    prompt_width: int
    width: int


def read_examples(path: Path) -> tuple[list[Example], list[str]]:
    """(the examples of the JSONL file `path`, its distinct labels in the order they first
    appear); an `EvalError` naming the line for one that is no example (`read_jsonl`), or
    the file where it holds fewer than two labels."""
    examples = [Example(n, r["text"], r["label"])
                for n, r in read_jsonl(path, EXAMPLE_FORMAT, _example_problem)]
    labels = list(dict.fromkeys(e.label for e in examples))
    if len(labels) < 2:
        raise EvalError(f"input={path}: every example has the label {labels[0]!r}; expected two "
                        f"labels or more, one {EXAMPLE_FORMAT} a line")
    return examples, labels


def _example_problem(record: Any) -> str | None:
    """What makes `record` no example, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    missing = [k for k in ("text", "label") if k not in record]
    if missing:
        return f"no {missing[0]!r}"
    if not isinstance(record["text"], str):
        return "'text' is no string"
    if not isinstance(record["label"], str) or not record["label"].strip():
        return "'label' must be a non-blank string"
    if STOP in record["label"]:  # "a" would end where "a\n\nb" goes on: "a\n\nb" never answered
        return f"'label' holds {STOP!r}, which ends a label in a prompt"
    return None


def deal(examples: Sequence[Example], seed: int) -> list[int]:
    """Every index of `examples` once: shuffled by `seed`, then dealt round-robin over the
    labels (in the order each first appears in the shuffle, each label's in shuffled order), so
    that every prefix holds each label's examples as evenly as the file allows."""
    queues: dict[str, list[int]] = {}
    for i in np.random.default_rng(seed).permutation(len(examples)):
        queues.setdefault(examples[i].label, []).append(int(i))
    rounds = max(len(q) for q in queues.values())
    return [q[r] for r in range(rounds) for q in queues.values() if r < len(q)]


def arranged(demos: Sequence[int], examples: Sequence[Example], arrangement: str, seed: int,
             order: int) -> list[int]:
    """`demos` (indices of `examples`) as order `order` of their shot count shows them: a
    permutation seeded by (seed, len(demos), order). `grouped`: then stably sorted by a random
    rank of their labels, so each label's demonstrations are adjacent. `alternating`: the
    labels, in a random rank, take turns (a label whose demonstrations are all shown drops
    out), each label's demonstrations in the permutation's order."""
    # the last word is not 0: a seed sequence ending in zeros is the one without them
    rng = np.random.default_rng([seed, len(demos), order, 1])
    shown = [demos[i] for i in rng.permutation(len(demos))]
    if arrangement != "random":
        labels = sorted({examples[i].label for i in shown})
        rank = dict(zip(labels, rng.permutation(len(labels))))
        if arrangement == "grouped":
            shown.sort(key=lambda i: rank[examples[i].label])
        else:  # the turn of a demonstration: how many of its label's come before it
            seen: dict[str, int] = {}
            turn = {}
            for i in shown:
                turn[i] = seen.get(examples[i].label, 0)
                seen[examples[i].label] = turn[i] + 1
            shown.sort(key=lambda i: (turn[i], rank[examples[i].label]))
    return shown


def prompt(demos: Sequence[Example], query: Example) -> str:
    """The text that each label continues: `demos` as `DEMO_FORMAT`, then `query`'s
    `QUERY_FORMAT`."""
    return ("".join(DEMO_FORMAT.format(text=d.text, label=d.label) for d in demos)
            + QUERY_FORMAT.format(text=query.text))


def shot_prompts(enc: Encoding, examples: Sequence[Example], labels: Sequence[str],
                 dealt: Sequence[int], test: Sequence[int], shots: int, options: EvalOptions,
                 path: Path) -> Prompts:
    """The `options.orders` prompts of `shots` demonstrations (the first `shots` of `dealt`)
    for the `test` items, each item's prompt with each label (`choice_tokens`: the prompt's ids
    are the same for every label; `stopped`); an `EvalError` for a label that adds no token."""
    demos, groups, prompt_width, width = [], [], 0, 0
    for order in range(options.orders):
        shown = arranged(dealt[:shots], examples, options.arrangement, options.seed, order)
        demos.append(shown)
        order_groups: list[tuple[Sequence[int], list[Sequence[int]]]] = []
        for t in test:
            text = prompt([examples[i] for i in shown], examples[t])
            ids, tails = choice_tokens(enc, text, [" " + label for label in labels])
            for label, tail in zip(labels, tails):
                if not tail:
                    raise EvalError(f"input={path}: the label {label!r} adds no token after "
                                    f"{QUERY_FORMAT!r} (data.tokenizer={enc.name})")
            context = np.asarray(ids, np.int32)
            ended = stopped(enc, QUERY_FORMAT.format(text=examples[t].text), labels, tails)
            order_groups.append((context, ended))
            prompt_width = max(prompt_width, len(context))
            width = max(width, len(context) + max(len(tail) for tail in ended))
        groups.append(order_groups)
    return Prompts(demos, groups, prompt_width, width)


def stopped(enc: Encoding, text: str, labels: Sequence[str],
            tails: Sequence[Sequence[int]]) -> list[Sequence[int]]:
    """`tails`, each label's ids after a prompt, with `STOP`'s first id as it reads after that
    label (`continuations`, after `text` + " " + label: the test item's `QUERY_FORMAT`, since
    what comes before it bears on no id past the label, and a whole many-shot prompt took 55 ms
    a label to encode at 48K tokens) appended to each whose ids begin another's: where
    constrained decoding may end that label rather than go on to the longer one."""
    begins = {tuple(u[:n]) for u in tails for n in range(1, len(u))}  # proper beginnings
    ended = [tuple(t) in begins for t in tails]
    if not any(ended):
        return list(tails)
    prefixed = [text + " " + label for label, end in zip(labels, ended) if end]
    after = iter(continuations(enc, prefixed, [STOP] * len(prefixed))[1])
    return [[*t, next(after)[0]] if end else t for t, end in zip(tails, ended)]


def constrained_greedy(tails: Sequence[Sequence[int]], logps: np.ndarray) -> int:
    """The label (index of `tails`, each label's ids) that greedy decoding constrained to the
    labels answers, given `logps` (labels, M): log p(each label's token | the prompt and the
    label's tokens before it). Each step takes, of the labels still possible, the token of the
    highest log-probability (labels that share the tokens so far share the step's distribution;
    on a tie the first label's), and keeps the labels that have it there, until one is left or
    one ends (its ids all decoded, `STOP` among them where it begins another label)."""
    alive, step = list(range(len(tails))), 0
    while len(alive) > 1:
        ended = [i for i in alive if len(tails[i]) == step]
        if ended:
            return ended[0]
        best = max(alive, key=lambda i: logps[i, step])
        alive = [i for i in alive if tails[i][step] == tails[best][step]]
        step += 1
    return alive[0]


def fits(prompts: Prompts, length: int) -> bool:
    """Whether the model reads at most `length` tokens of each prompt and label."""
    return prompts.width <= length + 1


def too_long(shots: int, prompts: Prompts, length: int) -> str:
    """The error of `shots` demonstrations whose `prompts` do not fit `length`."""
    return (f"shots={shots}: the longest prompt with its label is {prompts.width:,} tokens, of "
            f"which the model reads {prompts.width - 1:,}, more than length={length}; lower "
            "shots or raise length")


def doubling_shots(prompts_of: Callable[[int], Prompts], demonstrations: int,
                   length: int) -> tuple[list[int], str]:
    """(1, 2, 4, ... while every prompt of that many demonstrations (`prompts_of`) fits
    `length` and there are that many, a note of where and why the counts stop: Figure 6's sweep
    when `shots` is unset); an `EvalError` when one demonstration does not fit."""
    counts, shots = [], 1
    while shots <= demonstrations:
        prompts = prompts_of(shots)
        if not fits(prompts, length):
            if not counts:
                raise EvalError(too_long(shots, prompts, length))
            return counts, f"shots stop at {counts[-1]}: {too_long(shots, prompts, length)}"
        counts.append(shots)
        shots *= 2
    return counts, (f"shots stop at {counts[-1]}: the file's {demonstrations} examples past the "
                    f"test items are fewer than {shots}")


def icl_task(loaded: Loaded, options: EvalOptions) -> Report:
    """Accuracy per shot count: mean, standard deviation, minimum, maximum and their margin
    (Figure 7's measure of robustness) over `orders` orders of the demonstrations, on the same
    `test_items` items."""
    cfg = loaded.config
    length = eval_length(cfg, options, cfg.model.max_seq_len)
    path = Path(options.input)
    examples, labels = read_examples(path)
    enc = text_encoding(loaded)
    wanted = max(options.shots, default=1)
    if options.test_items + wanted > len(examples):
        asked = (f"shots={wanted}" if options.shots else
                 "1 demonstration (shots unset: 1, 2, 4, ... as many as there are)")
        raise EvalError(f"input={path}: {len(examples)} examples, fewer than test_items="
                        f"{options.test_items} + {asked}; lower test_items"
                        + (" or shots" if options.shots else ""))
    dealt = deal(examples, options.seed)
    test, pool = dealt[: options.test_items], dealt[options.test_items:]
    notes: list[str] = []

    def prompts_of(shots: int) -> Prompts:
        return shot_prompts(enc, examples, labels, pool, test, shots, options, path)

    counts = sorted(options.shots)
    if not counts:
        counts, note = doubling_shots(prompts_of, len(pool), length)
        notes.append(note)
    index = {label: i for i, label in enumerate(labels)}
    truth = np.array([index[examples[t].label] for t in test])
    predicted: dict[int, list[np.ndarray]] = {}  # per order, (test items,) label indices
    shown: dict[int, list[list[int]]] = {}
    tokens: dict[int, int] = {}
    with progress(len(counts) * options.orders * len(test), "prompt") as bar:
        done = 0
        for shots in reversed(counts):  # the longest prompts first: one too long stops at once
            prompts = prompts_of(shots)
            if not fits(prompts, length):
                raise EvalError(too_long(shots, prompts, length))
            predicted[shots] = []
            for order, groups in enumerate(prompts.groups, 1):
                where = f"shots={shots} order {order}/{options.orders}"
                logps = continuation_logprobs(
                    cfg.model, loaded.params, groups, options.batch_size, prompts.prompt_width,
                    scored=lambda n: bar.draw(done + n, where))
                done += len(groups)
                predicted[shots].append(np.array([constrained_greedy(tails, logp)
                                                  for (_, tails), logp in zip(groups, logps)]))
            shown[shots], tokens[shots] = prompts.demos, prompts.width
    accuracy = [[float(np.mean(p == truth)) for p in predicted[k]] for k in counts]
    mean = [float(np.mean(a)) for a in accuracy]
    std = [float(np.std(a)) for a in accuracy]
    low = [min(a) for a in accuracy]
    high = [max(a) for a in accuracy]
    chance = 1 / len(labels)
    return Report(
        {"input": str(path), "num_examples": len(examples), "labels": labels, "chance": chance,
         "num_test_items": len(test), "test_lines": [examples[t].line for t in test],
         "length": length, "arrangement": options.arrangement, "orders": options.orders,
         "seed": options.seed,
         "prompt_format": {"demonstration": DEMO_FORMAT, "query": QUERY_FORMAT,
                           "label": " {label}", "stop": STOP},
         "shots": counts, "prompt_tokens": [tokens[k] for k in counts],
         "accuracy_mean": mean, "accuracy_std": std, "accuracy_min": low, "accuracy_max": high,
         "accuracy_margin": [h - lo for h, lo in zip(high, low)], "accuracy": accuracy,
         "demonstrations": [[[examples[i].line for i in d] for d in shown[k]] for k in counts],
         "predictions": [[p.tolist() for p in predicted[k]] for k in counts]},
        [("examples", f"{len(test)} test items of {len(examples)}, {len(labels)} labels; chance "
                      f"{chance:.3f}"),
         (f"shots ({options.arrangement}, {options.orders} order{'s' * (options.orders != 1)})",
          "accuracy mean ± std  min  max (margin)")]
        + [(f"{k}", f"{m:.4f} ± {s:.4f}  {lo:.4f}  {h:.4f} ({h - lo:.4f})")
           for k, m, s, lo, h in zip(counts, mean, std, low, high)],
        notes=notes)
