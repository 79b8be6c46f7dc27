"""perf_analyzer, run the same way for every model, and a plot that puts its
results next to the project's own client.

`python -m client.perf run` runs the perf_analyzer bundled in the tritonclient
wheel against a running server: for each model (default: every model the
server reports ready), one perf_analyzer run per concurrency level with
count-based measurement windows, merged into `OUT_DIR/<model>.csv` (its own
columns, times in µs, rows in concurrency order). The input data is written
by `client.inputs` from the model's metadata and config, so ids stay in the
ranges the model declares, exactly as for the client.

`python -m client.perf plot` draws perf_analyzer CSVs and `python -m client
bench --json` files on one latency-vs-throughput chart.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client.api import PROTOCOLS, UNAVAILABLE, Client, ClientError, parse_url
from client.bench import read_json
from client.cli import UsageError, run_main
from client.inputs import InputError, ModelInfo, random_inputs
from client.plots import plot_latency_vs_throughput
from opara_core.cli_helpers import Parser, positive_int, positive_int_list

log = logging.getLogger(__name__)


class PerfError(RuntimeError):
    """perf_analyzer did not produce a measurement; the message has its last words."""


@dataclass(frozen=True)
class PerfConfig:
    """One perf_analyzer sweep of one model."""

    model: str
    url: str
    protocol: str = "grpc"
    concurrency: tuple[int, ...] = (1, 2, 4)
    batch: int = 1
    request_count: int = 50  # requests per measurement window
    stability_percentage: int = 20  # perf_analyzer defaults to 10; 20 tolerates a shared CPU
    max_trials: int = 10
    percentile: int = 50  # stabilise on p50: robust to the odd slow request on a shared CPU
    shared_memory: str = "none"
    timeout_s: float = 600.0


def perf_analyzer_binary() -> str:
    """The perf_analyzer that the tritonclient wheel installed next to this Python."""
    candidate = Path(sysconfig.get_path("scripts")) / "perf_analyzer"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("perf_analyzer")
    if found is None:
        raise PerfError("perf_analyzer not found; install tritonclient[all]==2.51.0 (make setup)")
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


def perf_analyzer_command(
    config: PerfConfig, concurrency: int, data_dir: Path, csv_path: Path, output_bytes: int = 0
) -> list[str]:
    command = [
        perf_analyzer_binary(),
        "-m", config.model,
        "-u", parse_url(config.url, config.protocol),
        "-i", config.protocol,
        "-b", str(config.batch),
        f"--concurrency-range={concurrency}:{concurrency}",
        "--measurement-mode=count_windows",
        f"--measurement-request-count={config.request_count}",
        f"--stability-percentage={config.stability_percentage}",
        f"--max-trials={config.max_trials}",
        f"--percentile={config.percentile}",
        f"--input-data={data_dir}",
        "-f", str(csv_path),
    ]  # fmt: skip
    if config.shared_memory != "none":
        command += [f"--shared-memory={config.shared_memory}", f"--output-shared-memory-size={max(output_bytes, 1)}"]
    return command


def write_input_data(info: ModelInfo, folder: Path, seed: int = 0) -> Path:
    """One raw binary file per input holding a batch-1 request, the
    `--input-data DIR` format; perf_analyzer repeats it for larger batches."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in random_inputs(info, 1, seed).items():
        if array.dtype == np.object_:
            raise InputError(f"input {name!r} is BYTES; write its perf_analyzer data by hand")
        np.ascontiguousarray(array).tofile(folder / name)
    return folder


def read_perf_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run_model(config: PerfConfig, info: ModelInfo, csv_path: Path) -> list[str]:
    """Sweep one model; writes `csv_path` with every level that measured.
    Returns the failures (one line each); raises PerfError if none measured."""
    output_bytes = max(
        (int(np.prod(info.full_shape(t, config.batch))) * t.dtype.itemsize for t in info.outputs if t.fixed), default=0
    )
    rows: list[dict[str, str]] = []
    failures: list[str] = []
    log_path = csv_path.with_suffix(".log")
    with tempfile.TemporaryDirectory(prefix="opara_perf_") as tmp, open(log_path, "w") as log_file:
        data_dir = write_input_data(info, Path(tmp) / "data")
        for concurrency in config.concurrency:
            part = Path(tmp) / f"c{concurrency}.csv"
            command = perf_analyzer_command(config, concurrency, data_dir, part, output_bytes)
            log.info("running %s", " ".join(command))
            log_file.write("$ " + " ".join(command) + "\n")
            try:
                done = subprocess.run(
                    command, env=perf_analyzer_env(), capture_output=True, text=True, timeout=config.timeout_s
                )
                output, code = done.stdout + done.stderr, done.returncode
            except subprocess.TimeoutExpired:
                output, code = f"timed out after {config.timeout_s:.0f} s", None
            log_file.write(output)
            if code == 0 and part.exists():
                rows += read_perf_csv(part)
                continue
            last = [line.strip() for line in output.splitlines() if line.strip()][-1:] or ["no output"]
            failures.append(f"{config.model} at concurrency {concurrency}: perf_analyzer exit {code}: {last[0]}")
    if not rows:
        raise PerfError("; ".join(failures) + f" (full output in {log_path})")
    rows.sort(key=lambda r: int(r["Concurrency"]))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return failures


# --- comparison plot -----------------------------------------------------------------


def perf_points(rows: list[dict[str, str]]) -> list[dict]:
    """perf_analyzer CSV rows (µs, inferences/s) as plot points (ms)."""
    return [
        {
            "concurrency": int(r["Concurrency"]),
            "throughput": float(r["Inferences/Second"]),
            "p50_ms": float(r["p50 latency"]) / 1000,
            "p99_ms": float(r["p99 latency"]) / 1000,
        }
        for r in rows
    ]


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
    run.add_argument("--request-count", type=positive_int, default=50, help="requests per measurement window")
    run.add_argument("--stability-percentage", type=positive_int, default=20, help="(perf_analyzer default: 10)")
    run.add_argument("--max-trials", type=positive_int, default=10)
    run.add_argument("--shared-memory", choices=("none", "system"), default="none")
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
    url = args.url or f"localhost:{8001 if args.protocol == 'grpc' else 8000}"
    try:
        parse_url(url, args.protocol)
    except ValueError as error:
        raise UsageError(str(error)) from None
    with Client(url, args.protocol) as client:
        try:
            models = args.model or client.ready_models()
        except ClientError as error:
            if error.kind == UNAVAILABLE:
                raise ClientError(
                    f"cannot reach the server at {url} over {args.protocol}: {error}", UNAVAILABLE
                ) from None
            raise
        if not models:
            raise ClientError(f"the server at {url} reports no ready model")
        infos = {model: client.model_info(model) for model in models}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    failures = []
    for model, info in infos.items():
        config = PerfConfig(
            model=model,
            url=url,
            protocol=args.protocol,
            concurrency=args.concurrency,
            batch=args.batch,
            request_count=args.request_count,
            stability_percentage=args.stability_percentage,
            max_trials=args.max_trials,
            shared_memory=args.shared_memory,
        )
        csv_path = args.out_dir / f"{model}.csv"
        try:
            failures += run_model(config, info, csv_path)
            print(f"{model}: wrote {csv_path}")
        except PerfError as error:
            failures.append(str(error))
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
