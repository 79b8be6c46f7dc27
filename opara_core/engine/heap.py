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
frozen or unfrozen then. CPython 3.12 starts with objects of its own frozen
(375; 3.11 and 3.13 with none): what was frozen when this module was imported
does not count as the process's policy. (Counted, it turned the policy off
on the GPU machine's Python 3.12: run 38 found 8 full collections, 2.4-2.6 s,
in each of NASNet's warm builds and nothing frozen.)

Freezing alone is not enough (CPU machine, Python 3.11: NASNet's traced
graph loaded and fused twice, 9 full collections): after the first one,
CPython sizes the next by the objects left unfrozen, so one comes every few
thousand promoted objects, each visiting what the build loaded since the
last freeze. During the build full collections are off (generations 0 and 1
still collect its young cycles); one full collection as the build ends,
while its long-lived objects are still frozen, frees what it dropped after
promoting it (a losing candidate's graph and the GPU memory it holds). Run
38 on the GPU machine: 2 full collections per build (one at startup, this
one: 0.22-0.28 s warm, 0.7 s cold) where there were 8 (warm) and 16 (cold).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_active = False  # the outermost context froze (nothing but the interpreter's own was frozen before it)
_thresholds: tuple[int, int, int] = (0, 0, 0)  # gc's before the outermost context
NO_FULL_COLLECTIONS = 2**30  # generation 1 collections before a full one: never, in a build
_FROZEN_AT_IMPORT = gc.get_freeze_count()  # the interpreter's own (Python 3.12), before any process froze its objects


@contextlib.contextmanager
def long_lived_frozen() -> Iterator[None]:
    """Every object tracked now frozen, and full collections off, until the
    outermost such context ends."""
    global _depth, _active, _thresholds
    with _lock:
        if _depth == 0:
            _active = gc.get_freeze_count() <= _FROZEN_AT_IMPORT
            if _active:
                gc.freeze()
                _thresholds = gc.get_threshold()
                gc.set_threshold(_thresholds[0], _thresholds[1], NO_FULL_COLLECTIONS)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _active:
                gc.collect()  # visits only what is not frozen: the build's own garbage
                gc.set_threshold(*_thresholds)
                gc.unfreeze()
                _active = False


def freeze_more() -> None:
    """Inside `long_lived_frozen`: freeze what was allocated since (a graph
    just traced or fused, kept to the build's end); outside it, nothing."""
    with _lock:
        if _depth and _active:
            gc.freeze()
