"""Run batches through a model: eagerly, or by replaying CUDA graphs per batch bucket.

Both runners share one calling convention built for a serving hot path with no
per-request allocation: the caller writes the batch into `host_inputs(n)` (numpy
views of preallocated, on a GPU pinned, staging buffers), calls `run(n)` and
reads the first `n` rows of the returned numpy views, which stay valid until
the next `run`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from opara_core.zoo import TensorSpec

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner is, for logs and metrics."""

    kind: str  # "eager" or "cuda-graph"
    device: str
    buckets: tuple[int, ...] = ()


def _staging(specs: Sequence[TensorSpec], rows: int, pin: bool) -> list[torch.Tensor]:
    return [torch.zeros((rows, *s.shape), dtype=s.dtype, pin_memory=pin) for s in specs]


class EagerRunner:
    """Runs the module as is, on the CPU or a GPU. The fallback of last resort."""

    def __init__(
        self,
        module: torch.nn.Module,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        device: torch.device,
        max_batch: int,
    ):
        self.module = module.to(device)
        self.device = device
        self.max_batch = max_batch
        pin = device.type == "cuda"
        self._host_in = _staging(inputs, max_batch, pin)
        self._host_out = _staging(outputs, max_batch, pin)
        self._lock = threading.Lock()
        self.info = RunnerInfo("eager", str(device))
        self.batches: Counter[int] = Counter()  # batch size -> runs
        self.padded_rows = 0

    def host_inputs(self, n: int) -> list[np.ndarray]:
        _check_rows(n, self.max_batch)
        return [t[:n].numpy() for t in self._host_in]

    def run(self, n: int) -> list[np.ndarray]:
        with self._lock, torch.inference_mode():
            args = [t[:n].to(self.device, non_blocking=True) for t in self._host_in]
            result = _as_tuple(self.module(*args))
            for host, out in zip(self._host_out, result):
                host[:n].copy_(out)
            self.batches[n] += 1
            return [t[:n].numpy() for t in self._host_out]


class GraphRunner:
    """One CUDA graph per batch bucket, all sharing one memory pool.

    A batch of n rows replays the smallest bucket >= n after one host-to-device
    copy per input; rows past n hold the previous batch's (valid) data, which is
    harmless because every served model treats rows independently in eval mode.
    A batch above the largest bucket runs as several chunks. A lock keeps two
    threads from replaying one graph at once.
    """

    def __init__(
        self,
        capture: Callable[[Sequence[torch.Tensor], object], tuple[torch.cuda.CUDAGraph, Sequence[torch.Tensor]]],
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        device: torch.device,
        max_batch: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
    ):
        self.device = device
        self.max_batch = max_batch
        self.buckets = tuple(sorted(set(buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self._host_in = _staging(inputs, max_batch, pin=True)
        self._host_out = _staging(outputs, max_batch, pin=True)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], list[torch.Tensor]]] = {}
        pool = torch.cuda.graph_pool_handle()
        # Smallest first: batch 1 is where latency matters most, and a capture
        # function that learns (build.AutoCapture) sees it first.
        with torch.inference_mode():  # no autograd state in the graphs or their outputs
            for bucket in self.buckets:
                static_in = [spec.random(bucket).to(device) for spec in inputs]
                graph, static_out = capture(static_in, pool)
                self._graphs[bucket] = (graph, static_in, list(static_out))
        self._lock = threading.Lock()
        self.info = RunnerInfo("cuda-graph", str(device), self.buckets)
        self.batches: Counter[int] = Counter()  # bucket -> replays
        self.padded_rows = 0
        log.info("captured CUDA graphs for buckets %s on %s", self.buckets, device)

    def host_inputs(self, n: int) -> list[np.ndarray]:
        _check_rows(n, self.max_batch)
        return [t[:n].numpy() for t in self._host_in]

    def bucket_for(self, n: int) -> int:
        """The smallest bucket that holds n rows (the largest if none does)."""
        return next((b for b in self.buckets if b >= n), self.buckets[-1])

    def run_on_device(self, n: int) -> list[torch.Tensor]:
        """Like `run`, but the outputs stay on the GPU: views of the graph's static
        outputs, valid until the next run (no device-to-host copy, no sync; the
        consumer must order itself after the current stream). For n up to the
        largest bucket; larger batches go through `run`."""
        if n > self.buckets[-1]:
            return [torch.from_numpy(a) for a in self.run(n)]
        with self._lock, torch.inference_mode():
            bucket = self.bucket_for(n)
            graph, static_in, static_out = self._graphs[bucket]
            self.batches[bucket] += 1
            self.padded_rows += bucket - n
            for static, host in zip(static_in, self._host_in):
                static[:n].copy_(host[:n], non_blocking=True)
            graph.replay()
            return [static[:n] for static in static_out]

    def run(self, n: int) -> list[np.ndarray]:
        with self._lock, torch.inference_mode():
            done = 0
            while done < n:
                rows = min(n - done, self.buckets[-1])
                bucket = self.bucket_for(rows)
                graph, static_in, static_out = self._graphs[bucket]
                self.batches[bucket] += 1
                self.padded_rows += bucket - rows
                for static, host in zip(static_in, self._host_in):
                    static[:rows].copy_(host[done : done + rows], non_blocking=True)
                graph.replay()
                for host, static in zip(self._host_out, static_out):
                    host[done : done + rows].copy_(static[:rows], non_blocking=True)
                done += rows
            torch.cuda.current_stream(self.device).synchronize()
            return [t[:n].numpy() for t in self._host_out]


def capture_sequential(module: torch.nn.Module, warmup: int = 3):
    """A capture function for GraphRunner: the module on one stream.

    Warm-up runs on a side stream first (cuDNN autotuning, lazy
    initialisation, workspaces), as CUDA-graph capture requires.
    """

    def capture(static_in: Sequence[torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                module(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            static_out = _as_tuple(module(*static_in))
        return graph, static_out

    return capture


def _as_tuple(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _check_rows(n: int, max_batch: int) -> None:
    if not 1 <= n <= max_batch:
        raise ValueError(f"batch of {n} rows is outside 1..{max_batch}")
