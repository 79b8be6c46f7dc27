"""Triton kernel of `engine.depthwise_conv` (imported only where it runs, on a GPU or
in Triton's interpreter).

`depthwise_conv2d` computes a depthwise 2-D convolution (one filter per channel,
channel multiplier 1) over a batch of images in any strides; with channels-last
tensors (what fused lanes run) the channels are the contiguous axis, so each
program reads a BLOCK_P x BLOCK_C tile of (output pixel, channel) per filter tap
in coalesced rows and sums the taps in fp32 registers, whatever the tensors'
dtype (fp32, bf16 or fp16: loads are widened, the sum is rounded once at the
store). The taps, strides, padding and dilation are compile-time constants; one
compiled kernel per (filter size, stride, padding, dilation), dtype, tile, ALIGN
and COLUMNS (below), whatever the image size, batch size or channel count.

Only a filter row's taps are unrolled; the rows are a loop. Unrolling all 49
taps of a 7x7 filter over a 128 x 64 tile took Triton 228 s to compile for an
H100 (2 CPU cores, 2026-11-28), a 5x5 one 16 s, and a build compiles every
candidate tile at every new shape: likely where two cold NASNet builds spent
their 10-minute device calls (docs/benchmarks.md run 25). With the row loop
the 7x7 tiles compile in 2-7 s.

The channel count comes in units of ALIGN (16 bytes: 4 fp32 or 8 bf16/fp16
elements, where the channel count and every pixel stride allow; else fewer), and the pixel offsets
are asserted multiples of it: Triton knows an integer argument's divisibility
only by 16, so at NASNet's 42, 84 and 168 channels it compiled scalar loads
(PTX for sm_90, checked on the CPU), and those shapes ran at 0.22-0.48x cuDNN's
speed against 0.56-1.58x at 96, 336 and 672 (H200, 2026-11-28, docs/benchmarks.md
run 26). With ALIGN they compile to the same 128-bit loads as 336 (64-bit at 42).
A load is also at most a thread's share of a tile row: 4 elements in every
candidate tile, so bf16 and fp16 load 64 bits at a time (PTX for sm_90 of the
5x5 tile at ALIGN 8, checked on the CPU, 2026-12-07).
The image sizes and pixel strides are not specialised on (the multiple of ALIGN
is all the loads need), so one compile serves every image and channel count of
an alignment.

COLUMNS > 1 (2 or 4) has each program row compute that many neighbouring
output pixels of one image row: it loads each input column a filter row
touches once and adds it into every output it feeds, instead of loading it
again per tap. At a 5x5 filter with stride 1, four outputs read 8 input
columns per filter row instead of 20 (7x7: 10 instead of 28). One kernel
answers both: COLUMNS = 1 is the one-output form. USED (a bit per input
column of the row's span) names the columns some output reads, so that a
dilated filter loads only those.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["channel_groups", "H", "W", "OH", "OW", "OWG", "groups", "stride_xn", "stride_xh", "stride_xw", "stride_on", "stride_oh", "stride_ow"])
def depthwise_conv2d(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    channel_groups, H, W, OH, OW, OWG, groups,
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_wc, stride_wh, stride_ww,
    stride_on, stride_oc, stride_oh, stride_ow,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DH: tl.constexpr, DW: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr,
    COLUMNS: tl.constexpr, USED: tl.constexpr,
):
    tl.static_assert(COLUMNS == 1 or COLUMNS == 2 or COLUMNS == 4)
    C = channel_groups * ALIGN  # channels, known to Triton as a multiple of ALIGN: see the module docstring
    offs_g = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # groups of COLUMNS output pixels of one row, over the batch
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_g = offs_g < groups
    in_c = offs_c < C
    n = offs_g // (OH * OWG)
    rest = offs_g % (OH * OWG)
    oh = rest // OWG
    ow0 = (rest % OWG) * COLUMNS  # the group's first output column
    x_images = n.to(tl.int64) * stride_xn
    channels = offs_c[None, :] * stride_xc
    acc0 = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc0 += tl.load(bias_ptr + offs_c, mask=in_c, other=0.0).to(tl.float32)[None, :]
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for kh in range(KH):  # a loop: see the module docstring
        ih = oh * SH - PH + kh * DH
        row_ok = in_g & (ih >= 0) & (ih < H)
        w_row = w_ptr + offs_c * stride_wc + kh * stride_wh
        for j in tl.static_range((COLUMNS - 1) * SW + (KW - 1) * DW + 1):  # the row's input columns
            if (USED >> j) & 1:
                iw = ow0 * SW - PW + j
                ok = row_ok & (iw >= 0) & (iw < W)
                pixel = tl.multiple_of(x_images + ih * stride_xh + iw * stride_xw, ALIGN)
                x = tl.load(x_ptr + pixel[:, None] + channels, mask=ok[:, None] & in_c[None, :], other=0.0).to(tl.float32)
                acc0 = _tap(acc0, x, w_row, stride_ww, in_c, j, KW, DW)
                if COLUMNS > 1:
                    acc1 = _tap(acc1, x, w_row, stride_ww, in_c, j - SW, KW, DW)
                if COLUMNS > 2:
                    acc2 = _tap(acc2, x, w_row, stride_ww, in_c, j - 2 * SW, KW, DW)
                    acc3 = _tap(acc3, x, w_row, stride_ww, in_c, j - 3 * SW, KW, DW)
    out_row = n.to(tl.int64) * stride_on + oh * stride_oh
    out_channels = offs_c[None, :] * stride_oc
    _store(out_ptr, acc0, out_row, ow0, stride_ow, out_channels, in_g, in_c, OW, ALIGN)
    if COLUMNS > 1:
        _store(out_ptr, acc1, out_row, ow0 + 1, stride_ow, out_channels, in_g, in_c, OW, ALIGN)
    if COLUMNS > 2:
        _store(out_ptr, acc2, out_row, ow0 + 2, stride_ow, out_channels, in_g, in_c, OW, ALIGN)
        _store(out_ptr, acc3, out_row, ow0 + 3, stride_ow, out_channels, in_g, in_c, OW, ALIGN)


@triton.jit
def _tap(acc, x, w_row, stride_ww, in_c, T: tl.constexpr, KW: tl.constexpr, DW: tl.constexpr):
    """acc plus x times the filter tap at input column offset T from the
    output's first column, if the filter has a tap there (compile-time)."""
    if T >= 0:
        if T % DW == 0:
            if T // DW < KW:
                acc += x * tl.load(w_row + (T // DW) * stride_ww, mask=in_c, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _store(out_ptr, acc, out_row, ow, stride_ow, out_channels, in_g, in_c, OW, ALIGN: tl.constexpr):
    """One output column of the groups (those past the row's end are not written),
    rounded to the output's dtype."""
    out_pixel = tl.multiple_of(out_row + ow * stride_ow, ALIGN)
    tl.store(out_ptr + out_pixel[:, None] + out_channels, acc.to(out_ptr.dtype.element_ty), mask=(in_g & (ow < OW))[:, None] & in_c[None, :])
