"""Which way of running an op was fastest, per shape, on this GPU.

The engine's own kernels (engine.skinny_gemm, engine.depthwise_conv) each
compete with a library call, and which wins depends on the shape and the GPU: a
shape is timed on its first call and the winner kept in this process and on
disk, under $OPARA_CACHE_DIR/FOLDER/KEY.json, KEY (engine.cache) of everything
the timing depends on (GPU, torch, Triton, the candidates), so that later builds
time nothing. Not the TF32 and cuDNN benchmark switches: the key is made once
per process and device, at the first call (which may come inside a fusion
check, with TF32 off), and the engine never turns TF32 on. A call inside a CUDA
graph capture cannot time: an unknown shape there gets the library's way
(builds warm up before they capture, so in practice every shape is known by
then). Also what timing and checking the candidates needs: `per_call_ms`,
`relative_error` (against a float64 answer, kept in float64: the errors
compared are ~1e-7, where compare.max_relative_error's fp32 arithmetic would
round), `triton_failures`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

import torch

from opara_core.engine import cache
from opara_core.engine.capture import capture_module, time_replays

log = logging.getLogger(__name__)

FORMAT = 2  # of the files and their key (2: keyed through engine.cache)

Choice = TypeVar("Choice")


class ShapeChoices(Generic[Choice]):
    """Choices per shape (a string), read from and merged into one JSON file: a
    choice is a kernel configuration (a dataclass of type `config`) or the name
    of a library way (a string; `library` the one taken inside a capture).
    The file is `folder`'s (engine.cache), keyed by `key_parts` and the parts
    of the software named in `software` (`gpu` needs `device`)."""

    def __init__(self, folder: str, key_parts: list, config: type, library: str, software: Iterable[str] = (), device: Any = None):
        self.folder, self.config, self.library = folder, config, library
        self.known: dict[str, Choice] = {}
        self.lock = threading.Lock()
        self.path: Path = cache.directory(folder) / f"{cache.key({'parts': key_parts, 'format': FORMAT}, software, device)}.json"
        self.known.update(self._read())
        self.warned = False

    def _read(self) -> dict[str, Choice]:
        """What the file holds (nothing if missing; unreadable: timed again, engine.cache warns)."""
        read = cache.read_json(self.path, lambda data: {shape: self.config(**c) if isinstance(c, dict) else str(c) for shape, c in data.items()}, f"{self.folder} choices")
        return read or {}

    def _write(self) -> None:
        """Merge with what other processes wrote and replace the file whole."""
        try:
            merged = {**self._read(), **self.known}
            cache.write_json(self.path, {shape: c if isinstance(c, str) else asdict(c) for shape, c in merged.items()})
        except OSError as error:
            log.warning("%s choices not saved to %s: %s", self.folder, self.path, error)

    def choose(self, shape: str, time_and_pick: Callable[[], Choice]) -> Choice:
        """The choice for `shape`: known, else `time_and_pick()`'s (then kept),
        else inside a capture the library's way (not kept)."""
        with self.lock:
            if shape in self.known:
                return self.known[shape]
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                if not self.warned:
                    log.warning("%s %s first seen inside a CUDA graph capture: %s (shapes are timed on their first call outside one)", self.folder, shape, self.library)
                    self.warned = True
                return self.library
            chosen = self.known[shape] = time_and_pick()
            self._write()
            return chosen


def per_call_ms(calls: list[Callable[[], object]], seconds: float = 0.002, repeats: int = 3) -> float:
    """Median ms per call of `calls` captured back to back in one CUDA graph."""
    captured = capture_module(lambda: [call() for call in calls], [], None, warmup=1)
    return time_replays(captured, seconds=seconds, repeats=repeats) / len(calls)


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest deviation from a float64 answer, relative to its largest entry."""
    return float((got.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30))


def triton_failures() -> tuple[type[Exception], ...]:
    """Triton's errors for code it cannot build (OutOfResources, PTXASError,
    CompilationError: one base class in recent Triton, separate ones before)."""
    try:
        from triton.errors import TritonError

        return (TritonError,)
    except ImportError:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        return (OutOfResources, CompilationError)
