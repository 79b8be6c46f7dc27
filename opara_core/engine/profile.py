"""Per-operator kernel costs measured on the GPU, for Alg. 2 and the critical path.

The traced module runs eagerly, one node after another on one stream, with a
`record_function("opara::<node>")` range around every node, after warm-up and
for a few iterations under `torch.profiler`. Kernels are matched to nodes
through the profiler's chrome trace: a device activity (kernel, memcpy,
memset) carries the correlation id of the CUDA runtime or driver call that
launched it, and that call lies inside exactly one node's range on the CPU
thread. Never by position or names of kernels: cuDNN, cuBLAS and fused ops
launch varying numbers of kernels under varying names.

A node's cost is the median over iterations of the summed durations of its
device activities; its launch resources (grid, block, registers per thread,
shared memory, estimated occupancy) come from its longest kernel. Profiles are
cached on disk, outside the package, keyed by everything that changes the
kernels: GPU, torch, cuDNN, the graph's fingerprint, input dtypes and shapes,
and the TF32 and cuDNN benchmark switches.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from opara_core.planning.dag import Dag
from opara_core.engine import cache, gpu_turn
from opara_core.engine.trace import OpGraph

log = logging.getLogger(__name__)

PREFIX = "opara::"  # record_function ranges are named PREFIX + node name
# Chrome-trace categories: the host calls that launch work, and the work on the device.
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation")  # host events a device activity's "External id" names
FORMAT = 2  # bump when the cached JSON or its key changes shape (2: keyed through engine.cache)


@dataclass(frozen=True)
class KernelCost:
    """What one node costs on the GPU: total device time per run, and the launch
    resources of its longest kernel (None where the trace does not say)."""

    duration_us: float
    kernels: int  # device activities per run: kernels, memcpys, memsets
    grid: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None
    registers_per_thread: int | None = None
    shared_memory: int | None = None  # bytes per block, static + dynamic
    occupancy: float | None = None  # estimated achieved occupancy, percent

    @property
    def threads(self) -> int | None:
        """Threads per block."""
        if self.block is None:
            return None
        x, y, z = self.block
        return x * y * z

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KernelCost:
        return cls(
            duration_us=float(data["duration_us"]),
            kernels=int(data["kernels"]),
            grid=_triple(data.get("grid")),
            block=_triple(data.get("block")),
            registers_per_thread=_int(data.get("registers_per_thread")),
            shared_memory=_int(data.get("shared_memory")),
            occupancy=_float(data.get("occupancy")),
        )


@dataclass(frozen=True)
class Profile(Mapping):
    """Node name -> KernelCost for one graph on one GPU.

    `unattributed` counts device activities whose launch lay outside every
    node's range (work the profiler saw that belongs to no node).
    """

    costs: Mapping[str, KernelCost] = field(default_factory=dict)
    key: str = ""
    device: str = ""
    iterations: int = 0
    unattributed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", MappingProxyType(dict(self.costs)))

    def __getitem__(self, name: str) -> KernelCost:
        return self.costs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.costs)

    def __len__(self) -> int:
        return len(self.costs)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "key": self.key,
            "device": self.device,
            "iterations": self.iterations,
            "unattributed": self.unattributed,
            "costs": {name: cost.to_json() for name, cost in self.costs.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Profile:
        if data.get("format") != FORMAT:
            raise ValueError(f"profile format {data.get('format')!r}, expected {FORMAT}")
        return cls(
            costs={name: KernelCost.from_json(cost) for name, cost in data["costs"].items()},
            key=data.get("key", ""),
            device=data.get("device", ""),
            iterations=int(data.get("iterations", 0)),
            unattributed=int(data.get("unattributed", 0)),
        )


# ---- chrome trace -> costs -----------------------------------------------------------


def parse_trace(trace: Mapping[str, Any] | Sequence[Mapping[str, Any]], prefix: str = PREFIX) -> Profile:
    """Attribute the device activities of a chrome trace to the `prefix` ranges.

    Each range instance (one per node and iteration) collects the activities
    whose launch call (matched by correlation id) started inside it, or, for a
    launch the trace lacks, whose host op (matched by "External id") did; ranges
    must not overlap, which holds for one interpreter running nodes one by one.
    An activity whose launch is in no range, or in two, is left unattributed.
    Every annotated node gets a cost, zero for nodes that launched nothing.
    """
    events = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    ranges: list[tuple[float, float, str]] = []
    launches: dict[Any, list[float]] = defaultdict(list)
    host_ops: dict[Any, list[float]] = defaultdict(list)  # External id -> start of the host op
    activities: list[Mapping[str, Any]] = []
    for event in events:
        if event.get("ph") != "X" or "ts" not in event:
            continue
        category, args = event.get("cat"), event.get("args") or {}
        if category == "user_annotation" and str(event.get("name", "")).startswith(prefix):
            start = float(event["ts"])
            ranges.append((start, start + float(event.get("dur", 0.0)), event["name"][len(prefix) :]))
        if category in LAUNCH_CATEGORIES and "correlation" in args:
            launches[args["correlation"]].append(float(event["ts"]))
        elif category in DEVICE_CATEGORIES and "correlation" in args:
            activities.append(event)
        elif category in HOST_CATEGORIES and "External id" in args:
            host_ops[args["External id"]].append(float(event["ts"]))
    ranges.sort()
    starts = [r[0] for r in ranges]

    def owner(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts <= ranges[i][1] else None

    per_range: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    unattributed = 0
    for activity in activities:
        args = activity["args"]
        # the launch call; failing that (a launch API the profiler did not record),
        # the host op that was innermost when the work was launched
        times = launches.get(args["correlation"]) or host_ops.get(args.get("External id"), ())
        owners = {owner(ts) for ts in times} - {None}
        if len(owners) == 1:
            per_range[owners.pop()].append(activity)
        else:
            unattributed += 1
    instances: dict[str, list[int]] = defaultdict(list)
    for i, (_, _, name) in enumerate(ranges):
        instances[name].append(i)
    costs = {name: _cost([per_range.get(i, []) for i in indices]) for name, indices in instances.items()}
    iterations = max((len(v) for v in instances.values()), default=0)
    if unattributed:
        log.info("profile: %d device activities launched outside any node's range", unattributed)
    return Profile(costs=costs, iterations=iterations, unattributed=unattributed)


def _cost(runs: list[list[Mapping[str, Any]]]) -> KernelCost:
    """One node's cost from its activities in each run (iteration)."""
    durations = [sum(float(a.get("dur", 0.0)) for a in run) for run in runs]
    kernels = [a for run in runs for a in run if a.get("cat") == "kernel"]
    longest = max(kernels, key=lambda a: float(a.get("dur", 0.0)), default=None)
    args = longest.get("args", {}) if longest is not None else {}
    return KernelCost(
        duration_us=float(statistics.median(durations)) if durations else 0.0,
        kernels=statistics.median_low([len(run) for run in runs]) if runs else 0,
        grid=_triple(args.get("grid")),
        block=_triple(args.get("block")),
        registers_per_thread=_int(args.get("registers per thread")),
        shared_memory=_int(args.get("shared memory")),
        occupancy=_occupancy(args),
    )


def _occupancy(args: Mapping[str, Any]) -> float | None:
    """Kineto writes "est. achieved occupancy %" (0-100); older builds a fraction
    under "est. achieved occupancy"."""
    if "est. achieved occupancy %" in args:
        return _float(args["est. achieved occupancy %"])
    value = _float(args.get("est. achieved occupancy"))
    return None if value is None else value * 100.0 if value <= 1.0 else value


def _triple(value: Any) -> tuple[int, int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 3 and all(_int(v) is not None for v in value):
        return tuple(int(v) for v in value)  # type: ignore[return-value]
    return None


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# ---- measuring -----------------------------------------------------------------------


class AnnotatedInterpreter(torch.fx.Interpreter):
    """Runs the graph node by node; each node that may launch work inside its own
    `record_function` range, so its kernels can be found in the trace."""

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op not in ("call_function", "call_method", "call_module"):
            return super().run_node(n)
        with torch.profiler.record_function(PREFIX + n.name):
            return super().run_node(n)


def measure(graph: OpGraph, inputs: Sequence[torch.Tensor], iterations: int = 5, warmup: int = 3) -> Profile:
    """Profile `graph` on its inputs' device, uncached. On a CPU only the node
    ranges are recorded (every cost is 0): what the tests without a GPU check."""
    from torch.profiler import ProfilerActivity, profile

    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in tree_leaves(inputs))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    interpreter = AnnotatedInterpreter(graph.module)
    with torch.no_grad():
        for _ in range(warmup):
            interpreter.run(*inputs)
        sync()
        with profile(activities=activities) as prof:
            for _ in range(iterations):
                interpreter.run(*inputs)
                sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return parse_trace(trace)


def cache_dir() -> Path:
    """Where profiles are kept: $OPARA_CACHE_DIR/profiles, else ~/.cache/opara/profiles (engine.cache)."""
    return cache.directory("profiles")


def cache_key(fingerprint: str, inputs: Sequence[tuple[str, tuple[int, ...]]], device: torch.device | str) -> str:
    """The key (engine.cache) of everything that changes which kernels run and
    how long they take: the graph, its inputs' dtypes and shapes, and the GPU,
    software and switches (`cache.KERNELS`: torch, cuDNN, TF32, cuDNN benchmark)."""
    return cache.key({"graph": fingerprint, "inputs": [[dtype, list(shape)] for dtype, shape in inputs], "format": FORMAT}, cache.KERNELS, device)


def load(key: str, directory: Path | None = None) -> Profile | None:
    """The cached profile for `key`, or None (also for an unreadable file)."""
    return cache.read_json((directory or cache_dir()) / f"{key}.json", Profile.from_json, "cached profile")


def store(profile: Profile, directory: Path | None = None) -> Path:
    """Write `profile` under its key atomically (a rename), so readers never see half a file."""
    return cache.write_json((directory or cache_dir()) / f"{profile.key}.json", profile.to_json(), indent=1, sort_keys=True)


def profile_graph(
    graph: OpGraph,
    example_inputs: Sequence[torch.Tensor],
    device: torch.device | str,
    iterations: int = 5,
    cache: bool = True,
) -> Profile:
    """Measured kernel costs of every node of `graph` on `device` (a CUDA device
    holding the graph's weights) for these inputs' shapes; from the cache when
    the same GPU, software, graph and shapes were profiled before."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"profiling needs a CUDA device, got {device}")
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    shapes = [(str(x.dtype), tuple(x.shape)) for x in tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    key = cache_key(graph.fingerprint, shapes, device)
    if cache:
        cached = load(key)
        if cached is not None:
            log.info("profile of %s from the cache (%s)", graph.name or "graph", key[:12])
            return cached
    gpu_turn.take()  # timing kernels needs the GPU to itself
    with torch.cuda.device(device):
        measured = measure(graph, inputs, iterations)
    result = dataclasses.replace(measured, key=key, device=torch.cuda.get_device_name(device))
    if cache:
        store(result)
    log.info("profiled %s: %d nodes, %.1f us in all", graph.name or "graph", len(result), sum(c.duration_us for c in result.values()))
    return result


# ---- using a profile -----------------------------------------------------------------


def apply_profile(graph: OpGraph, profile: Mapping[str, KernelCost]) -> OpGraph:
    """A new OpGraph (same module) whose DAG nodes carry measured cost (µs) and
    threads/registers/shared memory, so Alg. 2 and critical-path estimates use
    measurements. Nodes the profile lacks keep their static estimate. Each
    measured fx node also gets node.meta["opara_kernel_cost"]."""
    nodes = []
    missing = []
    for node in graph.dag.nodes:
        cost = profile.get(node.name)
        if cost is None:
            missing.append(node.name)
            nodes.append(node)
            continue
        nodes.append(
            dataclasses.replace(
                node,
                cost=cost.duration_us,
                threads=cost.threads,
                registers=cost.registers_per_thread,
                shared_memory=cost.shared_memory,
            )
        )
    if missing:
        log.warning("profile lacks %d of %d nodes (e.g. %s); they keep static costs", len(missing), len(nodes), missing[:3])
    for fx_node in graph.module.graph.nodes:
        if fx_node.name in profile:
            fx_node.meta["opara_kernel_cost"] = profile[fx_node.name]
    dag = Dag(tuple(nodes), graph.dag.edges)
    digest = cache.digest(f"{graph.fingerprint}\n{dag.fingerprint()}")[:16]
    return OpGraph(module=graph.module, dag=dag, fingerprint="sha256:" + digest, name=graph.name)
