"""The project's custom ops (`torch.ops.opara.*`), registered together.

Each op registers itself on first use (no side effects at import), which is
when a fusion pass puts it in a graph. A process that receives such a graph
without having run the pass, a segment-compile worker (engine.segment_compiler)
rebuilding its segment from operator names, must register them first: a NASNet build's workers
met `torch.ops.opara.depthwise_conv2d` unregistered, broke the pool, and left
every segment to the building process (H200, docs/benchmarks.md run 27).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from opara_core.engine import depthwise_conv, short_attention, skinny_gemm


def register_all() -> tuple[torch._ops.OpOverload, ...]:
    """Register every op a pass can put in a graph; returns them."""
    return (skinny_gemm.skinny_mm_op(), depthwise_conv.depthwise_conv_op(), short_attention.short_attention_op())


def aten_references() -> dict[torch._ops.OpOverload, Callable[..., torch.Tensor]]:
    """The ATen computation of each op whose body chooses a kernel by timing
    shapes, for a reference that must neither run the engine's kernels nor
    time: the fp32 check of a half-precision segment (engine.segment_compiler),
    which otherwise timed NASNet's 139 depthwise shapes in fp32 (about 45 s of
    its cold build on one H100, 2026-12-07). skinny_mm needs none: only fp32
    graphs hold it."""
    return {depthwise_conv.depthwise_conv_op(): depthwise_conv.cudnn_conv2d}
