"""One whole-model Inductor graph for every input shape, captured per shape.

A variable-length model's cells (sequence bucket x batch bucket) differ only in
sizes. Built per cell, every cell traced, planned and timed its own graphs (BERT's
36 cells: 93 s on an H100) and the multi-lane plans kept memory per lane
stream. Compiled once by `torch.compile` with dynamic sizes (Inductor's
freezing, under `inference_mode`, as an inference user runs it), the model is
one generated graph (two: Dynamo specialises sizes of 1), and each cell is a
CUDA graph captured around it on one stream: every cell's graph reuses the
blocks the larger ones freed.

Measured on one H100, 2026-11-26 (`scripts/varlen_cells.py --models bert`):
54 s to compile for all 36 cells; 0.93 ms at 16 tokens batch 1 against 1.54-1.94
for the engine's ATen graphs, 69.97 against 71.1 at 512 x 32; the pool of all 36
cells 778 MiB.

The compiled module must outlive its CUDA graphs (they read its frozen
weights): each CapturedGraph keeps it as its `owner`. `torch._dynamo.reset()`
in the same process would drop the compiled code while graphs still read it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from opara_core.engine.capture import CapturedGraph, CaptureError, capture_module


class WholeModelInductor:
    """`torch.compile(module, dynamic=True)`; compiles on the first capture and
    again only where a shape breaks its guards (a size of 1)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.compiled = torch.compile(module, dynamic=True)

    def capture(self, static_in: Sequence[torch.Tensor], pool: Any) -> CapturedGraph:
        """The compiled model at these inputs' shapes, as one CUDA graph in `pool`
        (the capture's warm-up compiles what is missing)."""
        try:
            with torch._inductor.config.patch(freezing=True), torch.inference_mode():
                captured = capture_module(self.compiled, static_in, pool)
        except CaptureError:
            raise
        except Exception as error:  # noqa: BLE001 - Dynamo and Inductor raise many kinds
            raise CaptureError(f"the whole-model Inductor graph failed at {[tuple(x.shape) for x in static_in]}: {type(error).__name__}: {error}") from error
        return captured
