"""Id ranges checked inside the graph a batch model serves.

An embedding index out of its table is a device-side assert inside a CUDA
graph, which ends the process's CUDA context, so every id must be checked
before the graph reads it. Checked on the host, that is numpy work per batch
(some 50 us with the cold caches a request meets); checked on the GPU from
outside the graph, it is several small kernel launches per batch. Here the
served module itself clamps its ranged inputs into their tables and returns,
as one more output, which rows were clamped: the check becomes part of the
captured graph (one fused kernel, no host work) and its verdict comes back
with the outputs. A clamped row's answer is thrown away and its request gets
an error naming the bad id.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from opara_core.spec import ModelSpec, TensorSpec

# the extra output: per row, 1 where an id was out of its range, else 0
OUT_OF_RANGE = "opara_ids_out_of_range"
OUT_OF_RANGE_SPEC = TensorSpec(OUT_OF_RANGE, torch.int32, ())


class ClampedIds(torch.nn.Module):
    """`module` with each ranged input clamped into its range first, and one
    more output: per row, 1 where any of its ids was out of range."""

    def __init__(self, module: torch.nn.Module, inputs: tuple[TensorSpec, ...]):
        super().__init__()
        self.module = module
        self.ranged: list[int] = []
        for k, spec in enumerate(inputs):
            limits = spec.limits()
            if limits is None:
                continue
            low, high = limits
            info = torch.iinfo(spec.dtype)
            self.ranged.append(k)
            # bounds in the input's own dtype (an int64 bound would promote int32 ids), per position where they differ
            self.register_buffer(f"low_{k}", torch.as_tensor(max(low, info.min), dtype=spec.dtype))
            self.register_buffer(f"high_{k}", torch.as_tensor(np.minimum(np.asarray(high) - 1, info.max), dtype=spec.dtype))

    def forward(self, *inputs: torch.Tensor):
        inputs = list(inputs)
        bad = None
        for k in self.ranged:
            ids = inputs[k]
            safe = torch.clamp(ids, getattr(self, f"low_{k}"), getattr(self, f"high_{k}"))
            rows = (safe != ids).flatten(1).any(1)
            bad = rows if bad is None else bad | rows
            inputs[k] = safe
        outputs = self.module(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return (*outputs, bad.to(torch.int32))


def in_graph(module: torch.nn.Module, entry: ModelSpec) -> tuple[torch.nn.Module, ModelSpec]:
    """The module to build and its description: `module` and `entry` as they
    are when no input is ranged, else `ClampedIds` and `entry` with the
    `OUT_OF_RANGE` output last."""
    if all(spec.limits() is None for spec in entry.inputs):
        return module, entry
    return ClampedIds(module, entry.inputs).eval(), dataclasses.replace(entry, outputs=(*entry.outputs, OUT_OF_RANGE_SPEC))


def guarded(entry: ModelSpec) -> bool:
    """Whether `entry` (what `in_graph` returned) carries the verdict output."""
    return bool(entry.outputs) and entry.outputs[-1].name == OUT_OF_RANGE
