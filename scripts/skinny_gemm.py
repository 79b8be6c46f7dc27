"""Small-M fp32 GEMMs: cuBLAS against `engine.skinny_gemm`'s split-K Triton kernel (GPU only).

For every (M, K, N) of the served models' linear layers at small batch (BERT
and T5 at a few token counts, DeepFM at batch 1, 8, 32), each kernel
configuration of a sweep is timed inside one CUDA graph that cycles through
enough copies of the weight to miss L2 (as a model's layers do), with the
weight as nn.Linear stores it ([N, K]) and stored transposed ([K, N], for
comparison), against cuBLAS: `torch.mm(x, w.t())` (what Inductor's graphs
call) and `torch.addmm(b, x, w.t())` (eager's call: cuBLASLt with the bias in
its epilogue). Then what the engine's chooser (`skinny_gemm.CANDIDATES`,
`best_of`) picks at the shape. Error against a float64 product.

With --large, the shapes above the split-K kernel's MAX_ROWS (BERT and T5 at
batch 8 and 32: 1,024 and 4,096 rows, or --shapes): cuBLAS on either weight
layout against tensor-core tiles with tf32x3 products (`LARGE_CANDIDATES` and
a grid around them, each on either copy of the weight), and the chooser's
pick among LARGE_CANDIDATES.

    python scripts/skinny_gemm.py --json $OUT/skinny_gemm.json [--shapes 16x768x768,...] [--quick]
    python scripts/skinny_gemm.py --large --json $OUT/large_gemm.json [--shapes 4096x3072x768,...] [--quick]

Prints a table and writes JSON. Refuses to run without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opara_core.engine.shape_choices import per_call_ms, relative_error  # noqa: E402
from opara_core.engine.skinny_gemm import (  # noqa: E402
    CUBLAS,
    LARGE_CANDIDATES,
    MAX_ROWS,
    SkinnyConfig,
    best_of,
    skinny_mm,
    slices,
    time_shape,
    weight_copies,
)

BERT = ((768, 2304), (768, 768), (768, 3072), (3072, 768))
T5 = ((512, 1536), (512, 512), (512, 1024), (512, 2048), (2048, 512))
DEEPFM = ((429, 400), (400, 400))
SHAPES = (
    [(m, k, n) for m in (16, 32, 128) for k, n in BERT]
    + [(m, k, n) for m in (32, 128) for k, n in T5]
    + [(m, k, n) for m in (1, 8, 32) for k, n in DEEPFM]
)
LARGE = [(m, k, n) for m in (1024, 4096) for k, n in BERT + T5]


def configs(k: int, n: int, quick: bool) -> list[SkinnyConfig]:
    """The sweep: tile widths, K steps and slices, one per distinct slicing."""
    found, seen = [], set()
    widths = [b for b in (16, 32, 64, 128) if b <= max(16, 1 << (n - 1).bit_length())]
    for block_n, block_k, split in itertools.product(widths, (64,) if quick else (32, 64, 128), (1, 2, 4, 8, 16)):
        config = SkinnyConfig(block_n, block_k, split)
        key = (block_n, block_k, slices(k, config))
        if key not in seen:
            seen.add(key)
            found.append(config)
    return found


def sweep(m: int, k: int, n: int, quick: bool) -> dict:
    """Every configuration timed in both weight layouts, the best of each refined over warps and stages."""
    x = torch.randn(m, k, device="cuda")
    weights = weight_copies(n, k, x.device)
    bias = torch.randn(n, device="cuda")
    exact = x.double() @ weights[0].t().double()
    row = {
        "shape": [m, k, n],
        "weight_copies": len(weights),
        "cublas_mm_ms": per_call_ms([lambda w=w: torch.mm(x, w.t()) for w in weights], seconds=0.02, repeats=5),
        "cublas_addmm_ms": per_call_ms([lambda w=w: torch.addmm(bias, x, w.t()) for w in weights], seconds=0.02, repeats=5),
        "error_cublas": relative_error(torch.mm(x, weights[0].t()), exact),
    }
    # stored transposed, [K, N] (the kernel's layout), and as nn.Linear stores it, [N, K] (passed as its [K, N] view)
    for layout, stored in (("kn", [w.t().contiguous() for w in weights]), ("nk", [w.t() for w in weights])):
        timed = {}

        def time_config(config: SkinnyConfig, **kwargs) -> float:
            return per_call_ms([lambda w=w: skinny_mm(x, w, config) for w in stored], **kwargs)

        for config in configs(k, n, quick):
            timed[config] = time_config(config)
        for base, warps, stages in itertools.product(sorted(timed, key=timed.get)[:3], (2, 4, 8), (2, 3, 4)):
            config = SkinnyConfig(base.block_n, base.block_k, base.split_k, warps, stages)
            if config not in timed:
                timed[config] = time_config(config)
        best = min(timed, key=timed.get)
        row[layout] = {
            "best": asdict(best),
            "ms": time_config(best, seconds=0.02, repeats=5),
            "error": relative_error(skinny_mm(x, stored[0], best), exact),
            "configs_timed": len(timed),
            "top5": [[asdict(c), timed[c]] for c in sorted(timed, key=timed.get)[:5]],
        }
    chooser = time_shape(m, k, n, x.device)
    chosen = best_of(chooser)
    row["chooser"] = {"config": asdict(chosen) if isinstance(chosen, SkinnyConfig) else chosen, "ms": chooser[chosen], "cublas_ms": chooser["cublas"]}
    return row


def large_configs(quick: bool) -> list[SkinnyConfig]:
    """tf32x3 tiles around LARGE_CANDIDATES (with --quick those only): heights,
    widths, warps, stages, either copy of the weight."""
    if quick:
        return list(LARGE_CANDIDATES)
    grid = [
        SkinnyConfig(n, 32, 1, num_warps=w, num_stages=st, block_m=m, precision="tf32x3", weight_layout=layout)
        for m, n, w, st, layout in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4), ("nk", "kn"))
        if m * n <= 128 * 128 or w == 8  # a 128 x 256 accumulator needs eight warps' registers
    ]
    return list(dict.fromkeys([*LARGE_CANDIDATES, *grid]))


def sweep_large(m: int, k: int, n: int, quick: bool) -> dict:
    """cuBLAS on both weight layouts against every tf32x3 tile that builds, with errors."""
    x = torch.randn(m, k, device="cuda")
    weights = weight_copies(n, k, x.device)
    stored = {"nk": [w.t() for w in weights], "kn": [w.t().contiguous() for w in weights]}
    exact = x.double() @ weights[0].t().double()
    row = {
        "shape": [m, k, n],
        "cublas_mm_ms": per_call_ms([lambda w=w: torch.mm(x, w) for w in stored["nk"]], seconds=0.02, repeats=5),
        "cublas_nn_ms": per_call_ms([lambda w=w: torch.mm(x, w) for w in stored["kn"]], seconds=0.02, repeats=5),
        "error_cublas": relative_error(torch.mm(x, stored["nk"][0]), exact),
        "tiles": [],
    }
    for config in large_configs(quick):
        try:
            error = relative_error(skinny_mm(x, stored[config.weight_layout][0], config), exact)
        except Exception as failure:  # noqa: BLE001 - a tile this GPU cannot build is reported, not fatal
            row["tiles"].append({"config": asdict(config), "failed": f"{type(failure).__name__}: {str(failure)[:120]}"})
            continue
        ms = per_call_ms([lambda w=w, c=config: skinny_mm(x, w, c) for w in stored[config.weight_layout]])
        row["tiles"].append({"config": asdict(config), "ms": ms, "error": error})
    timed = [t for t in row["tiles"] if "ms" in t]
    row["best"] = min(timed, key=lambda t: t["ms"]) if timed else None
    chooser = time_shape(m, k, n, x.device)
    chosen = best_of(chooser)
    row["chooser"] = {"config": asdict(chosen) if isinstance(chosen, SkinnyConfig) else chosen, "ms": chooser[chosen], "cublas_ms": chooser[CUBLAS]}
    return row


def print_large(row: dict) -> None:
    m, k, n = row["shape"]
    best, pick = row["best"], row["chooser"]["config"]
    mm = min(row["cublas_mm_ms"], row["cublas_nn_ms"])
    if best is None:
        print(f"{m:5} {k:5} {n:5} {row['cublas_mm_ms'] * 1e3:8.1f} {row['cublas_nn_ms'] * 1e3:8.1f}  no tile built", flush=True)
        return
    c = best["config"]
    label = pick if isinstance(pick, str) else f"m{pick['block_m']} n{pick['block_n']} w{pick['num_warps']} st{pick['num_stages']} {pick['weight_layout']}"
    print(f"{m:5} {k:5} {n:5} {row['cublas_mm_ms'] * 1e3:8.1f} {row['cublas_nn_ms'] * 1e3:8.1f} {best['ms'] * 1e3:8.1f} {mm / best['ms']:6.2f}  "
          f"m{c['block_m']} n{c['block_n']} w{c['num_warps']} st{c['num_stages']} {c['weight_layout']:3} {row['chooser']['ms'] * 1e3:8.1f}  {label:24} "
          f"{row['error_cublas']:.1e} / {best['error']:.1e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="BLOCK_K 64 only")
    parser.add_argument("--shapes", help="MxKxN,... instead of the built-in list")
    parser.add_argument("--large", action="store_true", help=f"shapes above {MAX_ROWS} rows: cuBLAS against tf32x3 tensor-core tiles")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("skinny_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else (LARGE if args.large else SHAPES)
    start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": sys.argv, "shapes": []}
    if args.large:
        print(f"{'M':>5} {'K':>5} {'N':>5} {'mm us':>8} {'mm nn us':>8} {'tile us':>8} {'mm/tile':>6}  best tf32x3 tile       chosen us  chooser's pick           err cuBLAS / tile")
        for m, k, n in shapes:
            result["shapes"].append(sweep_large(m, k, n, args.quick))
            print_large(result["shapes"][-1])
        return _finish(result, start, args.json)
    print(f"{'M':>4} {'K':>5} {'N':>5} {'addmm us':>8} {'mm us':>7} {'KN us':>7} {'NK us':>7} {'mm/KN':>6} {'chosen us':>9}  best KN config     chooser's pick     err cuBLAS / KN")
    for m, k, n in shapes:
        row = sweep(m, k, n, args.quick)
        result["shapes"].append(row)
        kn, best, pick = row["kn"], row["kn"]["best"], row["chooser"]["config"]
        label = pick if isinstance(pick, str) else f"n{pick['block_n']} s{pick['split_k']} w{pick['num_warps']}"
        print(f"{m:4} {k:5} {n:5} {row['cublas_addmm_ms'] * 1e3:8.2f} {row['cublas_mm_ms'] * 1e3:7.2f} {kn['ms'] * 1e3:7.2f} {row['nk']['ms'] * 1e3:7.2f} "
              f"{row['cublas_mm_ms'] / kn['ms']:6.2f} {row['chooser']['ms'] * 1e3:9.2f}  n{best['block_n']} k{best['block_k']} s{best['split_k']} "
              f"w{best['num_warps']} st{best['num_stages']}  {label:17}  {row['error_cublas']:.1e} / {kn['error']:.1e}", flush=True)
    return _finish(result, start, args.json)


def _finish(result: dict, start: float, path: Path | None) -> int:
    result["seconds"] = time.perf_counter() - start
    print(f"done in {result['seconds']:.0f} s")
    if path:
        path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
