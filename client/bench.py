"""The load generator: closed-loop workers, one concurrency level after another.

For each level, `c` workers each send a request, wait for the answer and send
the next; each request is timed on the client with a monotonic clock. Warm-up
requests run first and are not measured. The server-side split (queue,
compute input/infer/output) comes from the difference of Triton's cumulative
statistics before and after the measured interval, so it covers exactly the
measured requests (plus any other client's requests to the same model in that
interval, which a dedicated server does not have).

Latency percentiles and the mean are over successful requests only; failed
requests are counted in `requests` and `errors` and excluded from throughput.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from tqdm import tqdm

from client import lengths
from client.api import (
    DEFAULT_TIMEOUT_S,
    NO_RETRY,
    UNAVAILABLE,
    Client,
    ClientError,
    InferRequest,
    SharedMemoryRegions,
    check_shared_memory,
    describe,
)
from client.inputs import ModelInfo, load_inputs, random_inputs

log = logging.getLogger(__name__)

SHARED_MEMORY_MODES = ("none", "system", "cuda")
SERVER_COMPONENTS = ("queue", "compute_input", "compute_infer", "compute_output")
# distinct requests per worker with --lengths (cycled; drawn before the run)
LENGTHS_PER_WORKER = 64
LATENCY_NOTE = (
    "client-side latency per request (monotonic clock, warm-up excluded); "
    "p50/p90/p99/mean over successful requests; throughput_rps counts successful requests per second; "
    "server_*_ms are Triton's per-request averages over the measured interval"
)


@dataclass(frozen=True)
class BenchConfig:
    """One sweep. Exactly one of `requests` (per level) and `duration_s` (per level)."""

    model: str
    url: str
    protocol: str = "grpc"
    concurrency: tuple[int, ...] = (1,)
    requests: int | None = None
    duration_s: float | None = None
    batch: int | None = None  # rows per request: 1, or the batch of the input files
    shared_memory: str = "none"
    warmup: int = 2  # requests per worker before each level, not measured
    timeout_s: float = DEFAULT_TIMEOUT_S
    input_files: tuple[str, ...] = ()
    progress: bool = True
    lengths: str | None = None  # a client.lengths SPEC: each worker cycles through seeded lengths
    parameters: tuple[tuple[str, str], ...] = ()  # request parameters sent with every request

    def __post_init__(self) -> None:
        if (self.requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of --requests and --duration")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0, got {self.duration_s}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency must be positive integers, got {list(self.concurrency)}")
        if self.shared_memory not in SHARED_MEMORY_MODES:
            raise ValueError(f"--shared-memory must be one of {', '.join(SHARED_MEMORY_MODES)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.lengths is not None:
            if self.shared_memory != "none" or self.input_files:
                raise ValueError("--lengths draws random inputs of many shapes: it takes neither --shared-memory nor --input")
            lengths.parse(self.lengths)  # a bad SPEC fails here, before any request


@dataclass(frozen=True)
class Row:
    """One concurrency level. Times in ms; None where nothing was measured."""

    concurrency: int
    requests: int
    errors: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    p999_ms: float | None  # p99.9 and the slowest: the requests that stall far beyond p99
    max_ms: float | None
    mean_ms: float | None
    throughput_rps: float
    server_queue_ms: float | None = None
    server_compute_input_ms: float | None = None
    server_compute_infer_ms: float | None = None
    server_compute_output_ms: float | None = None


ROW_FIELDS = tuple(f.name for f in fields(Row))


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    rows: tuple[Row, ...]
    error_messages: tuple[str, ...] = ()
    batch: int = 1  # rows per request, as sent

    @property
    def errors(self) -> int:
        return sum(row.errors for row in self.rows)

    def to_json(self) -> dict:
        return {
            "model": self.config.model,
            "protocol": self.config.protocol,
            "url": self.config.url,
            "batch": self.batch,
            "shared_memory": self.config.shared_memory,
            "lengths": self.config.lengths,
            "parameters": dict(self.config.parameters),
            "latency": LATENCY_NOTE,
            "results": [asdict(row) for row in self.rows],
            "error_messages": list(self.error_messages),
        }


def summarize(
    concurrency: int, latencies_ns: list[int], errors: int, elapsed_s: float, server: dict | None = None
) -> Row:
    """A row from one level's successful latencies, error count and wall time."""
    ms = np.asarray(latencies_ns, dtype=np.float64) / 1e6
    p50, p90, p99, p999 = (float(v) for v in np.percentile(ms, [50, 90, 99, 99.9])) if ms.size else (None,) * 4
    mean = float(ms.mean()) if ms.size else None
    throughput = ms.size / elapsed_s if elapsed_s > 0 else 0.0
    server = server or {}
    return Row(
        concurrency=concurrency,
        requests=int(ms.size) + errors,
        errors=errors,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        p999_ms=p999,
        max_ms=float(ms.max()) if ms.size else None,
        mean_ms=mean,
        throughput_rps=throughput,
        **{f"server_{name}_ms": server.get(name) for name in SERVER_COMPONENTS},
    )


def server_split(
    before: dict[str, tuple[int, int]] | None, after: dict[str, tuple[int, int]] | None
) -> dict[str, float | None]:
    """Average ms per request of each server component between two snapshots."""
    split: dict[str, float | None] = {name: None for name in SERVER_COMPONENTS}
    if before is None or after is None:
        return split
    for name in SERVER_COMPONENTS:
        count = after[name][0] - before[name][0]
        ns = after[name][1] - before[name][1]
        split[name] = ns / count / 1e6 if count > 0 else None
    return split


# --- running -------------------------------------------------------------------------


class _Worker:
    """One closed-loop sender with its own client, shared-memory regions and
    request, all created, used and closed on one thread of its own: the HTTP
    client is neither thread-safe nor movable between threads (gevent binds
    its sockets to the thread that made them)."""

    def __init__(self, config: BenchConfig, info: ModelInfo, arrays: list[dict[str, np.ndarray]], batch: int):
        self.client: Client | None = None
        self.shm: SharedMemoryRegions | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-worker")
        try:
            self._thread.submit(self._open, config, info, arrays, batch).result()
        except BaseException:
            self.close()
            raise

    def _open(self, config: BenchConfig, info: ModelInfo, arrays: list[dict[str, np.ndarray]], batch: int) -> None:
        """`arrays`: the requests this worker sends in turn (one, unless --lengths)."""
        self.client = Client(config.url, config.protocol, config.timeout_s, retry=NO_RETRY)
        if config.shared_memory != "none":
            outputs = {t.name: (t.dtype, info.full_shape(t, batch)) for t in info.outputs}
            self.shm = SharedMemoryRegions(self.client, arrays[0], outputs, config.shared_memory)
        self.requests: list[InferRequest] = [
            dataclasses.replace(self.client.request(config.model, a, self.shm), parameters=config.parameters) for a in arrays
        ]
        self._sent = 0

    def submit(self, fn, *args) -> Future:
        """Run fn(self, *args) on this worker's thread."""
        return self._thread.submit(fn, self, *args)

    def send(self) -> str | None:
        """One request; the error message, or None on success."""
        request = self.requests[self._sent % len(self.requests)]
        self._sent += 1
        try:
            self.client.infer(request)
            return None
        except Exception as error:  # noqa: BLE001 - every failure is counted, none stops the run
            return describe(error)

    def _close(self) -> None:
        try:
            if self.shm is not None:
                self.shm.close()
        finally:
            if self.client is not None:
                self.client.close()

    def close(self) -> None:
        try:
            self._thread.submit(self._close).result()
        finally:
            self._thread.shutdown(wait=True)


class _Tally:
    """Shared state of one measured level: hands out requests, collects results."""

    def __init__(self, requests: int | None, deadline: float | None, stop: threading.Event, bar: tqdm):
        self._lock = threading.Lock()
        self._left = requests
        self._deadline = deadline
        self._stop = stop
        self._bar = bar
        self.latencies_ns: list[int] = []
        self.errors = 0
        self.messages: Counter[str] = Counter()

    def take(self) -> bool:
        """May a worker send another request?"""
        if self._stop.is_set():
            return False
        if self._deadline is not None:
            return time.monotonic() < self._deadline
        with self._lock:
            if self._left <= 0:
                return False
            self._left -= 1
            return True

    def record(self, latency_ns: int, error: str | None) -> None:
        with self._lock:
            if error is None:
                self.latencies_ns.append(latency_ns)
            else:
                self.errors += 1
                self.messages[error] += 1
            self._bar.update(1)


def _measured_loop(worker: _Worker, tally: _Tally) -> None:
    while tally.take():
        start = time.perf_counter_ns()  # monotonic, highest resolution
        error = worker.send()
        tally.record(time.perf_counter_ns() - start, error)


def _warmup_loop(worker: _Worker, count: int, stop: threading.Event) -> int:
    """Send `count` requests; how many succeeded."""
    succeeded = 0
    for _ in range(count):
        if stop.is_set():
            break
        succeeded += worker.send() is None
    return succeeded


def _on_workers(target, workers: list[_Worker], args: tuple, stop: threading.Event) -> list:
    """Run target(worker, *args) on every worker's thread, wait for all, return
    their results. On Ctrl-C, stop handing out requests, let in-flight ones
    finish, re-raise."""
    futures = [worker.submit(target, *args) for worker in workers]
    try:
        return [future.result() for future in futures]
    except BaseException:
        stop.set()
        wait(futures)
        raise


def _statistics(
    control: Client, model: str, before: dict | None = None, expected: int = 0, wait_s: float = 2.0
) -> dict | None:
    """A statistics snapshot. With `before`, wait (briefly) until the server
    has accounted for the `expected` successful requests: Triton updates its
    statistics just after sending a response, so the last ones can lag."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            stats = control.statistics(model)
        except ClientError as error:
            log.debug("no statistics for %s: %s", model, error)
            return None
        if before is None or stats["success"][0] - before["success"][0] >= expected or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def _measure(
    config: BenchConfig, control: Client, workers: list[_Worker], stop: threading.Event
) -> tuple[Row, Counter]:
    c = len(workers)
    # The warm-up's last requests can still be missing from the statistics
    # when their responses arrive; `before` waits for them so that none of
    # them (a new batch size's first, slow run, say) counts as measured.
    initial = _statistics(control, config.model)
    warmed = sum(_on_workers(_warmup_loop, workers, (config.warmup, stop), stop))
    with tqdm(
        total=config.requests,
        desc=f"concurrency {c}",
        unit="req",
        disable=not config.progress,
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        deadline = None if config.duration_s is None else time.monotonic() + config.duration_s
        tally = _Tally(config.requests, deadline, stop, bar)
        before = _statistics(control, config.model, initial, warmed)
        start = time.perf_counter_ns()
        _on_workers(_measured_loop, workers, (tally,), stop)
        elapsed_s = (time.perf_counter_ns() - start) / 1e9
        after = _statistics(control, config.model, before, len(tally.latencies_ns))
    row = summarize(c, tally.latencies_ns, tally.errors, elapsed_s, server_split(before, after))
    return row, tally.messages


def _model_inputs(control: Client, config: BenchConfig) -> tuple[ModelInfo, list[list[dict[str, np.ndarray]]], int]:
    """The model's description, each worker's requests' arrays, and the batch size.

    A model the server does not know still gets its requests sent (with no
    inputs), so that each one is counted as the error the server returns.
    """
    try:
        info = control.model_info(config.model)
    except ClientError as error:
        if error.kind == UNAVAILABLE:
            raise
        log.warning("model %r: %s; sending requests anyway, each will be counted as an error", config.model, error)
        batch = config.batch or 1
        return ModelInfo(config.model, batch, (), ()), [[{}]] * max(config.concurrency), batch
    workers = max(config.concurrency)
    if config.lengths is not None:
        drawn = lengths.parse(config.lengths).lengths(workers * LENGTHS_PER_WORKER)
        per_worker = [
            [random_inputs(info, config.batch or 1, seed=int(k), length=int(drawn[k])) for k in range(w, len(drawn), workers)]
            for w in range(workers)
        ]
        return info, per_worker, config.batch or 1
    if config.input_files:
        arrays = load_inputs(info, list(config.input_files), config.batch)
    else:
        arrays = random_inputs(info, config.batch or 1)
    batch = next(iter(arrays.values())).shape[0] if info.batching and arrays else 1
    return info, [[arrays]] * workers, batch


def run(config: BenchConfig, stop: threading.Event | None = None) -> BenchResult:
    """Measure every concurrency level of `config`; shared-memory regions and
    clients are released on the way out, whatever happens. Setting `stop`
    (the CLI passes its interrupt flag) ends the run after the requests in flight."""
    stop = threading.Event() if stop is None else stop
    check_shared_memory(config.shared_memory)
    with Client(config.url, config.protocol, config.timeout_s) as control, ExitStack() as stack:
        if not control.live():
            raise ClientError(f"server at {control.url} is not live", UNAVAILABLE)
        info, per_worker, batch = _model_inputs(control, config)
        workers = []
        for arrays in per_worker:
            workers.append(_Worker(config, info, arrays, batch))
            stack.callback(workers[-1].close)
        rows, messages = [], Counter()
        for c in config.concurrency:
            row, level_messages = _measure(config, control, workers[:c], stop)
            rows.append(row)
            messages.update(level_messages)
            log.info("concurrency %d: %s", c, row)
    top = tuple(f"{message} ({count}x)" for message, count in messages.most_common(3))
    return BenchResult(config, tuple(rows), top, batch)


# --- writers -------------------------------------------------------------------------


def write_json(path: Path, result: BenchResult) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=2) + "\n")


def write_csv(path: Path, rows: tuple[Row, ...] | list[Row]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in asdict(row).items()})


def read_json(path: Path) -> dict:
    """A `--json` file, checked for the fields readers rely on."""
    data = json.loads(Path(path).read_text())
    missing = [key for key in ("model", "protocol", "results") if key not in data]
    if missing:
        raise ValueError(f"{path} is not a bench result: missing {missing}")
    return data


def format_table(rows: tuple[Row, ...] | list[Row]) -> str:
    """The summary table the CLI prints."""
    columns = [
        *((name, name, "{:d}") for name in ("concurrency", "requests", "errors")),
        *((f"{name}_ms", f"{name} ms", "{:.1f}") for name in ("p50", "p90", "p99", "mean")),
        ("throughput_rps", "req/s", "{:.2f}"),
        ("server_queue_ms", "queue ms", "{:.2f}"),
        ("server_compute_input_ms", "in ms", "{:.2f}"),
        ("server_compute_infer_ms", "infer ms", "{:.1f}"),
        ("server_compute_output_ms", "out ms", "{:.2f}"),
    ]
    table = [[title for _, title, _ in columns]]
    for row in rows:
        values = asdict(row)
        table.append(["-" if values[key] is None else fmt.format(values[key]) for key, _, fmt in columns])
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in table)
