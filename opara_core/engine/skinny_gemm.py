"""fp32 GEMMs with few rows (x @ w.T + b, M <= 64) as a split-K Triton kernel.

Why: at small batch the transformers' and DeepFM's linear layers are GEMMs of
1-64 rows against weights of 0.2-9 MB. cuBLAS's fp32 kernels for them tile N
only, so a 768 x 768 weight at 16 rows runs on a few dozen of the H100's 132
SMs and reads the weights at 0.48 TB/s (BERT's 16-token cell: 706 of 876 us in
GEMMs, docs/benchmarks.md, variable lengths run 7). Splitting K as well puts
every SM to work; the partial sums are added in a fixed order by a second
kernel, so results do not vary from run to run. Products and sums stay fp32
(`precision` "ieee": no TF32 unless asked for).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

PRECISIONS = ("ieee", "tf32x3", "tf32")
SUM_BLOCK = 1024


@dataclass(frozen=True)
class SkinnyConfig:
    """A kernel configuration: tile widths, K slices, warps, pipeline stages."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def block_m(rows: int) -> int:
    """The tile height for `rows` rows: tl.dot needs at least 16, 64 caps registers."""
    return min(64, max(16, 1 << max(rows - 1, 0).bit_length()))


def slices(k: int, config: SkinnyConfig) -> tuple[int, int]:
    """(K per slice rounded up to whole BLOCK_K steps, number of non-empty slices)."""
    per = -(-k // config.split_k)
    per = -(-per // config.block_k) * config.block_k
    return per, -(-k // per)


@functools.cache
def _kernels():
    from opara_core.engine import skinny_kernels

    return skinny_kernels


def skinny_addmm(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig, precision: str = "ieee"
) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] (+ bias [N]) on the GPU, fp32, any strides."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    if x.dtype != torch.float32 or weight_t.dtype != torch.float32:
        raise TypeError(f"skinny_addmm takes float32 tensors, got {x.dtype} and {weight_t.dtype}")
    (m, k), (k2, n) = x.shape, weight_t.shape
    if k != k2:
        raise ValueError(f"skinny_addmm: x is {m}x{k}, weight_t {k2}x{n}")
    kernels = _kernels()
    out = torch.empty((m, n), device=x.device, dtype=torch.float32)
    per, split = slices(k, config)
    target = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    tile_m = block_m(m)
    grid = (-(-n // config.block_n), -(-m // tile_m), split)
    kernels.skinny_mm[grid](
        x, weight_t, bias if bias is not None else out, target,
        m, n, k, per,
        x.stride(0), x.stride(1), weight_t.stride(0), weight_t.stride(1),
        target.stride(0) if split > 1 else 0, target.stride(-2), target.stride(-1),
        HAS_BIAS=bias is not None and split == 1, PRECISION=precision,
        BLOCK_M=tile_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        kernels.sum_splits[(-(-m * n // SUM_BLOCK),)](
            target, bias if bias is not None else out, out, m * n, n,
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK,
        )
    return out
