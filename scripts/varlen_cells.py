"""What a variable-length model's (sequence, batch) cells would cost as one
whole-model Inductor graph compiled once with dynamic shapes (issue #16: the
small cells set the DP scheduler's gain and a lone request's latency; the
ATen graphs served today take 1.5 ms or more however few tokens they hold).

    python scripts/varlen_cells.py --models bert --json $OUT/varlen_cells.json [--aten-table docs/varlen_h100_run3.json]

For each model: `engine.whole_model` (`torch.compile` default mode, Inductor's
freezing, under `inference_mode`, `dynamic=True`: sizes other than 0 and 1 symbolic) is called
once per cell of the grid, each cell captured into a CUDA graph, all in one
graph memory pool, largest cell first, as serving captures them; each replay
timed (CUDA events). Reports the seconds compiling and capturing took and how
many graphs Dynamo compiled, the cost table, the pool's MiB, the largest error against the eager
model, and what the table predicts per scheduler for a length distribution
(`varlen_bench.predicted`, the DP against padding to the largest bucket),
next to the same prediction from an earlier run's measured (ATen) table.

Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from opara_core import zoo
from opara_core.engine.capture import pool_mb, time_replays
from opara_core.engine.compare import max_relative_error
from opara_core.engine.whole_model import WholeModelInductor
from opara_core.planning import batching
from opara_core.serving.varlen import DEFAULT_LENGTH_BUCKETS, axis_buckets
from varlen_bench import cost_table, predicted, print_prediction

BUCKETS = (1, 2, 4, 8, 16, 32)


def measure(model: str, buckets: tuple[int, ...], lengths: tuple[int, ...]) -> dict:
    entry = zoo.get(model)
    device = torch.device("cuda")
    module = entry.build().to(device).eval()
    axes = tuple(axis_buckets(axis, lengths) for axis in entry.lengths)
    cells = [(shape, b) for shape in reversed(batching.grid(axes)) for b in sorted(buckets, reverse=True)]
    pool = torch.cuda.graph_pool_handle()
    table, errors, graphs = {}, {}, []
    torch._dynamo.reset()
    whole = WholeModelInductor(module)
    seconds = 0.0
    for shape, batch in cells:
        inputs = [t.to(device) for t in entry.at(shape).example_inputs(batch, seed=3)]
        start = time.perf_counter()
        captured = whole.capture(inputs, pool)  # its warm-up compiles where no earlier graph's guards hold
        seconds += time.perf_counter() - start
        graphs.append(captured)  # alive until the pool is measured
        label = f"{','.join(map(str, shape))}x{batch}"
        table[label] = round(time_replays(captured), 3)
        if batch in (1, max(buckets)):
            with torch.inference_mode():
                errors[label] = max_relative_error(captured.outputs, module(*inputs))
        logging.info("%s: %.3f ms", label, table[label])
    return {
        "model": model,
        "compile_and_capture_seconds": round(seconds, 1),
        "dynamo_graphs": torch._dynamo.utils.counters["stats"].get("unique_graphs", 0),
        "cost_table_ms": table,
        "pool_mib": round(pool_mb(pool), 1),
        "max_relative_error": errors,
    }


def print_table(result: dict, buckets: tuple[int, ...]) -> None:
    print(f"\n## {result['model']}: whole-model Inductor, dynamic shapes: compile and capture {result['compile_and_capture_seconds']} s, "
          f"{result['dynamo_graphs']} Dynamo graphs, pool {result['pool_mib']} MiB, errors {result['max_relative_error']}\n")
    shapes = sorted({label.rpartition("x")[0] for label in result["cost_table_ms"]}, key=lambda s: tuple(map(int, s.split(","))))
    print("| shape \\ batch | " + " | ".join(map(str, buckets)) + " |")
    print("|---" * (len(buckets) + 1) + "|")
    for shape in shapes:
        print(f"| {shape} | " + " | ".join(f"{result['cost_table_ms'][f'{shape}x{b}']:.3f}" for b in buckets) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert", help="variable-length zoo models (default bert)")
    parser.add_argument("--buckets", default=",".join(map(str, BUCKETS)), help="batch buckets (default the served config's)")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTH_BUCKETS)), help="sequence buckets below each axis's limit")
    parser.add_argument("--distribution", default="lognormal:mean=50,cap=512,seed=1", help="request lengths for the prediction (client.lengths)")
    parser.add_argument("--aten-table", help="an earlier varlen_bench JSON whose measured tables to predict from too")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    buckets = tuple(int(b) for b in args.buckets.split(","))
    lengths = tuple(int(b) for b in args.lengths.split(","))
    models = [m for m in args.models.split(",") if m]
    for model in models:
        if not zoo.get(model).lengths:
            parser.error(f"{model} has no variable-length axis")
    earlier = json.load(open(args.aten_table))["meta"]["reports"] if args.aten_table else {}
    results = []
    for model in models:
        result = measure(model, buckets, lengths)
        result["prediction"] = predicted(result["cost_table_ms"], args.distribution)
        if model in earlier:
            result["aten_prediction"] = predicted(cost_table(earlier[model]), args.distribution)
        results.append(result)
        print_table(result, buckets)
        print_prediction(f"{model} (whole-model Inductor, dynamic)", result["prediction"], args.distribution)
        if "aten_prediction" in result:
            print_prediction(f"{model} (the earlier run's ATen graphs)", result["aten_prediction"], args.distribution)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
