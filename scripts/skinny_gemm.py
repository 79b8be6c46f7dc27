"""Small-M fp32 GEMMs: cuBLAS against `engine.skinny_gemm`'s split-K Triton kernel (GPU only).

For every (M, K, N) of the served models' linear layers at small batch (BERT
and T5 at a few token counts, DeepFM at batch 1, 8, 32): each kernel
configuration is timed inside one CUDA graph that cycles through enough
copies of the weight to miss L2 (as a model's layers do), against
`torch.addmm` (cuBLAS) on the same copies; error against a float64 product.
Then whole models, eager in a CUDA graph, with their nn.Linear layers of at
most --max-rows rows switched to the best configuration found, against the
same models unswitched: the end-to-end effect and the outputs' difference.

    python scripts/skinny_gemm.py --json $OUT/skinny_gemm.json

Prints tables and writes JSON. Refuses to run without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opara_core import zoo  # noqa: E402
from opara_core.engine.skinny_gemm import SkinnyConfig, skinny_addmm, slices  # noqa: E402

BERT = ((768, 2304), (768, 768), (768, 3072), (3072, 768))
T5 = ((512, 1536), (512, 512), (512, 1024), (512, 2048), (2048, 512))
DEEPFM = ((429, 400), (400, 400), (400, 1))
SHAPES = (
    [(m, k, n) for m in (16, 32, 128) for k, n in BERT]
    + [(m, k, n) for m in (32, 128) for k, n in T5]
    + [(m, k, n) for m in (1, 8, 32) for k, n in DEEPFM]
)
L2_MISS_BYTES = 256 * 2**20


def per_call_ms(calls: list, replays: int = 20, repeats: int = 5) -> float:
    """Median ms per call of `calls` captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays / len(calls))
    del graph
    return statistics.median(samples)


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30))


def configs(m: int, k: int, n: int, quick: bool) -> list[SkinnyConfig]:
    found, seen = [], set()
    widths = [b for b in (16, 32, 64, 128) if b <= max(16, 1 << (n - 1).bit_length())]
    for block_n, block_k, split in itertools.product(widths, (32, 64, 128) if not quick else (64,), (1, 2, 4, 8, 16)):
        config = SkinnyConfig(block_n, block_k, split)
        key = (block_n, block_k, slices(k, config))
        if key not in seen and block_k <= max(32, k):
            seen.add(key)
            found.append(config)
    return found


def sweep(m: int, k: int, n: int, quick: bool) -> dict:
    """Every configuration of one shape timed in both weight layouts (as nn.Linear
    stores it, [N, K], and stored transposed, [K, N]), the best of each refined
    over warps and stages; against cuBLAS's addmm (eager's call: cuBLASLt with
    the bias in its epilogue) and mm (Inductor's call: the bias added by a
    generated kernel, not timed here)."""
    x = torch.randn(m, k, device="cuda")
    copies = max(8, min(32, L2_MISS_BYTES // (k * n * 4)))
    weights = [torch.randn(n, k, device="cuda") / k**0.5 for _ in range(copies)]
    layouts = {"nk": [w.t() for w in weights], "kn": [w.t().contiguous() for w in weights]}
    bias = torch.randn(n, device="cuda")
    row = {
        "shape": [m, k, n],
        "weight_copies": copies,
        "cublas_addmm_ms": per_call_ms([lambda w=w: torch.addmm(bias, x, w.t()) for w in weights]),
        "cublas_mm_ms": per_call_ms([lambda w=w: torch.mm(x, w.t()) for w in weights]),
    }
    exact = torch.addmm(bias.double(), x.double(), weights[0].t().double())
    row["error_cublas"] = relative_error(torch.addmm(bias, x, weights[0].t()), exact)
    for layout, stored in layouts.items():
        timed = {}

        def time_config(config: SkinnyConfig, precision: str = "ieee", **kwargs) -> float:
            return per_call_ms([lambda w=w: skinny_addmm(x, w, bias, config, precision) for w in stored], **kwargs)

        for config in configs(m, k, n, quick):
            timed[config] = time_config(config, replays=5, repeats=3)
        top = sorted(timed, key=timed.get)[:3]
        for base, warps, stages in itertools.product(top, (2, 4, 8), (2, 3, 4)):
            config = SkinnyConfig(base.block_n, base.block_k, base.split_k, warps, stages)
            if config not in timed:
                timed[config] = time_config(config, replays=5, repeats=3)
        best = min(timed, key=timed.get)
        row[layout] = {
            "best": vars(best),
            "ms": time_config(best),
            "tf32x3_ms": time_config(best, "tf32x3"),
            "error": relative_error(skinny_addmm(x, stored[0], bias, best), exact),
            "error_tf32x3": relative_error(skinny_addmm(x, stored[0], bias, best, "tf32x3"), exact),
            "configs_timed": len(timed),
            "top5": [[vars(c), timed[c]] for c in sorted(timed, key=timed.get)[:5]],
        }
    return row


class SkinnyLinears:
    """Switches a module's nn.Linear layers to skinny_addmm for inputs of at most `max_rows` rows."""

    def __init__(self, module: torch.nn.Module, choose, max_rows: int):
        self.layers = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        self.choose, self.max_rows, self.shapes = choose, max_rows, set()

    def __enter__(self):
        for layer in self.layers:
            layer.forward = self._forward(layer)
        return self

    def __exit__(self, *exc):
        for layer in self.layers:
            del layer.forward

    def _forward(self, layer):
        def forward(x):
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] > self.max_rows:
                return torch.nn.functional.linear(x, layer.weight, layer.bias)
            shape = (rows.shape[0], layer.in_features, layer.out_features)
            self.shapes.add(shape)
            out = skinny_addmm(rows, layer.weight.t(), layer.bias, self.choose(shape))
            return out.reshape(*x.shape[:-1], layer.out_features)

        return forward


def models_table(choose, max_rows: int) -> list[dict]:
    rows = []
    cases = [("bert", (16,), 1), ("bert", (32,), 1), ("bert", (128,), 1), ("t5", None, 1), ("deepfm", None, 1), ("deepfm", None, 8), ("deepfm", None, 32)]
    for name, lengths, batch in cases:
        entry = zoo.get(name)
        entry = entry.at(lengths) if lengths else entry
        module = entry.build().cuda().eval()
        inputs = [t.cuda() for t in entry.example_inputs(batch)]
        with torch.inference_mode():
            plain = per_call_ms([lambda: module(*inputs)], replays=10)
            expected = module(*inputs)
            with SkinnyLinears(module, choose, max_rows) as switched:
                got = module(*inputs)  # outside any capture: sweeps the shapes not swept yet
                skinny = per_call_ms([lambda: module(*inputs)], replays=10)
        expected, got = (t[0] if isinstance(t, tuple) else t for t in (expected, got))
        error = float((got - expected).abs().max() / expected.abs().max())
        rows.append({"model": name, "lengths": lengths, "batch": batch, "eager_graph_ms": plain, "skinny_graph_ms": skinny,
                     "saved_ms": plain - skinny, "relative_error": error, "skinny_shapes": sorted(switched.shapes)})
        print(f"{name:7} {str(lengths or ''):7} b{batch:<3} eager graph {plain:7.3f} ms  skinny {skinny:7.3f} ms  "
              f"saved {plain - skinny:6.3f} ms  error {error:.1e}  ({len(switched.shapes)} shapes switched)", flush=True)
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="BLOCK_K 64 only")
    parser.add_argument("--max-rows", type=int, default=64, help="models: switch linears of at most this many rows")
    parser.add_argument("--no-models", action="store_true")
    parser.add_argument("--shapes", help="MxKxN,... instead of the built-in list")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("skinny_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": [], "models": []}
    found: dict[tuple, SkinnyConfig] = {}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    print(f"{'M':>4} {'K':>5} {'N':>5} {'addmm us':>8} {'mm us':>7} {'NK us':>7} {'KN us':>7} {'KN x mm':>7} {'KN tf32x3':>9}  best KN config  err cuBLAS / KN / KN tf32x3")
    for m, k, n in shapes:
        row = sweep(m, k, n, args.quick)
        found[(m, k, n)] = SkinnyConfig(**row["nk"]["best"])
        result["shapes"].append(row)
        kn, b = row["kn"], row["kn"]["best"]
        print(f"{m:4} {k:5} {n:5} {row['cublas_addmm_ms'] * 1e3:8.2f} {row['cublas_mm_ms'] * 1e3:7.2f} {row['nk']['ms'] * 1e3:7.2f} {kn['ms'] * 1e3:7.2f} "
              f"{row['cublas_mm_ms'] / kn['ms']:7.2f} {kn['tf32x3_ms'] * 1e3:9.2f}  n{b['block_n']} k{b['block_k']} s{b['split_k']} w{b['num_warps']} st{b['num_stages']}  "
              f"{row['error_cublas']:.1e} / {kn['error']:.1e} / {kn['error_tf32x3']:.1e}", flush=True)

    def choose(shape):
        if shape not in found:
            found[shape] = SkinnyConfig(**sweep(*shape, quick=True)["nk"]["best"])
        return found[shape]

    if not args.no_models:
        result["models"] = models_table(choose, args.max_rows)
    result["seconds"] = time.perf_counter() - start
    print(f"done in {result['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
