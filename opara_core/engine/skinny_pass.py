"""Inductor's own graph with frozen weights: its GEMMs through `opara::skinny_mm`.

`fusion.skinny_linears` gives the engine's graphs the small-row GEMM kernel
(`engine.skinny_gemm`) before Inductor compiles them. The whole-model graph
that variable-length serving compiles (`engine.whole_model`) is traced by
`torch.compile` itself, so the same rewrite runs as Inductor's post-grad custom
pass: after freezing, where every linear weight is a constant (folded to its
transposed view, [K, N]) and Inductor has already merged the linear layers
that share an input (BERT's q, k and v: one GEMM of N 2304). Each `mm` or
`addmm` whose right operand is such an fp32 CUDA constant becomes the op,
given the bias of an `addmm` (Inductor keeps `addmm` only where no pointwise
work follows that could take the add: the kernel adds it as it writes, cuBLAS
in `addmm`'s epilogue or as an add after `mm`, whichever was timed faster with
the bias at that shape; a separate generated add there cost BERT's 512 x 8 cell
2.3%, 19.33 against 18.89 ms on an H100, 2026-11-26). The op
picks a kernel or cuBLAS per row count when it runs, so one graph with
dynamic sizes serves every cell: a kernel where it measured faster (the
split-K one for few rows, tf32x3 tensor-core tiles above 128), elsewhere
cuBLAS's `mm` on the weight layout measured faster at that row count.
"""

from __future__ import annotations

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, GraphModule, Node

from opara_core.engine import skinny_gemm
from opara_core.engine.fusion import _add_constant, _constant

log = logging.getLogger(__name__)

aten = torch.ops.aten


class SkinnyGemmPass(CustomGraphPass):
    """For `torch._inductor.config.post_grad_custom_post_pass`. Its uuid (this
    file's and the op's source, the devices) keys Inductor's FX graph cache, so
    a change of either compiles again. `devices`: where GEMMs are rewritten (on
    a CPU the op is `torch.mm`: only tests want it there); `rewritten` counts
    the GEMMs of every graph it saw."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",)):
        self.devices = devices
        self.rewritten = 0

    def __call__(self, graph: Graph) -> None:
        count = rewrite_frozen_gemms(graph, self.devices)
        self.rewritten += count
        log.debug("%d frozen-weight GEMMs through opara::skinny_mm", count)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, skinny_gemm.__file__), extra=",".join(self.devices))


def rewrite_frozen_gemms(graph: Graph, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Route every GEMM with a constant fp32 right operand on one of `devices`
    through the op; the number rewritten."""
    gm = graph.owning_module
    count = 0
    for node in list(graph.nodes):
        weight_t = _frozen_right_operand(gm, node, devices)
        if weight_t is None:
            continue
        with graph.inserting_before(node):
            weight = _add_constant(gm, weight_t.t(), "skinny_w")
            stored = node.args[-1] if weight_t.is_contiguous() else _add_constant(gm, weight_t.contiguous(), "skinny_w_t")
            bias = (node.args[0],) if node.target is aten.addmm.default else ()
            result = graph.call_function(skinny_gemm.skinny_mm_op(), (node.args[-2], weight, stored, *bias))
            result.meta["val"] = node.meta["val"]
        right = node.args[-1]
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        if not right.users:  # only the weight read as it was; nothing else is removed
            graph.erase_node(right)
        count += 1
    return count


def _frozen_right_operand(gm: GraphModule, node: Node, devices: tuple[str, ...]) -> torch.Tensor | None:
    """W of `mm(x, W)` or `addmm(b, x, W)` (default alpha and beta) where W is a
    2-D fp32 constant on one of `devices` and x fp32; None for anything else."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default) or node.kwargs:
        return None
    weight_t, left = _constant(gm, node.args[-1]), node.args[-2]
    left_val = left.meta.get("val") if isinstance(left, Node) else None
    if weight_t is None or not isinstance(left_val, torch.Tensor) or "val" not in node.meta:
        return None
    if weight_t.dim() != 2 or weight_t.device.type not in devices or weight_t.dtype != torch.float32 or left_val.dtype != torch.float32:
        return None
    return weight_t

