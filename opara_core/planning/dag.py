"""The planning input: operators and their dependencies, with no torch import.

Every policy, launch order and plan works on a `Dag`, so that planning runs and is
tested on machines without a GPU, and a DAG file (`python -m opara_core plan --dag`)
and a traced model go through exactly the same code. Internally nodes are numbered
by their position in the (topological) node list; all helpers work on those
indices so that no result depends on the hashing of strings.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import networkx as nx

KINDS = ("compute", "memory")


@dataclass(frozen=True)
class OpNode:
    """One operator: what it costs and what it occupies on the GPU.

    `cost` is the estimated kernel time in µs (static model or profile). The
    resources are per kernel launch, where known (from a GPU profile): threads per
    block, registers per thread and shared memory per block in bytes; Opara's
    launch order puts the least demanding ready operator first.
    """

    name: str
    kind: str = "compute"
    cost: float = 1.0
    flops: float = 0.0
    bytes: float = 0.0
    threads: int | None = None
    registers: int | None = None
    shared_memory: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"node name must be a non-empty string, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"node {self.name!r}: kind must be 'compute' or 'memory', got {self.kind!r}")
        for field in ("cost", "flops", "bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"node {self.name!r}: {field} must be a finite number >= 0, got {value!r}")
        for field in ("threads", "registers", "shared_memory"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"node {self.name!r}: {field} must be an integer >= 0, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        """The node as a DAG-file entry; unknown resources are left out."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "cost": self.cost}
        for field in ("flops", "bytes"):
            if getattr(self, field):
                out[field] = getattr(self, field)
        for field in ("threads", "registers", "shared_memory"):
            if getattr(self, field) is not None:
                out[field] = getattr(self, field)
        return out

    @classmethod
    def from_json(cls, entry: Any) -> OpNode:
        if not isinstance(entry, dict):
            raise ValueError(f"a node must be an object with 'name' and 'kind', got {entry!r}")
        if "name" not in entry:
            raise ValueError(f"node {entry!r} has no 'name'")
        if "kind" not in entry:
            raise ValueError(f"node {entry['name']!r} has no 'kind' ('compute' or 'memory')")
        known = ("name", "kind", "cost", "flops", "bytes", "threads", "registers", "shared_memory")
        return cls(**{key: entry[key] for key in known if key in entry})


@dataclass(frozen=True)
class Dag:
    """Operators in a topological order and the dependency edges between them.

    Construction validates (duplicate names, edges naming unknown nodes, cycles,
    nodes not in topological order) and raises ValueError with a one-line message
    that names the problem. Repeated edges are kept once. The graph helpers are
    computed on first use and cached, on node indices.
    """

    nodes: tuple[OpNode, ...]
    edges: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        seen: set[str] = set()
        for node in self.nodes:
            if not isinstance(node, OpNode):
                raise ValueError(f"nodes must be OpNode objects, got {node!r}")
            if node.name in seen:
                raise ValueError(f"duplicate node name {node.name!r}")
            seen.add(node.name)
        edges: dict[tuple[str, str], None] = {}
        for edge in self.edges:
            if not isinstance(edge, (list, tuple)) or len(edge) != 2:
                raise ValueError(f"an edge must be a pair [src, dst], got {edge!r}")
            src, dst = edge
            for end in (src, dst):
                if not isinstance(end, str) or end not in seen:
                    raise ValueError(f"edge [{src!r}, {dst!r}] names unknown node {end!r}")
            edges[(src, dst)] = None
        object.__setattr__(self, "edges", tuple(edges))
        self._check_order()

    def _check_order(self) -> None:
        """Nodes must be listed in a topological order; say 'cycle' when there is one."""
        index = self.index
        backward = [(u, v) for u, v in self.edges if index[u] >= index[v]]
        if not backward:
            return
        graph = nx.DiGraph(self.edges)
        try:
            cycle = nx.find_cycle(graph, source=backward[0][0])
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle is None:
            try:
                cycle = nx.find_cycle(graph)
            except nx.NetworkXNoCycle:
                u, v = backward[0]
                raise ValueError(
                    f"nodes are not in a topological order: edge {u!r} -> {v!r} but {v!r} is listed first"
                ) from None
        path = [u for u, _ in cycle] + [cycle[0][0]]
        raise ValueError("cycle: " + " -> ".join(path))

    # ---- construction and serialisation -------------------------------------------

    @classmethod
    def from_json(cls, data: Any) -> Dag:
        """Read the DAG-file format: {"nodes": [{"name", "kind", ...}], "edges": [[src, dst]]}."""
        if not isinstance(data, dict):
            raise ValueError("a DAG must be a JSON object with 'nodes' and 'edges'")
        nodes = data.get("nodes")
        edges = data.get("edges", [])
        if not isinstance(nodes, list):
            raise ValueError("a DAG needs a 'nodes' list")
        if not isinstance(edges, list):
            raise ValueError("'edges' must be a list of [src, dst] pairs")
        return cls(tuple(OpNode.from_json(n) for n in nodes), tuple(tuple(e) if isinstance(e, list) else e for e in edges))

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [n.to_json() for n in self.nodes], "edges": [list(e) for e in self.edges]}

    def fingerprint(self) -> str:
        """A stable hash of the whole DAG (structure, kinds, costs)."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_networkx(self) -> nx.DiGraph:
        """A DiGraph keyed by node name, node attributes from OpNode, in file order."""
        graph = nx.DiGraph()
        for node in self.nodes:
            graph.add_node(node.name, **node.to_json())
        graph.add_edges_from(self.edges)
        return graph

    # ---- cached helpers on node indices -------------------------------------------

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    @cached_property
    def index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}

    @cached_property
    def index_edges(self) -> tuple[tuple[int, int], ...]:
        index = self.index
        return tuple((index[u], index[v]) for u, v in self.edges)

    @cached_property
    def preds(self) -> tuple[tuple[int, ...], ...]:
        """Predecessors of each node, in the order their edges appear."""
        return _adjacency(len(self.nodes), ((v, u) for u, v in self.index_edges))

    @cached_property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        """Successors of each node, in the order their edges appear."""
        return _adjacency(len(self.nodes), self.index_edges)

    @cached_property
    def reduced_edges(self) -> tuple[tuple[int, int], ...]:
        """The edges of the transitive reduction, in file order.

        Only these need synchronisation; every other edge is implied by a path. An
        edge u -> v is implied when v descends from another successor of u. Bitsets
        make this a few ms on NASNet, where `networkx.transitive_reduction` takes
        over a second (the tests check that both agree).
        """
        desc = self.descendants
        below = [0] * len(self.nodes)  # everything strictly below u's successors
        for u, succs in enumerate(self.succs):
            for w in succs:
                below[u] |= desc[w]
        return tuple((u, v) for u, v in self.index_edges if not below[u] >> v & 1)

    @cached_property
    def reduced_preds(self) -> tuple[tuple[int, ...], ...]:
        return _adjacency(len(self.nodes), ((v, u) for u, v in self.reduced_edges))

    @cached_property
    def reduced_succs(self) -> tuple[tuple[int, ...], ...]:
        return _adjacency(len(self.nodes), self.reduced_edges)

    @cached_property
    def descendants(self) -> tuple[int, ...]:
        """Strict descendants of each node as a bitset (bit j set: a path i -> j)."""
        n = len(self.nodes)
        desc = [0] * n
        for i in range(n - 1, -1, -1):
            bits = 0
            for j in self.succs[i]:
                bits |= desc[j] | (1 << j)
            desc[i] = bits
        return tuple(desc)

    def reaches(self, i: int, j: int) -> bool:
        """Whether there is a path from node i to node j (i != j)."""
        return bool(self.descendants[i] >> j & 1)

    @cached_property
    def costs(self) -> tuple[float, ...]:
        return tuple(float(n.cost) for n in self.nodes)

    @cached_property
    def top_levels(self) -> tuple[float, ...]:
        """Earliest start of each node with unlimited streams (µs)."""
        cost = self.costs
        top = [0.0] * len(self.nodes)
        for i, preds in enumerate(self.preds):
            top[i] = max((top[p] + cost[p] for p in preds), default=0.0)
        return tuple(top)

    @cached_property
    def bottom_levels(self) -> tuple[float, ...]:
        """Longest cost-weighted path from each node to a sink, the node included (µs)."""
        cost = self.costs
        bottom = [0.0] * len(self.nodes)
        for i in range(len(self.nodes) - 1, -1, -1):
            bottom[i] = cost[i] + max((bottom[s] for s in self.succs[i]), default=0.0)
        return tuple(bottom)

    @cached_property
    def critical_path(self) -> tuple[int, ...]:
        """The nodes of one longest path (ties go to the lower index)."""
        if not self.nodes:
            return ()
        bottom = self.bottom_levels
        sources = [i for i, p in enumerate(self.preds) if not p]
        path = [max(sources, key=lambda i: (bottom[i], -i))]
        while self.succs[path[-1]]:
            path.append(max(self.succs[path[-1]], key=lambda i: (bottom[i], -i)))
        return tuple(path)

    @cached_property
    def critical_path_us(self) -> float:
        """The length of the longest path: no schedule can finish sooner."""
        return max(self.bottom_levels, default=0.0)


def _adjacency(n: int, pairs: Any) -> tuple[tuple[int, ...], ...]:
    out: list[list[int]] = [[] for _ in range(n)]
    for a, b in pairs:
        out[a].append(b)
    return tuple(tuple(x) for x in out)
