"""Race checks of the multi-stream path on a GPU.

    python scripts/race_check.py eager --model googlenet --sanitizer
    compute-sanitizer --tool racecheck python scripts/race_check.py graph --model googlenet --replays 5
    python scripts/race_check.py graph --model googlenet --replays 1000

Both modes trace the model as serving does (trace, fusion passes), plan it
with a multi-stream policy (`opara`, at most --max-streams lanes) and compare
it with the sequential plan of the same traced graph, input by input:

eager  runs the plan eagerly on its CUDA streams, the exact schedule that is
       later captured (StreamInterpreter: the plan's lanes, events for its
       waits). With --sanitizer, PyTorch's CUDA sanitizer (CSAN) follows
       every kernel's reads and writes per stream and raises on any access to
       a tensor that no event orders: a missing wait or a freed buffer reused
       too early. It is switched on after tracing: TORCH_CUDA_SANITIZER=1
       from the start aborts the process inside torch.export (torch 2.11: the
       sanitizer's allocation hook raises through C++ during export's trace).
       A control run per model, the plan stripped of its cross-lane waits,
       must be flagged; if it is not, the sanitizer saw nothing and the
       check fails.
graph  captures both plans into CUDA graphs and replays them on fresh random
       inputs; outputs must be bitwise equal (same kernels, same inputs). Run
       it under `compute-sanitizer --tool racecheck` (shared-memory hazards in
       the kernels) or `--tool memcheck`, with few replays: the tools slow
       every kernel down a hundredfold.

Prints one line per model, writes JSON with --json, exits 1 on a race, a mismatch
or an unflagged control.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from opara_core import zoo
from opara_core.engine import runtime
from opara_core.engine.trace import trace_model
from opara_core.engine.build import static_inputs
from opara_core.engine.capture import LanePool, PlanCapture, StreamInterpreter, run_on_lanes
from opara_core.engine.fusion import fuse_graph
from opara_core.engine.interpreter import plan_graph


STARTED = time.perf_counter()


def progress(message: str) -> None:
    """A timestamped line on stderr: under a sanitizer, a run that hits its time
    limit still shows how far it got."""
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


def traced(model: str, device: torch.device, fusion: bool):
    """The model's kernel graph as build_runner makes it (traced, then fused)."""
    entry = zoo.get(model)
    module = entry.build().to(device).eval()
    graph = trace_model(entry, module, device)
    progress(f"{model}: traced")
    if fusion:
        checks = [tuple(t.to(device) for t in entry.example_inputs(1, seed=7))]
        graph, _ = fuse_graph(graph, device, check_inputs=checks)
        progress(f"{model}: fused")
    return entry, graph


def random_inputs(entry: zoo.ZooModel, generator: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(spec.random(1, generator).to(device) for spec in entry.inputs)


def check_eager(entry: zoo.ZooModel, graph, runs: int, max_streams: int, control: bool = False) -> dict:
    """`runs` random inputs through the multi-stream and the sequential plan on
    their lanes. With `control` (under the sanitizer) one more run of the
    multi-stream plan without its cross-lane waits, which the sanitizer must flag:
    proof that it sees the lanes at all."""
    device = torch.device("cuda")
    parallel = plan_graph(graph, "opara", max_streams)
    sequential = plan_graph(graph, "sequential")
    pool = LanePool(device)
    lanes = StreamInterpreter(graph, parallel, pool.lanes(parallel.priorities[: parallel.num_streams]))
    one_lane = StreamInterpreter(graph, sequential, pool.lanes(sequential.priorities[: sequential.num_streams] or (0,)))
    generator = torch.Generator().manual_seed(0)
    mismatches = 0
    with torch.inference_mode():
        for run in range(runs):
            inputs = random_inputs(entry, generator, device)
            got = [t.clone() for t in _outputs(run_on_lanes(lanes, inputs))]
            want = _outputs(run_on_lanes(one_lane, inputs))
            torch.cuda.synchronize()
            mismatches += not all(torch.equal(a, b) for a, b in zip(got, want))
            progress(f"{entry.name}: eager run {run + 1} of {runs} compared")
    result = {"streams": parallel.num_streams, "runs": runs, "mismatches": mismatches}
    if control and parallel.waits:
        result["control_flagged"] = control_flagged(graph, dataclasses.replace(parallel, waits=()), pool, entry, generator)
        progress(f"{entry.name}: control without waits {'flagged' if result['control_flagged'] else 'NOT flagged'}")
    return result


def control_flagged(graph, unordered, pool: LanePool, entry: zoo.ZooModel, generator: torch.Generator) -> bool:
    """Whether the sanitizer raises on a run of a plan stripped of its waits."""
    from torch.cuda._sanitizer import CUDASanitizerErrors

    lanes = StreamInterpreter(graph, unordered, pool.lanes(unordered.priorities[: unordered.num_streams]))
    try:
        with torch.inference_mode():
            run_on_lanes(lanes, random_inputs(entry, generator, torch.device("cuda")))
            torch.cuda.synchronize()
    except CUDASanitizerErrors:
        torch.cuda.synchronize()  # the run stopped midway: let its lanes drain before the next model
        return True
    return False


def check_graph(entry: zoo.ZooModel, graph, replays: int, max_streams: int) -> dict:
    device = torch.device("cuda")
    pool = LanePool(device)
    runners = {}
    for policy, budget in (("opara", max_streams), ("sequential", None)):
        plan = plan_graph(graph, policy, budget)
        with torch.inference_mode():
            captured = PlanCapture(graph, plan, pool)(static_inputs(entry, 1, device), torch.cuda.graph_pool_handle())
        runners[policy] = runtime.GraphRunner({1: captured}, entry.inputs, entry.outputs, device, 1)
        progress(f"{entry.name}: {policy} plan captured")
        if policy == "opara":
            streams = plan.num_streams
    generator = torch.Generator().manual_seed(0)
    mismatches = 0
    for replay in range(replays):
        inputs = random_inputs(entry, generator, torch.device("cpu"))
        outputs = {}
        for policy, runner in runners.items():
            outputs[policy] = [o.clone() for o in runner.run(inputs)]
        mismatches += not all(torch.equal(a, b) for a, b in zip(outputs["opara"], outputs["sequential"]))
        if replay < 10 or (replay + 1) % 100 == 0:
            progress(f"{entry.name}: replay {replay + 1} of {replays} compared")
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
    parser.add_argument("--sanitizer", action="store_true", help="eager: run under PyTorch's CUDA sanitizer (CSAN)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.sanitizer and args.mode != "eager":
        parser.error("--sanitizer checks eager runs only (CSAN does not see inside graph replays)")
    if os.environ.get("TORCH_CUDA_SANITIZER"):
        print("error: TORCH_CUDA_SANITIZER=1 aborts inside torch.export; use --sanitizer", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = args.autotune == "on"
    if args.mode == "eager" and not args.sanitizer:
        print("note: no --sanitizer: only the outputs are compared", file=sys.stderr)
    results, graphs = [], {}
    for model in args.model or zoo.names():  # all traced before the sanitizer starts watching
        try:
            graphs[model] = traced(model, torch.device("cuda"), not args.no_fusion)
        except Exception as error:  # noqa: BLE001 - one model's failure is its result
            results.append({"model": model, "error": f"trace: {type(error).__name__}: {error}"})
    if args.sanitizer:
        import torch.cuda._sanitizer as csan  # importing it installs its allocation hooks

        csan.enable_cuda_sanitizer()
        progress("CUDA sanitizer on")
    for model, (entry, graph) in graphs.items():
        start = time.perf_counter()
        try:
            if args.mode == "eager":
                result = check_eager(entry, graph, args.runs, args.max_streams, control=args.sanitizer)
            else:
                result = check_graph(entry, graph, args.replays, args.max_streams)
            result["error"] = None
        except Exception as error:  # noqa: BLE001 - the sanitizer reports races as exceptions
            result = {"error": f"{type(error).__name__}: {error}"}
        result.update(model=model, seconds=round(time.perf_counter() - start, 1))
        results.append(result)
        print(json.dumps(result), flush=True)
    failed = any(r["error"] or r.get("mismatches") or r.get("control_flagged") is False for r in results)
    summary = {
        "mode": args.mode,
        "torch_cuda_sanitizer": args.sanitizer,
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
