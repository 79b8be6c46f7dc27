"""Which weight layout cuBLAS runs faster for one linear layer, measured on the GPU.

A traced `nn.Linear` is `addmm(b, x, w.t())` (or `mm`): cuBLAS multiplies by
the weight [N, K] transposed (its `tn` kernels). Storing the weight transposed
and contiguous, [K, N], runs the `nn` kernels instead, as torch.compile's
freezing does when it folds the transpose into a constant. Neither is always
faster: on an H100 (docs/benchmarks.md run 11) BERT's feed-forward
down-projection at batch 32 took 509 us one way and 432 us the other, while
its 768x768 projections at batch 1 were 17% slower transposed. So the fusion
pass `pretranspose_linears` asks this module, per GEMM shape, and the answer
is kept on disk (by GPU, torch, TF32 switches and shape): a later build gets
the same layout, so the same graph, the same profile and the same compiled
segments.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from opara_core.engine.inductor_cache import cache_root

log = logging.getLogger(__name__)

FORMAT = 1
CALLS = 20  # calls per captured graph
REPEATS = 7  # replays timed; the median counts
THRESHOLD = 0.97  # transposed only where it is at least 3% faster (geometric mean over the row counts)


def replay_us(call: Callable[[], Any], calls: int = CALLS, repeats: int = REPEATS) -> float:
    """Microseconds per call: `calls` calls captured in one CUDA graph, the
    median of `repeats` replays (no launch overhead, as in the served graphs)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(samples)


def time_layouts(bias: bool, m: int, k: int, n: int, dtype: torch.dtype, device: torch.device | str) -> tuple[float, float]:
    """(us with the weight as stored, us with it stored transposed) for
    `x [m, k] @ w.t()` (plus a bias if `bias`), on random values."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, dtype=dtype, device=device, generator=generator)
    w = torch.randn(n, k, dtype=dtype, device=device, generator=generator)
    b = torch.randn(n, dtype=dtype, device=device, generator=generator)
    wt = w.t().contiguous()
    if bias:
        return replay_us(lambda: torch.addmm(b, x, w.t())), replay_us(lambda: torch.addmm(b, x, wt))
    return replay_us(lambda: torch.mm(x, w.t())), replay_us(lambda: torch.mm(x, wt))


def _key(bias: bool, rows: Sequence[int], k: int, n: int, dtype: torch.dtype, device: torch.device) -> str:
    text = json.dumps(
        {
            "op": "addmm" if bias else "mm",
            "rows": sorted(set(rows)),
            "k": k,
            "n": n,
            "dtype": str(dtype),
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "tf32": [torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()],
            "format": FORMAT,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_dir() -> Path:
    """$OPARA_CACHE_DIR/gemm_layouts, else ~/.cache/opara/gemm_layouts."""
    return cache_root() / "gemm_layouts"


def transposed_is_faster(bias: bool, rows: Sequence[int], k: int, n: int, dtype: torch.dtype, device: torch.device | str, directory: Path | None = None) -> bool:
    """Whether `x @ w.t()` (+ bias) with `x` of each of `rows` rows runs faster
    with `w` stored transposed: the geometric mean of the time ratios over
    `rows` (the smallest and largest bucket count the same) at most THRESHOLD.
    Measured once; the answer is read from the cache directory after. No for
    a weight not on a CUDA device (nothing to measure there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    directory = directory or cache_dir()
    path = directory / f"{_key(bias, rows, k, n, dtype, device)}.json"
    try:
        return bool(json.loads(path.read_text())["transposed"])
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as error:
        log.warning("measuring again: unreadable GEMM layout %s (%s)", path, error)
    times = {m: time_layouts(bias, m, k, n, dtype, device) for m in sorted(set(rows))}
    ratio = math.exp(statistics.fmean(math.log(t / s) for s, t in times.values()))
    transposed = ratio <= THRESHOLD
    log.info("GEMM %s k=%d n=%d rows %s: transposed/stored %.3f -> %s", "addmm" if bias else "mm", k, n, sorted(times), ratio, "transposed" if transposed else "as stored")
    record = {"transposed": transposed, "ratio": ratio, "us": {str(m): {"stored": s, "transposed": t} for m, (s, t) in times.items()}}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as tmp:
            json.dump(record, tmp, indent=1)
        os.replace(tmp.name, path)
    except OSError as error:  # the answer still holds for this build
        log.warning("GEMM layout not kept in %s: %s", directory, error)
    return transposed
