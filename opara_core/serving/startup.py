"""What a starting server says, in one place: the line each model logs when
it is ready, the format of a model's own log lines, and the launcher's
reading of tritonserver's output into progress lines.

tritonserver loads every model before it opens any port, so while it starts
there is nothing to poll: its output is the only source. The launcher feeds
each line to `StartupLog`, which keeps the whole output (a log file, or the
terminal when verbose) and writes the lines a person reads:

    loaded 3/8: bert (multi-stream graph, 6 buckets on cuda:0, 8.2 s to initialize; 41 s after start)
    still loading after 90 s (3 of 8 loaded): nasnet: profiling 312 kernels (4 s ago); t5: waiting for cuda:0 (30 s ago); gpt2: queued
    ready after 95 s: 8 of 8 models loaded; HTTP http://127.0.0.1:8000, gRPC 127.0.0.1:8001, ...

A model's own lines carry its name (`INFO [bert] opara_core.engine.build:
...`, `model_log_format`), so the launcher knows what each model is doing
and can name it when a start makes no progress. The `loaded` part comes from
the line a model logs at the end of `initialize` (`ready_line`), the rest
from Triton's own `loading:` / `successfully loaded` lines. On a host
without a GPU, Triton 2.51 prints four alarming but harmless lines about
CUDA (`CudaDriverHelper has not been initialized`, the pinned and CUDA
memory pools); they are replaced by one note. No torch here: the launcher
imports it.
"""

from __future__ import annotations

import logging
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
LOADING = re.compile(r"loading: (?P<model>[^:\s\"]+):\d+")
LOADED = re.compile(r"successfully loaded '(?P<model>[^']+)'")
FAILED = re.compile(r"failed to load '(?P<model>[^']+)'(?: version \d+)?: (?P<why>.*?)\"?$")
# A line of a model's own (model_log_format): level, [model], logger, message
MODEL_LINE = re.compile(r"^(?P<level>[A-Z]+) \[(?P<model>[^\]\s]+)\] (?P<logger>\S+): (?P<message>.*)$")
# Lines only the full log keeps when the terminal gets the short version:
# Triton's informational lines (glog `I<date>`) and Python's INFO and DEBUG.
# Triton's status tables (`+----+`, `| bert | 1 | READY |`) too: the loaded and failed lines say the same;
# and Python's warnings from torch and friends (`.../copyreg.py:99: FutureWarning: ...`), with the
# indented source line that follows each.
CHATTER = re.compile(r"^I\d{4} |^(?:INFO|DEBUG) |^[+|]|^\s*$")  # blank lines too
PY_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")

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


def model_log_format(model: str) -> str:
    """The logging format of a model's backend process: every line names the model."""
    return f"%(levelname)s [{model}] %(name)s: %(message)s"


class StartupLog:
    """Reads tritonserver's output, line by line (from the launcher's reader
    thread), and writes it with the progress lines added.

    `out`: the terminal. `expected`: the models the server will load (None:
    unknown, e.g. explicit model control). `hide_no_gpu_noise`: replace the
    CUDA lines of a GPU-less host by one note. `full_log`: where every line
    goes, after the seconds since the server started (a model's own lines
    have no clock of their own); with one, `out` gets only what a person
    reads (warnings, errors, a line per model, the progress and ready lines).
    """

    def __init__(self, out: TextIO, expected: Sequence[str] | None, hide_no_gpu_noise: bool, full_log: TextIO | None = None):
        self.out = out
        self.full_log = full_log
        self.expected = None if expected is None else sorted(expected)
        self.hide_no_gpu_noise = hide_no_gpu_noise
        self._lock = threading.Lock()
        self._noted = False
        self._after_warning = False  # the last line was a Python warning's first
        self.restart()

    def restart(self) -> None:
        """A new tritonserver process: counts start again."""
        with self._lock:
            self.started = self.last_output = time.monotonic()
            self.built: dict[str, str] = {}  # model -> what its ready line says it built
            self.loaded: list[str] = []
            self.failed: list[str] = []
            self.activity: dict[str, tuple[str, float]] = {}  # model -> (what it last said, when)

    def feed(self, line: str, progress: bool = True) -> None:
        """One line of output; `progress`: it is tritonserver's (a sign of
        progress), not the launcher's or the guard's own."""
        line = line.rstrip("\n")
        now = time.monotonic()
        with self._lock:
            if progress:
                self.last_output = now
            if self.full_log is not None:
                self.full_log.write(self._stamped(line, now) + "\n")
                self.full_log.flush()
            if self.hide_no_gpu_noise and NO_GPU_NOISE.search(line):
                if not self._noted:
                    self._noted = True
                    self._write(NO_GPU_NOTE)
                return
            warning_source = self._after_warning and line.startswith("  ")
            self._after_warning = bool(PY_WARNING.search(line))
            if self.full_log is None or not (CHATTER.search(line) or self._after_warning or warning_source):
                self._write(line, full=False)
            if own := MODEL_LINE.match(line):
                self.activity[own["model"]] = (own["message"], now)
            if ready := READY.search(line):
                seconds = float(ready["seconds"])
                self.built[ready["model"]] = f"{ready['built']} on {ready['device']}, {seconds:.1f} s to initialize"
            elif loaded := LOADED.search(line):
                self._progress("loaded", loaded["model"], self.loaded)
            elif failed := FAILED.search(line):
                self._progress("failed to load", failed["model"], self.failed, failed["why"])
            elif (loading := LOADING.search(line)) and loading["model"] not in self.activity:
                self.activity[loading["model"]] = ("loading", now)

    def _progress(self, verb: str, model: str, into: list[str], why: str = "") -> None:
        into.append(model)
        done = len(self.loaded) + len(self.failed)
        count = f"{done}/{len(self.expected)}" if self.expected is not None else str(done)
        what = "; ".join(p for p in (self.built.get(model, ""), why, f"{time.monotonic() - self.started:.0f} s after start") if p)
        self._write(f"{verb} {count}: {model} ({what})")

    def pending(self) -> list[str]:
        """The models not loaded (nor failed) yet, each with what it last did:
        `nasnet: profiling 312 kernels (4 s ago)`, `gpt2: queued`."""
        with self._lock:
            now = time.monotonic()
            done = {*self.loaded, *self.failed}
            names = self.expected if self.expected is not None else sorted(self.activity)
            described = []
            for name in names:
                if name in done:
                    continue
                if name in self.activity:
                    what, when = self.activity[name]
                    described.append(f"{name}: {_short(what)} ({now - when:.0f} s ago)")
                else:
                    described.append(f"{name}: queued (Triton loads a few models at a time)")
            return described

    def announce_waiting(self) -> None:
        """One line for a start that is still loading: which models, doing what."""
        pending = self.pending()
        if not pending:
            return
        with self._lock:
            total = f" of {len(self.expected)}" if self.expected is not None else ""
            self._write(f"still loading after {time.monotonic() - self.started:.0f} s ({len(self.loaded)}{total} loaded): " + "; ".join(pending))

    def announce_ready(self, urls: str) -> None:
        """The one line for a server that answers: how long it took, how many
        models, where to reach it."""
        with self._lock:
            total = f" of {len(self.expected)}" if self.expected is not None else ""
            failed = f", {len(self.failed)} failed ({', '.join(self.failed)})" if self.failed else ""
            self._write(f"ready after {time.monotonic() - self.started:.0f} s: {len(self.loaded)}{total} models loaded{failed}; {urls}")

    def _write(self, text: str, full: bool = True) -> None:
        """`text` to the terminal, and to the full log too where it is the
        launcher's own line (`full`: a tritonserver line is there already)."""
        self.out.write(text + "\n")
        self.out.flush()
        if full and self.full_log is not None:
            self.full_log.write(self._stamped(text, time.monotonic()) + "\n")
            self.full_log.flush()

    def _stamped(self, line: str, now: float) -> str:
        """`line` as the full log keeps it: after the seconds since the start."""
        return f"{now - self.started:8.2f} {line}"


class StartupHandler(logging.Handler):
    """The launcher's own log records into the startup log, sorted as
    tritonserver's lines are (INFO to the full log only; warnings and errors
    to the terminal too), and never counted as the server's progress."""

    def __init__(self, startup: StartupLog):
        super().__init__()
        self.startup = startup
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.startup.feed(self.format(record), progress=False)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _short(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
