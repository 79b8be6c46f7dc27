"""The static cost model: roofline time, FLOPs from PyTorch's formulas, class from intensity."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opara_core.engine import costs
from opara_core.engine.trace import trace


def test_roofline_estimate_and_class():
    spec = costs.GpuSpec(peak_flops=100e12, bandwidth=2e12, launch_us=3.0)
    assert spec.ridge == 50
    matmul = costs.estimate(flops=2e9, nbytes=1e6, spec=spec)  # 2000 FLOP/byte
    assert matmul.kind == "compute" and matmul.us == pytest.approx(2e9 / 100e12 * 1e6 + 3.0)
    add = costs.estimate(flops=0, nbytes=4e6, spec=spec)
    assert add.kind == "memory" and add.us == pytest.approx(4e6 / 2e12 * 1e6 + 3.0)
    assert costs.estimate(flops=49e6, nbytes=1e6, spec=spec).kind == "memory"  # just under the ridge
    assert add.intensity == 0 and matmul.intensity == 2000


def test_default_is_an_h100_in_fp32():
    assert costs.H100.ridge == pytest.approx(67e12 / 3.35e12)


class _ConvRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


@pytest.fixture(scope="module")
def conv_graph():
    batch = torch.export.Dim("batch", min=1, max=64)
    return trace(_ConvRelu(), (torch.randn(2, 64, 32, 32),), ({0: batch},))


def _node(graph, target):
    return next(n for n in graph.module.graph.nodes if n.target == target)


def _batch(node):
    """The symbol of the dynamic batch dimension in the node's output."""
    return node.meta["val"].shape[0].node.expr


def test_convolution_flops_bytes_and_class(conv_graph):
    conv = _node(conv_graph, torch.ops.aten.convolution.default)
    cost = costs.node_cost(conv, sizes={_batch(conv): 2})
    assert cost.flops == 2 * 2 * 64 * 32 * 32 * 64 * 3 * 3  # 2 * batch * Cout * H * W * Cin * k * k
    activation = 2 * 64 * 32 * 32 * 4
    assert cost.bytes == activation + 64 * 64 * 9 * 4 + 64 * 4 + activation  # input, weight, bias, output
    assert cost.kind == "compute"
    # trace() estimated it for the example inputs (batch 2) and kept it in node.meta
    assert conv.meta["opara_kind"] == "compute" and conv.meta["opara_cost"] == pytest.approx(cost.us)


def test_relu_is_memory_bound(conv_graph):
    relu = _node(conv_graph, torch.ops.aten.relu.default)
    cost = costs.node_cost(relu, sizes={_batch(relu): 2})
    assert cost.flops == 0 and cost.bytes == 2 * (2 * 64 * 32 * 32 * 4) and cost.kind == "memory"


def test_symbolic_batch_takes_the_requested_size(conv_graph):
    relu = _node(conv_graph, torch.ops.aten.relu.default)
    one = costs.node_cost(relu)  # a size without a value counts as 1
    assert one.bytes == 2 * (64 * 32 * 32 * 4)
    assert costs.node_cost(relu, sizes={_batch(relu): 8}).bytes == 8 * one.bytes


def test_trace_estimates_costs_for_cost_inputs():
    batch = torch.export.Dim("batch", min=1, max=64)
    graph = trace(_ConvRelu(), (torch.randn(2, 64, 32, 32),), ({0: batch},), cost_inputs=(torch.randn(6, 64, 32, 32),))
    relu = _node(graph, torch.ops.aten.relu.default)
    assert relu.meta["opara_bytes"] == 6 * 2 * (64 * 32 * 32 * 4)
    assert graph.dag.nodes[graph.dag.index[relu.name]].bytes == relu.meta["opara_bytes"]


def test_class_does_not_depend_on_the_node_name(conv_graph):
    relu = _node(conv_graph, torch.ops.aten.relu.default)
    before = costs.node_cost(relu)
    old = relu.name
    try:
        relu.name = "convolution_addmm_mm"
        assert costs.node_cost(relu) == before
    finally:
        relu.name = old
