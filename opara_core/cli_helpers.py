"""Command-line conventions shared by every CLI of the project (the plan CLI,
`python -m client`, `python -m client.perf`).

A bad command line is one `error: ...` line on stderr and exit 2; a failure is
one `error: ...` line and a non-zero exit, never a traceback. Standard library
only, so that the plan CLI and the client import it without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error instead of usage plus error."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(EXIT_USAGE)


def positive_int(text: str, least: int = 1) -> int:
    """An integer >= `least` (1), for argparse `type=`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0, for argparse `type=`."""
    return positive_int(text, least=0)


def positive_int_list(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4), for argparse `type=`."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4, got {text!r}")
    return values


def error_line(error: BaseException, known: tuple[type[BaseException], ...] = (ValueError, KeyError, OSError)) -> str:
    """`error: <first line of the message>`; an exception outside `known`
    (a bug, not bad input) is named, so a report says what broke."""
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    lines = str(text).strip().splitlines() or [type(error).__name__]
    first = " ".join(lines[0].split())
    return f"error: {first if isinstance(error, known) else type(error).__name__ + ': ' + first}"


def fail(error: BaseException, code: int = EXIT_FAILED, **kw) -> int:
    """Print `error_line(error)` on stderr and return `code`, for `except` blocks."""
    print(error_line(error, **kw), file=sys.stderr)
    return code


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """A config dataclass from the parsed arguments of the same names, plus
    `overrides` for those whose option is named or shaped differently."""
    names = {f.name for f in dataclasses.fields(cls)}
    given = {name: value for name, value in vars(args).items() if name in names}
    return cls(**{**given, **overrides})
