"""Where one replay's time goes: torch.compile's graph against auto's, kernel by kernel.

`python scripts/kernel_profile.py --models bert,t5 --batch 1 --json out/kernels.json --traces out/`

For each model and batch, the bench's torch.compile column (freezing, inference
mode, one CUDA graph; with `--compile-mode max-autotune-no-cudagraphs` its
max-autotune column) and the graph `auto` builds for that bucket as serving
does (fused lanes among the candidates) are replayed under the profiler. Per
replay (median of the profiled ones): kernels launched, the sum of their
durations, the time the GPU had at least one of them running (busy), the span
from the first kernel's start to the last one's end, and the sum split into
Inductor's generated kernels (`triton_*`), library GEMMs and convolutions
(cuBLAS, cuDNN, CUTLASS) and the rest (ATen's own kernels, copies). The heaviest
kernels of each graph by summed time follow. A gap between the two graphs in
one class says which kernels cost the difference: a profile, not a guess.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from opara_core import zoo
from opara_core.bench import auto_graph, compiled_graph, draw_timeline, profile_replays, rotating_inputs
from opara_core.engine.capture import time_replays

LIBRARY = re.compile(r"gemm|gemv|cutlass|xmma|cublas|cudnn|conv|winograd|implicit|sm\d\d_|nvjet", re.IGNORECASE)
REPLAYS = 5
TOP = 8


def kind(name: str) -> str:
    """Inductor-generated, a library call, or ATen's own (and copies)."""
    if name.startswith("triton"):
        return "triton"
    return "library" if LIBRARY.search(name) else "aten"


def replay_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and microseconds of one replay's device events."""
    busy, end = 0.0, float("-inf")
    for e in events:  # sorted by start: the union of the intervals
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    by_kind: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by_kind[kind(e["name"])].append(e["dur"])
    return {
        "kernels": len(events),
        "sum_us": sum(e["dur"] for e in events),
        "busy_us": busy,
        "span_us": max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events),
        "streams": len({e["args"].get("stream", e.get("tid")) for e in events}),
        "kinds": {k: {"count": len(v), "us": sum(v)} for k, v in sorted(by_kind.items())},
    }


def heaviest(replays: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The kernels with the most summed time per replay, grouped by name."""
    total: dict[str, list[float]] = defaultdict(list)
    for events in replays:
        for e in events:
            total[e["name"]].append(e["dur"])
    rows = [{"name": name, "kind": kind(name), "calls": len(d) // len(replays), "us": sum(d) / len(replays)} for name, d in total.items()]
    return sorted(rows, key=lambda r: -r["us"])[:TOP]


def print_heaviest(title: str, kernels: list[dict[str, Any]]) -> None:
    print(f"\n{title}: heaviest kernels (us per replay, calls)")
    for k in kernels:
        print(f"  {k['us']:8.1f}  {k['calls']:4d}  {k['kind']:8s}  {k['name'][:110]}")


def profile_graph(captured, label: str, trace: Path, timeline: Path | None, title: str) -> dict[str, Any]:
    replays = profile_replays(captured, REPLAYS, trace)
    summaries = [replay_summary(events) for events in replays]
    if timeline is not None and replays:
        draw_timeline(replays[0], title, timeline)
    median = {key: statistics.median(s[key] for s in summaries) for key in ("kernels", "sum_us", "busy_us", "span_us", "streams")}
    kinds = summaries[len(summaries) // 2]["kinds"]  # the middle replay's
    return {"label": label, "replay_ms": time_replays(captured, seconds=0.1), **median, "kinds": kinds, "heaviest": heaviest(replays)}


def profile_model(name: str, batch: int, max_streams: int, traces: Path, timeline: bool, mode: str = "default", lanes_autotune: bool = False) -> dict[str, Any]:
    device = torch.device("cuda")
    entry = zoo.get(name)
    torch.backends.cudnn.benchmark = True
    module = entry.build().to(device).eval()
    inputs = rotating_inputs(entry, batch, device)
    results = []
    compiled = compiled_graph(module, inputs, mode)
    label = "compile" if mode == "default" else f"compile {mode}"
    results.append(profile_graph(compiled, label, traces / f"{name}_b{batch}_{label.replace(' ', '_')}.trace.json", None, ""))
    del compiled
    auto, choice = auto_graph(name, batch, max_streams, fusion=True, fused_lanes_autotune=lanes_autotune)
    with torch.inference_mode():  # the runner's static inputs are inference tensors
        for static, x in zip(auto.inputs, inputs[0]):
            static.copy_(x)
    png = traces / f"{name}_b{batch}_auto_timeline.png" if timeline else None
    title = f"{name} batch {batch}: auto ({choice}) graph replay, kernels per stream"
    results.append(profile_graph(auto, f"auto ({choice})", traces / f"{name}_b{batch}_auto.trace.json", png, title))
    return {"model": name, "batch": batch, "graphs": results}


def table(models: list[dict[str, Any]]) -> str:
    head = ["model", "batch", "graph", "replay ms", "kernels", "sum us", "busy us", "span us", "streams", "triton us (n)", "library us (n)", "aten us (n)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in models:
        for g in m["graphs"]:
            cells = [m["model"], str(m["batch"]), g["label"], f"{g['replay_ms']:.3f}", f"{g['kernels']:.0f}"]
            cells += [f"{g[k]:.0f}" for k in ("sum_us", "busy_us", "span_us")] + [f"{g['streams']:.0f}"]
            for k in ("triton", "library", "aten"):
                v = g["kinds"].get(k)
                cells.append("-" if v is None else f"{v['us']:.0f} ({v['count']})")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert,t5")
    parser.add_argument("--batch", default="1")
    parser.add_argument("--max-streams", type=int, default=8)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--traces", type=Path, default=Path("out/kernel_profile"), help="directory for the chrome traces (and timelines)")
    parser.add_argument("--timeline", action="store_true", help="also draw each auto replay's kernels per stream (PNG)")
    parser.add_argument("--compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"), help="torch.compile's mode for the compile graph")
    parser.add_argument("--fused-lanes-autotune", default="", help="models whose auto graph times its fused lanes' convolution algorithms (engine setting fused_lanes_autotune)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the kernel profile needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        jobs = [(zoo.get(m).name, int(b)) for m in args.models.split(",") for b in args.batch.split(",")]
        lanes_autotune = {zoo.get(m).name for m in filter(None, args.fused_lanes_autotune.split(","))}
    except (KeyError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.traces.mkdir(parents=True, exist_ok=True)
    models = []
    for name, batch in jobs:
        models.append(profile_model(name, batch, args.max_streams, args.traces, args.timeline, args.compile_mode, name in lanes_autotune))
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "models": models}, indent=1))
    print(table(models))
    for m in models:
        for g in m["graphs"]:
            print_heaviest(f"{m['model']} b{m['batch']} {g['label']}", g["heaviest"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
