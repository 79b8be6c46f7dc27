"""The planning input: validation, JSON, and the cached graph helpers."""

from __future__ import annotations


import networkx as nx
import pytest
from engine_helpers import appendix_dag, dags, reach_by_brute_force, reduction_by_brute_force
from hypothesis import given, settings

from opara_core.planning.dag import Dag, OpNode


def _dag(names: str, edges: list[str]) -> Dag:
    return Dag(tuple(OpNode(n) for n in names), tuple(tuple(e) for e in edges))


def test_json_round_trip_keeps_everything():
    nodes = (
        OpNode("conv", "compute", cost=12.5, flops=1e9, bytes=4e6, threads=256, registers=64, shared_memory=4096),
        OpNode("relu", "memory", cost=2.0, bytes=8e5),
    )
    dag = Dag(nodes, (("conv", "relu"),))
    assert Dag.from_json(dag.to_json()) == dag
    assert dag.to_json()["nodes"][1] == {"name": "relu", "kind": "memory", "cost": 2.0, "bytes": 8e5}


def test_from_json_reads_the_cli_format_and_ignores_extra_fields():
    dag = Dag.from_json(
        {"nodes": [{"name": "a", "kind": "compute", "note": "x"}, {"name": "b", "kind": "memory"}], "edges": [["a", "b"]]}
    )
    assert dag.names == ("a", "b") and dag.edges == (("a", "b"),) and dag.nodes[0].cost == 1.0


@pytest.mark.parametrize(
    "data, message",
    [
        ({"nodes": [{"name": "a", "kind": "compute"}, {"name": "a", "kind": "memory"}], "edges": []}, "duplicate node name 'a'"),
        ({"nodes": [{"name": "a", "kind": "compute"}], "edges": [["a", "b"]]}, "edge ['a', 'b'] names unknown node 'b'"),
        (
            {"nodes": [{"name": n, "kind": "compute"} for n in "abc"], "edges": [["a", "b"], ["b", "c"], ["c", "a"]]},
            "cycle: ",
        ),
        ({"nodes": [{"name": "a", "kind": "compute"}], "edges": [["a", "a"]]}, "cycle: a -> a"),
        (
            {"nodes": [{"name": "b", "kind": "compute"}, {"name": "a", "kind": "compute"}], "edges": [["a", "b"]]},
            "not in a topological order: edge 'a' -> 'b'",
        ),
        ({"nodes": [{"name": "a", "kind": "gpu"}], "edges": []}, "kind must be 'compute' or 'memory'"),
        ({"nodes": [{"name": "a"}], "edges": []}, "node 'a' has no 'kind'"),
        ({"nodes": [{"name": "a", "kind": "compute", "cost": -1}], "edges": []}, "cost must be a finite number"),
        ({"nodes": [{"name": "a", "kind": "compute"}], "edges": [["a"]]}, "an edge must be a pair"),
        ({"edges": []}, "needs a 'nodes' list"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_input_gets_a_one_line_message_naming_the_problem(data, message):
    with pytest.raises(ValueError) as info:
        Dag.from_json(data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_cycle_is_reported_as_a_cycle_with_its_path():
    with pytest.raises(ValueError, match=r"^cycle: (a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c)$"):
        _dag("abc", ["ab", "bc", "ca"])


def test_repeated_edges_are_kept_once_in_first_order():
    dag = _dag("abc", ["ac", "bc", "ac"])
    assert dag.edges == (("a", "c"), ("b", "c"))


def test_predecessors_follow_the_order_of_edges_in_the_file():
    dag = _dag("abcd", ["bd", "cd", "ad"])
    assert dag.preds[3] == (1, 2, 0)
    assert dag.succs[0] == (3,)


def test_transitive_reduction_and_reachability():
    dag = _dag("abcd", ["ab", "bc", "ac", "cd", "ad"])
    assert dag.reduced_edges == ((0, 1), (1, 2), (2, 3))
    assert dag.reaches(0, 3) and not dag.reaches(3, 0) and not dag.reaches(1, 0)


@settings(max_examples=60, deadline=None)
@given(dag=dags())
def test_helpers_agree_with_brute_force(dag):
    assert sorted(dag.reduced_edges) == reduction_by_brute_force(dag)
    assert set(nx.transitive_reduction(nx.DiGraph(list(dag.index_edges))).edges) == set(dag.reduced_edges)
    reach = reach_by_brute_force(dag)
    n = len(dag)
    assert all(dag.reaches(u, v) == reach[u][v] for u in range(n) for v in range(n))
    graph = dag.to_networkx()
    assert list(graph.nodes) == list(dag.names) and set(graph.edges) == set(dag.edges)
    assert dag.critical_path_us == pytest.approx(nx.dag_longest_path_length(_weighted(dag)))


def test_critical_path_follows_the_most_expensive_branch():
    nodes = (OpNode("s", cost=1), OpNode("x", cost=5), OpNode("y", cost=9), OpNode("t", cost=1))
    dag = Dag(nodes, (("s", "x"), ("s", "y"), ("x", "t"), ("y", "t")))
    assert dag.critical_path == (0, 2, 3)
    assert dag.critical_path_us == 11
    assert dag.top_levels == (0, 1, 1, 10)


def test_fingerprint_is_stable_and_sensitive():
    dag = appendix_dag()
    assert dag.fingerprint() == appendix_dag().fingerprint()
    changed = Dag(dag.nodes[:-1] + (OpNode("13", cost=2.0),), dag.edges)
    assert changed.fingerprint() != dag.fingerprint()


def _weighted(dag: Dag) -> nx.DiGraph:
    """Node costs moved onto edges (plus a sink) so networkx can find the longest path."""
    graph = nx.DiGraph()
    graph.add_nodes_from(dag.names)
    graph.add_node("__sink__")
    for u, v in dag.edges:
        graph.add_edge(u, v, weight=dag.nodes[dag.index[u]].cost)
    for node in dag.nodes:
        graph.add_edge(node.name, "__sink__", weight=node.cost)
    return graph
