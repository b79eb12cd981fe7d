"""The eval.py command line: `task=NAME` and the other undotted keys are `EvalOptions`; dotted
`section.key=value` arguments override the checkpoint's saved config."""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Sequence
from pathlib import Path

from diff_jax.config import SEED_LIMIT, ConfigError, coerce, is_blank_path, parse_override
from diff_jax.kernels.reference import MAX_LOGIT_BITS

TASKS = ("ppl", "score", "niah", "attention", "outliers", "quant", "generate", "recall", "choice",
         "icl")
JSONL_INPUTS = {  # the tasks whose input is a .jsonl file: what it holds
    "choice": "one multiple-choice item a line",
    "icl": 'one {"text": str, "label": str} example a line',
    "generate": 'one {"prompt": str} a line',
}
# icl: demonstrations in random order, each label's together, or taking turns by label
ARRANGEMENTS = ("random", "grouped", "alternating")
PATH_OPTIONS: dict[str, str] = {  # the options naming a file or directory: what each expects
    "checkpoint": "a run, a step directory RUN/checkpoints/N or an export (or leave it out and "
                  "give train.run_dir=RUN)",
    "out_dir": "a directory (or leave it out: the checkpoint's eval/)",
    "input": "a .txt or .npy file (choice, icl, generate: a .jsonl file)",
    "output": "a .npy file (or leave it out: OUT_DIR/score.npy)",
}


# the options that size each task's device arrays (besides the model): what to lower when it
# does not fit in device memory
MEMORY_OPTIONS: dict[str, tuple[str, ...]] = {
    "ppl": ("batch_size", "length"), "score": ("length",), "niah": ("batch_size", "lengths"),
    "attention": ("lengths",), "outliers": ("batch_size", "length"),
    "quant": ("batch_size", "length", "lengths"), "generate": ("batch_size", "max_new_tokens", "prompt"),
    "recall": ("batch_size", "lengths"), "choice": ("batch_size", "length"),
    "icl": ("batch_size", "length"),
}
assert tuple(MEMORY_OPTIONS) == TASKS


class EvalError(ValueError):
    """A bad eval.py argument or input; the message names it."""


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """Keys of `python eval.py task=NAME [key=value ...]` (docs/evaluation.md lists each task's keys)."""

    task: str
    checkpoint: str | None = None  # a run dir, a step dir RUN/checkpoints/N, or an export dir
    step: int | None = None  # a step of the run (None: the latest)
    out_dir: str | None = None  # None: RUN/eval (a named step: RUN/eval/step-N; export: DIR/eval)
    # held-out text, in rows spread over the validation split: ppl scores `held_out_tokens`
    # tokens, quant `batches` batches; both in batches of `batch_size` rows of `length` tokens
    length: int | None = None  # None: train.seq_len (score: model.max_seq_len)
    batch_size: int = 4
    batches: int = 8
    held_out_tokens: int = 262_144  # ppl: held-out tokens scored (at most the split's)
    # score
    # score: .txt (encoded with data.tokenizer) or .npy of int ids; choice, icl: .jsonl of items
    input: str | None = None
    output: str | None = None  # None: OUT_DIR/score.npy (out_dir or its default)
    # niah / attention (and quant with niah=true); recall: needles = key–value pairs N
    needles: int = 4
    queries: int = 1
    distractors: float = 0.0  # recall: share of the pairs that are near-duplicate distractors
    depths: tuple[int, ...] = (0, 25, 50, 75, 100)  # percent
    lengths: tuple[int, ...] = ()  # () : (train.seq_len,)
    samples: int = 4
    seed: int = 0  # niah samples, sampling for generate, icl's examples and orders
    # outliers
    tokens: int = 2048
    # quant
    bits: tuple[int, ...] = (16, 8, 6, 4)
    niah: bool = False  # quant: also measure niah accuracy per bit width
    # icl: demonstration counts (() : 1, 2, 4, ... while the prompts fit), orders of each, how
    # they are arranged (ARRANGEMENTS), test items
    shots: tuple[int, ...] = ()
    orders: int = 5
    arrangement: str = "random"
    test_items: int = 250
    # generate
    prompt: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise EvalError(f"task={self.task}: unknown task; known tasks: {', '.join(TASKS)}")
        for name, expected in PATH_OPTIONS.items():
            if is_blank_path(getattr(self, name)):
                raise EvalError(f"{name}={getattr(self, name)}: empty; name {expected}")
        for name in ("batch_size", "batches", "held_out_tokens", "needles", "queries", "samples",
                     "tokens", "max_new_tokens", "orders", "test_items"):
            if getattr(self, name) < 1:
                raise EvalError(f"{name}={getattr(self, name)}: must be positive")
        if not 0 <= self.seed < SEED_LIMIT:  # jax.random.key (generate) keeps 32 bits of a seed
            raise EvalError(f"seed={self.seed}: must be in [0, 2**32)")
        for name in ("length", "step"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise EvalError(f"{name}={getattr(self, name)}: must be positive")
        if not self.queries <= self.needles:
            raise EvalError(f"queries={self.queries}: must be <= needles ({self.needles})")
        if not 0 <= self.distractors < 1:
            raise EvalError(f"distractors={self.distractors}: must be in [0, 1)")
        if any(n < 1 for n in self.lengths):
            raise EvalError(f"lengths={list(self.lengths)}: must be positive")
        if not self.depths or any(not 0 <= d <= 100 for d in self.depths):
            raise EvalError(f"depths={list(self.depths)}: expected one or more percentages in "
                            "[0, 100]")
        if not self.bits or any(not 2 <= n <= MAX_LOGIT_BITS for n in self.bits):
            raise EvalError(f"bits={list(self.bits)}: expected one or more widths in "
                            f"[2, {MAX_LOGIT_BITS}]")
        if self.task == "score" and self.input is None:
            raise EvalError("task=score needs input=FILE (.txt or .npy of int32 token ids)")
        if self.output is not None:
            # np.save appends .npy to any other name, which would write a file the report does
            # not name; the input would be overwritten by its own scores
            if Path(self.output).suffix != ".npy":
                raise EvalError(f"output={self.output}: expected a path ending in .npy (the "
                                "scores are written as a NumPy array)")
            if self.input is not None and _same_file(self.output, self.input):
                raise EvalError(f"output={self.output}: is the input file; name another")
        if self.task == "generate" and (self.prompt is None) == (self.input is None):
            raise EvalError('task=generate needs prompt="..." or input=PROMPTS.jsonl (one '
                            '{"prompt": str} a line), '
                            + ("not both" if self.input is not None else "got neither"))
        reads_jsonl = self.task != "generate" or self.input is not None  # else its prompt
        if self.task in JSONL_INPUTS and reads_jsonl and (self.input is None
                                                          or Path(self.input).suffix != ".jsonl"):
            raise EvalError(f"task={self.task} needs input=FILE.jsonl ({JSONL_INPUTS[self.task]}), "
                            f"got input={self.input}")
        if any(n < 0 for n in self.shots) or len(set(self.shots)) < len(self.shots):
            raise EvalError(f"shots={list(self.shots)}: expected distinct counts >= 0")
        if self.arrangement not in ARRANGEMENTS:
            raise EvalError(f"arrangement={self.arrangement}: expected one of "
                            f"{', '.join(ARRANGEMENTS)}")
        if self.task == "generate" and self.prompt == "":
            raise EvalError('prompt=: empty; task=generate continues a prompt of one or more '
                            'characters')
        half = None if self.prompt is None else lone_surrogate(self.prompt)
        if half is not None:
            raise EvalError(f"prompt: not Unicode text ({half}: a byte the shell passed that is "
                            "no UTF-8, or half of a UTF-16 pair); pass the prompt as UTF-8")

    def memory_advice(self, devices: str, spread: str | None = None) -> str:
        """What to change when this task does not fit in the memory of `devices` (e.g. "1 gpu
        device(s)"), for `device_memory.fit_or_explain`; `spread`: how to spread it over more
        devices, where some are left (`loading.eval_devices`)."""
        names = MEMORY_OPTIONS[self.task]
        shown = []
        if self.task == "generate":  # a prompt, or a file's prompts batch_size at a time
            names = tuple(n for n in names if n != ("prompt" if self.input else "batch_size"))
        for name in names:
            value = getattr(self, name)
            if name == "prompt":
                shown.append(f"a prompt of {len(value)} characters")
            elif value in (None, ()):
                default = ("model.max_seq_len" if self.task in ("score", "choice", "icl")
                           else "train.seq_len")
                shown.append(f"{name} unset (the run's {default})")
            else:
                shown.append(f"{name}={list(value) if isinstance(value, tuple) else value}")
        lowered = " or ".join(name for name in names if name != "prompt")
        shorten = ""  # generate: the longest prompt sizes the KV cache with max_new_tokens
        if self.task == "generate":
            shorten = (" or shorten the prompt" if self.input is None
                       else f" or shorten the longest prompts of input={self.input}")
        more = f", or {spread}" if spread else ""
        return (f"the checkpoint's model with task={self.task}, {', '.join(shown)} does not fit "
                f"on {devices}; lower {lowered}{shorten}{more}")


def lone_surrogate(value: typing.Any) -> str | None:
    """The first lone surrogate in the strings of `value` (a JSON value), escaped ("\\ud83d"),
    or None: half of a UTF-16 pair (JSON's escape of one alone), or a byte that is no UTF-8 on
    the command line (Python reads it as one of U+DC80–U+DCFF). No such string is Unicode text:
    tiktoken encodes another text in its place, a Hugging Face tokenizer raises TypeError, and
    printing it to a UTF-8 terminal raises UnicodeEncodeError."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return ascii(e.object[e.start])[1:-1]
    return None


def _same_file(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name the same file (`~` expanded, links resolved)."""
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def parse_args(argv: Sequence[str]) -> tuple[EvalOptions, list[str]]:
    """(options from the undotted keys, the dotted config overrides in order)."""
    hints = typing.get_type_hints(EvalOptions)
    values: dict[str, typing.Any] = {}
    overrides = []
    for arg in argv:
        if "=" not in arg:
            raise EvalError(f"argument {arg!r}: expected key=value")
        key = arg.partition("=")[0].strip()
        if "." in key:
            overrides.append(arg)
            continue
        if key not in hints:
            raise EvalError(f"{key}: unknown key; known keys: {', '.join(sorted(hints))} "
                            "(and section.key=value config overrides)")
        if hints[key] is str or hints[key] == (str | None):
            values[key] = arg.partition("=")[2]  # taken verbatim: prompts and paths are not YAML
            continue
        value = parse_override(arg)[1]
        if typing.get_origin(hints[key]) is tuple and not isinstance(value, list):
            value = [value]  # `bits=8` is `bits=[8]`
        try:
            values[key] = coerce(value, hints[key], key)
        except ConfigError as e:
            raise EvalError(str(e)) from None
    if "task" not in values:
        raise EvalError(f"missing task=NAME; tasks: {', '.join(TASKS)}")
    return EvalOptions(**values), overrides

