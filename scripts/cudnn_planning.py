"""Where cuDNN's planning at first calls goes, and what avoids it.

`python scripts/cudnn_planning.py --models nasnet --json out/planning.json`

A warm build of NASNet-A large spends most of its time in cuDNN's v8 API
planning each convolution shape at its first call (docs/benchmarks.md, runs 20
and 21); PyTorch keeps those plans per thread and in memory only. For each
model (eager, channels-last, fp32 with PyTorch's default TF32, cuDNN's
heuristics as fused lanes take them) three fresh processes run its first call
at each of the engine's default buckets (1, 2, 4, 8, 16, 32):

- `one thread`: one bucket after another, each convolution timed by kind
  (depthwise, grouped, dense; kernel and stride), then its replay from a CUDA
  graph at 1, 8 and 32 (ms);
- `a thread per bucket`: all six at once, one thread each (the plans are per
  thread, so each bucket plans its own, as a capture in that thread would);
- `depthwise without cuDNN`: the depthwise convolutions through ATen's own
  kernel (cuDNN switched off around them), then the replays.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

BUCKETS = (1, 2, 4, 8, 16, 32)
TIMED = (1, 8, 32)
WAYS = ("one thread", "a thread per bucket", "depthwise without cuDNN")


def kind(conv: Any) -> str:
    """What a convolution is, for the planning seconds by kind."""
    if conv.groups == 1:
        name = "dense"
    elif conv.groups == conv.in_channels == conv.out_channels:
        name = "depthwise"
    else:
        name = "grouped"
    return f"{name} k{conv.kernel_size[0]} s{conv.stride[0]}"


def measure(way: str, name: str) -> dict[str, Any]:
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
        from cudnn_first_call import graph_replay_ms  # scripts/, this script's directory

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
    """`measure` in a fresh process."""
    command = [sys.executable, __file__, "--child", way, "--models", name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name}, {way}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
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
    parser.add_argument("--models", default="nasnet")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)  # one way, in this process
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if args.child:
        print(json.dumps(measure(args.child, models[0])))
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
    for name in models:
        for way in WAYS:
            try:
                rows.append({"model": name, "way": way, "result": run_way(way, name)})
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                print(f"error: {error}", file=sys.stderr)
                return 1
            print(f"{name}, {way}: done", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
