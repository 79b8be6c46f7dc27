"""From a module to the fastest runner that is still right.

On a GPU: trace the module, plan it, capture one CUDA graph per batch bucket
(with `auto`, the fastest of several captured plans per bucket, never slower
than the sequential graph of the same traced graph), and check a replay against
eager. Any failure falls back, with the reason logged and kept in the runner's
info: multi-stream graph -> sequential graph -> eager. On a CPU: eager.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from . import runtime, zoo
from .capture import CaptureError, LanePool, plan_capture
from .fusion import FusionReport, fuse_graph
from .graph import OpGraph, trace
from .plan import Plan, plan_graph

log = logging.getLogger(__name__)

POLICIES = ("sequential", "opara", "nimble", "asap", "wavefront")

# What `auto` captures and times at the smallest bucket; larger buckets re-time
# only the best few of the bucket before them, plus the sequential graph.
AUTO_CANDIDATES: tuple[tuple[str, int], ...] = (
    ("opara", 8),
    ("opara", 16),
    ("nimble", 8),
    ("nimble", 16),
    ("asap", 4),
    ("asap", 8),
    ("asap", 16),
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
    fusion: bool = True  # fold, merge and fuse kernels before planning (opara_core.fusion)

    def __post_init__(self) -> None:
        if self.policy not in (*POLICIES, "auto"):
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join((*POLICIES, 'auto'))}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {self.max_streams}")
        if not self.buckets or min(self.buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {list(self.buckets)}")


@dataclass
class BuildReport:
    """What was built and why: shown in logs, plan summaries and metrics."""

    runner: str = "eager"
    choices: dict[int, str] = field(default_factory=dict)  # bucket -> "policy/lanes"
    timings_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # bucket -> candidate -> median ms
    fallbacks: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    fusion: FusionReport | None = None

    def summary(self) -> str:
        lines = [f"runner {self.runner}"]
        if self.fusion is not None:
            lines.append(f"fusion: {self.fusion}")
        for bucket, choice in sorted(self.choices.items()):
            times = ", ".join(f"{k} {v:.3f}" for k, v in sorted(self.timings_ms.get(bucket, {}).items(), key=lambda kv: kv[1]))
            lines.append(f"bucket {bucket}: {choice}" + (f" (median ms: {times})" if times else ""))
        lines += [f"fallback: {reason}" for reason in self.fallbacks]
        lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items()))
        return "\n".join(lines)


class GuardError(RuntimeError):
    """A captured graph disagreed with eager."""


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
    torch.backends.cudnn.benchmark = True
    graph = None
    try:
        start = time.perf_counter()
        graph = trace_on(module, entry, device)
        report.seconds["trace"] = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - any tracing failure falls back
        report.fallbacks.append(f"tracing failed: {error}")
    if graph is not None and settings.fusion:
        start = time.perf_counter()
        # checked against the unfused graph at the smallest and largest bucket;
        # a rejected rewrite falls back to fewer passes (see fuse_graph)
        checks = [tuple(t.to(device) for t in entry.example_inputs(b, seed=7)) for b in sorted({min(settings.buckets), max(settings.buckets)})]
        try:
            graph, report.fusion = fuse_graph(graph, device, check_inputs=checks)
        except Exception as error:  # noqa: BLE001 - the unfused graph is still right
            report.fallbacks.append(f"fusion: {error}")
        report.seconds["fusion"] = time.perf_counter() - start
    # The guard checks capture and scheduling: a replay against the same graph
    # run eagerly (same kernels). Fusion was checked on its own against the
    # unfused graph in plain fp32; with TF32 on, folded weights round differently.
    reference = graph.module if graph is not None else module
    lane_pool = LanePool(device)
    if graph is not None and settings.policy != "sequential":
        try:
            start = time.perf_counter()
            if settings.fail_capture:
                raise CaptureError("capture failure forced by the fail_capture switch")
            capture = _multi_stream_capture(graph, settings, lane_pool, report)
            runner = _guarded(capture, reference, entry, device, max_batch, settings)
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
        if graph is not None:
            capture = plan_capture(graph, plan_graph(graph, "sequential"), lane_pool)
        else:
            capture = runtime.capture_sequential(module)
        runner = _guarded(capture, reference, entry, device, max_batch, settings)
        report.seconds["capture"] = time.perf_counter() - start
        report.runner = "sequential graph"
        report.choices = {b: "sequential/1" for b in settings.buckets}
        return runner, report
    except (CaptureError, GuardError, RuntimeError) as error:
        report.fallbacks.append(f"sequential graph: {error}")
        log.warning("sequential graph failed, falling back to eager: %s", error)
    report.runner = "eager"
    return runtime.EagerRunner(module, entry.inputs, entry.outputs, device, max_batch), report


def trace_on(module: torch.nn.Module, entry: zoo.ZooModel, device: torch.device) -> OpGraph:
    """Trace on the device itself, so ops that create tensors (arange, full) are
    traced with that device; one dynamic-batch graph serves every bucket."""
    example = tuple(t.to(device) for t in entry.example_inputs(batch=2))
    return trace(module, example, zoo.dynamic_shapes(entry), cost_inputs=tuple(t[:1] for t in example), name=entry.name)


def _guarded(capture, module, entry, device, max_batch, settings: EngineSettings) -> runtime.GraphRunner:
    runner = runtime.GraphRunner(capture, entry.inputs, entry.outputs, device, max_batch, settings.buckets)
    if settings.guard:
        check_against_eager(runner, module, entry, settings.guard_tolerance)
    return runner


def check_against_eager(runner: runtime.GraphRunner, module: torch.nn.Module, entry: zoo.ZooModel, tolerance: float) -> None:
    """Replay every bucket on fresh random inputs and compare with eager."""
    for bucket in runner.buckets:
        inputs = entry.example_inputs(bucket, seed=1000 + bucket)
        for buffer, x in zip(runner.host_inputs(bucket), inputs):
            buffer[...] = x.numpy()
        outputs = [torch.from_numpy(o.copy()) for o in runner.run(bucket)]
        with torch.inference_mode():
            expected = runtime._as_tuple(module(*(x.to(runner.device) for x in inputs)))
        for got, want in zip(outputs, expected):
            want = want.cpu()
            scale = float(want.abs().max()) or 1.0
            error = float((got - want).abs().max()) / scale
            if not error <= tolerance:
                raise GuardError(f"bucket {bucket}: replay differs from eager by {error:.2e} (relative), tolerance {tolerance:.0e}")


def _multi_stream_capture(graph: OpGraph, settings: EngineSettings, lane_pool: LanePool, report: BuildReport):
    """A capture function that captures the configured policy, or with `auto`
    times the candidates per bucket and keeps the fastest."""
    if settings.policy != "auto":
        plan = plan_graph(graph, settings.policy, settings.max_streams)
        capture_plan = plan_capture(graph, plan, lane_pool)

        def capture(static_in, pool):
            report.choices[static_in[0].shape[0]] = f"{settings.policy}/{plan.num_streams}"
            return capture_plan(static_in, pool)

        return capture
    plans = {"sequential/1": plan_graph(graph, "sequential")}
    for policy, lanes in AUTO_CANDIDATES:
        if lanes <= max(settings.max_streams, 1):
            plan = plan_graph(graph, policy, lanes)
            plans.setdefault(f"{policy}/{plan.num_streams}", plan)
    return AutoCapture(graph, plans, lane_pool, report)


class AutoCapture:
    """Capture each candidate plan, time its replays, keep the fastest.

    The sequential graph of the same traced graph is always a candidate, so the
    choice is never slower than it (within timing noise).
    """

    def __init__(self, graph: OpGraph, plans: dict[str, Plan], lane_pool: LanePool, report: BuildReport, replays: int = 30, repeats: int = 3):
        self.graph = graph
        self.plans = plans
        self.lane_pool = lane_pool
        self.report = report
        self.replays = replays
        self.repeats = repeats
        self.shortlist: list[str] = list(plans)

    def __call__(self, static_in: Sequence[torch.Tensor], pool: Any):
        bucket = static_in[0].shape[0]
        timings: dict[str, float] = {}
        best: tuple[float, str, Any] | None = None
        for key in dict.fromkeys(["sequential/1", *self.shortlist]):
            try:
                captured = plan_capture(self.graph, self.plans[key], self.lane_pool)(static_in, pool)
            except CaptureError as error:
                log.info("auto: %s not captured at bucket %d: %s", key, bucket, error)
                continue
            timings[key] = time_replays(captured[0], self.replays, self.repeats)
            if best is None or timings[key] < best[0]:
                best = (timings[key], key, captured)
        if best is None:
            raise CaptureError(f"no candidate could be captured at bucket {bucket}")
        ranked = sorted(timings, key=timings.get)
        self.shortlist = [k for k in ranked if k != "sequential/1"][:AUTO_KEEP]
        self.report.choices[bucket] = best[1]
        self.report.timings_ms[bucket] = timings
        log.info("auto: bucket %d -> %s (%s)", bucket, best[1], ", ".join(f"{k} {timings[k]:.3f} ms" for k in ranked))
        return best[2]


def time_replays(cuda_graph: torch.cuda.CUDAGraph, replays: int = 30, repeats: int = 3, warmup: int = 3) -> float:
    """Median milliseconds per replay, timed with CUDA events."""
    stream = torch.cuda.current_stream()
    for _ in range(warmup):
        cuda_graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(replays):
            cuda_graph.replay()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays)
    return statistics.median(samples)
