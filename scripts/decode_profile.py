"""Where a decoding step of the served GPT-2 goes, per active-batch bucket.

`python scripts/decode_profile.py --rows 1,13,26,32 --context 128 --json out/decode.json --traces out/decode`

Generation's fourth run (docs/benchmarks.md) found iteration-level scheduling
held back by its step: 3.4 ms over 26 active rows against 3.0 ms over 13 and
1.2 ms for one, so twice the rows bought 1.45x the tokens. This builds the
decoder as the `gpt2` model serves it (GPT-2 small, seeded weights, the
config's slots and context, one CUDA graph per (rows, span) shape of
`generation.graph_buckets` x `generation.step_spans`) and, for each row
count, fills slots 0 to rows - 1 (the scheduler hands out the lowest free
slot) at `--context` positions and measures:

- the whole step as the loop calls it (`SlotDecoder.step`: host table, pinned
  copy in, replay, copy out, event wait), median ms over `--steps` calls;
- the bucket's graph replay alone, and the kernels of a few profiled replays:
  count, summed time, and the heaviest kernels by name (as
  `scripts/kernel_profile.py` reports them).

The difference between the two is the step's host side; the kernels say which
part of the graph grows with the rows (attention over the span, the GEMMs).
`--precision` measures what the same step would take with TF32 matmuls or
bf16 weights (the served model is fp32).

`--streams ROWS` applies the engine's stream planning to the step of ROWS
rows: the step is traced to ATen (make_fx, the cache writes included), its
kernel DAG built with the engine's cost model (`from_graph_module`), planned
with every policy (`plan_graph`) and each plan captured on its lanes
(`PlanCapture`, the engine's capture) and timed against the sequential plan
and the served graph; each plan's tokens must equal the served graph's. The
DAG's parallelism (summed cost over the critical path) bounds what lanes can
gain.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

SCRIPTS = Path(__file__).resolve().parent
REPLAYS = 5


def _kernel_profile():
    """scripts/kernel_profile.py (its replay summary and heaviest-kernel table)."""
    spec = importlib.util.spec_from_file_location("kernel_profile", SCRIPTS / "kernel_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_rows(text: str, slots: int) -> list[int]:
    rows = [int(r) for r in text.split(",") if r]
    if not rows or not all(1 <= r <= slots for r in rows):
        raise ValueError(f"--rows must be row counts from 1 to --slots ({slots}), got {text!r}")
    return rows


class _Replay:
    """A bucket's graph with the `replay()` that bench.profile_replays calls."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.replay = graph.replay


def profile_rows(decoder, rows: int, context: int, steps: int, trace: Path) -> dict[str, Any]:
    from opara_core.bench import profile_replays

    kernels = _kernel_profile()
    slots = list(range(rows))
    tokens = [1] * rows
    lengths = [context] * rows
    bucket = decoder.step_bucket(slots, [context] * rows)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        decoder.step(slots, tokens, lengths)
        times.append((time.perf_counter() - start) * 1000)
    graph = _Replay(bucket.graph)
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay_ms = []
    for _ in range(steps):
        start_event.record()
        graph.replay()
        end_event.record()
        end_event.synchronize()
        replay_ms.append(start_event.elapsed_time(end_event))
    replays = profile_replays(graph, REPLAYS, trace)
    summaries = [kernels.replay_summary(events) for events in replays]
    return {
        "rows": rows,
        "bucket": bucket.shape[0],
        "span": bucket.shape[1],
        "context": context,
        "step_ms": statistics.median(times[steps // 5 :]),  # the first calls warm up
        "replay_ms": statistics.median(replay_ms),
        "kernels": statistics.median(s["kernels"] for s in summaries),
        "kernel_sum_us": statistics.median(s["sum_us"] for s in summaries),
        "busy_us": statistics.median(s["busy_us"] for s in summaries),
        "heaviest": kernels.heaviest(replays),
    }


def step_graph(decoder, rows: int, context: int):
    """The step of `rows` rows at `context` positions as the engine sees it:
    (its OpGraph, traced to ATen with the cache writes, and the bucket it runs on)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from opara_core.engine.trace import from_graph_module

    slots = list(range(rows))
    decoder.step(slots, [1] * rows, [context] * rows)  # fills the bucket's inputs as the loop does
    bucket = decoder.step_bucket(slots, [context] * rows)
    span = bucket.shape[1]
    with torch.no_grad():
        traced = make_fx(lambda i: decoder._step(i[0], i[1], i[2], span, by_slot=True))(bucket.inputs)
    return from_graph_module(traced, name=f"decoding step {rows} x {span}"), bucket


def stream_plans(decoder, rows: int, context: int, max_streams: int) -> dict[str, Any]:
    """The engine's plans of one step on lanes, captured and timed (see the module docstring)."""
    from opara_core.engine.capture import LanePool, PlanCapture, time_replays
    from opara_core.engine.interpreter import plan_graph
    from opara_core.planning import policies

    graph, bucket = step_graph(decoder, rows, context)
    span = bucket.shape[1]
    dag = graph.dag
    bucket.graph.replay()
    expected = bucket.out.clone()
    served_ms = time_replays(_Replay(bucket.graph))
    lane_pool, pool, plans = LanePool(decoder.device), torch.cuda.graph_pool_handle(), []
    for policy in policies.names():
        plan = plan_graph(graph, policy, max_streams)
        with torch.no_grad():  # the traced weights are parameters; the cache is written in place
            captured = PlanCapture(graph, plan, lane_pool)([bucket.inputs], pool)
        captured.replay()
        torch.cuda.synchronize()
        plans.append({
            "policy": policy, "lanes": plan.num_streams, "waits": len(plan.waits), "estimated_us": plan.estimated_us,
            "replay_ms": time_replays(captured), "tokens_equal": bool(torch.equal(captured.outputs[0], expected)),
        })  # fmt: skip
    return {
        "rows": rows, "span": span, "kernels": len(dag), "sequential_us": sum(dag.costs), "critical_path_us": dag.critical_path_us,
        "parallelism": sum(dag.costs) / dag.critical_path_us, "served_graph_ms": served_ms, "plans": plans,
    }  # fmt: skip


def streams_table(result: dict[str, Any]) -> str:
    lines = [
        f"step of {result['rows']} rows x {result['span']} positions: {result['kernels']} kernels, cost model {result['sequential_us']:.0f} us "
        f"in sequence, critical path {result['critical_path_us']:.0f} us (parallelism {result['parallelism']:.2f}); "
        f"the served graph replays in {result['served_graph_ms']:.3f} ms",
        "| policy | lanes | waits | estimated us | replay ms | tokens equal |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for p in result["plans"]:
        lines.append(f"| {p['policy']} | {p['lanes']} | {p['waits']} | {p['estimated_us']:.0f} | {p['replay_ms']:.3f} | {p['tokens_equal']} |")
    return "\n".join(lines)


def table(results: list[dict[str, Any]]) -> str:
    head = ["rows", "bucket", "span", "step ms", "replay ms", "host ms", "kernels", "kernel sum us", "busy us"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["rows"], r["bucket"], r["span"], f"{r['step_ms']:.3f}", f"{r['replay_ms']:.3f}"]
        cells += [f"{r['step_ms'] - r['replay_ms']:.3f}", f"{r['kernels']:.0f}", f"{r['kernel_sum_us']:.0f}", f"{r['busy_us']:.0f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,13,16,26,32", help="active rows to measure (each runs on its bucket)")
    parser.add_argument("--slots", type=int, default=32, help="the model's max_active (default 32)")
    parser.add_argument("--max-context", type=int, default=512, help="the model's max_context (default 512)")
    parser.add_argument("--context", type=int, default=128, help="positions already in each active row's cache (default 128)")
    parser.add_argument("--steps", type=int, default=50, help="timed calls per row count (default 50)")
    parser.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32",
                        help="fp32 (as served), fp32 with TF32 matmuls, or bf16 weights and cache")
    parser.add_argument("--streams", type=int, default=0, metavar="ROWS", help="also plan the step of ROWS rows on lanes (see above)")
    parser.add_argument("--max-streams", type=int, default=4, help="lanes a --streams plan may use (default 4)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--traces", type=Path, default=Path("out/decode_profile"), help="directory for the chrome traces")
    args = parser.parse_args(argv)
    try:
        rows = parse_rows(args.rows, args.slots)
        if not 1 <= args.context < args.max_context:
            raise ValueError(f"--context must be from 1 to --max-context - 1 ({args.max_context - 1}), got {args.context}")
        if args.steps < 5:
            raise ValueError(f"--steps must be at least 5, got {args.steps}")
        if not 0 <= args.streams <= args.slots:
            raise ValueError(f"--streams must be a row count from 1 to --slots ({args.slots}), or 0 for none; got {args.streams}")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the decoding profile needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(SCRIPTS.parent))
    from opara_core.models.gpt2 import SlotDecoder
    from opara_core.serving.generation import graph_buckets, small_gpt2, step_spans

    device = torch.device("cuda")
    lm = small_gpt2({}).lm  # GPT-2 small, seeded as the zoo seeds it
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    if args.precision == "bf16":
        lm = lm.to(torch.bfloat16)
    start = time.perf_counter()
    decoder = SlotDecoder(lm, args.slots, args.max_context, device, graph_buckets(args.slots), capture=True, spans=step_spans(args.max_context))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, GPT-2 small {args.precision}, {args.slots} slots x {args.max_context} positions, "
          f"{len(decoder.buckets)} (rows, span) shapes captured in {time.perf_counter() - start:.1f} s; every row at {args.context} positions")
    args.traces.mkdir(parents=True, exist_ok=True)
    results, streams = [], None

    def save() -> None:
        if args.json:
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "precision": args.precision, "command": " ".join(sys.argv)}
            args.json.write_text(json.dumps({"meta": meta, "results": results, "streams": streams}, indent=1))

    for count in rows:
        results.append(profile_rows(decoder, count, args.context, args.steps, args.traces / f"decode_rows{count}.trace.json"))
        save()
    print(table(results))
    if args.streams:
        streams = stream_plans(decoder, args.streams, args.context, args.max_streams)
        save()
        print(streams_table(streams))
    kernels = _kernel_profile()
    for r in results:
        kernels.print_heaviest(f"{r['rows']} rows (bucket {r['bucket']} x {r['span']})", r["heaviest"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
