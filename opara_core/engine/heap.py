"""Garbage collection during a build: the objects that outlive it frozen.

A full collection visits every object the process tracks, and a build holds
millions that stay (the model, its traced and fused graphs, the loaded
segments' code). NASNet's first warm build on an H200 (docs/benchmarks.md run
36): 8 full collections in the process, 2.6 s; collections of generations 1
and 2 took 1.8 s of the build's 17.0 s, 1.1 s of them while it loaded its
saved segments. Frozen (`gc.freeze`), those objects are skipped; what the
build allocates and drops meanwhile (cycles of candidates it times and drops,
Inductor's loading state) is still collected. Leaving the outermost
`long_lived_frozen` returns them to the collector. A process that froze
objects itself (a server after its start) keeps its own policy: nothing is
frozen or unfrozen then.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_active = False  # the outermost context froze (nothing was frozen before it)


@contextlib.contextmanager
def long_lived_frozen() -> Iterator[None]:
    """Every object tracked now frozen until the outermost such context ends."""
    global _depth, _active
    with _lock:
        if _depth == 0:
            _active = gc.get_freeze_count() == 0
            if _active:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _active:
                gc.unfreeze()
                _active = False


def freeze_more() -> None:
    """Inside `long_lived_frozen`: freeze what was allocated since (a graph
    just traced or fused, kept to the build's end); outside it, nothing."""
    with _lock:
        if _depth and _active:
            gc.freeze()
