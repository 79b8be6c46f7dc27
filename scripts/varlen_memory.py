"""Where a variable-length model's graph pool holds its memory (issue #16's
memory target): builds the model's runners as the server does, one shape after
another into one pool, and after each shape reads `torch.cuda.memory_snapshot()`.

    python scripts/varlen_memory.py --models bert --policies auto,sequential --json $OUT/varlen_memory.json

Per shape: what `auto` chose per batch bucket, the pool's MiB, and the pool's
segments split by the stream they belong to (the caching allocator reuses a
free block only for an allocation on the same stream) into bytes in use
(live graph outputs, and blocks a later graph's capture holds) and free bytes.
Free bytes on a stream no later shape allocates on are memory the pool keeps
for nothing. With several `--policies` the model is built once per policy (a
fresh pool each time), so the split by stream can be compared with a plan
that never leaves one stream; `saved` builds with the whole-model Inductor
graph (`engine.whole_model`'s saved artifact, the server's default compiler)
instead of the engine's per-shape plans.
`--order` builds the shapes as `capture` "first_use" would when requests
first need them in that order (`random`, seeded; `ascending`, fewest tokens
first) instead of as "load" does (largest first). A policy suffixed `/one-priority` (an
experiment) creates every lane's stream at normal priority, so that lane L is
the same stream in every shape's plan whatever priorities the plans ask for.

Prints a table per policy and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import random
import time
from collections import defaultdict

import torch

from opara_core import zoo
from opara_core.engine.build import EngineSettings, build_runner, static_inputs
from opara_core.engine.capture import GraphPool, LanePool, pool_mb
from opara_core.planning import batching
from opara_core.serving.varlen import DEFAULT_LENGTH_BUCKETS, VarLenRunners, VarLenSettings, axis_buckets

MIB = 2**20


def stream_labels(pool: GraphPool) -> dict[int, str]:
    """Stream handle -> "lane L (priority P)" for the pool's lane streams."""
    return {s.cuda_stream: f"lane {lane} (priority {priority})" for (lane, priority), s in pool.lanes._streams.items()}


def pool_breakdown(pool: GraphPool) -> dict:
    """The pool's segments by stream: total, in use and free MiB, and the largest free block."""
    torch.cuda.synchronize()
    labels = stream_labels(pool)
    by_stream: dict[str, dict[str, float]] = defaultdict(lambda: {"total": 0.0, "in_use": 0.0, "free": 0.0, "largest_free": 0.0, "segments": 0})
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) != tuple(pool.handle):
            continue
        row = by_stream[labels.get(segment["stream"], f"stream {segment['stream']:#x}")]
        row["segments"] += 1
        row["total"] += segment["total_size"] / MIB
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                row["free"] += block["size"] / MIB
                row["largest_free"] = max(row["largest_free"], block["size"] / MIB)
            else:
                row["in_use"] += block["size"] / MIB
    return {label: {k: round(v, 1) for k, v in row.items()} for label, row in sorted(by_stream.items())}


class ObservedRunners(VarLenRunners):
    """VarLenRunners that read the pool after each shape's build."""

    def __init__(self, *args, **kwargs):
        self.observed: list[dict] = []  # filled while the base class builds every shape
        super().__init__(*args, **kwargs)

    def _build(self, shape):
        timings = super()._build(shape)
        report = self.report.shapes[shape]
        peaks = {b: round(self.report.graph_bytes.get((shape, b), 0) / MIB, 1) for b in sorted(report.choices)}
        self.observed.append({
            "shape": list(shape),
            "choices": {str(b): str(c) for b, c in sorted(report.choices.items())},
            "graph_peaks_mib": peaks,
            "pool_mib": round(self.report.pool_bytes / MIB, 1),
            "by_stream": pool_breakdown(self.pool),
        })
        logging.info("shape %s: pool %.0f MiB", shape, self.report.pool_bytes / MIB)
        return timings


def one_priority_lanes(self, priorities):
    """LanePool.lanes with every priority taken as normal (the /one-priority experiment)."""
    return ORIGINAL_LANES(self, [0] * len(priorities))


ORIGINAL_LANES = LanePool.lanes


def largest_alone(runners: VarLenRunners, module, entry, device, policy: str, cell) -> float:
    """MiB of the pool the largest cell's graph holds when it is captured alone
    (the issue's "largest single graph's pool": its own fragmentation included)."""
    shape, batch = cell
    pool = GraphPool.new(device)
    if runners.whole_model is not None:
        graph = runners.whole_model.capture(static_inputs(entry.at(shape), batch, device), pool.handle)
    else:
        graph, _ = build_runner(module, entry.at(shape), device, batch, EngineSettings(policy=policy, buckets=(batch,)), pool)
    mib = pool_mb(pool.handle)
    del graph
    return mib


ORDERS = ("random", "ascending")


def build_order(grid: list[tuple[int, ...]], order: str) -> list[tuple[int, ...]]:
    """The shapes a first-use start builds after the smallest (`grid[0]`), in `order`."""
    if order == "random":
        return random.Random(1).sample(grid[1:], len(grid) - 1)
    if order == "ascending":
        return sorted(grid[1:], key=lambda shape: (math.prod(shape), shape))
    raise ValueError(f"unknown order {order!r}; known: {', '.join(ORDERS)}")


def measure(model: str, variant: str, buckets: tuple[int, ...], lengths: tuple[int, ...], order: str = "load") -> dict:
    policy, _, experiment = variant.partition("/")
    if experiment not in ("", "one-priority"):
        raise SystemExit(f"unknown experiment {experiment!r} in {variant!r}; known: one-priority")
    LanePool.lanes = one_priority_lanes if experiment else ORIGINAL_LANES
    entry = zoo.get(model)
    device = torch.device("cuda")
    module = entry.build().to(device).eval()
    axes = tuple(axis_buckets(axis, lengths) for axis in entry.lengths)
    start = time.perf_counter()
    whole_model = policy == "saved"
    compiler = policy if whole_model else "engine"
    settings = EngineSettings(policy="auto" if whole_model else policy, buckets=buckets)
    capture = "load" if order == "load" else "first_use"
    runners = ObservedRunners(module, entry, device, settings, VarLenSettings(axes, capture=capture, compiler=compiler))
    for shape in [] if order == "load" else build_order(batching.grid(axes), order):
        runners.runner_for(shape)
    seconds = time.perf_counter() - start
    peaks = runners.report.graph_bytes
    largest = max(peaks.values())
    own_pool = largest_alone(runners, module, entry, device, policy, max(peaks, key=peaks.get))
    result = {
        "model": model,
        "policy": variant,
        "order": order,
        "build_seconds": round(seconds, 1),
        "shapes": runners.observed,
        "pool_mib": round(runners.report.pool_bytes / MIB, 1),
        "largest_graph_mib": round(largest / MIB, 1),
        "sum_of_peaks_mib": round(sum(peaks.values()) / MIB, 1),
        "outputs_mib": round(sum(t.numel() * t.element_size() for r in runners.runners.values() for g in getattr(r, "graphs", {}).values() for t in g.outputs) / MIB, 1),
        "pool_over_largest": round(runners.report.pool_bytes / largest, 3),
        "largest_alone_pool_mib": round(own_pool, 1),
        "pool_over_largest_alone": round(runners.report.pool_bytes / MIB / own_pool, 3),
        "cost_table_ms": {f"{','.join(map(str, s))}x{b}": round(v * 1e3, 3) for (s, b), v in runners.costs.seconds.items()},
        "grid": [list(s) for s in batching.grid(axes)],
    }
    del runners, module
    torch.cuda.empty_cache()
    return result


def print_table(result: dict) -> None:
    print(f"\n## {result['model']}, policy {result['policy']}, order {result['order']}: pool {result['pool_mib']} MiB, largest graph {result['largest_graph_mib']} MiB "
          f"(pool / largest {result['pool_over_largest']}; alone in a pool {result['largest_alone_pool_mib']} MiB, "
          f"pool / that {result['pool_over_largest_alone']}), peaks sum {result['sum_of_peaks_mib']} MiB, outputs {result['outputs_mib']} MiB, "
          f"build {result['build_seconds']} s\n")
    print("| after shape | choices (batch: candidate) | pool MiB | by stream: total / in use / free (largest free) MiB |")
    print("|---|---|---:|---|")
    for row in result["shapes"]:
        choices = ", ".join(f"{b}: {c}" for b, c in row["choices"].items())
        streams = "; ".join(f"{k}: {v['total']} / {v['in_use']} / {v['free']} ({v['largest_free']})" for k, v in row["by_stream"].items())
        print(f"| {','.join(map(str, row['shape']))} | {choices} | {row['pool_mib']} | {streams} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert", help="variable-length zoo models (default bert)")
    parser.add_argument("--policies", default="saved,auto,sequential", help="engine policies to build with, or saved, one pool each; suffix /one-priority for the experiment (default saved,auto,sequential)")
    parser.add_argument("--order", default="load", help="load (largest first), or the order first uses build in: random (seed 1), ascending (fewest tokens first); comma-separated for several")
    parser.add_argument("--buckets", default="1,2,4,8,16,32", help="batch buckets (default the served config's)")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTH_BUCKETS)), help="sequence buckets below each axis's limit")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: graph pools exist only there")
    models = [m for m in args.models.split(",") if m]
    for model in models:
        if not zoo.get(model).lengths:
            parser.error(f"{model} has no variable-length axis")
    unknown = sorted(set(args.order.split(",")) - {"load", *ORDERS})
    if unknown:
        parser.error(f"unknown --order {unknown[0]!r}; known: load, {', '.join(ORDERS)}")
    buckets = tuple(int(b) for b in args.buckets.split(","))
    lengths = tuple(int(b) for b in args.lengths.split(","))
    results = []
    for model in models:
        for policy, order in itertools.product(args.policies.split(","), args.order.split(",")):
            results.append(measure(model, policy, buckets, lengths, order))
            print_table(results[-1])
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
