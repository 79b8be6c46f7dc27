"""The one way the engine compares outputs: max relative error.

|got - want| over the largest |want|, worst over every tensor of a (nested)
output. Used by fusion's checks, the build's guard, the benchmarks and the
tests, so a tolerance means the same thing everywhere. An infinity where the
expected output has the same one is right (masked attention scores overflow to
-inf); NaN stays NaN, so `not error <= tolerance` rejects it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


def max_relative_error(actual: Any, expected: Any) -> float:
    """Worst relative error of `actual` against `expected` (same structure and
    shapes; tensors may sit on different devices). Integer tensors count as
    0 when equal and infinitely wrong otherwise."""
    got_leaves = [t for t in tree_leaves(actual) if isinstance(t, torch.Tensor)]
    want_leaves = [t for t in tree_leaves(expected) if isinstance(t, torch.Tensor)]
    if len(got_leaves) != len(want_leaves):
        raise ValueError(f"{len(got_leaves)} outputs instead of {len(want_leaves)}")
    worst = 0.0
    for got, want in zip(got_leaves, want_leaves):
        if got.shape != want.shape:
            raise ValueError(f"output of shape {tuple(got.shape)} instead of {tuple(want.shape)}")
        got = got.to(want.device)
        if not want.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(got, want) else float("inf"))
            continue
        if not want.numel():
            continue
        got, want = got.float(), want.float()
        finite = want[want.isfinite()]
        scale = float(finite.abs().max()) if finite.numel() else 1.0
        difference = (got - want).abs().masked_fill(got == want, 0.0)  # an infinity equal to the expected one is right
        error = float(difference.max()) / (scale or 1.0)
        if error != error:  # NaN: wrong whatever else
            return error
        worst = max(worst, error)
    return worst


def no_cudnn_autotuning() -> contextlib.AbstractContextManager[None]:
    """cuDNN's heuristics instead of its benchmark: benchmarking every
    convolution of every bucket took 13-17 s of GoogLeNet's 26 s warm build
    (H100, 2026-11-25). PyTorch keeps the first plan it made for a
    convolution's parameters (per thread), whichever the mode, so a run under
    this also decides what later runs and captures of the same convolutions on
    the same thread replay (fused lanes plan theirs on a thread of their own,
    engine.fused_lanes.on_planning_thread)."""
    return cudnn_algorithms(benchmark=False)


@contextlib.contextmanager
def cudnn_algorithms(benchmark: bool) -> Iterator[None]:
    """Convolutions first called inside pick their cuDNN algorithm by timing
    every one (`benchmark`) or by cuDNN's heuristics; the process's setting
    comes back after."""
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = benchmark
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved
