"""Static cost model: FLOPs and bytes per operator, no GPU needed.

Stands in for a GPU profile: an operator's time is estimated with a roofline,
max(FLOPs / peak, bytes / bandwidth) plus a launch overhead, and it is memory-bound
when its arithmetic intensity (FLOPs per byte) is below the GPU's ridge point. The
class comes from these numbers, never from operator names. FLOPs come from PyTorch's
own formulas (`torch.utils.flop_counter`); operators without a formula (elementwise,
pooling, normalisation) count 0 FLOPs, which makes them memory-bound, as they are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSpec:
    """The few numbers the roofline needs. The default is an H100 SXM running fp32."""

    name: str = "H100 SXM (fp32, no tensor cores)"
    peak_flops: float = 67e12  # FLOP/s
    bandwidth: float = 3.35e12  # bytes/s of HBM3
    launch_us: float = 2.0  # per-kernel overhead inside a CUDA graph

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which an operator is compute-bound."""
        return self.peak_flops / self.bandwidth


H100 = GpuSpec()


@dataclass(frozen=True)
class OpCost:
    """One operator's static estimate."""

    flops: float
    bytes: float
    us: float
    kind: str  # "compute" or "memory"

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf if self.flops else 0.0


def estimate(flops: float, nbytes: float, spec: GpuSpec = H100) -> OpCost:
    """The roofline estimate and compute/memory class for given FLOPs and bytes."""
    us = max(flops / spec.peak_flops, nbytes / spec.bandwidth) * 1e6 + spec.launch_us
    compute = flops > 0 and (nbytes == 0 or flops / nbytes >= spec.ridge)
    return OpCost(flops=float(flops), bytes=float(nbytes), us=us, kind="compute" if compute else "memory")


def node_cost(node: torch.fx.Node, spec: GpuSpec = H100, sizes: Mapping[Any, int] | None = None) -> OpCost:
    """Estimate a call_function node from its fake-tensor metadata (node.meta["val"]).

    Symbolic sizes (a dynamic batch) take their value from `sizes` (sympy symbol ->
    int); a symbol without one counts as 1.
    """
    concrete = _Concrete(sizes or {})
    args, kwargs = tree_map(concrete.arg, (node.args, node.kwargs))
    out = concrete(node.meta.get("val"))
    nbytes = sum(_nbytes(t) for t in tree_flatten((args, kwargs))[0]) + sum(_nbytes(t) for t in tree_flatten(out)[0])
    return estimate(_flops(node.target, args, kwargs, out), nbytes, spec)


def _flops(target: Any, args: Any, kwargs: Any, out: Any) -> float:
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0.0
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that cannot take these arguments: count no FLOPs
        log.debug("no FLOP count for %s", target, exc_info=True)
        return 0.0


@dataclass(frozen=True)
class _Concrete:
    """Fake tensors become meta tensors of concrete shape; SymInts become ints."""

    sizes: Mapping[Any, int]

    def arg(self, arg: Any) -> Any:
        return self(arg.meta.get("val")) if isinstance(arg, torch.fx.Node) else self(arg)

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty([self.int(d) for d in value.shape], dtype=value.dtype, device="meta")
        if isinstance(value, torch.SymInt):
            return self.int(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self(v) for v in value)
        return value

    def int(self, d: Any) -> int:
        if isinstance(d, int):
            return d
        expr = sympy.sympify(sympy.sympify(d.node.expr).xreplace(self.sizes))
        # an unbound symbol (not an input size) has no value to use: count it as 1
        return int(expr) if expr.is_number else 1


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
