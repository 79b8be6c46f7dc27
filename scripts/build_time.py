"""Where a model's build time goes on a GPU: trace, fusion, and per bucket the
captures and the replay timing of `auto`, plus the guard.

    python scripts/build_time.py --model nasnet --layout nhwc --autotune off --json out/build.json

With --capture-variants: capture the model's `asap` plan at --buckets' first
size with warm-up 1 and 2 and cross-lane memory reuse on and off, and print
seconds and pool MB per variant (what a capture's cost depends on).

Run one configuration per process: cuDNN's autotuning results are cached in the
process, so a second build in it would look faster than a fresh server's.
Prints the build report and appends one JSON line per run to --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from opara_core import zoo
from opara_core.engine.build import BuildReport, EngineSettings, build_runner, traced_graphs
from opara_core.engine.capture import LanePool, PlanCapture, pool_mb
from opara_core.engine.interpreter import plan_graph


def capture_variants(entry: zoo.ZooModel, settings: EngineSettings) -> list[dict]:
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = settings.autotune
    graphs = traced_graphs(entry.build().to(device).eval(), entry, device, settings, BuildReport())
    graph = graphs["nhwc" if settings.layout == "nhwc" else "nchw"]
    plan = plan_graph(graph, "asap", settings.max_streams)
    lane_pool = LanePool(device)
    static_in = [t.to(device) for t in entry.example_inputs(settings.buckets[0], seed=1)]
    results = []
    with torch.inference_mode():
        for warmup, reuse in ((2, True), (2, False), (1, True), (1, False), (2, True)):
            pool = torch.cuda.graph_pool_handle()
            torch.cuda.synchronize()
            start = time.perf_counter()
            captured = PlanCapture(graph, plan, lane_pool, warmup=warmup, reuse_memory=reuse)(static_in, pool)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            results.append({"warmup": warmup, "reuse": reuse, "seconds": round(seconds, 3), "pool_mb": pool_mb(pool), "streams": plan.num_streams})
            print(json.dumps(results[-1]), flush=True)
            del captured
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layout", default="auto", choices=("auto", "nchw", "nhwc"))
    parser.add_argument("--autotune", default="on", choices=("on", "off"))
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--buckets", default="1,2,4,8,16,32")
    parser.add_argument("--capture-variants", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    entry = zoo.get(args.model)
    settings = EngineSettings(
        policy=args.policy, layout=args.layout, autotune=args.autotune == "on", buckets=tuple(int(b) for b in args.buckets.split(","))
    )
    if args.capture_variants:
        results = capture_variants(entry, settings)
        if args.json:
            with args.json.open("a") as out:
                out.write(json.dumps({"model": args.model, "capture_variants": results}) + "\n")
        return 0
    start = time.perf_counter()
    _, report = build_runner(entry.build(), entry, torch.device("cuda"), max(settings.buckets), settings)
    total = time.perf_counter() - start
    print(f"{args.model} layout={args.layout} autotune={args.autotune}: {total:.1f} s in all")
    print(report.summary())
    if args.json:
        record = {
            "model": args.model,
            "layout": args.layout,
            "autotune": args.autotune,
            "policy": args.policy,
            "total_s": round(total, 2),
            "seconds": {k: round(v, 2) for k, v in report.seconds.items()},
            "choices": {b: str(c) for b, c in report.choices.items()},
            "chosen_ms": {b: report.timings_ms[b][c] for b, c in report.choices.items() if c in report.timings_ms.get(b, {})},
            "runner": report.runner,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
        with args.json.open("a") as out:
            out.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
