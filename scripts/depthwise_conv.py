"""A model's depthwise convolutions: cuDNN (its heuristics, as fused lanes capture)
against each tile of the engine's Triton kernel (engine.depthwise_conv), at every
distinct shape and batch size, on a GPU. Each candidate's answer is checked
against a float64 convolution before it is timed; times are per call, calls
captured back to back in one CUDA graph. Prints a table per batch size (the sums
weigh each shape by how often the model runs it) and writes JSON.

    python scripts/depthwise_conv.py --models nasnet --batch 1,8,32 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def depthwise_shapes(model: str) -> collections.Counter:
    """(C, H, W, kernel, stride, padding, dilation) -> calls per forward, from the
    eager model's convolutions with one filter per channel (batch 1, on the GPU)."""
    import torch

    from opara_core import zoo

    entry = zoo.get(model)
    module = entry.build().cuda().eval()
    found: collections.Counter = collections.Counter()

    def hook(conv, inputs, output):
        if conv.groups == conv.in_channels == conv.out_channels and not isinstance(conv.padding, str):
            _, c, h, w = inputs[0].shape
            found[(c, h, w, tuple(conv.kernel_size), tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation))] += 1

    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.inference_mode():
        module(*(t.cuda() for t in entry.example_inputs(1)))
    for handle in handles:
        handle.remove()
    return found


def sweep(shapes: collections.Counter, batch: int) -> dict:
    import torch

    from opara_core.engine import depthwise_conv as dw

    rows, totals = [], collections.defaultdict(float)
    for (c, h, w, k, stride, padding, dilation), count in sorted(shapes.items(), key=lambda kv: -kv[1]):
        generator = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(batch, c, h, w, device="cuda", generator=generator).contiguous(memory_format=torch.channels_last)
        weight = torch.randn(c, 1, *k, device="cuda", generator=generator)
        start = time.perf_counter()
        timings, errors = dw.time_shape(x, weight, None, stride, padding, dilation)
        seconds = time.perf_counter() - start
        tiles = {config: ms for config, ms in timings.items() if config != dw.CUDNN}
        best = min(tiles, key=tiles.get, default=None)
        print(f"  batch {batch} {c}x{h}x{w} {k} stride {stride}: cuDNN {timings[dw.CUDNN] * 1e3:.1f} us, best tile "
              + ("none" if best is None else f"{tiles[best] * 1e3:.1f} us {best}") + f" ({seconds:.1f} s to compile, check and time)", file=sys.stderr, flush=True)  # fmt: skip
        rows.append({
            "shape": [batch, c, h, w], "kernel": list(k), "stride": list(stride), "padding": list(padding), "dilation": list(dilation),
            "calls": count, "cudnn_us": timings[dw.CUDNN] * 1e3, "best": None if best is None else vars(best),
            "best_us": None if best is None else tiles[best] * 1e3, "seconds": seconds,
            "tiles": [{"config": vars(config), "us": None if config not in timings else timings[config] * 1e3,
                       "error": errors[config]} for config in dw.CANDIDATES],
            "error_cudnn": errors[dw.CUDNN],
        })  # fmt: skip
        totals["cudnn"] += count * timings[dw.CUDNN] * 1e3
        totals["best"] += count * min(timings.values()) * 1e3
        out = dw.output_size(h, k[0], stride[0], padding[0], dilation[0]) * dw.output_size(w, k[1], stride[1], padding[1], dilation[1])
        totals["bytes"] += count * batch * c * (h * w + out) * 4  # each input read and output written once
    return {"batch": batch, "rows": rows, "sum_us": dict(totals)}


def table(result: dict) -> str:
    lines = [f"batch {result['batch']}: all calls, cuDNN {result['sum_us']['cudnn']:.0f} us, "
             f"the faster per shape {result['sum_us']['best']:.0f} us ({result['sum_us']['cudnn'] / result['sum_us']['best']:.2f}x); "
             f"their inputs read and outputs written once: {result['sum_us']['bytes'] / 1e9:.2f} GB",
             "| C x H x W | kernel | stride | calls | cuDNN us | best tile us | speedup | best tile |", "|---|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for row in result["rows"]:
        best = row["best_us"]
        lines.append(f"| {' x '.join(map(str, row['shape'][1:]))} | {row['kernel']} | {row['stride']} | {row['calls']} | {row['cudnn_us']:.1f} | "
                     + (f"{best:.1f} | {row['cudnn_us'] / best:.2f}x | {row['best']}" if best else "- | - | none answered right") + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="nasnet", help="zoo models, comma-separated (default nasnet)")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: the depthwise sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "command": sys.argv, "models": {}}  # fmt: skip
    start = time.perf_counter()
    for model in args.models.split(","):
        shapes = depthwise_shapes(model)
        if not shapes:
            print(f"{model}: no depthwise convolutions")
            continue
        print(f"{model}: {sum(shapes.values())} depthwise convolutions, {len(shapes)} distinct shapes", flush=True)
        result["models"][model] = []
        for batch in (int(b) for b in args.batch.split(",")):
            result["models"][model].append(sweep(shapes, batch))
            print(table(result["models"][model][-1]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    result["seconds"] = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
