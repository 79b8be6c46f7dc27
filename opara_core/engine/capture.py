"""Carry out a plan on CUDA streams and capture it into a CUDA graph.

The only module that juggles streams and captures graphs (and times their
replays, for `auto`). A plan names a lane per operator, a launch
order and the cross-lane waits; here each lane becomes a CUDA stream (with the
plan's priority), each wait an event, and the whole schedule is captured on a
dedicated capture stream (lane 0): every other lane is forked from it with an
event at the start and joined back before the capture ends.

Memory: intermediates are freed at their last use in launch order. A tensor read
on a lane other than the one that made it is marked with `record_stream` for
that lane. By default the caching allocator then defers reusing its block until
the capture ends (multi-stream graphs held 2-8x the sequential graph's memory on
an H100); with the allocator's `graph_capture_record_stream_reuse` setting, which
captures turn on, a block is reused as soon as the captured graph's own
dependencies order every recorded use before the new allocation: reuse follows
the plan's happens-before, never mere program order.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from opara_core.engine.interpreter import PlanInterpreter
from opara_core.engine.trace import OpGraph
from opara_core.planning.plan import Plan

log = logging.getLogger(__name__)

# torch.cuda.Stream() hands out streams round-robin from a pool of this many per
# priority; asking for more gives an earlier stream again (silent aliasing).
STREAMS_PER_PRIORITY = 32


def reuse_memory_across_lanes(enabled: bool = True) -> bool:
    """Set the caching allocator's `graph_capture_record_stream_reuse`
    (process-wide); False where this torch lacks the setting."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )
    if setter is None:
        log.warning("this torch cannot change allocator settings; cross-lane memory is reused only after capture")
        return False
    try:
        setter(f"graph_capture_record_stream_reuse:{enabled}")
    except RuntimeError as error:
        log.warning("allocator setting graph_capture_record_stream_reuse unavailable (%s); memory use will be higher", error)
        return False
    return True


def pool_mb(pool: Any) -> float:
    """MB of segments a private graph memory pool holds (intermediates and outputs)."""
    torch.cuda.synchronize()
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool)) / 2**20


class CaptureError(RuntimeError):
    """A plan could not be captured; the runtime falls back and logs why."""


class LanePool:
    """CUDA streams for lanes, created once and reused by every capture.

    Graphs that share a memory pool must be captured on the same stream objects
    (the allocator keys cached blocks by stream), and creating streams per
    capture would run through torch's stream pool and alias.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}

    def lanes(self, priorities: Sequence[int]) -> list[torch.cuda.Stream]:
        """One stream per lane; lane i with priority p is always the same stream."""
        streams = []
        for lane, priority in enumerate(priorities):
            key = (lane, int(priority))
            if key not in self._streams:
                self._streams[key] = torch.cuda.Stream(device=self.device, priority=int(priority))
            streams.append(self._streams[key])
        handles = {s.cuda_stream for s in streams}
        if len(handles) != len(streams) or any(s == torch.cuda.default_stream(self.device) for s in streams):
            raise CaptureError(
                f"{len(streams)} lanes alias in torch's stream pool ({STREAMS_PER_PRIORITY} streams per priority); "
                "plan with a smaller max_streams"
            )
        return streams


@dataclass(frozen=True, eq=False)
class GraphPool:
    """A CUDA graph memory pool to capture several runners' graphs into, with
    the lane streams they are captured on: the allocator reuses a block freed
    in a capture only for an allocation on the same stream, so graphs share
    their intermediates' memory only when they share the streams too. Graphs
    in one pool must never replay concurrently, and a graph's outputs must be
    consumed (copied, on the replay's stream) before another graph of the pool
    replays: its intermediates may lie where the first one's outputs are."""

    handle: Any
    lanes: LanePool

    @classmethod
    def new(cls, device: torch.device) -> GraphPool:
        return cls(torch.cuda.graph_pool_handle(), LanePool(device))


class StreamInterpreter(PlanInterpreter):
    """Runs the plan's order with each node on its lane's stream.

    `run_node` is the one hook: wait on the events of cross-lane producers,
    launch on the node's stream, mark inputs read across lanes with
    `record_stream`, record an event if a later wait needs one.
    """

    def __init__(self, graph: OpGraph, plan: Plan, lanes: Sequence[torch.cuda.Stream]):
        super().__init__(graph, plan)
        if len(lanes) < plan.num_streams:
            raise CaptureError(f"plan needs {plan.num_streams} lanes, got {len(lanes)}")
        self.lanes = list(lanes)
        self.waits_for: dict[str, list[str]] = defaultdict(list)
        for producer, consumer in plan.waits:
            self.waits_for[consumer].append(producer)
        self.recorded = {producer for producer, _ in plan.waits}
        self.events: dict[str, torch.cuda.Event] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        lane = self.schedule.stream[n.name]
        stream = self.lanes[lane]
        for producer in self.waits_for.get(n.name, ()):
            stream.wait_event(self.events[producer])
        with torch.cuda.stream(stream):
            result = super().run_node(n)
        for inp in n.all_input_nodes:
            if inp.op == "call_function" and self.schedule.stream[inp.name] != lane:
                for tensor in _tensors(self.env[inp]):
                    tensor.record_stream(stream)
        if n.name in self.recorded:
            event = torch.cuda.Event()
            event.record(stream)
            self.events[n.name] = event
        return result


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


def run_on_lanes(interpreter: StreamInterpreter, inputs: Sequence[torch.Tensor]) -> Any:
    """Fork every lane from the current stream, run, join every lane back."""
    origin = torch.cuda.current_stream()
    fork = torch.cuda.Event()
    fork.record(origin)
    for stream in interpreter.lanes:
        if stream != origin:
            stream.wait_event(fork)
    interpreter.events.clear()
    result = interpreter.run(*inputs)
    for stream in interpreter.lanes:
        if stream != origin:
            origin.wait_stream(stream)
    return result


@dataclass(frozen=True, eq=False)
class CapturedGraph:
    """One captured CUDA graph and the static tensors it reads and writes: write a
    batch into `inputs`, `replay()`, read `outputs` (overwritten by the next replay).

    `owner` keeps alive what the graph reads but does not own: a CUDA graph
    holds raw device pointers, so the weights and folded constants of the
    module it was captured from must live as long as the graph. Without it, the
    traced module was freed when the build returned, and the next allocations
    (another build in the same process) overwrote weights that replays still
    read: wrong outputs, illegal addresses, out-of-bounds gathers on the H100.

    `peak_bytes`: the most bytes its capture held at once (intermediates and
    outputs), what the graph would need in a pool of its own.
    """

    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    owner: Any = None
    peak_bytes: int = 0

    @property
    def rows(self) -> int:
        return self.inputs[0].shape[0]

    def replay(self) -> None:
        self.graph.replay()


class PlanCapture:
    """Captures one plan on its lanes, at any batch size.

    One StreamInterpreter per plan, made once and reused for every bucket.
    Before each capture the exact schedule runs `warmup` times on the same
    stream objects (cuDNN autotuning, per-stream cuBLAS workspaces, lazy
    loading). `reuse_memory` lets the allocator reuse cross-lane blocks during
    capture (see the module docstring).
    """

    def __init__(self, graph: OpGraph, plan: Plan, lane_pool: LanePool, warmup: int = 1, reuse_memory: bool = True):
        self.plan = plan
        self.lanes = lane_pool.lanes(plan.priorities[: plan.num_streams] or (0,))
        self.interpreter = StreamInterpreter(graph, plan, self.lanes)
        self.warmup = warmup
        self.reuse_memory = reuse_memory

    def __call__(self, static_in: Sequence[torch.Tensor], pool: Any) -> CapturedGraph:
        capture_stream = self.lanes[0]
        capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture_stream):
            for _ in range(self.warmup):
                run_on_lanes(self.interpreter, static_in)
        torch.cuda.current_stream().wait_stream(capture_stream)
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        if self.plan.num_streams > 1:
            reuse_memory_across_lanes(self.reuse_memory)
        held = _reset_peak()
        try:
            with torch.cuda.graph(cuda_graph, pool=pool, stream=capture_stream, capture_error_mode="thread_local"):
                result = run_on_lanes(self.interpreter, static_in)
        except RuntimeError as error:
            raise CaptureError(f"capturing {self.plan.policy} with {self.plan.num_streams} lanes failed: {error}") from error
        peak = torch.cuda.max_memory_allocated() - held
        return CapturedGraph(cuda_graph, tuple(static_in), tuple(_tensors(result)), owner=self.interpreter.module, peak_bytes=peak)


def capture_module(module: torch.nn.Module, static_in: Sequence[torch.Tensor], pool: Any, warmup: int = 3) -> CapturedGraph:
    """The module as it is, on one stream: the fallback when tracing failed.

    Warm-up runs on a side stream first (cuDNN autotuning, lazy
    initialisation, workspaces), as CUDA-graph capture requires.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            module(*static_in)
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    held = _reset_peak()
    try:
        with torch.cuda.graph(cuda_graph, pool=pool, capture_error_mode="thread_local"):
            result = module(*static_in)
    except RuntimeError as error:
        raise CaptureError(f"capturing the module on one stream failed: {error}") from error
    peak = torch.cuda.max_memory_allocated() - held
    return CapturedGraph(cuda_graph, tuple(static_in), tuple(_tensors(result)), owner=module, peak_bytes=peak)


def _reset_peak() -> int:
    """Start counting the allocator's peak afresh; the bytes allocated now."""
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


@dataclass(frozen=True)
class Timing:
    """Median and p99 milliseconds of single calls, and how many were timed."""

    median_ms: float
    p99_ms: float
    calls: int


def time_calls(
    call: Callable[[int], Any], calls: int | None = None, repeats: int = 5, warmup: int = 5, seconds: float = 0.2, least: int = 20
) -> Timing:
    """Median and p99 of single calls, each between its own CUDA events;
    `call(i)` runs call i. Without `calls`, as many as fill about `seconds`
    per repetition (`least` to 500)."""
    stream = torch.cuda.current_stream()
    for i in range(warmup):
        call(i)
    torch.cuda.synchronize()
    if calls is None:
        start = time.perf_counter()
        for i in range(3):
            call(i)
        torch.cuda.synchronize()
        per_call = (time.perf_counter() - start) / 3
        calls = int(min(max(seconds / max(per_call, 1e-6), least), 500))
    samples = []
    for _ in range(repeats):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for i, (begin, end) in enumerate(events):
            begin.record(stream)
            call(i)
            end.record(stream)
        torch.cuda.synchronize()
        samples += [begin.elapsed_time(end) for begin, end in events]
    samples.sort()
    return Timing(statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))], len(samples))


def served_call(captured: CapturedGraph, inputs: Sequence[Sequence[torch.Tensor]]) -> Callable[[int], None]:
    """Call i as a request runs the graph: `inputs[i % len(inputs)]` copied
    into its static inputs, then the replay."""

    def call(i: int) -> None:
        for static, x in zip(captured.inputs, inputs[i % len(inputs)]):
            static.copy_(x, non_blocking=True)
        captured.replay()

    return call


def time_served(captured: CapturedGraph, seconds: float = 0.02) -> Timing:
    """What a request's replay costs, timed as the bench's `served` column
    times it (`served_call`, one event pair per call), with the graph's
    current inputs as the data. Unlike `time_replays` (back to back, for
    ranking candidates) it counts the input copy and each call's own start.

    Every load times every bucket so: 3 repetitions of >= 5 calls (NASNet's
    six buckets took 3.6 s of its warm load at 5 of >= 20, H100 2026-12-06)."""
    with torch.inference_mode():  # the static inputs are inference tensors
        call = served_call(captured, [tuple(t.clone() for t in captured.inputs)])
        return time_calls(call, repeats=3, warmup=3, seconds=seconds, least=5)


def time_replays(captured: CapturedGraph, seconds: float = 0.02, repeats: int = 5, warmup: int = 3, least: int = 3) -> float:
    """Median milliseconds per replay over `repeats` runs of ~`seconds` each
    (at least `least` replays each), timed with CUDA events (short graphs get
    more replays, so noise stays low)."""
    stream = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(warmup):
        captured.replay()
    end.record(stream)
    end.synchronize()
    replays = int(min(max(seconds * 1000 * warmup / max(start.elapsed_time(end), 1e-3), least), 1000))
    samples = []
    for _ in range(repeats):
        start.record(stream)
        for _ in range(replays):
            captured.replay()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays)
    return statistics.median(samples)
