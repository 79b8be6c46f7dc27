"""Triton kernels of `engine.skinny_gemm` (imported only where Triton and a GPU are).

`skinny_mm`: one program computes a BLOCK_M x BLOCK_N tile of `a @ b` over one
of SPLIT_K slices of K (the third grid axis). With one slice it adds the bias
and writes the result; with several it writes its partial sums to a workspace
[SPLIT_K, M, N] that `sum_splits` adds up (in a fixed order: the result does not
depend on which program finished first), adding the bias.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def skinny_mm(
    a_ptr, b_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_am, stride_ak, stride_bk, stride_bn, stride_os, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (kk[None, :] < k_end), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(kk[:, None] < k_end) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc, mask=mask)


@triton.jit
def sum_splits(
    parts_ptr, bias_ptr, out_ptr, MN, N,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(parts_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc, mask=mask)
