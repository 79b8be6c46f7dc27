"""Fused lanes: each segment of a plan compiled by Inductor, the segments on their lanes.

`torch.compile` fuses elementwise chains, reductions and concatenations into
generated kernels but runs one stream; the plans run ATen kernels on several
streams. Here a plan is cut into segments (`planning.segments`), each segment's
nodes become a submodule compiled by Inductor (`engine.segment_compiler`: no
Inductor CUDA graphs of its own, since the whole schedule is captured into one
graph by `capture`), and a top-level graph calls the segments. The result is an
ordinary `OpGraph` whose kernels are the segments, with the segment-level plan:
`capture.PlanCapture` runs and captures it like any other.

Inductor launches on the stream that is current when a compiled segment is
called, so each segment's kernels land on its lane. Each batch size's shapes
are compiled (or loaded from the cache directory) before its capture's
warm-up; shapes are static: Inductor turns its convolution layout optimisation
off under dynamic shapes (pytorch#102670: 23-35% slower replays of GoogLeNet at
batch 8 on an H100, docs/benchmarks.md run 7), and loading saved code is fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx._lazy_graph_module import _LazyGraphModule

from opara_core.engine.capture import CapturedGraph, CaptureError, LanePool, PlanCapture
from opara_core.engine.compare import cudnn_algorithms
from opara_core.engine.segment_compiler import CompileCount, CompiledSegment, prepare
from opara_core.engine.segment_compiler import layout as segment_layout
from opara_core.engine.trace import OpGraph
from opara_core.planning.plan import Plan
from opara_core.planning.segments import Segmentation, segment_plan

log = logging.getLogger(__name__)

T = TypeVar("T")


class _PlanningThread:
    """One daemon thread that runs the work handed to it, in order: a build
    interrupted in the middle of compiling need not wait for it at exit."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            work, future = self.jobs.get()
            try:
                future.set_result(work())
            except BaseException as error:  # noqa: BLE001 - the caller's to handle
                future.set_exception(error)

    def run(self, work: Callable[[], T]) -> T:
        future: Future = Future()
        self.jobs.put((work, future))
        return future.result()


_planners: dict[bool, _PlanningThread] = {}  # timed -> its thread
_planner_lock = threading.Lock()


def on_planning_thread(work: Callable[[], T], device: torch.device, timed: bool = False) -> T:
    """`work()` on the thread where fused lanes run every convolution first:
    one for cuDNN's heuristic algorithms, one for the timed ones (`timed`,
    the captures of `autotune`). PyTorch keeps one cuDNN plan per
    convolution's parameters per thread, the first it made, whichever the
    mode: on the build's own thread an ATen candidate, the trace, the profile
    or the bench's eager column that ran the same convolution under cuDNN's
    benchmark decided the fused lanes' algorithm too. A build that timed every
    candidate then replayed other plans than a warm build that captured only
    its remembered choice (GoogLeNet at batch 8: 0.488 ms in the bench's auto
    column, 0.545 ms from a warm serving build, H200, docs/benchmarks.md run
    41). On these threads the plans follow the mode of the thread only, in
    every process, so one build can capture the same segments both ways."""
    with _planner_lock:
        planner = _planners.get(timed)
        if planner is None:
            planner = _planners[timed] = _PlanningThread("fused-lanes-planning" + ("-timed" if timed else ""))
    if threading.current_thread() is planner.thread:
        return work()

    def run() -> T:  # the current device is per thread: the caller's
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return work()

    return planner.run(run)


def split_into_segments(graph: OpGraph, segmentation: Segmentation) -> GraphModule:
    """A top-level module that calls one submodule per segment, in segment order.

    Kernel nodes and the `getitem`s of their results go to the kernel's segment.
    Other free nodes (views, placeholders, weights) are copied into every segment
    (and the top level) that reads them, so a segment reads only graph inputs,
    weights and results of segments that the segment plan orders before it.
    Every segment returns a tuple of the values read outside it.

    The modules generate their Python code when first run or read (fx's
    `_LazyGraphModule`): a warm build runs the segments' compiled code, never
    their fx code (making NASNet's two fused plans took 0.60 s with the code
    generated up front, 0.38 s without, on the 2-core CPU).
    """
    gm = graph.module
    nodes = list(gm.graph.nodes)
    home: dict[Node, str] = {}
    for node in nodes:
        if node.name in segmentation.of:
            home[node] = segmentation.of[node.name]
        elif node.target is operator.getitem and node.args[0] in home:
            home[node] = home[node.args[0]]
    needed_by = _consumers(nodes, home)
    members: dict[str, list[Node]] = {name: [] for name in segmentation.members}
    for node in nodes:
        if node in home:
            members[home[node]].append(node)
    outputs = {name: [n for n in group if needed_by[n] - {name}] for name, group in members.items()}

    top = Graph()
    top.set_codegen(gm.graph._codegen)  # the same pytree handling of inputs and outputs
    top_env: dict[Node, Node] = {}
    modules: dict[str, Any] = {}
    for node in nodes:
        if node.op == "placeholder":
            top_env[node] = top.node_copy(node)
    for name in segmentation.members:
        module, inputs = _segment_module(gm, members[name], outputs[name], home)
        modules[name] = module
        call = top.call_module(name, tuple(_copied(top, top_env, i) for i in inputs))
        for k, produced in enumerate(outputs[name]):
            top_env[produced] = top.call_function(operator.getitem, (call, k))
    output = next(n for n in nodes if n.op == "output")
    top.node_copy(output, lambda n: _copied(top, top_env, n))
    attributes = {n.target: operator.attrgetter(n.target)(gm) for n in top.nodes if n.op == "get_attr"}
    # the segments put in after the top module's code is made: made with them,
    # it would generate every segment's code a second time (NASNet: 361 of them)
    result = _LazyGraphModule({**attributes, **{name: torch.nn.Module() for name in modules}}, top)
    for name, module in modules.items():
        setattr(result, name, module)
    return result


def _consumers(nodes: list[Node], home: dict[Node, str]) -> dict[Node, set[str]]:
    """Which segments (or "output") read each node's value, looking through copied free nodes."""
    needed: dict[Node, set[str]] = {}
    for node in reversed(nodes):
        where: set[str] = set()
        for user in node.users:
            if user.op == "output":
                where.add("output")
            elif user in home:
                where.add(home[user])
            else:
                where |= needed[user]
        needed[node] = where
    return needed


def _segment_module(gm: GraphModule, group: list[Node], outputs: list[Node], home: dict[Node, str]) -> tuple[GraphModule, list[Node]]:
    """One segment as a GraphModule, and the outside nodes it takes as inputs (in
    order): graph inputs and other segments' results; weights and free nodes are copied."""
    inside = set(group)
    inputs: list[Node] = []

    def find_inputs(node: Node) -> None:
        for arg in node.all_input_nodes:
            if arg in inside or arg in inputs or arg.op == "get_attr":
                continue
            if arg.op == "placeholder" or arg in home:
                inputs.append(arg)
            else:  # a free node copied in: its own inputs come from outside
                find_inputs(arg)

    for node in group:
        find_inputs(node)
    sub = Graph()
    env: dict[Node, Node] = {n: sub.placeholder(n.name) for n in inputs}
    for node in group:
        env[node] = sub.node_copy(node, lambda n: _copied(sub, env, n))
    sub.output(tuple(env[n] for n in outputs))
    attributes = {n.target: operator.attrgetter(n.target)(gm) for n in sub.nodes if n.op == "get_attr"}
    return _LazyGraphModule(attributes, sub), inputs


def _copied(graph: Graph, env: dict[Node, Node], node: Node) -> Node:
    """`node` in `graph`: already there, or a copy of a weight or free node (inputs first)."""
    if node not in env:
        if node.op == "get_attr":
            env[node] = graph.get_attr(node.target)
        else:
            env[node] = graph.node_copy(node, lambda n: _copied(graph, env, n))
    return env[node]


def fused_lanes(graph: OpGraph, plan: Plan, compile_segments: bool = True) -> tuple[OpGraph, Plan]:
    """The graph with each segment of `plan` as one submodule (a CompiledSegment,
    compiled per shape by `segment_compiler.prepare`, or its plain fx module),
    and the segment-level plan to run it with."""
    segmentation = segment_plan(graph.dag, plan)
    top = split_into_segments(graph, segmentation)
    for node in top.graph.nodes:
        node.meta["opara_free"] = node.op != "call_module"
    if compile_segments:
        for name in segmentation.members:
            top.add_submodule(name, CompiledSegment(top.get_submodule(name)))
    log.info("%s: %d kernels in %d segments on %d lanes", plan.policy, len(plan.order), len(segmentation.members), plan.num_streams)
    return dataclasses.replace(graph, module=top, dag=segmentation.dag), segmentation.plan


class InductorCapture(PlanCapture):
    """PlanCapture of a fused-lanes graph: before the first capture at a new
    batch size, its segments are loaded from `cache_dir` or compiled there
    (`prepare_captures` does that for several captures and batch sizes at once).

    Its convolutions take cuDNN's heuristic algorithms unless `autotune` (the
    candidates of a `-timed` graph, which the build's `fused_lanes_autotune`
    adds): PyTorch plans a convolution at its first call in a thread and keeps
    that plan for every later call with the same parameters, so the first run
    decides: their recording runs and captures all run on a thread of their
    own per mode (`on_planning_thread`), where nothing else runs a convolution
    first. Benchmarking them cost a warm
    build 6.5 (ResNet-50) to 51 s (NASNet) across six buckets, heuristics 0.4
    and 28 s (eager channels-last modules, H200, docs/benchmarks.md run 20).
    But the heuristics ran several of ResNet-50's 1x1 convolutions fused with
    their residual add and ReLU as a GEMM plus a separate epilogue kernel: with
    `autotune` its batch-8 replay took 0.817 ms against torch.compile's 0.946,
    its warm build 8.1 s against 3.2 (H200, run 39); GoogLeNet's at batch 8
    0.468 against 0.549, warm build 6.2 s against 5.7 (run 41)."""

    def __init__(self, graph: OpGraph, plan: Plan, lane_pool: LanePool, cache_dir: Path, autotune: bool = False, **kwargs: Any):
        fused, segment_level = fused_lanes(graph, plan)
        super().__init__(fused, segment_level, lane_pool, **kwargs)
        self.graph = fused  # the segments as kernels: other plans of it reuse the compiled code
        self.module = fused.module
        self.cache_dir = cache_dir
        self.autotune = autotune
        self.segments = len(segment_level.order)
        self.count = CompileCount()
        self.prepared: set[tuple] = set()  # input layouts whose segments are ready

    def __call__(self, static_in: Any, pool: Any) -> CapturedGraph:
        what = f"fused lanes ({self.plan.policy}, {self.segments} segments)"
        try:
            captured = on_planning_thread(lambda: self._capture(static_in, pool), static_in[0].device, timed=self.autotune)
        except CaptureError:
            raise
        except Exception as error:  # noqa: BLE001 - an Inductor failure only drops this candidate
            raise CaptureError(f"{what}: {type(error).__name__}: {error}") from error
        eager = [name for name, m in self.module.named_children() if isinstance(m, CompiledSegment) and m.eager_calls]
        if eager:  # compiled code expects its inputs' exact layout; a segment that got another ran eagerly
            raise CaptureError(f"{what}: {len(eager)} segments ran eagerly at batch {static_in[0].shape[0]} (e.g. {eager[0]}): inputs laid out unlike at compile time")
        return captured

    def _capture(self, static_in: Any, pool: Any) -> CapturedGraph:
        with torch.inference_mode(), cudnn_algorithms(benchmark=self.autotune):
            self.count += prepare_captures([(self, static_in)])
            return super().__call__(static_in, pool)


def prepare_captures(runs: Sequence[tuple[InductorCapture, Sequence[torch.Tensor]]]) -> CompileCount:
    """Load or compile the segments of each capture for its inputs' shapes, all
    in one go (one pool of compile workers for everything that is missing).
    Captures of one build share their cache directory. Those that time their
    convolutions (`autotune`) record on their own planning thread, after the
    others: the same segments' code, compiled for the first group, loads."""
    todo = [(capture, inputs) for capture, inputs in runs if segment_layout(inputs) not in capture.prepared]
    count = CompileCount()
    for timed in sorted({capture.autotune for capture, _ in todo}):
        group = [(capture, inputs) for capture, inputs in todo if capture.autotune == timed]

        def load_or_compile(group=group, timed=timed) -> CompileCount:  # the recording runs call the convolutions first
            with torch.inference_mode():
                return prepare([(capture.module, inputs) for capture, inputs in group], group[0][0].cache_dir, autotune=timed)

        count += on_planning_thread(load_or_compile, group[0][1][0].device, timed=timed)
        for capture, inputs in group:
            capture.prepared.add(segment_layout(inputs))
    return count
