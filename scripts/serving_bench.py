"""Serving benchmark: perf_analyzer over gRPC against the real server, per model,
each row beside the Python backend's floor measured in the same run.

    python scripts/serving_bench.py --models googlenet,resnet50 --concurrency 1,16 \
        --shared-memory none,system,cuda --json out/serving.json

Starts tritonserver through the project's launcher on a copy of the selected
models of model_repository/, plus for each model `<model>_floor`: a Python model
that does no work (opara_core.serving.floor), made from the model's own config
(same inputs and outputs, instance kind, dynamic batching, GPU inputs). It waits
until every model is ready (on a GPU host: traced, planned and captured), then
runs perf_analyzer at batch 1 for each model, shared-memory mode (none: tensors
in the gRPC message; system; cuda: the tensors stay on the GPU, GPU host only)
and concurrency, and right after it the same level against the floor model, with
rotating seeded random inputs (valid ids for embedding inputs). Prints a
markdown table with the latency percentiles, Triton's server-side split, the
floor and the model's time above it, and writes JSON after every row (a run cut
short keeps what it measured). `--precision bf16` serves every model (and its
floor) in bf16; the JSON's meta and the line above the table say which.

Beside each model it also serves
`<model>_peer` (opara_core.serving.peer): the hand-written model.py a user
writes without this project, torch.compile with freezing and a CUDA graph per
bucket in the same precision, measured right after the floor at each level
(`--no-peer` leaves it out). `--io-floor` adds `<model>_iofloor`
(opara_core.serving.floor.IOFloorModel): the floor plus moving the tensors to
the GPU and back around a graph of memsets, what any model.py that replays a
CUDA graph pays with no model, measured after the floor. A start in which a
model timed its graph candidates (a cold cache) is restarted on the warm cache
before any measurement, unless `--cold-start`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from client.api import Client, ClientError, check_shared_memory
from client.inputs import ModelInfo
from client.perf import PerfConfig, output_bytes, perf_analyzer_command, perf_row, read_perf_csv, write_input_data
from client.perf import run_perf_analyzer as perf_run
from opara_core import zoo
from opara_core.parameters import get as get_parameter
from opara_core.serving import model_config
from opara_core.serving.launcher import ADMIN_KEY_ENV, DEFAULT_MODEL_REPOSITORY, ServerConfig, TritonServer, free_port
from opara_core.serving.triton_backend import StageClock

FLOOR_SUFFIX = "_floor"
PEER_SUFFIX = "_peer"
IO_FLOOR_SUFFIX = "_iofloor"
PRECISION = get_parameter("precision")  # --precision's choices, and what a config without the parameter gets
FLOOR_MODEL_PY = '''"""The Python backend's floor beside {model}: no work, zeros out (made by scripts/serving_bench.py)."""

from opara_core.serving.floor import FloorModel


class TritonPythonModel(FloorModel):
    zoo_name = {model!r}
'''


IO_FLOOR_MODEL_PY = '''"""The I/O floor beside {model}: the floor plus moving the tensors, no model (made by scripts/serving_bench.py)."""

from opara_core.serving.floor import IOFloorModel


class TritonPythonModel(IOFloorModel):
    zoo_name = {model!r}
'''


PEER_MODEL_PY = '''"""The hand-written peer beside {model}: torch.compile and a CUDA graph per bucket (made by scripts/serving_bench.py)."""

from opara_core.serving.peer import PeerModel


class TritonPythonModel(PeerModel):
    zoo_name = {model!r}
'''


def add_floor_model(repository: Path, model: str) -> str:
    """`<model>_floor` beside `model` in `repository` (see `add_companion`). Returns its name."""
    return add_companion(repository, model, FLOOR_SUFFIX, FLOOR_MODEL_PY)


def add_io_floor_model(repository: Path, model: str) -> str:
    """`<model>_iofloor` beside `model` in `repository` (see `add_companion`). Returns its name."""
    return add_companion(repository, model, IO_FLOOR_SUFFIX, IO_FLOOR_MODEL_PY)


def add_peer_model(repository: Path, model: str) -> str:
    """`<model>_peer` beside `model` in `repository` (see `add_companion`). Returns its name."""
    return add_companion(repository, model, PEER_SUFFIX, PEER_MODEL_PY)


def add_companion(repository: Path, model: str, suffix: str, model_py: str) -> str:
    """`<model><suffix>` beside `model` in `repository`: the model's config under
    the new name (so the same inputs, outputs, instance group, batching and
    parameters) with `model_py` as its model.py. Returns its name."""
    name = model + suffix
    config = model_config.read(repository / model / "config.pbtxt")
    config.name = name
    (repository / name / "1").mkdir(parents=True)
    model_config.write(repository / name / "config.pbtxt", config)
    (repository / name / "1" / "model.py").write_text(model_py.format(model=model))
    return name


def set_instances(config, instances: int, where: Path) -> None:
    """`instances` model instances (stub processes, each with its own graphs) in the ModelConfig `config`."""
    if len(config.instance_group) != 1:
        raise SystemExit(f"{where}: {len(config.instance_group)} instance groups; the benchmarks set the count of one")
    config.instance_group[0].count = instances


def set_parameter(config, key: str, value: str) -> None:
    """The parameter `key` of the ModelConfig `config` set to `value` (replaced or added)."""
    if not re.fullmatch(r"[\w.]+", key):
        raise SystemExit(f"error: parameter {key}={value!r}: a key is letters, digits, '_' and '.'")
    config.parameters[key].string_value = value


def copy_model(repository: Path, name: str, instances: int, queue_delay_us: int | None, parameters: dict[str, str], greedy: bool = False) -> None:
    """The shipped model `name` copied into `repository` with `instances`
    model instances, `parameters` set, and where given its queue delay
    replaced and (`greedy`) its preferred batch sizes dropped."""
    shutil.copytree(DEFAULT_MODEL_REPOSITORY / name, repository / name)
    path = repository / name / "config.pbtxt"
    config = model_config.read(path)
    set_instances(config, instances, path)
    if greedy:
        config.dynamic_batching.ClearField("preferred_batch_size")
    if queue_delay_us is not None:
        config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
    for key, value in parameters.items():
        set_parameter(config, key, value)
    model_config.write(path, config)


def make_repository(
    models: list[str],
    root: Path,
    instances: int = 1,
    batching: str = "preferred",
    queue_delay_us: int | None = None,
    parameters: dict[str, str] | None = None,
    peers: bool = True,
    io_floors: bool = False,
) -> Path:
    """A copy of the selected models, each with `instances` model instances
    (stub processes, each with its own graphs) and its floor model beside it.
    batching "greedy" drops the preferred batch sizes, so that Triton sends
    every queued request (up to max_batch_size) instead of the largest
    preferred size it can form (7 queued: 4 now, 3 later); `queue_delay_us`
    replaces the configs' max_queue_delay_microseconds; `parameters` are set
    in every config (the floor's too: it is made from the model's config);
    `peers`: the hand-written peer beside each model too; `io_floors`: the I/O floor too."""
    repository = root / "models"
    for name in models:
        copy_model(repository, name, instances, queue_delay_us, parameters or {}, greedy=batching == "greedy")
        add_floor_model(repository, name)
        if io_floors:
            add_io_floor_model(repository, name)
        if peers:
            add_peer_model(repository, name)
    return repository


def run_perf_analyzer(
    binary: str, url: str, info: ModelInfo, concurrency: int, shm: str, data: Path, requests: int, out: Path, admin_key: str
) -> dict:
    """One level through client.perf's driver (its command, input format and CSV
    parser); stabilised on p50 within 20% over up to 10 windows (on the mean, 6
    windows, T5's concurrency-1 row never settled on the H100: the odd slow
    request moved the mean)."""
    config = PerfConfig(
        model=info.name, url=url, protocol="grpc", concurrency=(concurrency,), batch=1, request_count=requests,
        stability_percentage=20, max_trials=10, percentile=50, shared_memory=shm, admin_key=admin_key, binary=binary,
    )  # fmt: skip
    command = perf_analyzer_command(config, concurrency, data, out, max(output_bytes(info, 1), 4096))
    started = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log_file:
        code, output = perf_run(command, log_file, config.timeout_s, echo=False)
    if code != 0 or not out.exists():
        return {"error": output[-800:]}
    row = perf_row(read_perf_csv(out)[0])
    del row["concurrency"]
    row["avg_ms"] = mean_latency(output) or row["avg_ms"]
    return {"throughput_rps": row.pop("throughput"), **row, "seconds": time.perf_counter() - started}


def mean_latency(output: str) -> float | None:
    """The mean request time (ms) of perf_analyzer's stable windows: its summary's
    "Avg gRPC time" (or HTTP); the CSV of a run stabilised on p50 has no mean. A
    mean far above the p50 with a normal p99 means a few requests stalled."""
    found = re.findall(r"Avg (?:gRPC|HTTP) time: (\d+) usec", output)
    return int(found[-1]) / 1000 if found else None


def execute_counters(metrics_url: str) -> dict[str, dict[str, float]]:
    """Per model: opara_execute_seconds_total by stage and opara_requests_total."""
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    counters: dict[str, dict[str, float]] = {}
    for model, stage, value in re.findall(r'^opara_execute_seconds_total\{model="(\w+)",stage="(\w+)"\} (\S+)$', text, re.M):
        counters.setdefault(model, {})[stage] = float(value)
    for model, value in re.findall(r'^opara_requests_total\{model="(\w+)"\} (\S+)$', text, re.M):
        counters.setdefault(model, {})["requests"] = float(value)
    return counters


def batch_counts(http_url: str, model: str) -> tuple[int, int]:
    """Triton's (inference_count, execution_count) of the model: requests
    (rows, at batch 1) and the batches they were run in."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=30) as response:
        stats = json.load(response)["model_stats"]
    return sum(int(m.get("inference_count", 0)) for m in stats), sum(int(m.get("execution_count", 0)) for m in stats)


def mean_batch(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Rows per execution between two `batch_counts` snapshots."""
    executions = after[1] - before[1]
    return round((after[0] - before[0]) / executions, 2) if executions > 0 else None


def execute_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per request in each stage of `execute` between two scrapes."""
    requests = after.get("requests", 0) - before.get("requests", 0)
    if requests <= 0:
        return {}
    return {k: round(1000 * (v - before.get(k, 0)) / requests, 4) for k, v in after.items() if k != "requests"}


def gpu_ready_lines(log: str) -> dict[str, str]:
    """What each model on a GPU logged after `ready on cuda...: ` at the end of
    its `initialize` (opara_core.serving.startup.ready_line); of a restarted
    server, the last start's."""
    return dict(re.findall(r"model (\w+) ready on cuda\S* in [\d.]+ s: ([^\n]*)", log))


def replay_medians(log: str) -> dict[str, float]:
    """Bucket-1 replay medians the models logged when they chose their graph."""
    medians = {}
    for model, line in gpu_ready_lines(log).items():
        found = re.search(r"bucket 1: ([\w:/-]+)(?: served [\d.]+ ms)? \(median ms: (.*?)\)", line)  # graph names hold '-' (inductor-cudnn)
        if found:
            times = dict(re.findall(r"([\w:/-]+) ([\d.]+)", found.group(2)))
            medians[model] = float(times.get(found.group(1), "nan"))
    return medians


def timed_in_this_start(log: str, models: list[str]) -> list[str]:
    """The models whose last start timed their graph candidates in the serving
    process (a cold cache: the ready line of a multi-stream graph without
    "choices: remembered"). Such a process launched the same graphs 2-4x
    slower, and its lone requests' `run` took 0.178 ms against 0.140 after a
    warm start (DeepFM, one H100, 2026-12-07, docs/benchmarks.md), while a
    deployment serves from a warm cache (`make warm` in its image, and every
    restart)."""
    last = gpu_ready_lines(log)
    return [m for m in models if last.get(m, "").startswith("multi-stream graph") and "choices: remembered" not in last[m]]


def server_ms(result: dict) -> float:
    """Triton's time per request: queue and compute input, infer and output."""
    return sum(result[f"server_{k}_ms"] for k in ("queue", "compute_input", "compute_infer", "compute_output"))


def table(rows: list[dict], replay: dict[str, float]) -> str:
    """Markdown: perf_analyzer's numbers, Triton's split, the bucket-1 replay,
    the floor model's p50 and server time in the same run and the model's time
    above them, the I/O floor's p50 and throughput and the p50 above it and the
    replay, the hand-written peer's p50 and throughput (and ours against it),
    and execute's own split."""
    lines = [
        "| model | shm | conc | infer/s | p50 ms | p99 ms | mean ms | queue | compute input | compute infer | compute output "
        "| bucket-1 replay | outside replay | floor p50 | floor server | p50 above floor | outside replay above floor "
        "| floor infer/s | I/O floor p50 | I/O floor infer/s | p50 above I/O floor + replay "
        "| peer p50 | peer infer/s | infer/s / peer | mean batch | execute: validate / stage / run / respond |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['shared_memory']} | {r['concurrency']} | error: {r['error'][-120:]!r} |")
            continue
        graph = replay.get(r["model"])
        outside = server_ms(r) - graph if graph else None
        floor = r.get("floor") or {}
        measured = "error" not in floor and bool(floor)
        peer = r.get("peer") or {}
        peer_measured = "error" not in peer and bool(peer)
        io = r.get("io_floor") or {}
        io_measured = "error" not in io and bool(io)
        stages = r.get("execute_ms") or {}
        split = " / ".join(f"{stages[k]:.3f}" for k in StageClock.STAGES if k in stages) or "-"
        cells = [
            r["model"], r["shared_memory"], r["concurrency"], f"{r['throughput_rps']:.0f}", f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
            f"{r['avg_ms']:.3f}" if r.get("avg_ms") else "-",
            *(f"{r[f'server_{k}_ms']:.3f}" for k in ("queue", "compute_input", "compute_infer", "compute_output")),
            graph or "-",
            "-" if outside is None else f"{outside:.3f}",
            f"{floor['p50_ms']:.3f}" if measured else "error" if floor else "-",
            f"{server_ms(floor):.3f}" if measured else "-",
            f"{r['p50_ms'] - floor['p50_ms']:.3f}" if measured else "-",
            f"{outside - server_ms(floor):.3f}" if measured and outside is not None else "-",
            f"{floor['throughput_rps']:.0f}" if measured else "-",
            f"{io['p50_ms']:.3f}" if io_measured else "error" if io else "-",
            f"{io['throughput_rps']:.0f}" if io_measured else "-",
            f"{r['p50_ms'] - io['p50_ms'] - graph:.3f}" if io_measured and graph else "-",
            f"{peer['p50_ms']:.3f}" if peer_measured else "error" if peer else "-",
            f"{peer['throughput_rps']:.0f}" if peer_measured else "-",
            f"{r['throughput_rps'] / peer['throughput_rps']:.2f}" if peer_measured and peer["throughput_rps"] else "-",
            r.get("mean_batch") or "-",
            split,
        ]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no CUDA device)"


def precision_title(precision: str | None) -> str:
    """The line above a table that tells a bf16 run's rows from an fp32 run's (None: no --precision: each config's own)."""
    return f"precision: {precision}" if precision else f"precision: the config's own (default {PRECISION.default})"


def served_parameters(args: argparse.Namespace) -> dict[str, str]:
    """The parameters set in every served config: --parameter's KEY=VALUE pairs and --precision."""
    malformed = [p for p in args.parameter if "=" not in p]
    if malformed:
        raise SystemExit(f"error: --parameter {malformed[0]!r}: use KEY=VALUE")
    parameters = dict(p.split("=", 1) for p in args.parameter)
    if args.precision:
        if parameters.get("precision", args.precision) != args.precision:
            raise SystemExit(f"error: --precision {args.precision} and --parameter precision={parameters['precision']}: give one")
        parameters["precision"] = args.precision
    return parameters


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(zoo.names()))
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--shared-memory", default="none,system", help="modes, of none, system and cuda (GPU host)")
    parser.add_argument("--instances", type=int, default=1, help="model instances per model (instance_group count)")
    parser.add_argument(
        "--batching", choices=("preferred", "greedy"), default="preferred",
        help="preferred: the configs' preferred batch sizes (the graph buckets); greedy: none, every queued request goes",
    )  # fmt: skip
    parser.add_argument("--queue-delay", type=int, default=None, metavar="US", help="max_queue_delay_microseconds (default: the configs')")
    parser.add_argument(
        "--parameter", action="append", default=[], metavar="KEY=VALUE",
        help="set a config parameter in every served config, e.g. torch_threads=0, output_memory=host, "
        "FORCE_CPU_ONLY_INPUT_TENSORS=yes (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--precision", choices=PRECISION.choices, default=None,
        help="the precision parameter of every served config (docs/precision.md; default: the configs' own)",
    )  # fmt: skip
    parser.add_argument("--no-peer", action="store_true", help="serve no hand-written peer beside the models")
    parser.add_argument("--io-floor", action="store_true", help="serve the I/O floor beside the models too (the floor plus moving the tensors)")
    parser.add_argument(
        "--cold-start", action="store_true",
        help="measure the first start even where a model timed its candidates in it (by default such a start is "
        "restarted on the warm cache first: what a deployment serves from)",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=1000, help="requests per measurement window")
    parser.add_argument("--perf-analyzer", default=None, help="default: the one of the tritonclient wheel, else on PATH")
    parser.add_argument("--budget", type=float, default=None, metavar="S", help="start no measurement after S seconds; the rest is listed as skipped")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log", type=Path, help="where the server log goes")
    parser.add_argument("--report", type=Path, help="no run: print the table of this JSON (replay times from --log if given)")
    return parser


def main() -> int:
    args = argument_parser().parse_args()
    if args.report:
        stored = json.loads(args.report.read_text())
        replay = replay_medians(args.log.read_text(errors="replace")) if args.log else stored["meta"].get("replay_ms", {})
        # a JSON from before --precision has no "precision": its rows were served in the configs' own
        print(precision_title(stored["meta"].get("precision")))
        print(table(stored["rows"], replay))
        return 0
    modes = args.shared_memory.split(",")
    unknown = sorted(set(modes) - {"none", "system", "cuda"})
    if unknown:
        raise SystemExit(f"error: unknown shared-memory modes {unknown}; use none, system, cuda")
    if "cuda" in modes:
        try:
            check_shared_memory("cuda")
        except ClientError as error:
            raise SystemExit(f"error: {error}") from None
    parameters = served_parameters(args)
    started = time.perf_counter()
    models = [zoo.get(m).name for m in args.models.split(",")]
    work = Path(tempfile.mkdtemp(prefix="serving_bench_"))
    repository = make_repository(models, work, args.instances, args.batching, args.queue_delay, parameters, peers=not args.no_peer, io_floors=args.io_floor)
    # the server is ours: its admin key (for the shared-memory API) is OPARA_ADMIN_KEY or a new one
    config = ServerConfig(
        model_repository=repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        admin_key=os.environ.get(ADMIN_KEY_ENV) or secrets.token_hex(32),
    )  # fmt: skip
    log_path = args.log or work / "server.log"
    meta = {
        "date": time.strftime("%Y-%m-%d"), "device": device_name(), "command": " ".join(sys.argv), "instances": args.instances,
        "batching": args.batching, "queue_delay_us": args.queue_delay, "parameters": parameters, "requests_per_window": args.requests,
        "precision": parameters.get("precision"),  # None: the configs' own
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }  # fmt: skip
    rows: list[dict] = []
    skipped: list[str] = []

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "rows": rows, "skipped": skipped}, indent=1))

    server = TritonServer(config, log_path).start()
    try:
        server.wait_ready(timeout_s=900)
        meta["load_seconds"] = time.perf_counter() - started
        print(f"server ready with {len(models)} models and their floors in {meta['load_seconds']:.0f} s", flush=True)
        cold = timed_in_this_start(log_path.read_text(errors="replace"), models)
        if cold and not args.cold_start:
            print(f"{', '.join(cold)} timed their candidates in this start (a cold cache): restarting on the warm cache", flush=True)
            server.stop(keep_guard=True)  # as the launcher restarts a server
            restarted = time.perf_counter()
            server.start().wait_ready(timeout_s=900)
            meta["cold_load_seconds"], meta["load_seconds"] = meta["load_seconds"], time.perf_counter() - restarted
            meta["restarted_warm"] = cold
            print(f"server ready again in {meta['load_seconds']:.0f} s", flush=True)

        def measure(model: str, info: ModelInfo, data: Path, shm: str, concurrency: int) -> dict:
            out = work / f"{model}_{shm}_{concurrency}.csv"
            before = execute_counters(server.metrics_url).get(model, {})
            counts = batch_counts(server.http_url, model)
            result = run_perf_analyzer(args.perf_analyzer, server.grpc_url, info, concurrency, shm, data, args.requests, out, config.admin_key)
            result["mean_batch"] = mean_batch(counts, batch_counts(server.http_url, model))
            # a mean over the whole run, perf_analyzer's warm-up included; the model
            # pushes its counts on a later execute (at most every 0.5 s), so the last
            # moments of a run land in the next run of the same model
            result["execute_ms"] = execute_split(before, execute_counters(server.metrics_url).get(model, {}))
            return result

        for model in models:
            floor, peer = model + FLOOR_SUFFIX, model + PEER_SUFFIX
            with Client(server.grpc_url) as client:
                info, floor_info = client.model_info(model), client.model_info(floor)
                peer_info = client.model_info(peer) if (repository / peer).is_dir() else None
                io_floor = model + IO_FLOOR_SUFFIX
                io_floor_info = client.model_info(io_floor) if (repository / io_floor).is_dir() else None
            data = write_input_data(info, work / f"{model}.json", count=4, seed=200)
            for shm in modes:
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    if args.budget is not None and time.perf_counter() - started > args.budget:
                        skipped.append(f"{model} {shm} c={concurrency}")
                        continue
                    result = measure(model, info, data, shm, concurrency)
                    result["floor"] = {k: v for k, v in measure(floor, floor_info, data, shm, concurrency).items() if k != "execute_ms"}
                    if io_floor_info is not None:
                        result["io_floor"] = {k: v for k, v in measure(io_floor, io_floor_info, data, shm, concurrency).items() if k != "execute_ms"}
                    if peer_info is not None:
                        result["peer"] = {k: v for k, v in measure(peer, peer_info, data, shm, concurrency).items() if k != "execute_ms"}
                    rows.append({"model": model, "shared_memory": shm, "concurrency": concurrency, **result})
                    print(json.dumps(rows[-1]), flush=True)
                    save()
    finally:
        server.stop()
    meta["replay_ms"] = replay_medians(log_path.read_text(errors="replace"))
    save()
    print()
    print(precision_title(meta["precision"]))
    print(table(rows, meta["replay_ms"]))
    if skipped:
        print(f"skipped (past --budget {args.budget:g} s): {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
