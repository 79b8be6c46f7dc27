"""Race checks of the multi-stream path on a GPU (one model per run).

    TORCH_CUDA_SANITIZER=1 python scripts/race_check.py eager --model googlenet
    compute-sanitizer --tool racecheck python scripts/race_check.py graph --model googlenet --replays 5
    python scripts/race_check.py graph --model googlenet --replays 1000

Both modes trace the model as serving does (trace, fusion passes), plan it
with a multi-stream policy (`opara`, at most --max-streams lanes) and compare
it with the sequential plan of the same traced graph, input by input:

eager  runs the plan eagerly on its CUDA streams, the exact schedule that is
       later captured (StreamInterpreter: the plan's lanes, events for its
       waits). Under TORCH_CUDA_SANITIZER=1, PyTorch's CUDA sanitizer follows
       every kernel's reads and writes per stream and raises on any access to
       a tensor that no event orders: a missing wait or a freed buffer reused
       too early.
graph  captures both plans into CUDA graphs and replays them on fresh random
       inputs; outputs must be bitwise equal (same kernels, same inputs). Run
       it under `compute-sanitizer --tool racecheck` (shared-memory hazards in
       the kernels) or `--tool memcheck`, with few replays: the tools slow
       every kernel down a hundredfold.

Prints one line per model, writes JSON with --json, exits 1 on a race or a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from opara_core import runtime, zoo
from opara_core.build import trace_on
from opara_core.capture import LanePool, StreamInterpreter, plan_capture, run_on_lanes
from opara_core.fusion import fuse_graph
from opara_core.plan import plan_graph


def traced(model: str, device: torch.device, fusion: bool):
    """The model's kernel graph as build_runner makes it (traced, then fused)."""
    entry = zoo.get(model)
    module = entry.build().to(device).eval()
    graph = trace_on(module, entry, device)
    if fusion:
        checks = [tuple(t.to(device) for t in entry.example_inputs(1, seed=7))]
        graph, _ = fuse_graph(graph, device, check_inputs=checks)
    return entry, graph


def random_inputs(entry: zoo.ZooModel, generator: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(spec.random(1, generator).to(device) for spec in entry.inputs)


def check_eager(model: str, runs: int, max_streams: int, fusion: bool) -> dict:
    device = torch.device("cuda")
    entry, graph = traced(model, device, fusion)
    parallel = plan_graph(graph, "opara", max_streams)
    sequential = plan_graph(graph, "sequential")
    pool = LanePool(device)
    lanes = StreamInterpreter(graph, parallel, pool.lanes(parallel.priorities[: parallel.num_streams]))
    one_lane = StreamInterpreter(graph, sequential, pool.lanes(sequential.priorities[: sequential.num_streams] or (0,)))
    generator = torch.Generator().manual_seed(0)
    mismatches = 0
    with torch.inference_mode():
        for _ in range(runs):
            inputs = random_inputs(entry, generator, device)
            got = [t.clone() for t in _outputs(run_on_lanes(lanes, inputs))]
            want = _outputs(run_on_lanes(one_lane, inputs))
            torch.cuda.synchronize()
            mismatches += not all(torch.equal(a, b) for a, b in zip(got, want))
    return {"streams": parallel.num_streams, "runs": runs, "mismatches": mismatches}


def check_graph(model: str, replays: int, max_streams: int, fusion: bool) -> dict:
    device = torch.device("cuda")
    entry, graph = traced(model, device, fusion)
    pool = LanePool(device)
    runners = {}
    for policy, budget in (("opara", max_streams), ("sequential", None)):
        plan = plan_graph(graph, policy, budget)
        with torch.inference_mode():
            runners[policy] = runtime.GraphRunner(plan_capture(graph, plan, pool), entry.inputs, entry.outputs, device, 1, (1,))
        if policy == "opara":
            streams = plan.num_streams
    generator = torch.Generator().manual_seed(0)
    mismatches = 0
    for _ in range(replays):
        inputs = random_inputs(entry, generator, torch.device("cpu"))
        outputs = {}
        for policy, runner in runners.items():
            for buffer, x in zip(runner.host_inputs(1), inputs):
                buffer[...] = x.numpy()
            outputs[policy] = [o.copy() for o in runner.run(1)]
        mismatches += not all((a == b).all() for a, b in zip(outputs["opara"], outputs["sequential"]))
    return {"streams": streams, "replays": replays, "mismatches": mismatches}


def _outputs(result) -> list[torch.Tensor]:
    return [v for v in tree_flatten(result)[0] if isinstance(v, torch.Tensor)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("eager", "graph"))
    parser.add_argument("--model", action="append", help="zoo model (repeatable; default: all)")
    parser.add_argument("--runs", type=int, default=20, help="eager: runs per model (default 20)")
    parser.add_argument("--replays", type=int, default=1000, help="graph: replays per model (default 1000)")
    parser.add_argument("--max-streams", type=int, default=16)
    parser.add_argument("--no-fusion", action="store_true", help="plan the unfused graph")
    parser.add_argument("--autotune", choices=("on", "off"), default="off",
                        help="cudnn.benchmark (default off: under compute-sanitizer every algorithm tried is instrumented too)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = args.autotune == "on"
    sanitizer = bool(os.environ.get("TORCH_CUDA_SANITIZER"))
    if args.mode == "eager" and not sanitizer:
        print("note: TORCH_CUDA_SANITIZER is not set: only the outputs are compared", file=sys.stderr)
    results, failed = [], False
    for model in args.model or zoo.names():
        start = time.perf_counter()
        try:
            if args.mode == "eager":
                result = check_eager(model, args.runs, args.max_streams, not args.no_fusion)
            else:
                result = check_graph(model, args.replays, args.max_streams, not args.no_fusion)
            result["error"] = None
        except Exception as error:  # noqa: BLE001 - the sanitizer reports races as exceptions
            result = {"error": f"{type(error).__name__}: {error}"}
        result.update(model=model, seconds=round(time.perf_counter() - start, 1))
        failed |= bool(result["error"] or result.get("mismatches"))
        results.append(result)
        print(json.dumps(result), flush=True)
    summary = {
        "mode": args.mode,
        "torch_cuda_sanitizer": sanitizer,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "scripts/race_check.py", *sys.argv[1:]]),
        "results": results,
        "passed": not failed,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print("PASSED" if not failed else "FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
