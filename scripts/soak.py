"""Soak a running server: a concurrency sweep for a fixed time per level, with
no failed request, no wrong answer and flat server memory as the bar.

    python scripts/soak.py --url 127.0.0.1:8001 --model deepfm --duration 60 --concurrency 1,8,64 --json out/soak.json

The load is the project's client (`client.bench`: closed-loop workers sending
valid random inputs). Alongside it a checker sends fixed seeded inputs and
compares every answer with the eager model in the precision it is served in
(--precision; the oracle): Triton batches the
checker's rows together with the load's, which is where a mix-up would show.
Memory is sampled with the server idle, after a warm-up at the highest
concurrency (the baseline) and after every level: the unique set size (USS,
the pages only that process maps) of the tritonserver process and of the
model's backend processes, and their GPU memory where nvidia-smi exists. USS,
not RSS, because the Python backend maps its shared-memory pool again each
time the pool grows and RSS counts every page once per mapping; not PSS,
because PSS splits each shared library's pages among the processes mapping
it, so it grows when other processes on the machine exit (17% for
tritonserver while a test suite's other servers stopped). RSS and PSS are recorded too. The run passes when
nothing failed, nothing was wrong and no USS or GPU sample grew more than
--memory-tolerance over its baseline, and no level's mean request time was
above --stall-ratio (1.5) times its p50: a mean that far above the median while
the p99 stays normal means a few requests stalled far beyond p99 (their p99.9
and slowest request are in the table). Prints a table, writes JSON, exits 1 on
a failed run. The server must run on this machine for memory to be measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from client import bench
from client.api import Client, describe, result_arrays
from opara_core.cli_helpers import positive_int_list
from opara_core import parameters, zoo
from opara_core.engine import precision
from opara_core.engine.compare import max_relative_error
from opara_core.serving.launcher import find_server, stub_processes

log = logging.getLogger("soak")


# --- memory ------------------------------------------------------------------------------


def resident(pid: int) -> dict[str, int]:
    """{"uss": bytes, "pss": bytes, "rss": bytes} of a process (/proc/PID/smaps_rollup)."""
    found = {"uss": 0}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("Pss", "Rss"):
            found[key.lower()] = int(line.split()[1]) * 1024
        elif key in ("Private_Clean", "Private_Dirty"):
            found["uss"] += int(line.split()[1]) * 1024
    return found


def gpu_bytes(pids: list[int]) -> int | None:
    """GPU memory used by `pids` (nvidia-smi), or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    used = {int(pid): int(mib) for pid, mib in (line.split(",") for line in out.strip().splitlines() if line.strip())}
    return sum(used.get(pid, 0) for pid in pids) * 2**20


class Memory:
    """Samples of the server's and the model's processes."""

    def __init__(self, server_pid: int, model: str):
        self.server_pid = server_pid
        pattern = re.compile(rf"{re.escape(model)}_\d+_\d+")
        self.stubs = {name: pid for name, pid in stub_processes(server_pid).items() if pattern.fullmatch(name)}
        if not self.stubs:
            raise RuntimeError(f"no backend process of {model} under tritonserver pid {server_pid}")

    def sample(self) -> dict[str, int]:
        sample = {}
        for name, pid in [("tritonserver", self.server_pid), *sorted(self.stubs.items())]:
            for kind, value in resident(pid).items():
                sample[f"{name}_{kind}"] = value
        gpu = gpu_bytes([self.server_pid, *self.stubs.values()])
        if gpu is not None:
            sample["gpu"] = gpu
        return sample


def growth(baseline: dict[str, int], samples: list[dict[str, int]]) -> dict[str, float]:
    """Largest relative growth over the baseline of each judged quantity (USS, GPU)."""
    judged = [key for key in baseline if key.endswith("_uss") or key == "gpu"]
    return {key: max(s[key] for s in samples) / baseline[key] - 1 if baseline[key] else 0.0 for key in judged}


# --- answers -----------------------------------------------------------------------------


class Checker(threading.Thread):
    """Sends fixed inputs in a loop and compares each answer with the oracle."""

    def __init__(self, url: str, protocol: str, model: str, served: str, tolerance: float | None, interval_s: float = 0.1, cases: int = 6):
        """`served`: the precision the model is served in (the oracle's);
        `tolerance`: None for zoo.oracle_tolerance with the oracle's own
        error against the fp32 module on the checker's inputs."""
        super().__init__(daemon=True)
        entry = zoo.get(model)
        module = entry.build()
        oracle = precision.cast(module, entry, served)
        self.url, self.protocol, self.model, self.interval_s = url, protocol, model, interval_s
        self.output = entry.outputs[0].name
        self.cases = []
        own_error = 0.0
        with torch.inference_mode():
            for seed in range(cases):
                tensors = entry.example_inputs(1 + seed % 3, seed=1000 + seed)
                arrays = {spec.name: t.numpy() for spec, t in zip(entry.inputs, tensors)}
                expected = oracle(*tensors)
                self.cases.append((arrays, expected.numpy()))
                if oracle is not module:
                    own_error = max(own_error, max_relative_error(expected, module(*tensors)))
        self.tolerance = zoo.oracle_tolerance(served, own_error) if tolerance is None else tolerance
        self.stop = threading.Event()
        self.idle = threading.Lock()  # held while a request is out: hold it to keep the checker quiet
        self.sent = self.wrong = self.errors = 0
        self.messages: list[str] = []

    def run(self) -> None:
        with Client(self.url, self.protocol) as client:
            requests = [(client.request(self.model, arrays), expected) for arrays, expected in self.cases]
            while not self.stop.is_set():
                request, expected = requests[self.sent % len(requests)]
                self.sent += 1
                try:
                    with self.idle:
                        got = result_arrays(request, client.infer(request), [self.output])[self.output]
                except Exception as error:  # noqa: BLE001 - counted and reported
                    self.errors += 1
                    self.messages.append(describe(error))
                    continue
                scale = max(float(np.abs(expected).max()), 1e-12)
                if got.shape != expected.shape or float(np.abs(got - expected).max()) > self.tolerance * scale:
                    self.wrong += 1
                    self.messages.append(f"wrong answer for case {(self.sent - 1) % len(requests)}")
                self.stop.wait(self.interval_s)


# --- the run -----------------------------------------------------------------------------


def device() -> str:
    if shutil.which("nvidia-smi"):
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout
        if names.strip():
            return ", ".join(sorted(set(names.strip().splitlines())))
    return f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()})"


def soak(args: argparse.Namespace) -> dict:
    port = int(args.url.rpartition(":")[2])
    server_pid = args.server_pid or find_server(port)
    memory = Memory(server_pid, args.model) if server_pid else None
    if memory is None:
        log.warning("no tritonserver on this machine listens on port %d: memory is not measured", port)

    def level(concurrency: int, seconds: float) -> bench.Row:
        config = bench.BenchConfig(
            model=args.model, url=args.url, protocol=args.protocol, concurrency=(concurrency,), duration_s=seconds,
            warmup=2, progress=False,
        )  # fmt: skip
        result = bench.run(config)
        messages.extend(result.error_messages)
        return result.rows[0]

    def idle_sample() -> dict[str, int]:
        """Memory with nothing in flight: the load has ended, the checker waits."""
        if memory is None:
            return {}
        with checker.idle:
            time.sleep(1.0)
            return memory.sample()

    messages: list[str] = []
    checker = Checker(args.url, args.protocol, args.model, args.precision, args.tolerance)
    checker.start()
    try:
        log.info("warm-up: concurrency %d for %.0f s", max(args.concurrency), args.warmup)
        level(max(args.concurrency), args.warmup)
        baseline = idle_sample()
        rows, samples = [], []
        for concurrency in args.concurrency:
            log.info("concurrency %d for %.0f s", concurrency, args.duration)
            rows.append(asdict(level(concurrency, args.duration)))
            samples.append(idle_sample())
            rows[-1]["memory"] = samples[-1]
    finally:
        checker.stop.set()
        checker.join(60)
    grew = growth(baseline, samples) if memory else {}
    problems = []
    errors = sum(row["errors"] for row in rows)
    if errors:
        problems.append(f"{errors} failed requests: {messages[:3]}")
    if checker.wrong or checker.errors or checker.sent == 0:
        problems.append(f"checker: {checker.sent} sent, {checker.wrong} wrong, {checker.errors} failed: {checker.messages[:3]}")
    problems += [f"{key} grew {value:.1%} (limit {args.memory_tolerance:.0%})" for key, value in grew.items() if value > args.memory_tolerance]
    problems += stalls(rows, args.stall_ratio)
    return {
        "model": args.model,
        "protocol": args.protocol,
        "url": args.url,
        "device": device(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "scripts/soak.py", *sys.argv[1:]]),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "levels": rows,
        "memory": {"measured": memory is not None, "baseline": baseline, "growth": grew, "tolerance": args.memory_tolerance},
        "checks": {"sent": checker.sent, "wrong": checker.wrong, "errors": checker.errors, "precision": args.precision, "tolerance": checker.tolerance},
        "errors": errors,
        "error_messages": messages[:10],
        "passed": not problems,
        "problems": problems,
    }


def stalls(rows: list[dict], ratio: float) -> list[str]:
    """A problem line for each level whose mean request time exceeds `ratio` times its p50."""
    return [
        f"concurrency {row['concurrency']}: mean {row['mean_ms']:.2f} ms > {ratio:g} x p50 {row['p50_ms']:.2f} ms "
        f"(p99 {row['p99_ms']:.2f}, p99.9 {row['p999_ms']:.2f}, slowest {row['max_ms']:.2f} ms): requests stalled"
        for row in rows if row["p50_ms"] and row["mean_ms"] > ratio * row["p50_ms"]
    ]  # fmt: skip


def table(result: dict) -> str:
    lines = [f"{result['model']} over {result['protocol']} at {result['url']} on {result['device']}, {result['date']}"]
    times = ("p50_ms", "p99_ms", "p999_ms", "max_ms", "mean_ms")
    header = (f"{'concurrency':>11} {'requests':>9} {'errors':>6} " + " ".join(f"{k[:-3].replace('p999', 'p99.9') + ' ms':>10}" for k in times)
              + f" {'req/s':>8}  memory after the level (MiB)")  # fmt: skip
    lines.append(header)
    for row in result["levels"]:
        memory = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in row["memory"].items() if not k.endswith("_rss")) or "-"
        cells = " ".join(f"{'-' if row.get(k) is None else format(row[k], '.2f'):>10}" for k in times)
        lines.append(f"{row['concurrency']:>11} {row['requests']:>9} {row['errors']:>6} {cells} {row['throughput_rps']:>8.1f}  {memory}")
    baseline = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in result["memory"]["baseline"].items() if not k.endswith("_rss"))
    baseline = baseline or "not measured"
    lines.append(f"memory after warm-up (MiB): {baseline}")
    lines.append("largest growth: " + (", ".join(f"{k} {v:+.2%}" for k, v in result["memory"]["growth"].items()) or "-"))
    checks = result["checks"]
    lines.append(f"checked answers: {checks['sent']} sent, {checks['wrong']} wrong, {checks['errors']} failed")
    lines.append("PASSED" if result["passed"] else "FAILED: " + "; ".join(result["problems"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="HOST:PORT of the server (gRPC or HTTP port, see --protocol)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--model", default="deepfm")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per concurrency level (default 60)")
    parser.add_argument("--concurrency", type=positive_int_list, default=(1, 2, 4, 8, 16, 32, 64), help="levels, e.g. 1,8,64")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds at the highest level before the baseline (default 30)")
    parser.add_argument("--memory-tolerance", type=float, default=0.02, help="largest growth allowed (default 0.02)")
    parser.add_argument("--precision", choices=parameters.get("precision").choices, default=precision.FP32,
                        help="the precision the model is served in, which the oracle runs in (its config's `precision`, fp32 where a CPU lacks it; default fp32)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="answer error allowed, relative to the largest output (default: 5e-2 with a GPU (TF32 convolutions), else 1e-4; "
                             "in bf16 or fp16 plus three times the oracle's own error against fp32)")
    parser.add_argument("--stall-ratio", type=float, default=1.5, help="largest mean request time allowed, in p50s (default 1.5)")
    parser.add_argument("--server-pid", type=int, default=None, help="tritonserver's pid (default: found by port)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("client").setLevel(logging.WARNING)
    result = soak(args)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
