"""The numerics a model is built in: fp32, tf32, bf16 or fp16.

A half-precision model is the user's module cast to bf16 or fp16 inside a
wrapper (`AtPrecision`) that casts its floating inputs in and its floating
outputs back to the datatypes the model declares: the wire keeps what
config.pbtxt says, and the casts are operators of the traced graph and of every
captured CUDA graph, never a host step. Integer inputs (ids, masks) pass as
they are. Every path builds from that wrapper: the ATen plans, fused lanes and
the whole-model artifacts alike. `tf32` keeps fp32 tensors and allows TF32
matrix products and convolutions while the model is built and captured (a CUDA
graph keeps the kernels it captured).

The guard of such a build compares it with the fp32 module (`tolerance`); the
engine's small-row GEMM and short attention take fp32 only, so in half
precision their passes step aside for cuBLAS and Inductor; the depthwise
convolution (engine.depthwise_conv) takes bf16 and fp16 too.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from opara_core.spec import ModelSpec

FP32, TF32, BF16, FP16 = "fp32", "tf32", "bf16", "fp16"
HALF = {BF16: torch.bfloat16, FP16: torch.float16}
# `precision_tolerance` "auto": a build may be as far from the fp32 module as
# the module itself run eagerly in that precision, twice over (rounding
# differently is all a right graph does), and at least FLOOR. bf16 keeps 8 bits
# of mantissa (unit roundoff 2**-9, 2e-3), fp16 and TF32 11 (2**-12, 2.4e-4);
# a network adds its layers' roundings up, and a deep network with seeded
# (untrained) weights amplifies them: the zoo's modules run eagerly in bf16
# against fp32 at batch 8 (H200, 2026-12-02, docs/precision.md) GoogLeNet
# 1.4e-1, ResNet-50 1.7e-1, NASNet 1.9e-1, DeepFM 2.3e-3, BERT 1.7e-2, T5
# 1.2e-2 (engine.compare's measure); in fp16 1.8e-2 to 5.8e-2 for the CNNs.
FLOOR = {BF16: 2e-2, FP16: 5e-3, TF32: 5e-3}
EAGER_FACTOR = 2.0


@dataclass(frozen=True)
class Accuracy:
    """One graph's distance from the fp32 module (engine.compare's max relative error)."""

    error: float  # the graph's replay
    eager: float  # the same module run eagerly in the precision, on the same inputs
    tolerance: float  # what the error was held to


_cast: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]] = weakref.WeakKeyDictionary()


class AtPrecision(torch.nn.Module):
    """`module` run in `dtype`: floating inputs cast to it on the way in,
    floating outputs cast back to the model's declared datatypes on the way out."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, model: ModelSpec):
        super().__init__()
        self.module = module
        self.precision = next(name for name, d in HALF.items() if d == dtype)  # a plain setting: part of trace keys
        self._dtype = dtype
        self._cast_in = tuple(spec.dtype.is_floating_point for spec in model.inputs)
        self._out = tuple(spec.dtype for spec in model.outputs)

    def forward(self, *inputs: Any) -> Any:
        inputs = tuple(x.to(self._dtype) if cast else x for x, cast in zip(inputs, self._cast_in)) + inputs[len(self._cast_in) :]
        leaves, structure = tree_flatten(self.module(*inputs))
        tensors = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        for k, dtype in zip(tensors, self._out):
            if leaves[k].is_floating_point() and dtype.is_floating_point:
                leaves[k] = leaves[k].to(dtype)
        return tree_unflatten(leaves, structure)


def tolerance(precision: str, setting: float | str, eager_error: float) -> float:
    """The guard's bound against the fp32 module for `precision` (`setting`:
    the `precision_tolerance` parameter; "auto": EAGER_FACTOR times
    `eager_error`, the module's own error run eagerly in that precision, and
    at least FLOOR)."""
    if setting != "auto":
        return float(setting)
    return max(FLOOR[precision], EAGER_FACTOR * eager_error)


def on_device(precision: str, device: torch.device) -> tuple[str, str]:
    """The precision a model asking for `precision` is built in on `device`,
    and why, where that is another one: a CPU without native bf16 or fp16
    (oneDNN's check: AVX512-BF16, AMX or AVX512-FP16) would emulate it, slower
    than fp32, and TF32 is a GPU's."""
    if torch.device(device).type == "cuda" or precision == FP32:
        return precision, ""
    if precision == TF32:
        return FP32, "tf32 is a GPU's (TF32 tensor cores); this CPU instance runs fp32"
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported() if precision == BF16 else torch.ops.mkldnn._is_mkldnn_fp16_supported()
    if native:
        return precision, ""
    return FP32, f"this CPU has no native {precision}; it runs fp32"


def cast(module: torch.nn.Module, model: ModelSpec, precision: str) -> torch.nn.Module:
    """`module` in `precision`: the module itself for fp32 and tf32, else an
    `AtPrecision` around a half copy of it (the fp32 module stays the guard's
    reference). One copy per module and precision, whichever path asks (every
    shape of a variable-length model builds from the same one)."""
    if precision not in HALF:
        return module
    done = _cast.setdefault(module, {})
    if precision not in done:
        half = copy.deepcopy(module).to(HALF[precision])
        done[precision] = AtPrecision(half, HALF[precision], model).eval()
    return done[precision]


def describe(found: Mapping[Any, Accuracy]) -> str:
    """One line of a report: the worst graph's error, and what it was held to."""
    worst = max(found.values(), key=lambda a: a.error)
    return (
        f"max relative error against the fp32 module {worst.error:.1e} (the module run eagerly in this precision: "
        f"{worst.eager:.1e}; tolerance {worst.tolerance:.1e}) over {len(found)} graphs"
    )


@contextlib.contextmanager
def numerics(precision: str) -> Iterator[None]:
    """Inside, matrix products and convolutions may use TF32 (`tf32`) or not
    (every other precision: fp32 is PyTorch's defaults, which keep cuDNN's TF32
    convolutions; half precisions do not use TF32); the process's settings come
    back after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if precision == TF32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@contextlib.contextmanager
def fp32_reference() -> Iterator[None]:
    """Inside, the fp32 module runs as the user wrote it with PyTorch's
    defaults (TF32 matrix products off), whatever the build allowed."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
