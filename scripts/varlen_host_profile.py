"""Where a lone variable-length request's host time goes, outside the server.

    python scripts/varlen_host_profile.py --model bert --json $OUT/host_profile.json

Builds the model's served runners as a GPU instance does (`serving.varlen`,
capture "first_use": only the smallest shape, the whole-model compile), then
for one request of `--tokens` tokens times, in this process:

- check: `varlen.check_request` (what `execute` does to validate a request);
- run: `VarLenRunners.run` to its return (schedule, pad, queue, wait, copy back),
  and its `queued` point (what the server's metrics call stage);
- replay: the cell's graph replayed back to back (CUDA events: its GPU time),
  and `CUDAGraph.replay()` alone on the host (the launch's CPU cost), queued
  behind other replays and launched onto an idle GPU;
- the same `run` with `--gap` ms of sleep between requests (a server's requests
  arrive with gaps: the GPU idles and the process sleeps) and without, with
  the time spent in the replay call, in staging the inputs and in allocating
  the outputs; the inputs packed into the cell's pinned buffer that its graph
  copies up (`PackedInputs`, the served path) and unpacked (padded per input,
  through `GraphRunner.run`);
- launch cost against graph size: graphs of 10 to 400 small kernels;

and profiles `run` with torch.profiler (CPU operators and CUDA runtime calls,
self time per call). Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from opara_core import zoo
from opara_core.engine.build import EngineSettings
from opara_core.engine.capture import time_replays
from opara_core.serving import varlen

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", default="bert", choices=("bert", "t5"))
parser.add_argument("--tokens", type=int, default=16)
parser.add_argument("--repeats", type=int, default=2000)
parser.add_argument("--gap", type=float, default=1.0, help="ms of sleep between requests in the second timing")
parser.add_argument("--json", type=Path, default=Path("out/host_profile.json"))
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING)


def per_call_us(fn, repeats: int) -> float:
    """Median over five rounds of the mean host microseconds per call."""
    fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats // 5):
            fn()
        rounds.append((time.perf_counter() - start) / (repeats // 5) * 1e6)
    return statistics.median(rounds)


device = torch.device("cuda")
entry = zoo.get(args.model)
settings = EngineSettings(buckets=(1, 2, 4, 8, 16, 32))
start = time.perf_counter()
runners = varlen.VarLenRunners(entry.build(), entry, device, settings, varlen.VarLenSettings(tuple(varlen.axis_buckets(a) for a in entry.lengths), capture="first_use"))
built_s = time.perf_counter() - start
lengths = tuple(min(args.tokens, a.limit) for a in entry.lengths)
tensors = {spec.name: t for spec, t in zip(entry.at(lengths).inputs, entry.at(lengths).example_inputs(1, seed=7))}
request = varlen.check_request(entry, tensors, "dp")
shape = next(s for s in runners.runners)
graph = runners.runners[shape].graphs[1]
laps = {}


def run_once():
    start = time.perf_counter()
    runners.run([request], queued=lambda: laps.setdefault("queued", []).append(time.perf_counter() - start))
    laps.setdefault("run", []).append(time.perf_counter() - start)


def replay_only():
    graph.graph.replay()


def timed(owner, name: str, key: str):
    """Wrap owner.name so that each call's host seconds are appended to laps[key]."""
    original = getattr(owner, name)

    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            laps.setdefault(key, []).append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def idle_launch_us(captured_graph, gap_s: float, repeats: int = 200) -> float:
    """Median host microseconds of one replay() onto an idle GPU."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        time.sleep(gap_s)
        start = time.perf_counter()
        captured_graph.replay()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def queued_launch_us(captured_graph, repeats: int = 50) -> float:
    torch.cuda.synchronize()
    captured_graph.replay()  # the GPU is busy from here on
    start = time.perf_counter()
    for _ in range(repeats):
        captured_graph.replay()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / repeats * 1e6


def small_kernels_graph(count: int) -> torch.cuda.CUDAGraph:
    x = torch.zeros(1024, device=device)
    for _ in range(3):
        x.add_(1)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        for _ in range(count):
            x.add_(1)
    cuda_graph.keep = x
    return cuda_graph


with torch.inference_mode():
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "tokens": args.tokens,
        "built_s": round(built_s, 1),
        "cell": f"{shape}x1",
        "check_us": per_call_us(lambda: varlen.check_request(entry, tensors, "dp"), args.repeats),
    }
    for _ in range(args.repeats):
        run_once()
    result["run_us"] = statistics.median(laps["run"]) * 1e6
    result["queued_us"] = statistics.median(laps["queued"]) * 1e6
    result["replay_gpu_us"] = time_replays(graph) * 1e3
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        replay_only()
    result["replay_launch_us"] = (time.perf_counter() - start) / 50 * 1e6  # 50 launches queue well ahead of the GPU
    result["replay_launch_idle_us"] = idle_launch_us(graph.graph, args.gap * 1e-3)
    result["launch_by_kernels"] = {}
    for count in (10, 50, 200, 400):
        small = small_kernels_graph(count)
        result["launch_by_kernels"][count] = {"queued_us": queued_launch_us(small), "idle_us": idle_launch_us(small, args.gap * 1e-3)}
    # the server's cadence: a gap between requests, and where run's host time goes
    from opara_core.engine import capture, runtime
    timed(capture.CapturedGraph, "replay", "replay")
    timed(runtime.GraphRunner, "run", "graph_runner_run")
    timed(runtime.PackedInputs, "refill", "refill")
    timed(varlen.VarLenRunners, "_run_group", "run_group")
    packed = runners._packed
    # unpacked: padded per input and run through GraphRunner.run, as before PackedInputs (it now also
    # waits for the GPU before it refills the graph's host inputs: idle by then, a few us)
    for label, cells in (("packed", packed), ("unpacked", {})):
        runners._packed = cells
        for gap, count in ((args.gap, 400), (0.0, 1000)):
            laps.clear()
            for _ in range(count):
                time.sleep(gap * 1e-3)
                run_once()
            result[f"{label}, gap {gap:g} ms"] = {key: statistics.median(values) * 1e6 for key, values in laps.items() if values}
    runners._packed = packed
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            run_once()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
print(table)
print(json.dumps(result, indent=1))
args.json.parent.mkdir(parents=True, exist_ok=True)
args.json.write_text(json.dumps({**result, "profile": table}, indent=1))
