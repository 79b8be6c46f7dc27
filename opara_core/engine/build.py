"""From a module to the fastest runner that is still right.

On a GPU: trace the module, plan it, capture one CUDA graph per batch bucket
(with `auto`, the fastest of several captured plans per bucket, never slower
than the sequential graph of the same traced graph), and check a replay against
eager. Any failure falls back, with the reason logged and kept in the runner's
info: multi-stream graph -> sequential graph -> eager. On a CPU: eager.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from opara_core import zoo
from opara_core.engine import runtime
from opara_core.engine.capture import CaptureError, LanePool, plan_capture
from opara_core.engine.interpreter import reordered_graph
from opara_core.engine.fusion import CONV, CONV_ADD_RELU, CONV_RELU, FusionReport, fuse_graph
from opara_core.engine.trace import OpGraph, trace
from opara_core.engine.interpreter import plan_graph
from opara_core.planning.plan import Plan

log = logging.getLogger(__name__)

POLICIES = ("sequential", "opara", "nimble", "asap", "wavefront")
LAYOUTS = ("auto", "nchw", "nhwc")

# What `auto` captures and times at the smallest bucket, per layout; larger
# buckets re-time only the best few of the bucket before, plus the sequential graph.
AUTO_CANDIDATES: tuple[tuple[str, int], ...] = (
    ("opara", 8),
    ("nimble", 8),
    ("asap", 4),
    ("asap", 8),
    ("wavefront", 8),
)
AUTO_KEEP = 3


@dataclass(frozen=True)
class EngineSettings:
    """How a model is compiled; set per model by config.pbtxt parameters."""

    policy: str = "auto"  # one of POLICIES, or "auto"
    max_streams: int = 8
    buckets: tuple[int, ...] = runtime.DEFAULT_BUCKETS
    guard: bool = True
    guard_tolerance: float = 1e-4
    fail_capture: bool = False  # a test switch: every multi-stream capture fails
    fusion: bool = True  # fold, merge and fuse kernels before planning (opara_core.engine.fusion)
    # convolution layout: NHWC (channels_last) wins at larger batches and on some
    # models, NCHW on others; "auto" times both (one traced graph, NHWC weights) per bucket
    layout: str = "auto"
    # cudnn.benchmark: time every convolution algorithm per shape (faster graphs,
    # slower builds: each new shape in each bucket and layout is autotuned)
    autotune: bool = True

    def __post_init__(self) -> None:
        if self.policy not in (*POLICIES, "auto"):
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join((*POLICIES, 'auto'))}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {self.max_streams}")
        if not self.buckets or min(self.buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {list(self.buckets)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")


@dataclass
class BuildReport:
    """What was built and why: shown in logs, plan summaries and metrics."""

    runner: str = "eager"
    choices: dict[int, str] = field(default_factory=dict)  # bucket -> "layout:policy/lanes"
    timings_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # bucket -> candidate -> median ms
    fallbacks: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    fusion: FusionReport | None = None  # of the traced graph (both layouts share it)

    def summary(self) -> str:
        lines = [f"runner {self.runner}"]
        lines += [f"fusion: {self.fusion}"] if self.fusion else []
        for bucket, choice in sorted(self.choices.items()):
            times = ", ".join(f"{k} {v:.3f}" for k, v in sorted(self.timings_ms.get(bucket, {}).items(), key=lambda kv: kv[1]))
            lines.append(f"bucket {bucket}: {choice}" + (f" (median ms: {times})" if times else ""))
        lines += [f"fallback: {reason}" for reason in self.fallbacks]
        lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items()))
        return "\n".join(lines)


class GuardError(RuntimeError):
    """A captured graph disagreed with eager."""


@dataclass(frozen=True)
class Candidate:
    """One way to capture the model: a traced graph (in a layout) and a plan."""

    key: str  # "layout:policy/lanes"
    graph: OpGraph
    plan: Plan


def build_runner(
    module: torch.nn.Module,
    entry: zoo.ZooModel,
    device: torch.device,
    max_batch: int,
    settings: EngineSettings = EngineSettings(),
) -> tuple[Any, BuildReport]:
    """The fastest correct runner for `module` on `device`, and how it was chosen."""
    report = BuildReport()
    if device.type != "cuda":
        return runtime.EagerRunner(module, entry.inputs, entry.outputs, device, max_batch), report
    module = module.to(device).eval()
    torch.backends.cudnn.benchmark = settings.autotune
    graphs = traced_graphs(module, entry, device, settings, report)
    lane_pool = LanePool(device)
    if graphs and settings.policy != "sequential":
        try:
            start = time.perf_counter()
            if settings.fail_capture:
                raise CaptureError("capture failure forced by the fail_capture switch")
            auto = AutoCapture(candidates(graphs, settings), lane_pool, report)
            runner = runtime.GraphRunner(auto, entry.inputs, entry.outputs, device, max_batch, settings.buckets)
            if settings.guard:
                check_against_eager(runner, {b: c.graph.module for b, c in auto.chosen.items()}, entry, settings.guard_tolerance)
            report.seconds["plan+capture"] = time.perf_counter() - start
            report.runner = "multi-stream graph"
            return runner, report
        except (CaptureError, GuardError, RuntimeError) as error:
            report.fallbacks.append(f"multi-stream graph: {error}")
            log.warning("multi-stream graph failed, falling back to a sequential graph: %s", error)
            report.choices.clear()
            report.timings_ms.clear()
    try:
        start = time.perf_counter()
        if graphs:
            graph = next(iter(graphs.values()))
            capture = plan_capture(graph, plan_graph(graph, "sequential"), lane_pool)
            reference = graph.module
        else:
            capture, reference = runtime.capture_sequential(module), module
        runner = runtime.GraphRunner(capture, entry.inputs, entry.outputs, device, max_batch, settings.buckets)
        if settings.guard:
            check_against_eager(runner, {b: reference for b in runner.buckets}, entry, settings.guard_tolerance)
        report.seconds["capture"] = time.perf_counter() - start
        report.runner = "sequential graph"
        report.choices = {b: f"{next(iter(graphs), 'module')}:sequential/1" for b in settings.buckets}
        return runner, report
    except (CaptureError, GuardError, RuntimeError) as error:
        report.fallbacks.append(f"sequential graph: {error}")
        log.warning("sequential graph failed, falling back to eager: %s", error)
    report.runner = "eager"
    return runtime.EagerRunner(module, entry.inputs, entry.outputs, device, max_batch), report


def traced_graphs(module, entry: zoo.ZooModel, device: torch.device, settings: EngineSettings, report: BuildReport) -> dict[str, OpGraph]:
    """The model traced (and fused) in each layout to try; empty if tracing fails.

    The guard later compares each replay with its own graph run eagerly (same
    kernels): fusion is checked on its own here, against the unfused graph in
    plain fp32, since with TF32 folded weights round differently.
    """
    has_convs = any(isinstance(m, torch.nn.Conv2d) for m in module.modules())
    layouts = {"auto": ("nchw", "nhwc") if has_convs else ("nchw",), "nchw": ("nchw",), "nhwc": ("nhwc",)}[settings.layout]
    start = time.perf_counter()
    try:
        graph = trace_on(module, entry, device)
    except Exception as error:  # noqa: BLE001 - any tracing failure falls back
        report.fallbacks.append(f"tracing: {error}")
        return {}
    report.seconds["trace"] = time.perf_counter() - start
    if settings.fusion:
        start = time.perf_counter()
        buckets = sorted({min(settings.buckets), max(settings.buckets)})
        checks = [tuple(t.to(device) for t in entry.example_inputs(b, seed=7)) for b in buckets]
        try:
            graph, report.fusion = fuse_graph(graph, device, check_inputs=checks)
        except Exception as error:  # noqa: BLE001 - the unfused graph is still right
            report.fallbacks.append(f"fusion: {error}")
        report.seconds["fusion"] = time.perf_counter() - start
    # NHWC is the same traced and fused graph with channels-last convolution
    # weights (tracing and fusing it again took as long as the first time)
    return {layout: graph if layout == "nchw" else channels_last_graph(graph) for layout in layouts}


def candidates(graphs: dict[str, OpGraph], settings: EngineSettings) -> list[Candidate]:
    """What AutoCapture times: the sequential graph of every layout, plus the
    configured policy (or, with `auto`, every AUTO_CANDIDATES policy) per layout."""
    wanted = AUTO_CANDIDATES if settings.policy == "auto" else ((settings.policy, settings.max_streams),)
    found: dict[str, Candidate] = {}
    for layout, graph in graphs.items():
        for policy, lanes in (("sequential", 1), *wanted):
            plan = plan_graph(graph, policy, min(lanes, settings.max_streams))
            key = f"{layout}:{policy}/{plan.num_streams}"
            found.setdefault(key, Candidate(key, graph, plan))
    return list(found.values())


def channels_last_graph(graph: OpGraph) -> OpGraph:
    """A copy of `graph` whose 2-d convolution weights are channels-last: cuDNN
    then runs the whole network in NHWC, the layout its tensor-core kernels
    prefer. Same nodes and DAG, so plans made for one fit the other; other
    attributes are shared, not copied."""
    old = graph.module
    nodes = old.graph.nodes
    attributes: dict[str, Any] = {n.target: old.get_submodule(n.target) for n in nodes if n.op == "call_module"}
    for node in nodes:
        if node.op == "get_attr":
            attributes[node.target] = operator.attrgetter(node.target)(old)
    for node in nodes:
        if node.op == "call_function" and node.target in (CONV, CONV_RELU, CONV_ADD_RELU) and isinstance(node.args[1], torch.fx.Node):
            weight = node.args[1]
            value = attributes.get(weight.target) if weight.op == "get_attr" else None
            if isinstance(value, torch.Tensor) and value.dim() == 4:
                attributes[weight.target] = value.detach().contiguous(memory_format=torch.channels_last)
    module = torch.fx.GraphModule(attributes, reordered_graph(old.graph, tuple(n.name for n in nodes)))
    return dataclasses.replace(graph, module=module)


def trace_on(module: torch.nn.Module, entry: zoo.ZooModel, device: torch.device) -> OpGraph:
    """Trace on the device itself, so ops that create tensors (arange, full) are
    traced with that device; one dynamic-batch graph serves every bucket."""
    example = tuple(t.to(device) for t in entry.example_inputs(batch=2))
    return trace(module, example, zoo.dynamic_shapes(entry), cost_inputs=tuple(t[:1] for t in example), name=entry.name)


def check_against_eager(runner: runtime.GraphRunner, references: dict[int, torch.nn.Module], entry: zoo.ZooModel, tolerance: float) -> None:
    """Replay every bucket on fresh random inputs and compare with the graph it
    replays, run eagerly (`references`: bucket -> module)."""
    for bucket in runner.buckets:
        inputs = entry.example_inputs(bucket, seed=1000 + bucket)
        for buffer, x in zip(runner.host_inputs(bucket), inputs):
            buffer[...] = x.numpy()
        outputs = [torch.from_numpy(o.copy()) for o in runner.run(bucket)]
        with torch.inference_mode():
            expected = runtime._as_tuple(references[bucket](*(x.to(runner.device) for x in inputs)))
        for got, want in zip(outputs, expected):
            want = want.cpu()
            scale = float(want.abs().max()) or 1.0
            error = float((got - want).abs().max()) / scale
            if not error <= tolerance:
                raise GuardError(f"bucket {bucket}: replay differs from eager by {error:.2e} (relative), tolerance {tolerance:.0e}")


class AutoCapture:
    """Capture each candidate, time its replays, keep the fastest, per bucket.

    The sequential graph of the same traced graph is always a candidate, so the
    choice is never slower than it (within timing noise). `chosen` records the
    candidate kept for each bucket.
    """

    def __init__(self, candidates: list[Candidate], lane_pool: LanePool, report: BuildReport):
        self.candidates = {c.key: c for c in candidates}
        self.lane_pool = lane_pool
        self.report = report
        self.shortlist: list[str] = list(self.candidates)
        self.chosen: dict[int, Candidate] = {}

    def __call__(self, static_in: Sequence[torch.Tensor], pool: Any):
        bucket = static_in[0].shape[0]
        timings: dict[str, float] = {}
        best: tuple[float, str, Any] | None = None
        failures = []
        sequential = [k for k in self.candidates if k.endswith(":sequential/1")]
        seconds = {"capture": 0.0, "timing": 0.0}
        for key in dict.fromkeys([*sequential, *self.shortlist]):
            candidate = self.candidates[key]
            start = time.perf_counter()
            try:
                captured = plan_capture(candidate.graph, candidate.plan, self.lane_pool)(static_in, pool)
            except CaptureError as error:
                log.warning("auto: %s not captured at bucket %d: %s", key, bucket, error)
                failures.append(f"{key}: {error}")
                continue
            finally:
                seconds["capture"] += time.perf_counter() - start
            start = time.perf_counter()
            timings[key] = time_replays(captured[0])
            seconds["timing"] += time.perf_counter() - start
            if best is None or timings[key] < best[0]:
                best = (timings[key], key, captured)
        if best is None:
            raise CaptureError(f"no candidate could be captured at bucket {bucket}: {'; '.join(failures)[:1000]}")
        ranked = sorted(timings, key=timings.get)
        self.shortlist = [k for k in ranked if k not in sequential][:AUTO_KEEP]
        self.chosen[bucket] = self.candidates[best[1]]
        self.report.choices[bucket] = best[1]
        self.report.timings_ms[bucket] = timings
        for stage, spent in seconds.items():
            self.report.seconds[f"{stage} b{bucket}"] = spent
        log.info("auto: bucket %d -> %s (%s)", bucket, best[1], ", ".join(f"{k} {timings[k]:.3f} ms" for k in ranked))
        return best[2]


def time_replays(cuda_graph: torch.cuda.CUDAGraph, seconds: float = 0.02, repeats: int = 5, warmup: int = 3) -> float:
    """Median milliseconds per replay over `repeats` runs of ~`seconds` each,
    timed with CUDA events (short graphs get more replays, so noise stays low)."""
    stream = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(warmup):
        cuda_graph.replay()
    end.record(stream)
    end.synchronize()
    replays = int(min(max(seconds * 1000 * warmup / max(start.elapsed_time(end), 1e-3), 3), 1000))
    samples = []
    for _ in range(repeats):
        start.record(stream)
        for _ in range(replays):
            cuda_graph.replay()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays)
    return statistics.median(samples)
