"""Triton kernel of `engine.depthwise_conv` (imported only where it runs, on a GPU or
in Triton's interpreter).

`depthwise_conv2d` computes a depthwise 2-D convolution (one filter per channel,
channel multiplier 1) over a batch of images in any strides; with channels-last
tensors (what fused lanes run) the channels are the contiguous axis, so each
program reads a BLOCK_P x BLOCK_C tile of (output pixel, channel) per filter tap
in coalesced rows and sums the taps in fp32 registers. The taps, strides,
padding and dilation are compile-time constants; one compiled kernel per
(filter size, stride, padding, dilation), tile and ALIGN (below), whatever the
image size, batch size or channel count.

Only a filter row's taps are unrolled; the rows are a loop. Unrolling all 49
taps of a 7x7 filter over a 128 x 64 tile took Triton 228 s to compile for an
H100 (2 CPU cores, 2026-11-28), a 5x5 one 16 s, and a build compiles every
candidate tile at every new shape: likely where two cold NASNet builds spent
their 10-minute device calls (docs/benchmarks.md run 25). With the row loop
the 7x7 tiles compile in 2-7 s.

The channel count comes in units of ALIGN (4 floats, 16 bytes, where the
channel count and every pixel stride allow; else 2 or 1), and the pixel offsets
are asserted multiples of it: Triton knows an integer argument's divisibility
only by 16, so at NASNet's 42, 84 and 168 channels it compiled scalar loads
(PTX for sm_90, checked on the CPU), and those shapes ran at 0.22-0.48x cuDNN's
speed against 0.56-1.58x at 96, 336 and 672 (H200, 2026-11-28, docs/benchmarks.md
run 26). With ALIGN they compile to the same 128-bit loads as 336 (64-bit at 42).
The image sizes and pixel strides are not specialised on (the multiple of ALIGN
is all the loads need), so one compile serves every image and channel count of
an alignment.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["channel_groups", "H", "W", "OH", "OW", "pixels", "stride_xn", "stride_xh", "stride_xw", "stride_on", "stride_oh", "stride_ow"])
def depthwise_conv2d(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    channel_groups, H, W, OH, OW, pixels,
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_wc, stride_wh, stride_ww,
    stride_on, stride_oc, stride_oh, stride_ow,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DH: tl.constexpr, DW: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr,
):
    C = channel_groups * ALIGN  # channels, known to Triton as a multiple of ALIGN: see the module docstring
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # output pixels over the whole batch
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_p = offs_p < pixels
    in_c = offs_c < C
    n = offs_p // (OH * OW)
    rest = offs_p % (OH * OW)
    oh = rest // OW
    ow = rest % OW
    x_images = n.to(tl.int64) * stride_xn
    channels = offs_c[None, :] * stride_xc
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for kh in range(KH):  # a loop: see the module docstring
        ih = oh * SH - PH + kh * DH
        row_ok = in_p & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = ow * SW - PW + kw * DW
            ok = row_ok & (iw >= 0) & (iw < W)
            pixel = tl.multiple_of(x_images + ih * stride_xh + iw * stride_xw, ALIGN)
            x = tl.load(x_ptr + pixel[:, None] + channels, mask=ok[:, None] & in_c[None, :], other=0.0)
            w = tl.load(w_ptr + offs_c * stride_wc + kh * stride_wh + kw * stride_ww, mask=in_c, other=0.0)
            acc += x * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=in_c, other=0.0)[None, :]
    out_pixel = tl.multiple_of(n.to(tl.int64) * stride_on + oh * stride_oh + ow * stride_ow, ALIGN)
    out = out_ptr + out_pixel[:, None] + offs_c[None, :] * stride_oc
    tl.store(out, acc, mask=in_p[:, None] & in_c[None, :])
