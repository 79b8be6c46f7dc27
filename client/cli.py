"""Command-line conventions shared by `python -m client` and `python -m client.perf`.

Bad arguments and failures end in one `error: ...` line on stderr and a
non-zero exit status, never a traceback: 2 for bad arguments, 1 for a failed
run or an unreachable server, 130 when interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Callable

from client.api import ClientError
from client.inputs import InputError

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error instead of usage plus error."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


class UsageError(ValueError):
    """Arguments that parse but do not make sense together."""


def concurrency_list(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4), for argparse `type=`."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4, got {text!r}")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# Set by SIGINT and SIGTERM. A KeyboardInterrupt can be swallowed where it lands
# (inside a gRPC call it becomes an RPC error), so long loops also check this.
INTERRUPTED = threading.Event()


def _interrupt(signum, frame) -> None:
    INTERRUPTED.set()
    raise KeyboardInterrupt


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Call `main(argv)`, turning expected failures into `error:` lines and
    SIGTERM into the same clean unwinding as Ctrl-C (so `finally` blocks,
    e.g. shared-memory cleanup, always run)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    INTERRUPTED.clear()
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = main(argv)
        if INTERRUPTED.is_set():
            raise KeyboardInterrupt
        return code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except ClientError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    except (InputError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
