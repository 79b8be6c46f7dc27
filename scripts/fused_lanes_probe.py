"""Probe fused lanes on the GPU: per model and batch, the ATen plans, the same
plans with each segment compiled by Inductor, and torch.compile (freezing,
replayed from a CUDA graph), all timed in this run; JSON to --json.

`python scripts/fused_lanes_probe.py --models googlenet,bert --batch 1,8 --json out.json`

`--variants nchw/static,nchw/dynamic,nhwc/dynamic` compiles the Inductor graph in
several ways (NHWC: channels-last convolution weights; dynamic: the batch
dimension as a symbol from the second batch size on); each capture object is
kept across the batch sizes, as a serving build does, so `build_s` per batch
shows what each batch compiled.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from opara_core import zoo
from opara_core.bench import Row, _time_compiled, graph_call, rotating_inputs, time_calls
from opara_core.engine.build import channels_last_graph, static_inputs
from opara_core.engine.capture import LanePool, PlanCapture
from opara_core.engine.compare import max_relative_error
from opara_core.engine.fused_lanes import InductorCapture
from opara_core.engine.fusion import fuse_graph
from opara_core.engine.interpreter import plan_graph
from opara_core.engine.trace import trace_zoo

PLANS = (("sequential", 1), ("opara", 8), ("asap", 4), ("wavefront", 8))
INDUCTOR_PASSES = ("drop_identities", "cse", "fold_batchnorm")


def probe(name: str, batches: list[int], plans, compile_peer: bool, variants=(("nchw", "static"),)) -> list[dict]:
    device = torch.device("cuda")
    entry = zoo.get(name)
    torch.backends.cudnn.benchmark = True
    module = entry.build().to(device).eval()
    traced = trace_zoo(entry, module, device)
    checks = [tuple(t.to(device) for t in entry.example_inputs(b, seed=7)) for b in sorted({1, max(batches)})]
    graphs = {"aten": fuse_graph(traced, device, check_inputs=checks)[0]}
    inductor = fuse_graph(traced, device, passes=INDUCTOR_PASSES, check_inputs=checks)[0]
    # the Inductor graph in each (layout, shapes) variant: "inductor", "inductor-nhwc-dynamic", ...
    shapes_of = {}
    for layout, shapes in variants:
        kind = "-".join(["inductor"] + [layout] * (layout == "nhwc") + [shapes] * (shapes == "dynamic"))
        graphs[kind] = channels_last_graph(inductor) if layout == "nhwc" else inductor
        shapes_of[kind] = shapes
    lane_pool = LanePool(device)
    rows = []
    captures = {}
    for kind, graph in graphs.items():
        for policy, lanes in plans:
            plan = plan_graph(graph, policy, lanes)
            start = time.perf_counter()
            try:
                captures[(kind, policy, plan.num_streams)] = (
                    InductorCapture(graph, plan, lane_pool, shapes=shapes_of[kind]) if kind in shapes_of else PlanCapture(graph, plan, lane_pool)
                )
            except Exception as error:  # noqa: BLE001
                print(f"{name} {kind} {policy}: split failed: {error}", flush=True)
                continue
            print(f"{name} {kind} {policy}/{plan.num_streams}: {len(plan.order)} kernels, "
                  f"{getattr(captures[(kind, policy, plan.num_streams)], 'segments', len(plan.order))} pieces, {time.perf_counter() - start:.1f} s", flush=True)
    for batch in batches:
        inputs = rotating_inputs(entry, batch, device)
        row = {"model": name, "batch": batch, "ms": {}, "build_s": {}, "error": {}, "notes": []}
        with torch.inference_mode():
            expected = module(*inputs[0])
        expected = expected if isinstance(expected, (tuple, list)) else (expected,)
        for key, capture in captures.items():
            label = "%s:%s/%d" % key
            start = time.perf_counter()
            try:
                static_in = static_inputs(entry, batch, device)  # normal tensors: graph_call copies into them
                with torch.inference_mode():
                    captured = capture(static_in, torch.cuda.graph_pool_handle())
                row["build_s"][label] = time.perf_counter() - start
                graph_call(captured, inputs)(0)
                torch.cuda.synchronize()
                row["error"][label] = max_relative_error([o.float() for o in captured.outputs], [e.float() for e in expected])
                row["ms"][label] = time_calls(graph_call(captured, inputs)).median_ms
                del captured
            except Exception as error:  # noqa: BLE001
                row["notes"].append(f"{label}: {type(error).__name__}: {str(error)[:300]}")
            print(name, batch, label, row["ms"].get(label), row["error"].get(label), row["build_s"].get(label), flush=True)
        if compile_peer:
            peer = Row(name, batch)
            timing = _time_compiled(module, inputs, peer, "default")
            row["ms"]["torch.compile"] = timing.median_ms if timing else None
            row["notes"] += peer.notes
            print(name, batch, "torch.compile", row["ms"]["torch.compile"], peer.notes, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="googlenet")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--plans", default=",".join(f"{p}/{n}" for p, n in PLANS))
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--variants", default="nchw/static", help="Inductor graph variants, layout/shapes: e.g. nchw/static,nchw/dynamic,nhwc/dynamic")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    plans = [(p.split("/")[0], int(p.split("/")[1])) for p in args.plans.split(",")]
    rows = []
    for name in args.models.split(","):
        variants = [tuple(v.split("/")) for v in args.variants.split(",")]
        rows += probe(name, [int(b) for b in args.batch.split(",")], plans, not args.no_compile, variants)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
