"""What cuDNN's first call of each convolution shape costs, per cuDNN API and mode.

`python scripts/cudnn_first_call.py --models nasnet,inception_v3,resnet50,googlenet --json out/cudnn.json`

PyTorch plans a convolution at its first call in a thread and keeps that plan
for every later call with the same parameters. Through cuDNN's v8 API (the
default) planning builds execution plans; with its benchmark on it also times
them. A warm build of the engine pays that for every convolution of every
bucket, in every process: no cache outside the process keeps plans.

For each model (eager, channels-last, fp32 with PyTorch's default TF32
convolutions) and each of cuDNN's v8 and v7 APIs (`TORCH_CUDNN_V8_API_DISABLED=1`)
with its benchmark on and off, one fresh process runs the model once at each of
the engine's default buckets (1, 2, 4, 8, 16, 32) and reports the seconds of
those first calls, then the replay time (median of CUDA events) of the model
captured in a CUDA graph at 1, 8 and 32: what those plans give.

`--planning` (v8 API, heuristics, as fused lanes capture; default model
NASNet-A large) measures where that planning goes and what avoids it, three
fresh processes per model:

- `one thread`: the six buckets one after another, each convolution timed by
  kind (depthwise, grouped, dense; kernel and stride), then the replays;
- `a thread per bucket`: all six at once, one thread each (the plans are per
  thread, so each bucket plans its own, as a capture in that thread would);
- `depthwise without cuDNN`: the depthwise convolutions through ATen's own
  kernel (cuDNN switched off around them), then the replays.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

BUCKETS = (1, 2, 4, 8, 16, 32)
TIMED = (1, 8, 32)
CONFIGS = (("v8", True), ("v8", False), ("v7", True), ("v7", False))
WAYS = ("one thread", "a thread per bucket", "depthwise without cuDNN")
REPLAYS = 50


def measure(models: list[str]) -> dict[str, Any]:
    """One process's measurements under its cuDNN API and mode (set before this runs)."""
    import torch

    from opara_core import zoo

    device = torch.device("cuda")
    torch.ones(1, device=device).sum().item()  # CUDA's own start-up is not a convolution's
    results: dict[str, Any] = {}
    for name in models:
        entry = zoo.get(name)
        torch.manual_seed(0)
        module = entry.builder().eval().to(device).to(memory_format=torch.channels_last)
        first: dict[int, float] = {}
        replay_ms: dict[int, float] = {}
        with torch.inference_mode():
            for batch in BUCKETS:
                x = torch.randn(batch, *entry.inputs[0].shape, device=device).contiguous(memory_format=torch.channels_last)
                torch.cuda.synchronize()
                start = time.perf_counter()
                module(x)
                torch.cuda.synchronize()
                first[batch] = time.perf_counter() - start
                if batch in TIMED:
                    replay_ms[batch] = graph_replay_ms(module, x)
        results[name] = {"first_call_s": first, "first_calls_s": sum(first.values()), "graph_ms": replay_ms}
    return results


def graph_replay_ms(module: Any, x: Any) -> float:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        module(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module(x)
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def run_config(api: str, benchmark: bool, models: list[str]) -> dict[str, Any]:
    """`measure` in a fresh process: PyTorch reads the API switch once per
    process and keeps plans per thread, so no configuration sees another's."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDNN_V8_API_DISABLED"}
    if api == "v7":
        env["TORCH_CUDNN_V8_API_DISABLED"] = "1"
    command = [sys.executable, __file__, "--child", "on" if benchmark else "off", "--models", ",".join(models)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"cuDNN {api}, benchmark {'on' if benchmark else 'off'}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | cuDNN API | benchmark | first calls, 6 buckets (s) | graph ms at " + " / ".join(map(str, TIMED)) + " |", "|---|---|---|---:|---|"]
    for row in rows:
        for name, result in row["models"].items():
            replays = " / ".join(f"{result['graph_ms'][str(b)]:.3f}" for b in TIMED)
            lines.append(f"| {name} | {row['api']} | {'on' if row['benchmark'] else 'off'} | {result['first_calls_s']:.1f} | {replays} |")
    return "\n".join(lines)


def kind(conv: Any) -> str:
    """What a convolution is, for the planning seconds by kind."""
    if conv.groups == 1:
        name = "dense"
    elif conv.groups == conv.in_channels == conv.out_channels:
        name = "depthwise"
    else:
        name = "grouped"
    return f"{name} k{conv.kernel_size[0]} s{conv.stride[0]}"


def measure_way(way: str, name: str) -> dict[str, Any]:
    """One process's measurement of `way` (run in a fresh process: plans live as long as it)."""
    import torch

    from opara_core import zoo

    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda")
    torch.ones(1, device=device).sum().item()  # CUDA's own start-up is no convolution's
    entry = zoo.get(name)
    torch.manual_seed(0)
    module = entry.builder().eval().to(device).to(memory_format=torch.channels_last)
    convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    if way == "depthwise without cuDNN":
        for conv in convs:
            if kind(conv).startswith("depthwise"):
                conv.forward = _without_cudnn(conv.forward)
    by_kind: dict[str, float] = {}
    hooks = _time_by_kind(convs, by_kind) if way == "one thread" else []
    inputs = {b: torch.randn(b, *entry.inputs[0].shape, device=device).contiguous(memory_format=torch.channels_last) for b in BUCKETS}
    first: dict[int, float] = {}

    def first_call(batch: int) -> None:
        with torch.inference_mode():
            start = time.perf_counter()
            module(inputs[batch])
            torch.cuda.synchronize()
            first[batch] = time.perf_counter() - start

    start = time.perf_counter()
    if way == "a thread per bucket":
        threads = [threading.Thread(target=first_call, args=(b,)) for b in BUCKETS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for batch in BUCKETS:
            first_call(batch)
    wall = time.perf_counter() - start
    result: dict[str, Any] = {"first_calls_s": wall, "first_call_s": first, "by_kind_s": by_kind, "graph_ms": {}}
    if way != "a thread per bucket":
        for hook in hooks:
            hook.remove()
        with torch.inference_mode():
            result["graph_ms"] = {b: graph_replay_ms(module, inputs[b]) for b in TIMED}
    return result


def _without_cudnn(forward: Any) -> Any:
    import torch

    def run(x: Any) -> Any:
        with torch.backends.cudnn.flags(enabled=False):
            return forward(x)

    return run


def _time_by_kind(convs: list, seconds: dict[str, float]) -> list:
    """Hooks that add each convolution call's seconds (synchronised) to its kind's."""
    import torch

    started: dict[int, float] = {}

    def before(conv: Any, args: Any) -> None:
        torch.cuda.synchronize()
        started[id(conv)] = time.perf_counter()

    def after(conv: Any, args: Any, out: Any) -> None:
        torch.cuda.synchronize()
        seconds[kind(conv)] = seconds.get(kind(conv), 0.0) + time.perf_counter() - started[id(conv)]

    hooks = []
    for conv in convs:
        hooks += [conv.register_forward_pre_hook(before), conv.register_forward_hook(after)]
    return hooks


def run_way(way: str, name: str) -> dict[str, Any]:
    """`measure_way` in a fresh process."""
    command = [sys.executable, __file__, "--child-way", way, "--models", name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name}, {way}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def planning_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | way | first calls, 6 buckets (s) | of which depthwise (s) | graph ms at " + " / ".join(map(str, TIMED)) + " |",
        "|---|---|---:|---:|---|",
    ]
    for row in rows:
        result = row["result"]
        depthwise = sum(s for k, s in result["by_kind_s"].items() if k.startswith("depthwise"))
        share = f"{depthwise:.1f}" if result["by_kind_s"] else "-"
        replays = " / ".join(f"{result['graph_ms'][str(b)]:.3f}" for b in TIMED) if result["graph_ms"] else "-"
        lines.append(f"| {row['model']} | {row['way']} | {result['first_calls_s']:.1f} | {share} | {replays} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated zoo names (default nasnet,inception_v3,resnet50,googlenet; nasnet with --planning)")
    parser.add_argument("--planning", action="store_true", help="where v8's planning goes and what avoids it, instead of the API and mode table")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)  # one configuration, in this process
    parser.add_argument("--child-way", choices=WAYS, help=argparse.SUPPRESS)  # one way of --planning, in this process
    args = parser.parse_args(argv)
    models = (args.models or ("nasnet" if args.planning else "nasnet,inception_v3,resnet50,googlenet")).split(",")
    if args.child_way:
        print(json.dumps(measure_way(args.child_way, models[0])))
        return 0
    if args.child:
        import torch

        torch.backends.cudnn.benchmark = args.child == "on"
        print(json.dumps(measure(models)))
        return 0
    import torch

    from opara_core import zoo

    try:
        for name in models:
            zoo.get(name)
    except KeyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    try:
        if args.planning:
            for name in models:
                for way in WAYS:
                    rows.append({"model": name, "way": way, "result": run_way(way, name)})
                    print(f"{name}, {way}: done", file=sys.stderr, flush=True)
        else:
            for api, benchmark in CONFIGS:
                rows.append({"api": api, "benchmark": benchmark, "models": run_config(api, benchmark, models)})
                print(f"cuDNN {api}, benchmark {'on' if benchmark else 'off'}: done", file=sys.stderr, flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(planning_table(rows) if args.planning else table(rows))
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
