"""Triton kernels of `engine.skinny_gemm` (imported only where it runs them, on a GPU).

`skinny_mm` computes `x @ w_t` for x [M, K] and w_t [K, N] (a linear layer's
weight stored transposed: N contiguous, which the dot reads fastest; as
nn.Linear stores it, [N, K], the same kernel ran no faster than cuBLAS). Each
program computes a BLOCK_M x BLOCK_N tile over one of the slices of K that the
third grid axis numbers: with one slice it writes its result, with several it
writes its partial sums to a workspace [SPLIT_K, M, N] that `sum_splits` adds
up in a fixed order (the result does not depend on which program finished
first). A bias, if any, is added by whichever kernel writes the result.
Sums are fp32; products as `PRECISION` says (Triton's `input_precision`:
"ieee" fp32, "tf32x3" three TF32 tensor-core products per fp32 one). The
weight may also be read through a [K, N] view of the [N, K] weight (strides
say which).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def skinny_mm(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_os, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & (kk[None, :] < k_end), other=0.0)
        w = tl.load(w_ptr + kk[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=(kk[:, None] < k_end) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc, mask=mask)


@triton.jit
def sum_splits(parts_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(parts_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc, mask=mask)
