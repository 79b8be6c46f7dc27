"""Attention over few tokens: the memory-efficient SDPA kernel (what Inductor's
fp32 graphs call) against `engine.short_attention`'s Triton kernel (GPU only).

At BERT's shape (12 heads of 64, the mask bias broadcast from [B, 1, 1, L]) and
T5-small's (8 heads of 64, a position bias per head, scale 1) for batch 1-8 and
8-128 tokens: microseconds per call, each timed as calls back to back inside one
CUDA graph (`shape_choices.per_call_ms`), error of each against float64, and
whether the outputs share a layout. The kernel up to the
lengths its tile holds (`TILE_TOKENS`); `short_attention.MAX_TOKENS` comes from it.

    python scripts/short_attention.py --json $OUT/short_attention.json

Prints a table and writes JSON. Refuses to run without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opara_core.engine.short_attention import TILE_TOKENS, kernel_attention  # noqa: E402
from opara_core.engine.shape_choices import per_call_ms  # noqa: E402

MODELS = {"bert": (12, None), "t5": (8, 1.0)}  # heads, scale (None: 1/sqrt(64))


def inputs(model: str, batch: int, length: int):
    heads, _ = MODELS[model]
    qkv = torch.randn(batch, length, 3 * heads * 64, device="cuda")
    q, k, v = (t.view(batch, length, heads, 64).permute(0, 2, 1, 3) for t in qkv.split(heads * 64, dim=-1))
    if model == "bert":  # the last quarter of the keys of every row but the first padded
        keep = torch.ones(batch, length, device="cuda")
        keep[1:, length - length // 4 :] = 0
        bias = ((1 - keep) * torch.finfo(torch.float32).min).view(batch, 1, 1, length).expand(batch, heads, length, length)
    else:
        bias = torch.randn(1, heads, length, length, device="cuda").expand(batch, heads, length, length)
    return q, k, v, bias


def error(got: torch.Tensor, q, k, v, bias, scale) -> float:
    scores = q.double() @ k.double().transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale) + bias.double()
    exact = scores.softmax(-1) @ v.double()
    return float((got.double() - exact).abs().max() / exact.abs().max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--lengths", default="8,16,24,32,48,64,128")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    rows = []
    print("| model | batch | tokens | efficient us | kernel us | kernel / efficient | error efficient | error kernel | same layout |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, (_, scale) in MODELS.items():
        for batch in map(int, args.batches.split(",")):
            for length in map(int, args.lengths.split(",")):
                q, k, v, bias = inputs(model, batch, length)
                theirs = lambda: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, scale=scale)[0]  # noqa: E731
                row = {"model": model, "batch": batch, "tokens": length, "efficient_us": per_call_ms([theirs] * 20) * 1e3,
                       "error_efficient": error(theirs(), q, k, v, bias, scale)}  # fmt: skip
                mine = lambda: kernel_attention(q, k, v, bias, scale)  # noqa: E731
                if length <= TILE_TOKENS:
                    row |= {"kernel_us": per_call_ms([mine] * 20) * 1e3, "error_kernel": error(mine(), q, k, v, bias, scale),
                            "same_layout": mine().stride() == theirs().stride()}  # fmt: skip
                rows.append(row)
                kernel = f"{row['kernel_us']:.2f} | {row['kernel_us'] / row['efficient_us']:.2f} | " if "kernel_us" in row else "- | - | "
                tail = f"{row['error_kernel']:.1e} | {row['same_layout']}" if "kernel_us" in row else "- | -"
                print(f"| {model} | {batch} | {length} | {row['efficient_us']:.2f} | {kernel}{row['error_efficient']:.1e} | {tail} |", flush=True)
    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                     "command": " ".join(sys.argv), "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
