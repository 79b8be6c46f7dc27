"""Launch orders (topological, Opara Alg. 2, critical-path first) and lane priorities."""

from __future__ import annotations

import pytest
from engine_helpers import appendix_dag, dags
from hypothesis import given, settings

from opara_core.planning import order as orders
from opara_core.planning.dag import Dag, OpNode


def _fan_out(children: list[OpNode]) -> Dag:
    """A source feeding every child: all children are ready at once after it."""
    return Dag((OpNode("src"), *children), tuple(("src", c.name) for c in children))


def _names(dag: Dag, order: tuple[int, ...]) -> list[str]:
    return [dag.names[i] for i in order]


def test_topological_is_the_node_list():
    dag = appendix_dag()
    assert orders.topological(dag) == tuple(range(13))


def test_opara_alternates_compute_and_memory_starting_with_compute():
    children = [OpNode("m1", "memory"), OpNode("m2", "memory"), OpNode("c1", "compute"), OpNode("c2", "compute")]
    dag = _fan_out(children)
    assert _names(dag, orders.resource_aware(dag)) == ["src", "m1", "c1", "m2", "c2"]


def test_opara_flag_flips_every_step_even_when_one_list_is_empty():
    # After src (compute, taken alone), the flag says "memory" next.
    dag = _fan_out([OpNode("c1", "compute"), OpNode("m1", "memory")])
    assert _names(dag, orders.resource_aware(dag)) == ["src", "m1", "c1"]


def test_opara_launches_the_least_resource_demand_first():
    children = [
        OpNode("big_smem", "compute", threads=256, shared_memory=48 * 1024),
        OpNode("small", "compute", threads=128, shared_memory=0),
        OpNode("mid", "compute", threads=256, shared_memory=8 * 1024),
    ]
    dag = _fan_out(children)
    assert _names(dag, orders.resource_aware(dag))[1:] == ["small", "mid", "big_smem"]


def test_without_a_profile_the_cheaper_operator_goes_first():
    dag = _fan_out([OpNode("slow", "compute", cost=9), OpNode("fast", "compute", cost=1)])
    assert _names(dag, orders.resource_aware(dag))[1:] == ["fast", "slow"]


def test_resource_demand_is_the_mean_of_known_fractions():
    assert orders.resource_demand(OpNode("x")) == 0
    node = OpNode("x", threads=512, registers=64, shared_memory=24 * 1024)
    assert orders.resource_demand(node) == pytest.approx((0.5 + 0.5 + 0.5) / 3)


def test_critical_path_first_takes_the_longest_remaining_path():
    nodes = (OpNode("s"), OpNode("short", cost=1), OpNode("long", cost=10), OpNode("tail", cost=1))
    dag = Dag(nodes, (("s", "short"), ("s", "long"), ("long", "tail")))
    assert _names(dag, orders.critical_path(dag)) == ["s", "long", "short", "tail"]


@settings(max_examples=60, deadline=None)
@given(dag=dags())
def test_every_order_is_a_topological_permutation(dag):
    for name in orders.ORDERS:
        order = orders.launch_order(dag, name)
        assert sorted(order) == list(range(len(dag)))
        pos = {v: i for i, v in enumerate(order)}
        assert all(pos[u] < pos[v] for u, v in dag.index_edges)
        assert order == orders.launch_order(dag, name)  # deterministic


def test_unknown_order_is_a_value_error():
    with pytest.raises(ValueError, match="unknown launch order 'random'"):
        orders.launch_order(appendix_dag(), "random")


def test_lanes_carrying_the_critical_path_get_high_priority():
    nodes = (OpNode("s"), OpNode("cheap", cost=1), OpNode("heavy", cost=10), OpNode("t"))
    dag = Dag(nodes, (("s", "cheap"), ("s", "heavy"), ("cheap", "t"), ("heavy", "t")))
    # lanes: s, heavy, t on lane 1; cheap on lane 0
    assert orders.lane_priorities(dag, (1, 0, 1, 1)) == (orders.NORMAL_PRIORITY, orders.HIGH_PRIORITY)
    assert orders.HIGH_PRIORITY < orders.NORMAL_PRIORITY  # CUDA: lower number, higher priority
