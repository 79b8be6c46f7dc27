"""Serving benchmark: perf_analyzer over gRPC against the real server, per model.

    python scripts/serving_bench.py --models googlenet,resnet50 --concurrency 1,16 \
        --shared-memory none,system --json out/serving.json

Starts tritonserver through the project's launcher on a copy of
model_repository/ (plus `googlenet_dlpack`, GoogLeNet returning its outputs as
GPU tensors through DLPack instead of one host copy), waits until every model
is ready (on a GPU host: traced, planned and captured), then runs perf_analyzer
at batch 1 for each model, concurrency and shared-memory mode, with rotating
seeded random inputs (valid ids for embedding inputs). Prints a markdown table
with the latency percentiles and Triton's server-side split, and writes JSON.
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

from client.api import Client
from client.inputs import ModelInfo
from client.perf import PerfConfig, output_bytes, perf_analyzer_command, perf_row, read_perf_csv, write_input_data
from client.perf import run_perf_analyzer as perf_run
from opara_core import zoo
from opara_core.serving.launcher import ADMIN_KEY_ENV, DEFAULT_MODEL_REPOSITORY, ServerConfig, TritonServer, free_port
from opara_core.serving.triton_backend import StageClock

DLPACK_VARIANT = "googlenet_dlpack"


def make_repository(models: list[str], root: Path, instances: int = 1, batching: str = "preferred") -> Path:
    """A copy of the selected models, plus the DLPack-output variant of googlenet,
    each with `instances` model instances (stub processes, each with its own
    graphs). batching "greedy" drops the preferred batch sizes, so that Triton
    sends every queued request (up to max_batch_size) instead of the largest
    preferred size it can form (7 queued: 4 now, 3 later)."""
    repository = root / "models"
    for name in models:
        shutil.copytree(DEFAULT_MODEL_REPOSITORY / name, repository / name)
        config = repository / name / "config.pbtxt"
        text, found = re.subn(r"instance_group \[ \{ count: \d+ \} \]", f"instance_group [ {{ count: {instances} }} ]", config.read_text())
        if found != 1:
            raise SystemExit(f"{config}: no single `instance_group [ {{ count: N }} ]` line to set the instance count in")
        if batching == "greedy":
            text, found = re.subn(r"\n  preferred_batch_size: \[[\d, ]+\]", "", text)
            if found != 1:
                raise SystemExit(f"{config}: no single `preferred_batch_size` line to drop")
        config.write_text(text)
    if "googlenet" in models:
        variant = repository / DLPACK_VARIANT
        shutil.copytree(repository / "googlenet", variant)
        config = (variant / "config.pbtxt").read_text().replace('name: "googlenet"', f'name: "{DLPACK_VARIANT}"')
        config += 'parameters { key: "output_memory" value: { string_value: "gpu" } }\n'
        (variant / "config.pbtxt").write_text(config)
    return repository


def run_perf_analyzer(
    binary: str, url: str, info: ModelInfo, concurrency: int, shm: str, data: Path, requests: int, out: Path, admin_key: str
) -> dict:
    """One level through client.perf's driver (its command, input format and CSV
    parser); stabilised on the mean, as before the driver was shared."""
    config = PerfConfig(
        model=info.name, url=url, protocol="grpc", concurrency=(concurrency,), batch=1, request_count=requests,
        stability_percentage=20, max_trials=6, percentile=None, shared_memory=shm, admin_key=admin_key, binary=binary,
    )  # fmt: skip
    command = perf_analyzer_command(config, concurrency, data, out, max(output_bytes(info, 1), 4096))
    started = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log_file:
        code, output = perf_run(command, log_file, config.timeout_s, echo=False)
    if code != 0 or not out.exists():
        return {"error": output[-800:]}
    row = perf_row(read_perf_csv(out)[0])
    del row["concurrency"]
    return {"throughput_rps": row.pop("throughput"), **row, "seconds": time.perf_counter() - started}


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


def replay_medians(log: str) -> dict[str, float]:
    """Bucket-1 replay medians the models logged when they chose their graph
    (one line each, opara_core.serving.startup.ready_line)."""
    medians = {}
    for model, line in re.findall(r"model (\w+) ready on cuda\S* in [\d.]+ s: ([^\n]*)", log):
        found = re.search(r"bucket 1: ([\w:/]+) \(median ms: (.*?)\)", line)
        if found:
            times = dict(re.findall(r"([\w:/]+) ([\d.]+)", found.group(2)))
            medians[model] = float(times.get(found.group(1), "nan"))
    return medians


def table(rows: list[dict], replay: dict[str, float]) -> str:
    """Markdown: perf_analyzer's numbers, Triton's split, the bucket-1 replay and execute's own split."""
    lines = []
    lines.append(
        "| model | shm | conc | infer/s | p50 ms | p99 ms | queue | compute input | compute infer | compute output "
        "| bucket-1 replay | outside replay | mean batch | execute: validate / stage / run / respond |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['shared_memory']} | {r['concurrency']} | error: {r['error'][-120:]!r} |")
            continue
        server_ms = r["server_queue_ms"] + r["server_compute_input_ms"] + r["server_compute_infer_ms"] + r["server_compute_output_ms"]
        graph = replay.get("googlenet" if r["model"] == DLPACK_VARIANT else r["model"])
        outside = f"{server_ms - graph:.3f}" if graph else "-"
        stages = r.get("execute_ms") or {}
        split = " / ".join(f"{stages[k]:.3f}" for k in StageClock.STAGES if k in stages) or "-"
        lines.append(
            f"| {r['model']} | {r['shared_memory']} | {r['concurrency']} | {r['throughput_rps']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} "
            f"| {r['server_queue_ms']:.3f} | {r['server_compute_input_ms']:.3f} | {r['server_compute_infer_ms']:.3f} "
            f"| {r['server_compute_output_ms']:.3f} | {graph if graph else '-'} | {outside} | {r.get('mean_batch') or '-'} | {split} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(zoo.names()))
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--shared-memory", default="none,system")
    parser.add_argument("--instances", type=int, default=1, help="model instances per model (instance_group count)")
    parser.add_argument(
        "--batching", choices=("preferred", "greedy"), default="preferred",
        help="preferred: the configs' preferred batch sizes (the graph buckets); greedy: none, every queued request goes",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=1000, help="requests per measurement window")
    parser.add_argument("--perf-analyzer", default=None, help="default: the one of the tritonclient wheel, else on PATH")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log", type=Path, help="where the server log goes")
    parser.add_argument("--report", type=Path, help="no run: print the table of this JSON (replay times from --log if given)")
    args = parser.parse_args()
    if args.report:
        stored = json.loads(args.report.read_text())
        replay = replay_medians(args.log.read_text(errors="replace")) if args.log else stored["meta"].get("replay_ms", {})
        print(table(stored["rows"], replay))
        return 0
    models = [zoo.get(m).name for m in args.models.split(",")]
    work = Path(tempfile.mkdtemp(prefix="serving_bench_"))
    repository = make_repository(models, work, args.instances, args.batching)
    served = models + ([DLPACK_VARIANT] if "googlenet" in models else [])
    # the server is ours: its admin key (for the shared-memory API) is OPARA_ADMIN_KEY or a new one
    config = ServerConfig(
        model_repository=repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        admin_key=os.environ.get(ADMIN_KEY_ENV) or secrets.token_hex(32),
    )  # fmt: skip
    log_path = args.log or work / "server.log"
    rows = []
    started = time.perf_counter()
    server = TritonServer(config, log_path).start()
    try:
        server.wait_ready(timeout_s=900)
        load_s = time.perf_counter() - started
        print(f"server ready with {len(served)} models in {load_s:.0f} s", flush=True)
        for model in served:
            with Client(server.grpc_url) as client:
                info = client.model_info(model)
            data = write_input_data(info, work / f"{model}.json", count=4, seed=200)
            for shm in args.shared_memory.split(","):
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    out = work / f"{model}_{shm}_{concurrency}.csv"
                    before = execute_counters(server.metrics_url).get(model, {})
                    counts = batch_counts(server.http_url, model)
                    result = run_perf_analyzer(
                        args.perf_analyzer, server.grpc_url, info, concurrency, shm, data, args.requests, out, config.admin_key
                    )
                    result["mean_batch"] = mean_batch(counts, batch_counts(server.http_url, model))
                    # a mean over the whole run, perf_analyzer's warm-up included; the model
                    # pushes its counts on a later execute (at most every 0.5 s), so the last
                    # moments of a run land in the next run of the same model
                    result["execute_ms"] = execute_split(before, execute_counters(server.metrics_url).get(model, {}))
                    rows.append({"model": model, "shared_memory": shm, "concurrency": concurrency, **result})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    replay = replay_medians(log_path.read_text(errors="replace"))
    print()
    print(table(rows, replay))
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "instances": args.instances, "batching": args.batching, "load_seconds": load_s, "replay_ms": replay}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
