"""What an error message keeps of a library's error: its first line, and the chain of errors it
was raised from. XLA, orbax (a multi-line repr of the tensorstore spec) and tiktoken raise errors
whose text goes on for many lines; the one error line a command prints keeps the first."""

from __future__ import annotations

LINE_LIMIT = 300  # characters of an error's first line that a message keeps
CHAIN_LIMIT = 16  # errors of a chain followed (a chain may loop: `raise a from b` with b from a)


def first_line(error: BaseException, empty: str = "") -> str:
    """The first line of `error`'s text, stripped, cut at `LINE_LIMIT` characters with " ..."
    after it; `empty` when the text is blank."""
    line = (str(error).strip().splitlines() or [empty])[0].strip()
    return line if len(line) <= LINE_LIMIT else line[:LINE_LIMIT] + " ..."


def chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from or during (`__cause__`, else `__context__`),
    outermost first, at most `CHAIN_LIMIT`."""
    errors = [error]
    while len(errors) < CHAIN_LIMIT and (errors[-1].__cause__ or errors[-1].__context__) is not None:
        errors.append(errors[-1].__cause__ or errors[-1].__context__)
    return errors
