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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BUCKETS = (1, 2, 4, 8, 16, 32)
TIMED = (1, 8, 32)
CONFIGS = (("v8", True), ("v8", False), ("v7", True), ("v7", False))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="nasnet,inception_v3,resnet50,googlenet")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)  # one configuration, in this process
    args = parser.parse_args(argv)
    models = args.models.split(",")
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
    for api, benchmark in CONFIGS:
        try:
            rows.append({"api": api, "benchmark": benchmark, "models": run_config(api, benchmark, models)})
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(f"cuDNN {api}, benchmark {'on' if benchmark else 'off'}: done", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
