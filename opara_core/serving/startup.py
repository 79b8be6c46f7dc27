"""What a starting server says, in one place: the line each model logs when
it is ready, and the launcher's reading of tritonserver's output into
progress lines.

tritonserver loads every model before it opens any port, so while it starts
there is nothing to poll: its output is the only source. The launcher feeds
each line to `StartupLog`, which passes it on and adds its own lines:

    loaded 3/8: bert (multi-stream graph, 6 buckets on cuda:0, 8.2 s to initialize; 41 s after start)
    ready after 95 s: 8 of 8 models loaded; HTTP http://127.0.0.1:8000, gRPC 127.0.0.1:8001, ...

The model's part comes from the line its `initialize` logs (`ready_line`),
the rest from Triton's own `loading:` / `successfully loaded` lines. On a
host without a GPU, Triton 2.51 prints four alarming but harmless lines about
CUDA (`CudaDriverHelper has not been initialized`, the pinned and CUDA memory
pools); they are replaced by one note. No torch here: the launcher imports it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from typing import TextIO

# The model's own line: `model bert ready on cuda:0 in 8.2 s: <what it built> | <details>`
READY = re.compile(
    r"model (?P<model>\S+) ready on (?P<device>\S+) in (?P<seconds>[\d.]+) s: (?P<built>[^|]*?)\s*(?:\| (?P<details>.*))?$"
)
# Triton's lines (2.51 quotes its messages; older releases did not)
LOADED = re.compile(r"successfully loaded '(?P<model>[^']+)'")
FAILED = re.compile(r"failed to load '(?P<model>[^']+)'(?: version \d+)?: (?P<why>.*?)\"?$")

# Triton 2.51 on a host without a GPU (or without a driver): nothing is wrong,
# the CUDA pools are simply off and requests use ordinary host memory.
NO_GPU_NOISE = re.compile(
    r"CudaDriverHelper has not been initialized"
    r"|Unable to allocate pinned system memory, pinned memory pool will not be available"
    r"|CUDA memory pool disabled"
    r"|failed to allocate pinned system memory: no pinned memory pool"
)
NO_GPU_NOTE = (
    "note: no GPU on this host: tritonserver's CUDA memory pools are off and its "
    "\"CudaDriverHelper has not been initialized\" error is harmless (models run on the CPU); "
    "those lines are hidden (--log-verbose 1 shows them)"
)


def ready_line(model: str, device: str, seconds: float, built: str, details: Sequence[str] = ()) -> str:
    """The one line a model logs at the end of `initialize`: what it built
    (short, repeated in the launcher's `loaded` line), then the details."""
    line = f"model {model} ready on {device} in {seconds:.1f} s: {built}"
    return line + (" | " + "; ".join(details) if details else "")


class StartupLog:
    """Reads tritonserver's output, line by line (from the launcher's reader
    thread), writes it to `out` with the progress lines added.

    `expected`: the models the server will load (None: unknown, e.g. explicit
    model control). `hide_no_gpu_noise`: replace the CUDA lines of a GPU-less
    host by one note.
    """

    def __init__(self, out: TextIO, expected: Sequence[str] | None, hide_no_gpu_noise: bool):
        self.out = out
        self.expected = None if expected is None else sorted(expected)
        self.hide_no_gpu_noise = hide_no_gpu_noise
        self._lock = threading.Lock()
        self._noted = False
        self.restart()

    def restart(self) -> None:
        """A new tritonserver process: counts start again."""
        with self._lock:
            self.started = time.monotonic()
            self.built: dict[str, str] = {}  # model -> what its ready line says it built
            self.loaded: list[str] = []
            self.failed: list[str] = []

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        with self._lock:
            if self.hide_no_gpu_noise and NO_GPU_NOISE.search(line):
                if not self._noted:
                    self._noted = True
                    self._write(NO_GPU_NOTE)
                return
            self._write(line)
            if ready := READY.search(line):
                seconds = float(ready["seconds"])
                self.built[ready["model"]] = f"{ready['built']} on {ready['device']}, {seconds:.1f} s to initialize"
            elif loaded := LOADED.search(line):
                self._progress("loaded", loaded["model"], self.loaded)
            elif failed := FAILED.search(line):
                self._progress("failed to load", failed["model"], self.failed, failed["why"])

    def _progress(self, verb: str, model: str, into: list[str], why: str = "") -> None:
        into.append(model)
        done = len(self.loaded) + len(self.failed)
        count = f"{done}/{len(self.expected)}" if self.expected is not None else str(done)
        what = "; ".join(p for p in (self.built.get(model, ""), why, f"{time.monotonic() - self.started:.0f} s after start") if p)
        self._write(f"{verb} {count}: {model} ({what})")

    def announce_ready(self, urls: str) -> None:
        """The one line for a server that answers: how long it took, how many
        models, where to reach it."""
        with self._lock:
            total = f" of {len(self.expected)}" if self.expected is not None else ""
            failed = f", {len(self.failed)} failed ({', '.join(self.failed)})" if self.failed else ""
            self._write(f"ready after {time.monotonic() - self.started:.0f} s: {len(self.loaded)}{total} models loaded{failed}; {urls}")

    def _write(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()
