"""Tracing: free nodes by op semantics, contracted edges, hazard edges, and every zoo model."""

from __future__ import annotations

import operator

import pytest
import torch
from engine_helpers import traced
from torch import nn
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from opara_core import zoo
from opara_core.engine import costs
from opara_core.engine.trace import _is_view, from_graph_module, is_free, trace

aten = torch.ops.aten


@pytest.mark.parametrize(
    "op, view",
    [
        (aten.view.default, True),
        (aten.permute.default, True),
        (aten.expand.default, True),
        (aten.t.default, True),
        (aten.slice.Tensor, True),
        (aten.select.int, True),
        (aten.unsqueeze.default, True),
        (aten.split.Tensor, True),
        (aten.alias.default, True),
        (aten.relu.default, False),
        (aten.clone.default, False),
        (aten.add_.Tensor, False),  # writes in place: a kernel, not a view
        (aten.convolution.default, False),
    ],
)
def test_views_are_recognised_from_the_schema(op, view):
    assert _is_view(op._schema) is view


class _Mixed(nn.Module):
    """Convolution, a view chain (flatten, transpose), a matmul: edges pass through views."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.weight = nn.Parameter(torch.randn(4 * 8 * 8, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x)).flatten(1)
        return y @ self.weight + y.sum(1, keepdim=True).t().t()


@pytest.fixture(scope="module")
def mixed():
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    return trace(_Mixed(), (torch.randn(2, 3, 8, 8),), ({0: batch},), name="mixed")


def test_free_nodes_are_marked_and_left_out_of_the_dag(mixed):
    nodes = list(mixed.module.graph.nodes)
    free = {n.name for n in nodes if n.meta["opara_free"]}
    kernels = [n.name for n in nodes if not n.meta["opara_free"]]
    assert list(mixed.dag.names) == kernels
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output", "call_module") or n.target is operator.getitem:
            assert n.name in free, n.format_node()
        if n.target in (aten.view.default, aten.permute.default, aten.t.default, aten.sym_size.int):
            assert n.name in free, n.format_node()
        if n.target in (aten.convolution.default, aten.relu.default, aten.mm.default, aten.add.Tensor):
            assert n.name not in free, n.format_node()
    assert any(n.op == "call_module" for n in nodes)  # export's guard function is there, and free


def test_edges_are_contracted_through_views(mixed):
    by_target = {}
    for n in mixed.module.graph.nodes:
        by_target.setdefault(n.target, n.name)
    relu, mm = by_target[aten.relu.default], by_target[aten.mm.default]
    # relu -> view (flatten) -> mm in the fx graph; one edge relu -> mm in the DAG.
    assert (relu, mm) in mixed.dag.edges


def test_the_traced_module_serves_other_batch_sizes(mixed):
    model = _Mixed()
    model.load_state_dict(mixed.module.state_dict())
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(mixed.module(x), model(x))


def test_fingerprint_is_stable_and_follows_the_inputs():
    torch.manual_seed(0)
    module = _Mixed()
    first = trace(module, (torch.randn(2, 3, 8, 8),))
    second = trace(module, (torch.randn(2, 3, 8, 8),))
    other = trace(module, (torch.randn(3, 3, 8, 8),))
    assert first.fingerprint == second.fingerprint != other.fingerprint


def _hazard_graph() -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """relu; a reader; an in-place add on relu's output; a later reader; an in-place mul."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(aten.relu.default, (x,))
    r1 = graph.call_function(aten.mul.Tensor, (a, 2.0))
    w1 = graph.call_function(aten.add_.Tensor, (a, 1.0))
    view = graph.call_function(aten.view.default, (a, [-1]))
    r2 = graph.call_function(aten.sum.default, (view,))
    w2 = graph.call_function(aten.mul_.Tensor, (a, 3.0))
    graph.output((r1, r2, w2))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    FakeTensorProp(gm).propagate(torch.randn(4, 4))
    return gm, {"r1": r1.name, "w1": w1.name, "r2": r2.name, "w2": w2.name}


def test_in_place_ops_get_hazard_edges():
    gm, name = _hazard_graph()
    edges = set(from_graph_module(gm).dag.edges)
    assert (name["r1"], name["w1"]) in edges  # write after read: the reader must go first
    assert (name["w1"], name["r2"]) in edges  # read after write, through a view, not a data edge
    assert (name["w1"], name["w2"]) in edges  # write after write
    assert (name["r2"], name["w2"]) in edges  # write after read, through a view


def test_plans_of_a_graph_with_hazards_compute_what_the_graph_computes():
    from opara_core.engine.interpreter import run_plan
    from opara_core.engine.interpreter import plan_graph

    gm, _ = _hazard_graph()
    op_graph = from_graph_module(gm)
    x = torch.randn(4, 4)
    expected = gm(x.clone())
    for policy in ("opara", "nimble", "wavefront"):
        for order in ("topological", "opara", "critical_path"):
            out = run_plan(op_graph, plan_graph(op_graph, policy, order=order), x.clone())
            torch.testing.assert_close(out, expected)


def test_functional_graphs_get_exactly_the_contracted_data_edges(mixed):
    def kernel_sources(node):  # walk back through free nodes to the kernels that feed `node`
        found = []
        for inp in node.all_input_nodes:
            found.extend(kernel_sources(inp) if inp.meta["opara_free"] else [inp])
        return found

    expected = {
        (k.name, n.name)
        for n in mixed.module.graph.nodes
        if not n.meta["opara_free"]
        for k in kernel_sources(n)
    }
    assert set(mixed.dag.edges) == expected


@pytest.mark.parametrize("name", zoo.names())
def test_every_zoo_model_traces_into_a_kernel_dag(name):
    graph = traced(name)
    nodes = list(graph.module.graph.nodes)
    kernels = [n for n in nodes if not is_free(n)]
    assert [n.name for n in kernels] == list(graph.dag.names)
    assert len(graph.dag) > 10 and graph.dag.edges
    ridge = costs.H100.ridge
    for n in kernels:  # the class comes from arithmetic intensity alone
        assert n.meta["opara_cost"] > 0
        compute = n.meta["opara_flops"] > 0 and n.meta["opara_flops"] >= ridge * n.meta["opara_bytes"]
        assert n.meta["opara_kind"] == ("compute" if compute else "memory"), n.format_node()
    assert "memory" in {node.kind for node in graph.dag.nodes}  # at batch 1 DeepFM has nothing else
    assert graph.fingerprint.startswith("sha256:")
    assert graph.name == name


def test_googlenet_has_its_57_convolutions_and_parallel_branches():
    graph = traced("googlenet")
    convs = [n for n in graph.module.graph.nodes if n.target == aten.convolution.default]
    assert len(convs) == 57 and all(c.name in graph.dag.index for c in convs)
    assert graph.dag.critical_path_us < 0.6 * sum(graph.dag.costs)  # room for concurrency
