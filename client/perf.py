"""perf_analyzer, run the same way for every model, and a plot that puts its
results next to the project's own client.

`python -m client.perf run` runs the perf_analyzer bundled in the tritonclient
wheel against a running server: for each model (default: every model the
server reports ready; decoupled models are skipped), one perf_analyzer run
per concurrency level with count-based measurement windows sized to the
model's speed, merged into `OUT_DIR/<model>.csv` (its own columns, times in
µs, rows in concurrency order, and our `Settled`: a level that does not settle
is measured once more as a fixed number of requests, without the stability
check, and marked `no`); perf_analyzer's output is streamed as it comes. The input data is
written by `client.inputs` from the model's metadata and config, so ids stay
in the ranges the model declares, exactly as for the client. This module is
the project's one perf_analyzer driver: scripts/serving_bench.py uses its
command builder, input format and CSV parser too.

`python -m client.perf plot` draws perf_analyzer CSVs and `python -m client
bench --json` files on one latency-vs-throughput chart.
"""

from __future__ import annotations

import argparse
import base64
import csv
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from client import lengths
from client.api import PROTOCOLS, SHARED_MEMORY_KINDS, Client, ClientError, check_shared_memory, parse_url
from client.bench import read_json
from client.cli import UsageError, run_main, server_url, unreachable
from client.inputs import DEFAULT_LENGTH, InputError, ModelInfo, random_inputs
from client.plots import plot_latency_vs_throughput
from opara_core.cli_helpers import Parser, config_from_args, non_negative_int, positive_int, positive_int_list
from opara_core.serving.admin_key import read_admin_key

class PerfError(RuntimeError):
    """perf_analyzer did not produce a measurement; the message has its last words."""


UNSTABLE = "Failed to obtain stable measurement"


@dataclass(frozen=True)
class PerfConfig:
    """One perf_analyzer sweep of one model. The defaults finish on a shared
    2-core CPU (see README, make perf): short count windows, judged on p50, and
    a level that does not settle is measured once more without the stability
    check and marked unsettled (Settled=no in the CSV) instead of failing."""

    model: str
    url: str
    protocol: str = "grpc"
    concurrency: tuple[int, ...] = (1, 2, 4)
    batch: int = 1
    request_count: int = 50  # requests per measurement window
    stability_percentage: int = 30  # perf_analyzer's 10 (and 20) never settled on the busy 2-core CPU machine
    max_trials: int = 10  # windows before giving up (perf_analyzer's default); a settled level needs 3 in a row
    # an unsettled level: measured again as this many windows' worth of requests
    # without the stability check (throughput swung sixfold between windows on the
    # shared 2-core machine); 0: it is an error
    rough_windows: int = 3
    percentile: int | None = 50  # stabilise on p50 (None: on the mean), robust to the odd slow request
    shared_memory: str = "none"
    timeout_s: float = 600.0
    admin_key: str | None = field(default=None, repr=False)  # for the shared-memory API
    binary: str | None = None  # default: the perf_analyzer of the tritonclient wheel
    verbose: bool = True  # -v: one line per measurement window, so a slow level shows it is converging
    lengths: str | None = None  # a client.lengths SPEC: the input data holds requests of those lengths


def perf_analyzer_binary() -> str:
    """The perf_analyzer that the tritonclient wheel installed next to this Python."""
    candidate = Path(sysconfig.get_path("scripts")) / "perf_analyzer"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("perf_analyzer")
    if found is None:
        raise PerfError("perf_analyzer not found; install tritonclient==2.51.0 (make setup)")
    return found


def perf_analyzer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment perf_analyzer needs: the 2.51 binary links libcudart.so.12,
    even on a CPU-only machine, which nvidia-cuda-runtime-cu12 provides."""
    env = dict(os.environ if base is None else base)
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is not None and spec.submodule_search_locations:
        lib = str(Path(list(spec.submodule_search_locations)[0]) / "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    return env


def exec_perf_analyzer() -> None:
    """`opara-perf-analyzer ARGS...`: perf_analyzer itself, with the library
    path it needs (`.venv/bin/perf_analyzer` alone cannot find libcudart.so.12)."""
    try:
        binary = perf_analyzer_binary()
    except PerfError as error:
        sys.exit(f"error: {error}")
    os.execve(binary, [binary, *sys.argv[1:]], perf_analyzer_env())


def admin_key_header(protocol: str, key: str) -> list[str]:
    """perf_analyzer's `-H` for the admin key; over gRPC it becomes metadata,
    which needs Triton's protocol prefix."""
    name = "admin-key" if protocol == "http" else "triton-grpc-protocol-admin-key"
    return ["-H", f"{name}:{key}"]


def perf_analyzer_command(
    config: PerfConfig, concurrency: int, data_path: Path, csv_path: Path, output_bytes: int = 0, total: int | None = None
) -> list[str]:
    """One level's perf_analyzer command: count windows until stable, or with
    `total`, exactly that many requests measured once (no stability check)."""
    if total is None:
        measure = [
            "--measurement-mode=count_windows",
            f"--measurement-request-count={config.request_count}",
            f"--stability-percentage={config.stability_percentage}",
            f"--max-trials={config.max_trials}",
        ]
    else:
        measure = [f"--request-count={total}"]
    command = [
        config.binary or perf_analyzer_binary(),
        "-m", config.model,
        "-u", parse_url(config.url, config.protocol),
        "-i", config.protocol,
        "-b", str(config.batch),
        f"--concurrency-range={concurrency}:{concurrency}",
        *measure,
        f"--input-data={data_path}",
        "-f", str(csv_path),
    ]  # fmt: skip
    if config.percentile is not None:
        command.append(f"--percentile={config.percentile}")
    if config.verbose:
        command.append("-v")
    if config.shared_memory != "none":
        command += [f"--shared-memory={config.shared_memory}", f"--output-shared-memory-size={max(output_bytes, 1)}"]
        if config.admin_key:  # the shared-memory API is restricted
            command += admin_key_header(config.protocol, config.admin_key)
    return command


def output_bytes(info: ModelInfo, batch: int, length: int = DEFAULT_LENGTH) -> int:
    """The largest output of one request: the size of each output shared-memory
    slot. A variable dimension counts at `length`, the longest input of the data
    (a variable-length model's output follows one of its inputs' lengths)."""
    rows = batch if info.batching else 1
    return max((rows * int(np.prod(t.sized(length))) * t.dtype.itemsize for t in info.outputs), default=0)


def write_input_data(info: ModelInfo, path: Path, count: int = 1, seed: int = 0, lengths: np.ndarray | None = None) -> Path:
    """perf_analyzer's `--input-data` JSON: `count` batch-1 requests (used in
    turn), each tensor as base64 of its raw bytes, which leaves perf_analyzer
    nothing to parse; perf_analyzer repeats rows for larger batches. The data
    comes from `client.inputs`, so ids stay in the ranges the model declares.
    A tensor with a variable dimension carries its `shape`: request k has
    length `lengths[k]` there (client.inputs.DEFAULT_LENGTH without `lengths`)."""
    entries = []
    variable = {t.name for t in info.inputs if not t.fixed}
    for k in range(count):
        entry = {}
        length = None if lengths is None else int(lengths[k % len(lengths)])
        for name, array in random_inputs(info, 1, seed + k, length=length).items():
            if array.dtype == np.object_:
                raise InputError(f"input {name!r} is BYTES; write its perf_analyzer data by hand")
            row = array[0] if info.batching else array
            entry[name] = {"b64": base64.b64encode(np.ascontiguousarray(row).tobytes()).decode()}
            if name in variable:
                entry[name]["shape"] = list(row.shape)
        entries.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": entries}))
    return path


def read_perf_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# perf_analyzer's CSV columns (µs, except throughput) -> our keys (ms)
PERF_COLUMNS = {
    "p50 latency": "p50_ms",
    "p90 latency": "p90_ms",
    "p99 latency": "p99_ms",
    "Avg latency": "avg_ms",
    "Server Queue": "server_queue_ms",
    "Server Compute Input": "server_compute_input_ms",
    "Server Compute Infer": "server_compute_infer_ms",
    "Server Compute Output": "server_compute_output_ms",
    "Client Send": "client_send_ms",
    "Client Recv": "client_recv_ms",
}


def perf_row(row: dict[str, str]) -> dict:
    """One perf_analyzer CSV row: concurrency, throughput (inferences/s) and
    times in ms (0 where perf_analyzer left a column out)."""
    def number(key: str) -> float:
        try:
            return float(row.get(key) or 0)
        except ValueError:
            return 0.0

    return {
        "concurrency": int(row["Concurrency"]),
        "throughput": number("Inferences/Second"),
        **{ours: number(theirs) / 1000 for theirs, ours in PERF_COLUMNS.items()},
    }


def run_perf_analyzer(command: list[str], log_file: TextIO, timeout_s: float, echo: bool = True) -> tuple[int | None, str]:
    """Run one perf_analyzer, its output streamed line by line to `log_file`
    (and to stdout when `echo`) as it comes. Returns (exit code or None when it
    ran past `timeout_s`, the output)."""
    log_file.write("$ " + " ".join(command) + "\n")
    lines: list[str] = []
    process = subprocess.Popen(
        command, env=perf_analyzer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        process.kill()

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        for line in process.stdout:
            lines.append(line)
            log_file.write(line)
            log_file.flush()
            if echo:
                print("  " + line, end="", flush=True)
        code = process.wait()
    finally:
        timer.cancel()
        if process.poll() is None:  # interrupted
            process.kill()
            process.wait()
    if timed_out.is_set():
        lines.append(f"timed out after {timeout_s:.0f} s\n")
        log_file.write(lines[-1])
        return None, "".join(lines)
    return code, "".join(lines)


def failure_line(config: PerfConfig, concurrency: int, code: int | None, output: str) -> str:
    """One line on why a level measured nothing; for an unstable one, which options to raise."""
    where = f"{config.model} at concurrency {concurrency}"
    if UNSTABLE in output:
        return f"{where}: {_unstable(config)}: raise {RAISE}"
    last = [line.strip() for line in output.splitlines() if line.strip()][-1:] or ["no output"]
    return f"{where}: perf_analyzer exit {code}: {last[0]}"


def decoupled(config: dict) -> bool:
    """Whether a model answers with a stream of responses (Triton's decoupled transaction policy)."""
    return bool((config.get("model_transaction_policy") or {}).get("decoupled"))


RAISE = "--max-trials, --stability-percentage or --request-count (make perf: PERF_ARGS=...)"


def _unstable(config: PerfConfig) -> str:
    return (
        f"no stable measurement in {config.max_trials} windows of {config.request_count} requests "
        f"(p{config.percentile or 'mean'} and throughput within {config.stability_percentage}%)"
    )


def rough_line(config: PerfConfig, concurrency: int) -> str:
    """One line for a level measured without the stability check."""
    return (
        f"{config.model} at concurrency {concurrency}: {_unstable(config)}; measured "
        f"{config.rough_windows * config.request_count} requests once instead (Settled=no in the CSV: a rough "
        f"number); for a settled one raise {RAISE}"
    )


MIN_WINDOW_REQUESTS, MAX_WINDOW_REQUESTS = 10, 50
LENGTH_REQUESTS = 256  # distinct requests in the input data with --lengths, sent in turn


def window_requests(url: str, protocol: str, info: ModelInfo, batch: int, window_s: float) -> int:
    """Requests in a window of about `window_s` seconds: a slow model (NASNet on
    a CPU, 0.6 s a request) gets short count windows and still settles in
    minutes, a fast one gets up to 50. The fastest of three requests after a
    warm-up sets the pace: a request slowed by a busy machine would shrink the
    windows until nothing settles."""
    with Client(url, protocol) as client:
        request = client.request(info.name, random_inputs(info, batch))
        client.infer(request)
        latencies = []
        for _ in range(3):
            start = time.perf_counter()
            client.infer(request)
            latencies.append(time.perf_counter() - start)
    count = max(MIN_WINDOW_REQUESTS, min(MAX_WINDOW_REQUESTS, math.ceil(window_s / min(latencies))))
    print(f"{info.name}: {min(latencies) * 1000:.0f} ms a request: windows of {count} requests", flush=True)
    return count


def run_model(config: PerfConfig, info: ModelInfo, csv_path: Path, echo: bool = True) -> tuple[list[str], list[str]]:
    """Sweep one model; writes `csv_path` with every level that measured, each
    row marked Settled yes or no. Returns (failures, levels measured without
    the stability check), one line each; raises PerfError if none measured."""
    rows: list[dict[str, str]] = []
    failures: list[str] = []
    rough: list[str] = []
    log_path = csv_path.with_suffix(".log")
    with tempfile.TemporaryDirectory(prefix="opara_perf_") as tmp, open(log_path, "w") as log_file:
        longest = DEFAULT_LENGTH
        if config.lengths is None:
            data = write_input_data(info, Path(tmp) / "data.json")
        else:
            drawn = lengths.parse(config.lengths).lengths(LENGTH_REQUESTS)
            data = write_input_data(info, Path(tmp) / "data.json", count=LENGTH_REQUESTS, lengths=drawn)
            longest = int(max(drawn))
        for concurrency in config.concurrency:
            part = Path(tmp) / f"c{concurrency}.csv"
            command = perf_analyzer_command(config, concurrency, data, part, output_bytes(info, config.batch, longest))
            if echo:
                print(f"{config.model}: concurrency {concurrency}", flush=True)
            code, output = run_perf_analyzer(command, log_file, config.timeout_s, echo)
            settled = "yes"
            if code != 0 and UNSTABLE in output and config.rough_windows:
                total = config.rough_windows * config.request_count
                if echo:
                    print(f"{config.model}: concurrency {concurrency} did not settle; measuring {total} requests once", flush=True)
                command = perf_analyzer_command(config, concurrency, data, part, output_bytes(info, config.batch, longest), total)
                code, output = run_perf_analyzer(command, log_file, config.timeout_s, echo)
                settled = "no"
            if code == 0 and part.exists():
                rows += [{**row, "Settled": settled} for row in read_perf_csv(part)]
                if settled == "no":
                    rough.append(rough_line(config, concurrency))
            else:
                failures.append(failure_line(config, concurrency, code, output))
    if not rows:
        raise PerfError("; ".join(failures) + f" (full output in {log_path})")
    rows.sort(key=lambda r: int(r["Concurrency"]))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return failures, rough


# --- comparison plot -----------------------------------------------------------------


def perf_points(rows: list[dict[str, str]]) -> list[dict]:
    """perf_analyzer CSV rows (µs, inferences/s) as plot points (ms)."""
    keys = ("concurrency", "throughput", "p50_ms", "p99_ms")
    return [{k: v for k, v in perf_row(r).items() if k in keys} for r in rows]


def bench_points(data: dict) -> list[dict]:
    """Rows of a bench JSON file as plot points; throughput in inferences/s
    (requests/s times the batch size), as perf_analyzer reports it."""
    batch = int(data.get("batch", 1))
    return [
        {
            "concurrency": r["concurrency"],
            "throughput": r["throughput_rps"] * batch,
            "p50_ms": r["p50_ms"],
            "p99_ms": r["p99_ms"],
        }
        for r in data["results"]
        if r.get("p50_ms") is not None
    ]


# --- CLI -----------------------------------------------------------------------------


def _parser() -> Parser:
    parser = Parser(
        prog="python -m client.perf", description="perf_analyzer sweeps, and plots comparing them with the client"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    run = sub.add_parser("run", help="run perf_analyzer for each model; one CSV per model")
    run.add_argument("--model", action="append", help="model to measure (repeatable); default: every ready model")
    run.add_argument("--protocol", choices=PROTOCOLS, default="grpc")
    run.add_argument("--url", help="HOST:PORT (default localhost:8001 for grpc, localhost:8000 for http)")
    run.add_argument("--concurrency", type=positive_int_list, default=(1, 2, 4), help="levels, e.g. 1,2,4")
    run.add_argument("--batch", type=positive_int, default=1)
    run.add_argument(
        "--request-count",
        type=positive_int,
        default=None,
        help="requests per measurement window (default: about --window-seconds of them, timed per model, "
        f"{MIN_WINDOW_REQUESTS} to {MAX_WINDOW_REQUESTS})",
    )
    run.add_argument(
        "--window-seconds", type=float, default=5.0, help="target length of a window when --request-count is not given"
    )
    run.add_argument(
        "--stability-percentage",
        type=positive_int,
        default=PerfConfig.stability_percentage,
        help=f"how far 3 windows in a row may differ (default {PerfConfig.stability_percentage}; perf_analyzer's own: 10)",
    )
    run.add_argument("--max-trials", type=positive_int, default=PerfConfig.max_trials, help="windows before giving up")
    run.add_argument(
        "--rough-windows",
        type=non_negative_int,
        default=PerfConfig.rough_windows,
        help="a level that does not settle is measured once more as this many windows' worth of requests, without "
        f"the stability check, and marked Settled=no (default {PerfConfig.rough_windows}; 0: an unsettled level is an error)",
    )
    run.add_argument(
        "--shared-memory",
        choices=("none", *SHARED_MEMORY_KINDS),
        default="none",
        help="perf_analyzer's --shared-memory: system (same host) or cuda (same GPU host: tensors stay on the GPU)",
    )
    run.add_argument(
        "--lengths", metavar="SPEC", help="variable-length models: requests of seeded lengths (see client/lengths.py)"
    )
    run.add_argument("--out-dir", type=Path, default=Path("out/perf"))
    plot = sub.add_parser("plot", help="perf_analyzer CSVs and bench JSONs on one latency-vs-throughput plot")
    plot.add_argument("--perf-csv", type=Path, action="append", default=[], help="a `run` CSV (repeatable)")
    plot.add_argument(
        "--bench-json",
        type=Path,
        action="append",
        default=[],
        help="a `python -m client bench --json` file (repeatable)",
    )
    plot.add_argument("--output", type=Path, required=True, help="PNG file to write")
    plot.add_argument("--title", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plot":
        return _plot(args)
    if args.lengths is not None:
        if args.shared_memory != "none":
            raise UsageError("--lengths sends outputs of many sizes: it does not take --shared-memory")
        lengths.parse(args.lengths)
    url = server_url(args.url, args.protocol)
    check_shared_memory(args.shared_memory)
    with Client(url, args.protocol) as client:
        try:
            models = args.model or client.ready_models()
            if not models:
                raise ClientError(f"the server at {url} reports no ready model")
            streaming = [model for model in models if decoupled(client.model_config(model))]
            infos = {model: client.model_info(model) for model in models if model not in streaming}
        except ClientError as error:
            raise unreachable(error, url, args.protocol) from None
    for model in streaming:
        print(
            f"{model}: skipped: a decoupled model (its tokens streamed as they come), which perf_analyzer's "
            f"request sweep does not measure; use `python -m client generate --model {model} --rate R` (see README)",
            flush=True,
        )
    if not infos:
        raise UsageError(f"nothing to measure: {', '.join(streaming)} only")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    failures, rough = [], []
    for model, info in infos.items():
        count = args.request_count or window_requests(url, args.protocol, info, args.batch, args.window_seconds)
        config = config_from_args(PerfConfig, args, model=model, url=url, request_count=count, admin_key=read_admin_key(url))
        csv_path = args.out_dir / f"{model}.csv"
        try:
            failed, unsettled = run_model(config, info, csv_path)
            failures += failed
            rough += unsettled
            print(f"{model}: wrote {csv_path}")
        except PerfError as error:
            failures.append(str(error))
    for line in rough:
        print(f"note: {line}")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _plot(args: argparse.Namespace) -> int:
    if not args.perf_csv and not args.bench_json:
        raise UsageError("give at least one --perf-csv or --bench-json")
    series, models = [], set()
    for path in args.perf_csv:
        series.append({"label": f"perf_analyzer {path.stem}", "points": perf_points(read_perf_csv(path))})
        models.add(path.stem)
    for path in args.bench_json:
        data = read_json(path)
        series.append({"label": f"client {data['protocol']}", "points": bench_points(data)})
        models.add(data["model"])
    title = args.title or f"{', '.join(sorted(models))}: latency vs throughput"
    plot_latency_vs_throughput(series, args.output, title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
