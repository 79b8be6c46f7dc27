"""How `python -m client` and `python -m client.perf` run: signals and failures.

Bad arguments and failures end in one `error: ...` line on stderr and a
non-zero exit status, never a traceback: 2 for bad arguments, 1 for a failed
run or an unreachable server, 130 when interrupted (Ctrl-C or SIGTERM). The
parser and argument types are opara_core.cli_helpers, shared with the plan CLI.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Callable

from client.api import DEFAULT_PORTS, UNAVAILABLE, ClientError, parse_url
from client.inputs import InputError
from opara_core.cli_helpers import EXIT_INTERRUPTED, EXIT_USAGE, fail

class UsageError(ValueError):
    """Arguments that parse but do not make sense together."""


def server_url(url: str | None, protocol: str) -> str:
    """--url as HOST:PORT, localhost and the protocol's port by default."""
    try:
        return parse_url(url or f"localhost:{DEFAULT_PORTS[protocol]}", protocol)
    except ValueError as error:
        raise UsageError(str(error)) from None


def unreachable(error: ClientError, url: str, protocol: str) -> ClientError:
    """The error, saying where the server was looked for when nobody answered."""
    if error.kind == UNAVAILABLE:
        return ClientError(f"cannot reach the server at {url} over {protocol}: {error}", UNAVAILABLE)
    return error


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
        return fail(error, EXIT_USAGE)
    except (ClientError, InputError, ValueError, OSError) as error:
        return fail(error, known=(Exception,))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
