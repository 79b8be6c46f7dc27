"""A build's turn on a GPU that other processes' builds share.

Triton loads a repository's models in parallel, one backend process each, and
`auto` compares replay timings that are only fair on an otherwise idle GPU
(measured on an H100: BERT built beside six other models timed its graphs
1.8x slow and kept the sequential graph). So a build holds its GPU's turn, an
exclusive flock on one file per physical GPU, while it uses the GPU, and
steps `aside` while it only compiles (Inductor: minutes of CPU per model on
a cold cache). Meanwhile the next model traces, profiles and times on the
GPU, and the compiles of several models overlap: the shipped repository's
cold start is then about the GPU work of all models plus the longest compile,
not the sum of every build.

One turn per process at a time (a model's build runs in its own backend
process), whichever thread then steps aside (fused lanes compile on a
planning thread of their own); `aside` outside a turn does nothing, so the
engine may step aside wherever it compiles, whoever called it.

A turn held `lazily` is taken only when the build calls `take`: a batch
model's build takes it before it profiles and times candidates, and, where
it captures remembered choices (a warm start), only before its captures.
Until then it traces, fuses, loads its compiled segments and runs them once:
host work, or GPU work that times nothing (NASNet's 10.5 s of reading its
traced graph in the shipped repository's warm start, H100 2026-12-06, and
~25 s of first runs, H200), which waiting for the others' turns only delayed.
A variable-length model's build (serving.varlen) takes it once its saved
whole-model artifact is loaded, before it captures and times its shapes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)

class _Turn:
    """The turn this process holds: its lock file and descriptor (None while
    aside, or until `take` where held lazily: then `lazy` is what to log while it waits)."""

    path: Path | None = None
    fd: int | None = None
    lazy: str | None = None


_state = _Turn()
_guard = threading.RLock()  # one aside at a time; one inside another (same thread) just runs


def lock_path(device: torch.device) -> Path:
    """One lock file per physical GPU (by UUID where torch reports it)."""
    properties = torch.cuda.get_device_properties(device)
    name = str(getattr(properties, "uuid", "") or f"index{device.index or 0}")
    return Path(tempfile.gettempdir()) / f"opara_build_{re.sub(r'[^A-Za-z0-9-]', '', name)}.lock"


def _acquire(path: Path, waiting: str) -> int:
    descriptor = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)  # read-only: another user's file works too
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if waiting:
            log.info("%s", waiting)
        fcntl.flock(descriptor, fcntl.LOCK_EX)
    return descriptor


@contextlib.contextmanager
def held(path: Path, waiting: str = "", lazily: bool = False) -> Iterator[None]:
    """Hold the turn of the GPU whose lock file is `path` (blocking until it
    is free; `waiting` is logged first where it is not free at once); with
    `lazily`, from the first `take` on (before it, `aside` has nothing to give)."""
    if _state.path is not None:
        raise RuntimeError(f"this process already holds the GPU turn {_state.path}")
    if lazily:
        _state.lazy = waiting
    else:
        _state.fd = _acquire(path, waiting)
    _state.path = path
    try:
        yield
    finally:
        if _state.fd is not None:
            os.close(_state.fd)  # releases the lock
        _state.path = _state.fd = _state.lazy = None


def take() -> None:
    """Take a turn held lazily now (blocking until it is free): the build is
    about to use the GPU. Nothing where the turn is taken already, or none is held."""
    with _guard:
        if _state.lazy is not None and _state.path is not None:
            _state.fd = _acquire(_state.path, _state.lazy)
            _state.lazy = None


def holding() -> bool:
    """Whether this process holds a GPU turn now (not stepped aside)."""
    return _state.fd is not None


@contextlib.contextmanager
def aside(what: str) -> Iterator[None]:
    """Give the turn this process holds to another build while `what` (CPU
    work: compiling) runs, and take it back afterwards; nothing outside a turn."""
    with _guard:
        if _state.fd is None:
            yield
            return
        log.info("%s: the GPU is free for other builds meanwhile", what)
        os.close(_state.fd)
        _state.fd = None
        try:
            yield
        finally:
            _state.fd = _acquire(_state.path, f"{what} done; waiting for the GPU: another model's build is using it")
