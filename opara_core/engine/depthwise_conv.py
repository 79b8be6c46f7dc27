"""Depthwise convolutions (one filter per channel) as a Triton kernel of our own.

Why: NASNet-A large's 220 depthwise convolutions run in cuDNN's
`conv2d_c1_k1_nhwc` kernel, 2,607 of 8,043 us of torch.compile's replay at
batch 8 and 9,083 of 24,523 at 32 (H200, docs/benchmarks.md run 17), where
reading their inputs and writing their outputs once takes about 730 and 2,900 us
at HBM speed: cuDNN runs them 3-4x slower than the memory allows, and NASNet is
the one model whose fused lanes did not beat torch.compile at 8 and 32. With
this kernel where it wins (5x5 and 7x7 filters over many channels; cuDNN keeps
the rest), NASNet's served graph replayed 8.02 -> 7.53 ms at batch 8 (H200,
docs/benchmarks.md run 26). cuDNN still won its most frequent shapes (3x3 and
5x5 filters at 168-672 channels, 0.62-0.84x at batch 32, run 27), where each
output's taps were loaded apart: the tiles that compute 2 or 4 neighbouring
outputs from shared loads (depthwise_kernels, COLUMNS) are for those. The
kernel is now taken unless cuDNN is much faster (MAX_SLOWDOWN): cuDNN's
planning of each shape in every process is what a warm build waits for.

`depthwise_conv2d` runs one tile configuration; `time_shape` times cuDNN (its
heuristics, as fused lanes capture) against every candidate at one shape, after
checking each candidate's answer against a float64 convolution (the probe
scripts/depthwise_conv.py, since removed, swept NASNet's shapes with it). `depthwise_conv` runs
whichever `best_of` picked from its first call's timings at that shape (engine.shape_choices),
and `depthwise_conv_op` is it as a custom op for Inductor's graphs
(fusion.depthwise_convs puts it there, in the fused-lanes graphs: build.INDUCTOR_PASSES).
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from opara_core.cpus import usable_cpus
from opara_core.engine.shape_choices import ShapeChoices, per_call_ms, relative_error, triton_failures

log = logging.getLogger(__name__)

KERNEL_VERSION = 6  # bump when the kernel or the candidates change: the choices on disk are then timed again
# The kernel is chosen unless cuDNN takes less than 1 / MAX_SLOWDOWN of its time. Not a margin the
# kernel must win by: cuDNN plans each depthwise shape again in every process, ~210 ms per shape and
# batch size on an H200 (docs/benchmarks.md run 21), which a warm build pays before it can capture
# (NASNet: ~53 shapes left to cuDNN over six buckets, ~11 s of its 24.7 s warm build, run 29), while the
# kernel needs none. In run 28's sweep of NASNet's shapes, the kernel everywhere cuDNN was at most 1.5x
# faster adds 75, 45 and 226 us of kernel time at batch 1, 8 and 32 to 719, 1,963 and 6,359 and leaves
# cuDNN one shape of 69 (3x3 over 42 channels at 83x83, batch 32: 1.67x).
MAX_SLOWDOWN = 1.5
CUDNN = "cudnn"
# The dtypes the kernel takes (one for input, filter, bias and output; it sums in fp32), and the largest error
# against a float64 convolution of the same values, relative to its largest entry: fp32 sums of <= 49 taps
# ~1e-7; in bf16 and fp16 the output's one rounding (<= 2^-8 and 2^-11 of the largest entry) dominates.
ACCURACY = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@dataclass(frozen=True)
class DepthwiseConfig:
    block_p: int  # groups of `columns` output pixels per program (over the whole batch)
    block_c: int  # channels per program: the contiguous axis of a channels-last tensor
    num_warps: int = 4
    columns: int = 1  # neighbouring output pixels of a row per group (1, 2 or 4), sharing their input loads


# Tiles of 4 and 2 neighbouring outputs of a row per group (run 28's sweep of NASNet's 69 shapes at
# batch 1, 8 and 32 on an H200: one of these six was the best at every shape, 16x32 x 4 at 44; run
# 27's four one-column tiles (64x32, 256x16/8w, 32x64, 128x32/8w) were never the best nor within 3%
# of it, and went: 40% fewer compiles per shape). The kernel still takes one column (`columns=1`).
CANDIDATES = (
    DepthwiseConfig(16, 32, 4, 4),
    DepthwiseConfig(64, 16, 8, 4),
    DepthwiseConfig(8, 64, 4, 4),
    DepthwiseConfig(32, 32, 8, 4),
    DepthwiseConfig(32, 32, 4, 2),
    DepthwiseConfig(128, 16, 8, 2),
)


def output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation, config: DepthwiseConfig) -> torch.Tensor:
    """F.conv2d(x, weight, bias, stride, padding, dilation, groups=C) for x [N, C, H, W]
    and weight [C, 1, KH, KW], all float32, bfloat16 or float16, any strides; the
    output is channels-last, in their dtype."""
    return _run(x, weight, bias, stride, padding, dilation, config, compile_only=False)


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation, config: DepthwiseConfig, compile_only: bool) -> torch.Tensor:
    """`depthwise_conv2d`, or with `compile_only` only Triton's compile of the kernel
    for these arguments (nothing launched; the output is not written)."""
    n, c, h, w = x.shape
    if weight.dim() != 4 or weight.shape[0] != c or weight.shape[1] != 1:
        raise ValueError(f"depthwise_conv2d: weight {tuple(weight.shape)} is not [{c}, 1, KH, KW] for {c} channels")
    if not takes_dtypes(x, weight, bias):
        dtypes = ", ".join(str(t.dtype) for t in (x, weight, bias) if t is not None)
        raise TypeError(f"depthwise_conv2d takes float32, bfloat16 or float16 tensors of one dtype, got {dtypes}")
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"depthwise_conv2d: bias {tuple(bias.shape)} is not [{c}]")
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = weight.shape[2:], _pair(stride), _pair(padding), _pair(dilation)
    oh, ow = output_size(h, kh, sh, ph, dh), output_size(w, kw, sw, pw, dw)
    out = torch.empty((n, c, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    from opara_core.engine import depthwise_kernels

    if config.columns not in (1, 2, 4):
        raise ValueError(f"depthwise_conv2d: {config.columns} columns per group; the kernel takes 1, 2 or 4")
    row_groups = -(-ow // config.columns)
    groups = n * oh * row_groups
    align = vector_width(c, x, out)
    kernel, grid = depthwise_kernels.depthwise_conv2d, (-(-groups // config.block_p), -(-c // config.block_c))
    (kernel.warmup if compile_only else kernel[grid])(
        x, weight, out if bias is None else bias, out,
        c // align, h, w, oh, ow, row_groups, groups,
        *x.stride(), weight.stride(0), weight.stride(2), weight.stride(3), *out.stride(),
        KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw, HAS_BIAS=bias is not None,
        BLOCK_P=config.block_p, BLOCK_C=config.block_c, ALIGN=align, COLUMNS=config.columns, USED=used_columns(config.columns, kw, sw, dw),
        num_warps=config.num_warps, **({"grid": grid} if compile_only else {}),
    )  # fmt: skip
    return out


def used_columns(columns: int, kernel_w: int, stride_w: int, dilation_w: int) -> int:
    """A bit for each input column (from a group's first) that one of its
    `columns` outputs reads: the kernel loads only those."""
    return sum({1 << (k * stride_w + t * dilation_w) for k in range(columns) for t in range(kernel_w)})


def takes_dtypes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes these tensors: one dtype of ACCURACY's for all."""
    return x.dtype in ACCURACY and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)


def vector_width(channels: int, x: torch.Tensor, out: torch.Tensor) -> int:
    """Elements per vector load the kernel may use (up to 16 bytes: 4 fp32 or
    8 bf16/fp16 elements, else 2 or 1): the largest that divides the channel count
    and every stride but the channels' of both tensors (depthwise_kernels'
    docstring says why the kernel needs to be told)."""
    strides = [s for t in (x, out) for axis, s in enumerate(t.stride()) if axis != 1]
    widths = [a for a in (8, 4, 2, 1) if a * x.element_size() <= 16]
    return next(a for a in widths if channels % a == 0 and all(s % a == 0 for s in strides))


def compile_candidates(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation, candidates=CANDIDATES) -> None:
    """Have Triton compile every candidate tile for these arguments at once, in
    threads: the chooser needs them all (6 tiles at each new filter, stride and
    channel alignment: about 60 compiles in a cold NASNet build, 0.3-1.8 s each
    for sm_90 on the 2-core CPU machine, 2026-11-28), and
    Triton's compiler spends most of its time outside the GIL (4 tiles in 2.4 s
    in 2 threads against 3.8 s in one, 2 CPU cores, 2026-11-28). A tile that
    fails here is compiled again by `time_shape`, which reports why."""
    def compile_one(config: DepthwiseConfig) -> None:
        with torch.cuda.device(x.device):
            try:
                _run(x, weight, bias, stride, padding, dilation, config, compile_only=True)
            except Exception:  # noqa: BLE001 - reported where the tile is run (time_shape)
                log.debug("depthwise tile %s did not compile in the pool", config, exc_info=True)

    with ThreadPoolExecutor(max_workers=max(1, min(len(candidates), usable_cpus() // 2))) as pool:
        list(pool.map(compile_one, candidates))


def cudnn_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation) -> torch.Tensor:
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups=x.shape[1])


def time_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation=1, candidates=CANDIDATES) -> tuple[dict, dict]:
    """(ms per call of cuDNN and of each candidate that builds and answers within
    ACCURACY for its dtype, each candidate's error or the reason it was dropped) at this shape,
    calls captured back to back in one CUDA graph; cuDNN with its heuristics
    (benchmark mode off, as fused lanes capture)."""
    exact = cudnn_conv2d(x.double(), weight.double(), None if bias is None else bias.double(), stride, padding, dilation)
    compile_candidates(x, weight, bias, stride, padding, dilation, candidates)
    with torch.backends.cudnn.flags(enabled=True, benchmark=False):
        timings = {CUDNN: per_call_ms([lambda: cudnn_conv2d(x, weight, bias, stride, padding, dilation)] * 8)}
        errors: dict = {CUDNN: relative_error(cudnn_conv2d(x, weight, bias, stride, padding, dilation), exact)}
    for config in candidates:
        try:
            errors[config] = relative_error(depthwise_conv2d(x, weight, bias, stride, padding, dilation, config), exact)
        except (*triton_failures(), RuntimeError) as error:
            errors[config] = f"{type(error).__name__}: {str(error)[:200]}"
            continue
        if errors[config] <= ACCURACY[x.dtype]:
            timings[config] = per_call_ms([lambda c=config: depthwise_conv2d(x, weight, bias, stride, padding, dilation, c)] * 8)
    return timings, errors


def best_of(timings: dict) -> DepthwiseConfig | str:
    """The fastest candidate unless cuDNN is more than MAX_SLOWDOWN times faster; cuDNN if no candidate answered right."""
    best = min((c for c in timings if isinstance(c, DepthwiseConfig)), key=timings.get, default=None)
    return best if best is not None and timings[best] <= MAX_SLOWDOWN * timings[CUDNN] else CUDNN


def output_format(x: torch.Tensor) -> torch.memory_format:
    """The output's layout, whichever way runs: channels-last for a channels-last
    input, else contiguous (so that a fake output and the real one agree)."""
    channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if channels_last else torch.contiguous_format


def fake_output_matches(out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `out`, the replaced convolution's value (same shape), is what the
    op's fake implementation gives for input `x`: then the fusion pass keeps it
    instead of calling the op under the fake mode (a custom op's dispatch there:
    0.6 s of NASNet's sampled warm build, collections during it included;
    docs/benchmarks.md run 37)."""
    want = torch.empty(out.shape, device="meta", memory_format=output_format(x))
    return out.dtype == x.dtype and out.device == x.device and out.stride() == want.stride()


class Choices(ShapeChoices):
    """The tile or cuDNN per depthwise shape (and input layout) on this GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        key = [KERNEL_VERSION, MAX_SLOWDOWN, {str(t): a for t, a in ACCURACY.items()}, [asdict(c) for c in CANDIDATES]]
        super().__init__("depthwise", key, DepthwiseConfig, CUDNN, software=("gpu", "torch", "triton", "cudnn"), device=device)

    def choose(self, x: torch.Tensor, weight: torch.Tensor, bias: bool, stride, padding, dilation) -> DepthwiseConfig | str:
        fmt = output_format(x)
        shape = f"{list(x.shape)},{list(weight.shape[2:])},s{list(stride)},p{list(padding)},d{list(dilation)},{str(fmt).removeprefix('torch.')},{str(x.dtype).removeprefix('torch.')}" + ("+bias" if bias else "")

        def time_and_pick() -> DepthwiseConfig | str:
            start = time.perf_counter()
            sample = torch.randn(x.shape, device=x.device, dtype=x.dtype).contiguous(memory_format=fmt)
            filters = torch.randn(weight.shape, device=x.device, dtype=x.dtype)
            timings, _ = time_shape(sample, filters, torch.randn(x.shape[1], device=x.device, dtype=x.dtype) if bias else None, stride, padding, dilation)
            chosen = best_of(timings)
            log.info("depthwise convolution %s: %s (%.1f us; cuDNN %.1f us; chosen in %.1f s)", shape, chosen, timings[chosen] * 1e3, timings[CUDNN] * 1e3, time.perf_counter() - start)
            return chosen

        return super().choose(shape, time_and_pick)


_choices: dict[str, Choices] = {}


def choices_for(device: torch.device) -> Choices:
    if str(device) not in _choices:
        _choices[str(device)] = Choices(device)
    return _choices[str(device)]


def depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation) -> torch.Tensor:
    """F.conv2d(..., groups=C) for a weight [C, 1, KH, KW]: for a channels-last
    input on a GPU the kernel unless its first call at this shape measured
    cuDNN much faster (`best_of`), else cuDNN; the output in `output_format(x)`.
    In fp32, bf16 and fp16 alike (a half-precision build's graph holds its
    convolutions in that dtype: cuDNN plans those per shape too). Only
    channels-last inputs are timed: fused lanes run the network channels-last
    (build.channels_last_graph), and an NCHW call (a fusion check, a profile)
    would only add a second set of shapes for Triton to compile candidates for."""
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    fmt = output_format(x)
    usable = x.is_cuda and fmt == torch.channels_last and takes_dtypes(x, weight, bias) and x.numel() > 0
    if usable and weight.dim() == 4 and weight.shape[:2] == (x.shape[1], 1):
        choice = choices_for(x.device).choose(x, weight, bias is not None, stride, padding, dilation)
        if isinstance(choice, DepthwiseConfig):
            out = depthwise_conv2d(x, weight, bias, stride, padding, dilation, choice)
            return out if fmt == torch.channels_last else out.contiguous()
    return cudnn_conv2d(x, weight, bias, stride, padding, dilation).contiguous(memory_format=fmt)


@functools.cache
def depthwise_conv_op():
    """`torch.ops.opara.depthwise_conv2d` (registered on first use: no side effects
    at import): `depthwise_conv` as a custom op, so that Inductor calls it as one
    opaque kernel with a fake implementation for shapes."""

    @torch.library.custom_op("opara::depthwise_conv2d", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
        return depthwise_conv(x, weight, bias, stride, padding, dilation)

    @op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
        n, c, h, w = x.shape
        size = (n, c, output_size(h, weight.shape[2], stride[0], padding[0], dilation[0]), output_size(w, weight.shape[3], stride[1], padding[1], dilation[1]))
        return torch.empty(size, device=x.device, dtype=x.dtype, memory_format=output_format(x))

    # the static cost model counts its FLOPs as the convolution's (engine.costs)
    from torch.utils.flop_counter import flop_registry

    conv = flop_registry[torch.ops.aten.convolution]
    flop_registry.setdefault(torch.ops.opara.depthwise_conv2d, lambda x, weight, *args, out_val=None, **kwargs: conv(x, weight, None, None, None, None, False, out_val=out_val))
    return torch.ops.opara.depthwise_conv2d.default
