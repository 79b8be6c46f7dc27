"""Would fused lanes load fewer compiled segments with a dynamic batch dimension,
at no replay cost? (GPU for the replay times; the rest runs on the CPU too.)

NASNet's warm build loads 431-441 Inductor artifacts, one per segment and
bucket (docs/benchmarks.md runs 30 and 34), at a fixed ~16-22 ms each in
Inductor's own load path. Five of its six buckets share one plan, so one
artifact per segment compiled with a dynamic batch dimension would load about
172 instead. This probe measures both sides on NASNet-like cells (a 1x1
convolution, average and max pooling, concatenation, at 42x42 with 84
channels, channels-last), each compiled by `torch._inductor.standalone_compile`
once per batch size (static, as segment_compiler does) and once with the batch
dimension dynamic:

- each artifact's load seconds in a new process (`CompiledArtifact.load`:
  writing its entries into Inductor's caches, `load_cache_artifacts`, and the
  rest: cache lookup, guards, loading the generated module);
- each artifact's answer against the eager cell at every batch it serves;
- on a GPU, the median replay time of 20 calls in one CUDA graph at every batch.

    python scripts/dynamic_batch_probe.py --out probe/ --cells 4    # ~90 s on an H200

Prints a table and writes OUT/dynamic_batch_probe.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CHANNELS, SIDE = 84, 42  # a NASNet-A large cell at 42x42
BATCHES = (2, 4, 8, 16)
DYNAMIC_EXAMPLE_BATCH = 8
REPLAY_CALLS, REPLAYS = 20, 15


def cell(variant: int):
    """A NASNet-like cell; `variant` changes a constant, so each variant compiles on its own."""

    def forward(x, weight, bias):  # no annotations: make_fx would keep them, as strings, in the graph's globals (unpicklable)
        y = F.conv2d(torch.relu(x), weight, bias)
        pooled = F.avg_pool2d(y, 3, 1, 1, count_include_pad=False) + F.max_pool2d(y, 3, 1, 1) * (1 + variant * 0.01)
        return (torch.cat([pooled, y], 1).relu(),)

    return forward


def example_inputs(batch: int, device: str) -> list[torch.Tensor]:
    x = torch.randn(batch, CHANNELS, SIDE, SIDE, device=device).to(memory_format=torch.channels_last)
    weight = torch.randn(CHANNELS, CHANNELS, 1, 1, device=device).to(memory_format=torch.channels_last)
    return [x, weight, torch.randn(CHANNELS, device=device)]


def static_graph(variant: int, inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(cell(variant))(*inputs)


def dynamic_batch_graph(variant: int, inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
    """The cell traced on fake inputs whose batch size (only) is a symbol."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    batch_only = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (inputs[0].dim() - 1))
    fakes = [mode.from_tensor(inputs[0], symbolic_context=batch_only)] + [mode.from_tensor(t, static_shapes=True) for t in inputs[1:]]
    with mode:
        return make_fx(cell(variant))(*fakes)


def compile_artifacts(folder: Path, device: str, cells: int, batches: tuple[int, ...]) -> dict[str, float]:
    """Save `s{cell}_{batch}.bin` (static), `d{cell}.bin` (dynamic batch) and
    `warmup.bin`; returns each artifact's compile seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    seconds = {}

    def save(name: str, graph: torch.fx.GraphModule, inputs: list[torch.Tensor], dynamic_shapes: str) -> None:
        start = time.perf_counter()
        torch._inductor.standalone_compile(graph, inputs, dynamic_shapes=dynamic_shapes).save(path=str(folder / f"{name}.bin"), format="binary")
        seconds[name] = round(time.perf_counter() - start, 3)

    for variant in range(cells):
        for batch in batches:
            inputs = example_inputs(batch, device)
            save(f"s{variant}_{batch}", static_graph(variant, inputs), inputs, "from_example_inputs")
        inputs = example_inputs(DYNAMIC_EXAMPLE_BATCH, device)
        save(f"d{variant}", dynamic_batch_graph(variant, inputs), inputs, "from_graph")
    inputs = example_inputs(batches[0], device)
    save("warmup", static_graph(cells, inputs), inputs, "from_example_inputs")  # another cell: the new process's first load pays its imports
    return seconds


def replay_ms(compiled, inputs: list[torch.Tensor]) -> float:
    """Median ms of one call, from CUDA-graph replays of REPLAY_CALLS calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compiled(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAY_CALLS):
            compiled(*inputs)
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPLAY_CALLS)
    return statistics.median(times)


def load_and_run(folder: Path, device: str, batches: tuple[int, ...]) -> dict:
    """In a new process: load every artifact (split into load_cache_artifacts and
    the rest), check it against the eager cell at each batch it serves, and
    time its replays there on a GPU."""
    real = torch.compiler.load_cache_artifacts
    spent = [0.0]

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    torch.compiler.load_cache_artifacts = timed
    with torch.inference_mode():
        torch._inductor.CompiledArtifact.load(path=str(folder / "warmup.bin"), format="binary")(*example_inputs(batches[0], device))
    loads, runs = {}, {}
    for path in sorted(folder.glob("[sd]*.bin")):
        name = path.stem
        spent[0] = 0.0
        start = time.perf_counter()
        compiled = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
        total = time.perf_counter() - start
        loads[name] = {"load_cache_artifacts_s": round(spent[0], 5), "rest_s": round(total - spent[0], 5)}
        variant = int(name[1:].split("_")[0])
        for batch in batches if name.startswith("d") else (int(name.split("_")[1]),):
            inputs = example_inputs(batch, device)
            with torch.inference_mode():
                got, want = compiled(*inputs)[0], cell(variant)(*inputs)[0]
                error = ((got - want).abs().max() / want.abs().max()).item()
                runs[f"{name}@{batch}"] = {"relative_error": error, **({"replay_ms": round(replay_ms(compiled, inputs), 5)} if device == "cuda" else {})}
    return {"loads": loads, "runs": runs}


def table(result: dict, cells: int, batches: tuple[int, ...]) -> str:
    """Replay ms per batch, static against dynamic (mean over the cells), and load ms per artifact."""
    runs, lines = result["runs"], ["| batch | static ms | dynamic ms | dynamic / static |", "|---:|---:|---:|---:|"]
    for batch in batches:
        static = [runs[f"s{v}_{batch}@{batch}"].get("replay_ms") for v in range(cells)]
        dynamic = [runs[f"d{v}@{batch}"].get("replay_ms") for v in range(cells)]
        if None in static + dynamic:
            lines.append(f"| {batch} | - | - | - |")
            continue
        s, d = statistics.mean(static), statistics.mean(dynamic)
        lines.append(f"| {batch} | {s:.4f} | {d:.4f} | {d / s:.2f}x |")
    loads = result["loads"].values()
    lines.append(
        f"\nload per artifact, mean over {len(loads)}: load_cache_artifacts {1e3 * statistics.mean(x['load_cache_artifacts_s'] for x in loads):.1f} ms, "
        f"the rest {1e3 * statistics.mean(x['rest_s'] for x in loads):.1f} ms"
    )
    return "\n".join(lines)


@contextlib.contextmanager
def inductor_cache(directory: str):
    """Inductor's cache directory for this process while the block runs (then as it was)."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cells", type=int, default=4, help="distinct cells (each compiled static at every batch and once dynamic)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = args.out / "artifacts"
    if args.child:
        print(json.dumps(load_and_run(folder, device, batches)))
        return 0
    if min(batches) < 2:
        parser.error("--batches: every batch size must be at least 2 (Inductor specializes a dimension of size 1)")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(args.out / "inductor")}
    with inductor_cache(env["TORCHINDUCTOR_CACHE_DIR"]):  # the cache the loading process reads
        compiled = compile_artifacts(folder, device, args.cells, batches)
    command = [sys.executable, __file__, "--out", str(args.out), "--batches", args.batches, "--child"]
    child = subprocess.run(command, env=env, capture_output=True, text=True)
    if child.returncode != 0:
        print(f"the loading process failed (exit {child.returncode}):\n{child.stderr[-3000:]}", file=sys.stderr)
        return 1
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__, "cells": args.cells,
              "batches": list(batches), "compile_s": compiled, **json.loads(child.stdout.strip().splitlines()[-1])}  # fmt: skip
    (args.out / "dynamic_batch_probe.json").write_text(json.dumps(result, indent=1))
    print(table(result, args.cells, batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
