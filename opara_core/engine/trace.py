"""Trace a model into an operator graph: an fx GraphModule plus the kernel DAG to plan.

`torch.export` (a functional ATen graph) is used because `fx.symbolic_trace` fails
on timm's NASNet and HuggingFace models. Every fx node gets `node.meta["opara_free"]`:
free nodes launch no kernel (placeholders, get_attr, output, getitem, views, and
nodes with no tensor result such as symbolic sizes or export's guard function). The
kernel DAG holds only the other nodes, with edges through free nodes contracted and,
if mutating ops survive, read/write hazard edges added. Kernel nodes also get their
static cost in `node.meta` ("opara_cost" in µs, "opara_flops", "opara_bytes",
"opara_kind").
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_flatten

from opara_core.engine import costs as cost_model
from opara_core.engine.trace_cache import exported_module
from opara_core.planning.dag import Dag, OpNode
from opara_core.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class OpGraph:
    """A traced model: the runnable fx module and the kernel DAG that plans are made for.

    `fingerprint` identifies the model and its inputs (graph code, DAG with costs,
    input shapes and dtypes), so a stored plan can be matched to what it was made for.
    """

    module: torch.fx.GraphModule
    dag: Dag
    fingerprint: str
    name: str = ""

    def free_nodes(self) -> list[torch.fx.Node]:
        return [n for n in self.module.graph.nodes if n.meta["opara_free"]]


def trace(
    module: torch.nn.Module,
    example_inputs: Sequence[Any],
    dynamic_shapes: Any = None,
    *,
    cost_inputs: Sequence[Any] | None = None,
    spec: cost_model.GpuSpec = cost_model.H100,
    name: str = "",
    cache: Path | None = None,
) -> OpGraph:
    """Export `module` (switched to eval mode) with `example_inputs` and build its OpGraph.

    With `dynamic_shapes` (torch.export's argument) one graph serves every batch
    size; export specialises a dimension whose example size is 0 or 1, so trace with
    a batch of at least 2 and pass `cost_inputs` with the batch the costs are for.
    `cache`: a directory of exported graphs (engine.trace_cache), None to export.
    """
    example_inputs = tuple(example_inputs)
    gm = exported_module(module.eval(), example_inputs, dynamic_shapes, cache)
    inputs = example_inputs if cost_inputs is None else tuple(cost_inputs)
    sizes = _size_env(gm, inputs)
    shapes = [(tuple(t.shape), str(t.dtype)) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    return from_graph_module(gm, sizes=sizes, spec=spec, name=name, salt=repr(shapes))


def trace_model(
    model: ModelSpec,
    module: torch.nn.Module,
    device: torch.device | str = "cpu",
    batch: int = 1,
    spec: cost_model.GpuSpec = cost_model.H100,
    cache: Path | None = None,
) -> OpGraph:
    """Trace `module`, whose interface `model` describes, with a dynamic
    batch, on `device` itself so that ops that create tensors (arange, full)
    are traced with that device; one graph serves every batch size, and costs
    are estimated for `batch`. `cache`: see `trace`."""
    module = module.to(device)
    example = tuple(t.to(device) for t in model.example_inputs(max(batch, 2)))
    return trace(
        module,
        example,
        model.dynamic_shapes(max_batch=max(64, batch)),
        cost_inputs=tuple(t.to(device) for t in model.example_inputs(batch)),
        spec=spec,
        name=model.name,
        cache=cache,
    )


def from_graph_module(
    gm: torch.fx.GraphModule,
    *,
    sizes: Mapping[sympy.Symbol, int] | None = None,
    spec: cost_model.GpuSpec = cost_model.H100,
    name: str = "",
    salt: str = "",
) -> OpGraph:
    """Annotate an ATen-level GraphModule (nodes need meta["val"]) and build its kernel DAG."""
    nodes = list(gm.graph.nodes)
    for node in nodes:
        node.meta["opara_free"] = is_free(node)
    kernels = [n for n in nodes if not n.meta["opara_free"]]
    for node in kernels:
        cost = cost_model.node_cost(node, spec, sizes)
        node.meta.update(opara_cost=cost.us, opara_flops=cost.flops, opara_bytes=cost.bytes, opara_kind=cost.kind)
    edges = _kernel_edges(nodes)
    dag = Dag(
        tuple(
            OpNode(
                name=n.name,
                kind=n.meta["opara_kind"],
                cost=n.meta["opara_cost"],
                flops=n.meta["opara_flops"],
                bytes=n.meta["opara_bytes"],
            )
            for n in kernels
        ),
        tuple((u.name, v.name) for u, v in edges),
    )
    digest = hashlib.sha256("\n".join([gm.code, dag.fingerprint(), salt]).encode()).hexdigest()[:16]
    log.info("traced %s: %d nodes, %d kernels, %d edges", name or "graph", len(nodes), len(kernels), len(dag.edges))
    return OpGraph(module=gm, dag=dag, fingerprint="sha256:" + digest, name=name)


# ---- which nodes launch kernels ------------------------------------------------------


def is_free(node: torch.fx.Node) -> bool:
    """Whether the node launches no kernel.

    Views are recognised by the ATen schema, not by name: every result aliases an
    input and nothing is written in place (`aten.view(Tensor(a) self) -> Tensor(a)`).
    A node without a tensor result (symbolic sizes, asserts, export's `_guards_fn`)
    launches nothing either.
    """
    if node.op in ("placeholder", "get_attr", "output") or node.target is operator.getitem:
        return True
    if not _has_tensor(node.meta.get("val")):
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return _is_view_op(target)
    return False


@functools.cache
def _is_view_op(op: torch._ops.OpOverload) -> bool:
    """Per op, not per node: reading `_schema` and its arguments builds new
    objects each time (0.75 s of NASNet's warm build on an H200, run 36)."""
    return op.overloadpacket in _UNANNOTATED_VIEWS or _is_view(op._schema)


# `_unsafe_view` returns a view by contract ("a view, hidden from autograd") but its
# schema carries no alias annotation.
_UNANNOTATED_VIEWS = (torch.ops.aten._unsafe_view,)


def _is_view(schema: torch.FunctionSchema) -> bool:
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    return bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(_has_tensor(v) for v in value)


def _written_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes an op writes in place (schema `Tensor(a!)`)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    written = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        written.extend(v for v in tree_flatten(value)[0] if isinstance(v, torch.fx.Node))
    return written


# ---- dependency edges ----------------------------------------------------------------


def _kernel_edges(nodes: Sequence[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Edges between kernel nodes: data edges contracted through free nodes, then hazards."""
    reach: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # free node -> kernels it passes on
    edges: dict[tuple[torch.fx.Node, torch.fx.Node], None] = {}
    for node in nodes:
        if node.op == "output":
            continue
        sources: dict[torch.fx.Node, None] = {}
        for inp in node.all_input_nodes:
            for k in reach[inp] if inp.meta["opara_free"] else (inp,):
                sources[k] = None
        if node.meta["opara_free"]:
            reach[node] = list(sources)
        else:
            edges.update(((k, node), None) for k in sources)
    edges.update((e, None) for e in _hazard_edges(nodes))
    return list(edges)


def _hazard_edges(nodes: Sequence[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Read-after-write, write-after-read and write-after-write edges for in-place ops.

    A write is not visible as a data edge: later readers of the written tensor (or a
    view of it) name the original node. Tensors are grouped by the storage they view
    (their root); accesses to one root are ordered as in the graph. Functional
    graphs (what torch.export gives) have no writes and get no extra edges.
    """
    if not any(_written_inputs(n) for n in nodes):
        return []
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    last_writer: dict[torch.fx.Node, torch.fx.Node] = {}
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    edges = []
    for node in nodes:
        inputs = node.all_input_nodes
        written = _written_inputs(node)
        if node.meta["opara_free"]:
            root[node] = root[inputs[0]] if inputs else node
            continue
        root[node] = root[written[0]] if written else node
        reads = list(dict.fromkeys(root[i] for i in inputs))
        writes = list(dict.fromkeys(root[i] for i in written))
        for r in reads:
            if r in last_writer:
                edges.append((last_writer[r], node))
        for r in writes:
            edges.extend((reader, node) for reader in readers.get(r, []) if reader is not node)
            if r in last_writer:
                edges.append((last_writer[r], node))
            last_writer[r] = node
            readers[r] = []
        for r in reads:
            if r not in writes:
                readers.setdefault(r, []).append(node)
    return [(u, v) for u, v in edges if u is not v]


def _size_env(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> dict[sympy.Symbol, int]:
    """Map each symbolic input dimension (e.g. the batch) to its size in `inputs`."""
    env: dict[sympy.Symbol, int] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, tree_flatten(inputs)[0]):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(value, torch.Tensor):
            for dim, actual in zip(val.shape, value.shape):
                if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol):
                    env[dim.node.expr] = int(actual)
    return env
