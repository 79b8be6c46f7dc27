"""Which way of running an op was fastest, per shape, on this GPU.

The engine's own kernels (engine.skinny_gemm, engine.depthwise_conv) each
compete with a library call, and which wins depends on the shape and the GPU: a
shape is timed on its first call and the winner kept in this process and on
disk, under $OPARA_CACHE_DIR/FOLDER/KEY.json, KEY a hash of everything the
timing depends on (GPU, torch, Triton, the candidates), so that later builds
time nothing. A call inside a CUDA graph capture cannot time: an unknown shape
there gets the library's way (builds warm up before they capture, so in
practice every shape is known by then).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Callable, Generic, TypeVar

import torch

from opara_core.engine.inductor_cache import cache_root, write_json_atomically

log = logging.getLogger(__name__)

Choice = TypeVar("Choice")


class ShapeChoices(Generic[Choice]):
    """Choices per shape (a string), read from and merged into one JSON file;
    `encode` and `decode` turn a choice into JSON and back."""

    def __init__(self, folder: str, key_parts: list, encode: Callable[[Choice], object], decode: Callable[[object], Choice], library: Choice):
        self.folder, self.encode, self.decode, self.library = folder, encode, decode, library
        self.known: dict[str, Choice] = {}
        self.lock = threading.Lock()
        self.path: Path = cache_root() / folder / f"{hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:24]}.json"
        self.known.update(self._read())
        self.warned = False

    def _read(self) -> dict[str, Choice]:
        try:
            return {shape: self.decode(choice) for shape, choice in json.loads(self.path.read_text()).items()}
        except (OSError, ValueError, TypeError, AttributeError) as error:
            if not isinstance(error, FileNotFoundError):
                log.warning("%s choices in %s not read (%s): timed again", self.folder, self.path, error)
            return {}

    def _write(self) -> None:
        """Merge with what other processes wrote and replace the file whole."""
        try:
            merged = {**self._read(), **self.known}
            write_json_atomically(self.path, {shape: self.encode(choice) for shape, choice in merged.items()})
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
