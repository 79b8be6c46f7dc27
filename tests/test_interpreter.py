"""Plans over traced graphs: the full-graph schedule, and the interpreter that runs a
plan's order and matches eager PyTorch on every zoo model."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import traced
from torch import nn
from torch.utils._pytree import tree_leaves

from opara_core import zoo
from opara_core.planning import policies
from opara_core.engine.interpreter import PlanInterpreter, graph_schedule, plan_graph, run_plan
from opara_core.engine.trace import trace
from opara_core.planning.plan import Plan


def _assert_same(actual, expected):
    actual, expected = tree_leaves(actual), tree_leaves(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("name", zoo.names())
def test_plan_execution_equals_eager(name):
    """Opara's plan (Alg. 2 order, most streams) against the eager module, batch 1."""
    graph = traced(name)
    model = zoo.get(name)
    inputs = model.example_inputs(1, seed=1)
    with torch.no_grad():
        expected = model.build()(*inputs)
    _assert_same(run_plan(graph, plan_graph(graph, "opara"), *inputs), expected)


@pytest.mark.parametrize("policy", policies.names())
def test_every_policy_and_budget_runs_correctly(policy):
    graph = traced("deepfm")  # small and wide: many lanes, many orders differ
    model = zoo.get("deepfm")
    inputs = model.example_inputs(3, seed=2)  # another batch size than traced
    with torch.no_grad():
        expected = model.build()(*inputs)
    for budget in (None, 2):
        _assert_same(run_plan(graph, plan_graph(graph, policy, budget), *inputs), expected)


def test_nodes_run_in_the_plans_order_on_their_lanes():
    graph = traced("deepfm")
    plan = plan_graph(graph, "opara", order="critical_path")
    interpreter = PlanInterpreter(graph, plan)
    with torch.no_grad():
        interpreter.run(*zoo.get("deepfm").example_inputs(1))
    schedule = graph_schedule(plan, graph)
    assert [name for name, _ in interpreter.executed] == list(schedule.order)
    assert [name for name, _ in interpreter.executed if name in plan.stream] == list(plan.order)
    assert all(lane == schedule.stream[name] for name, lane in interpreter.executed)


class _Branches(nn.Module):
    """Two conv branches joined by cat, then views (free) and two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.cat([torch.relu(self.a(x)), self.b(x)], 1).flatten(1)
        return y.sum(-1), y.t()


@pytest.fixture(scope="module")
def branches():
    torch.manual_seed(0)
    return trace(_Branches(), (torch.randn(2, 3, 8, 8),), name="branches")


def test_graph_schedule_covers_every_node_inputs_first(branches):
    plan = plan_graph(branches, "opara")
    schedule = graph_schedule(plan, branches)
    nodes = {n.name: n for n in branches.module.graph.nodes}
    assert sorted(schedule.order) == sorted(nodes)
    pos = {name: i for i, name in enumerate(schedule.order)}
    for name, node in nodes.items():
        assert all(pos[i.name] < pos[name] for i in node.all_input_nodes), name
    assert schedule.order[-1] == "output"
    kernels = [name for name in schedule.order if name in plan.stream]
    assert kernels == list(plan.order)


def test_free_nodes_take_their_producers_stream(branches):
    plan = plan_graph(branches, "opara")
    schedule = graph_schedule(plan, branches)
    for node in branches.module.graph.nodes:
        if node.name in plan.stream:
            assert schedule.stream[node.name] == plan.stream[node.name]
        elif node.op in ("placeholder", "get_attr", "output"):
            assert schedule.stream[node.name] == 0
        else:
            assert schedule.stream[node.name] == schedule.stream[node.all_input_nodes[0].name]


def test_plan_graph_carries_the_fingerprint_and_free_count(branches):
    plan = plan_graph(branches, "nimble")
    assert plan.fingerprint == branches.fingerprint
    assert plan.free_ops == len(branches.free_nodes()) > 0
    assert plan.num_streams == 2  # the two conv branches


def test_graph_schedule_rejects_an_order_that_breaks_an_edge(branches):
    plan = plan_graph(branches, "sequential")
    broken = Plan.from_json({**plan.to_json(), "order": list(reversed(plan.order))})
    with pytest.raises(ValueError, match="before one of its inputs"):
        graph_schedule(broken, branches)
