"""Run batches through a model: eagerly, or by replaying captured CUDA graphs.

Every runner follows the `Runner` protocol, built for a serving hot path with
no per-request allocation and torch tensors end to end: `run(inputs)` takes,
per model input, the row blocks of one batch (one block per request, on the
host or already on the GPU), copies them once into place (host blocks into
pinned staging, then to the GPU, or straight to the GPU where their own memory
is page-locked; GPU blocks device to device into the graph's static inputs),
runs the batch and returns each output's rows, as views that stay valid until
the next `run`. The runtime only replays: graphs come from
`build`, captured by `capture`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from opara_core.engine.capture import CapturedGraph
from opara_core.spec import TensorSpec

log = logging.getLogger(__name__)

# One model input of one batch: a tensor, or its row blocks in order (one per request).
Blocks = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner is, for logs and metrics."""

    kind: str  # "eager" or "cuda-graph"
    device: str
    buckets: tuple[int, ...] = ()


class Runner(Protocol):
    """What the Triton adapter, the guard and the benchmarks call."""

    info: RunnerInfo
    device: torch.device
    max_batch: int
    batches: Counter[int]  # bucket (graphs) or batch size (eager) -> runs
    padded_rows: int

    def run(self, inputs: Sequence[Blocks], outputs_on_device: bool = False) -> list[torch.Tensor]:
        """Run one batch; each output's rows, on the host unless `outputs_on_device`
        (then views of the runner's own buffers, valid until the next run, ordered
        on the current stream)."""
        ...


def _blocks(value: Blocks) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def batch_rows(inputs: Sequence[Blocks], max_batch: int) -> int:
    """Rows in the batch; a batch outside 1..max_batch is refused."""
    first = inputs[0]
    n = first.shape[0] if isinstance(first, torch.Tensor) else sum(block.shape[0] for block in first)
    if not 1 <= n <= max_batch:
        raise ValueError(f"batch of {n} rows is outside 1..{max_batch}")
    return n


def _staging(specs: Sequence[TensorSpec], rows: int, device: torch.device | str = "cpu", pin: bool = False) -> list[torch.Tensor]:
    return [torch.zeros((rows, *s.shape), dtype=s.dtype, device=device, pin_memory=pin) for s in specs]


# below this many bytes per row block on average, a batch's host blocks are
# gathered on the host first: one transfer per input instead of one per block
DIRECT_MIN_BLOCK_BYTES = 64 * 1024


def direct_pays(inputs: Sequence[Blocks]) -> bool:
    """Whether host blocks should go to the GPU one transfer each, straight from
    page-locked memory, rather than be gathered into the pinned staging first
    (a CPU copy) and sent one transfer per input. A transfer costs the host a
    few microseconds to issue and the GPU its own latency, while gathering small
    rows on the host costs next to nothing: DeepFM's batch of 9 requests, two
    inputs of 52 and 104 bytes a row, would issue 18 transfers instead of 2. An
    image (GoogLeNet's 588 KiB) is worth sending where it lies."""
    for parts in inputs:
        if not isinstance(parts, torch.Tensor) and len(parts) > 1 and sum(p.nbytes for p in parts) < DIRECT_MIN_BLOCK_BYTES * len(parts):
            return False
    return True


def gather(blocks: Blocks, out: torch.Tensor) -> torch.Tensor:
    """Copy the row blocks into `out`'s first rows: the batch's one copy (or,
    from the host into GPU memory, its one transfer)."""
    if isinstance(blocks, torch.Tensor) or len(blocks) == 1:  # one request: no slicing to do when `out` has its rows
        part = blocks if isinstance(blocks, torch.Tensor) else blocks[0]
        rows = part.shape[0]
        out = out if out.shape[0] == rows else out[:rows]
        out.copy_(part, non_blocking=True)
        return out
    parts = list(blocks)
    rows = sum(p.shape[0] for p in parts)
    if out.device != parts[0].device:  # one transfer per block (a GPU can't cat from host memory)
        offset = 0
        for part in parts:
            out[offset : offset + part.shape[0]].copy_(part, non_blocking=True)
            offset += part.shape[0]
    else:
        torch.cat(parts, dim=0, out=out[:rows])
    return out[:rows]


class EagerRunner:
    """Runs the module as is, on the CPU or a GPU. The fallback of last resort."""

    def __init__(self, module: torch.nn.Module, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], device: torch.device, max_batch: int):
        self.module = module.to(device)
        self.device = device
        self.max_batch = max_batch
        self._inputs = _staging(inputs, max_batch, device)
        self._host_out = _staging(outputs, max_batch, pin=device.type == "cuda") if device.type == "cuda" else None
        self._lock = threading.Lock()
        self.info = RunnerInfo("eager", str(device))
        self.batches: Counter[int] = Counter()  # batch size -> runs
        self.padded_rows = 0

    def run(self, inputs: Sequence[Blocks], outputs_on_device: bool = False) -> list[torch.Tensor]:
        n = batch_rows(inputs, self.max_batch)
        with self._lock, torch.inference_mode():
            args = [gather(blocks, buffer) for blocks, buffer in zip(inputs, self._inputs)]
            result = _as_tuple(self.module(*args))
            self.batches[n] += 1
            if self._host_out is None or outputs_on_device:
                return list(result)
            for host, out in zip(self._host_out, result):
                host[:n].copy_(out, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            return [t[:n] for t in self._host_out]


@dataclass(frozen=True)
class _RowViews:
    """What a batch of `rows` rows touches, sliced once when the runner is made
    rather than on every run: its bucket's graph (`captured.rows` rows) and the
    first `rows` rows of that graph's inputs and outputs and of the runner's
    host staging."""

    captured: CapturedGraph
    static_in: tuple[torch.Tensor, ...]
    staging_in: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    host_out: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, captured: CapturedGraph, rows: int, host_in: Sequence[torch.Tensor], host_out: Sequence[torch.Tensor]) -> _RowViews:
        def first(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return tuple(t[:rows] for t in tensors)

        return cls(captured, first(captured.inputs), first(host_in), first(captured.outputs), first(host_out))


class GraphRunner:
    """Replays one captured CUDA graph per batch bucket (all built by `build`, in
    one memory pool).

    A batch of n rows replays the smallest bucket >= n; rows past n hold the
    previous batch's (valid) data, which is harmless because every served model
    treats rows independently in eval mode. A batch above the largest bucket
    runs as several chunks. A lock keeps two threads from replaying one graph
    at once. A graph whose inputs are host tensors copies them up itself
    (`PackedInputs`): the runner waits for the GPU before it refills them.
    """

    def __init__(
        self,
        graphs: Mapping[int, CapturedGraph],
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        device: torch.device,
        max_batch: int,
    ):
        if not graphs or min(graphs) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {sorted(graphs)}")
        for bucket, captured in graphs.items():
            if captured.rows != bucket or len(captured.inputs) != len(inputs) or len(captured.outputs) != len(outputs):
                raise ValueError(f"the graph for bucket {bucket} has {captured.rows} rows, {len(captured.inputs)} inputs, {len(captured.outputs)} outputs")
        self.device = device
        self.max_batch = max_batch
        self.graphs = dict(sorted(graphs.items()))
        self.buckets = tuple(self.graphs)
        self._host_in = _staging(inputs, max_batch, pin=True)
        self._host_out = _staging(outputs, max_batch, pin=True)
        # recorded after a copy up from host memory by a run that returns its outputs on the
        # device without waiting for the GPU: the next run must not refill the pinned
        # staging while that copy may still be reading it (`_staging_queued`)
        self._host_in_read = torch.cuda.Event()
        self._staging_queued = False
        self._device_in: list[torch.Tensor] | None = None  # for GPU batches above the largest bucket
        self._input_specs = tuple(inputs)
        self._inputs_on_host = any(t.device.type == "cpu" for captured in graphs.values() for t in captured.inputs)
        self._views = {rows: _RowViews.of(self.graphs[self.bucket_for(rows)], rows, self._host_in, self._host_out) for rows in range(1, self.buckets[-1] + 1)}
        self._lock = threading.Lock()
        self.info = RunnerInfo("cuda-graph", str(device), self.buckets)
        self.batches: Counter[int] = Counter()  # bucket -> replays
        self.padded_rows = 0

    def bucket_for(self, n: int) -> int:
        """The smallest bucket that holds n rows (the largest if none does)."""
        return next((b for b in self.buckets if b >= n), self.buckets[-1])

    def run(self, inputs: Sequence[Blocks], outputs_on_device: bool = False) -> list[torch.Tensor]:
        n = batch_rows(inputs, self.max_batch)
        first = inputs[0] if isinstance(inputs[0], torch.Tensor) else inputs[0][0]
        on_gpu = first.device.type == "cuda"
        with self._lock:
            if torch.is_inference_mode_enabled():  # a served execute holds it already: entering costs a few us a call
                return self._run(inputs, n, on_gpu, outputs_on_device)
            with torch.inference_mode():
                return self._run(inputs, n, on_gpu, outputs_on_device)

    def _run(self, inputs: Sequence[Blocks], n: int, on_gpu: bool, outputs_on_device: bool) -> list[torch.Tensor]:
        if self._staging_queued and not on_gpu:  # the last run returned on the device: its copy may still be reading the staging
            self._host_in_read.synchronize()
            self._staging_queued = False
        if n > self.buckets[-1]:
            self._run_chunks(n, [gather(blocks, buffer) for blocks, buffer in zip(inputs, self._staging_for(on_gpu))])
            torch.cuda.current_stream(self.device).synchronize()
            return [t[:n] for t in self._host_out]
        views = self._views[n]
        self._count(views.captured.rows, n)
        if self._inputs_on_host:  # such a graph reads its host inputs when it replays: the last replay must have run
            torch.cuda.current_stream(self.device).synchronize()
        # host blocks in page-locked memory (serving.pinned_host) go straight to the graph's inputs,
        # unless they are many small ones (direct_pays): those are gathered into the staging first
        direct = on_gpu or (not self._inputs_on_host and direct_pays(inputs) and all(t.is_pinned() for blocks in inputs for t in _blocks(blocks)))
        if direct:
            for blocks, static in zip(inputs, views.static_in):
                gather(blocks, static)
        else:
            for blocks, staged, static in zip(inputs, views.staging_in, views.static_in):
                gather(blocks, staged)
                static.copy_(staged, non_blocking=True)
        if outputs_on_device and not on_gpu:  # the caller may reuse the blocks' memory, and the next run the staging, once these copies have read them
            self._host_in_read.record()
        views.captured.replay()
        if outputs_on_device:
            if not on_gpu:
                if direct:
                    self._host_in_read.synchronize()
                else:
                    self._staging_queued = True
            return list(views.outputs)
        for host, out in zip(views.host_out, views.outputs):
            host.copy_(out, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return list(views.host_out)

    def _count(self, bucket: int, rows: int) -> None:
        self.batches[bucket] += 1
        self.padded_rows += bucket - rows

    def _staging_for(self, on_gpu: bool) -> list[torch.Tensor]:
        if not on_gpu:
            return self._host_in
        if self._device_in is None:
            self._device_in = _staging(self._input_specs, self.max_batch, self.device)
        return self._device_in

    def _run_chunks(self, n: int, batch: list[torch.Tensor]) -> None:
        """Rows above the largest bucket: one replay per chunk of at most that many rows."""
        done = 0
        while done < n:
            rows = min(n - done, self.buckets[-1])
            bucket = self.bucket_for(rows)
            self._count(bucket, rows)
            captured = self.graphs[bucket]
            if self._inputs_on_host:
                torch.cuda.current_stream(self.device).synchronize()
            for static, staged in zip(captured.inputs, batch):
                static[:rows].copy_(staged[done : done + rows], non_blocking=True)
            captured.replay()
            for host, out in zip(self._host_out, captured.outputs):
                host[done : done + rows].copy_(out[:rows], non_blocking=True)
            done += rows


class PackedInputs:
    """A graph's static inputs as views of one device buffer, filled from a
    pinned host twin of the same layout by a copy captured at the head of the
    graph (`copy_up`, the graph's prologue): a caller that assembles its batch
    row by row writes the rows into `refill()`'s host views and replays, one
    submission to the GPU per batch. The host views are the graph's inputs
    (`CapturedGraph.inputs`), so `GraphRunner.run` fills them as well.

    For the variable-length path, where a lone request's host time before the
    launch is latency: a 16-token BERT request's replay was queued 85 us after
    `VarLenRunners.run` began, against 170 with each input padded into a tensor
    of its own and sent by `GraphRunner.run` (staging, one transfer per input),
    and a copy outside the graph cost 59 us on the host after 1 ms of idle GPU
    (H100, 2026-11-27, the probe scripts/varlen_host_profile.py, since removed; docs/benchmarks.md,
    variable lengths run 9). The inputs must share a dtype (`fits`)."""

    def __init__(self, specs: Sequence[TensorSpec], rows: int, device: torch.device):
        if not self.fits(specs):
            raise ValueError(f"packed inputs need one dtype, got {sorted({str(s.dtype) for s in specs})}")
        sizes = [rows * math.prod(s.shape) for s in specs]
        dtype = specs[0].dtype
        self.host_buffer = torch.zeros(sum(sizes), dtype=dtype, pin_memory=True)
        self.device_buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
        shapes = [(rows, *s.shape) for s in specs]
        self.host_inputs = [v.view(shape) for v, shape in zip(self.host_buffer.split(sizes), shapes)]
        self.device_inputs = [v.view(shape) for v, shape in zip(self.device_buffer.split(sizes), shapes)]
        self._read = torch.cuda.Event()  # recorded after each replay that copied `host_buffer` up

    @staticmethod
    def fits(specs: Sequence[TensorSpec]) -> bool:
        return len({s.dtype for s in specs}) == 1

    def copy_up(self) -> None:
        """The whole host buffer into the device views (the graph's prologue)."""
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)

    def refill(self) -> list[torch.Tensor]:
        """The host views, zeroed, once the last replay that read them has (`replayed`)."""
        self._read.synchronize()  # returns at once unless that replay is still queued
        self.host_buffer.zero_()
        return self.host_inputs

    def replayed(self) -> None:
        """Mark the replay just queued (on the current stream) as the host buffer's last reader."""
        self._read.record()


def _as_tuple(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)
