"""A variable-length model's measured cost table, kept on disk for `capture` "first_use".

A start that captures every shape ("load", and `launcher warm`, which fills a
container image's cache) times every cell's replay. A "first_use" start builds
only the smallest shape, so without these timings its scheduler would plan
with the token-count model until each shape has run once (T5: the DP then lost
to greedy, docs/benchmarks.md variable lengths run 5). So a start that timed
every cell stores them, and a "first_use" start on the same GPU, software and
model structure plans with them; a shape built later replaces its cells with
its own timings. The tables lie as JSON under $OPARA_CACHE_DIR/costs (default
~/.cache/opara/costs; engine.cache), one file per key; delete them to plan from the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from opara_core.engine import cache
from opara_core.engine.trace_cache import module_fingerprint

FORMAT = 2  # bump when the key or the file changes shape (2: keyed through engine.cache, cuDNN and TF32 in it)

Cell = tuple[tuple[int, ...], int]  # (shape, batch bucket)


# what the timings depend on of the software, besides the graphs: not the cuDNN benchmark
# switch, which each build sets (after this key is made) from its settings
SOFTWARE = ("gpu", "torch", "cudnn", "tf32")


def costs_dir() -> Path:
    return cache.directory("costs")


def costs_key(model: str, module: torch.nn.Module, compiler: str, axes: Sequence[Sequence[int]], batches: Sequence[int], device: torch.device) -> str:
    """The key (engine.cache) of what the timings depend on: the model and its
    structure, the compiler, the grid, the GPU and the software (`SOFTWARE`)."""
    return cache.key(
        {
            "model": model,
            "structure": module_fingerprint(module),
            "compiler": compiler,
            "axes": [list(buckets) for buckets in axes],
            "batches": sorted(batches),
            "format": FORMAT,
        },
        SOFTWARE,
        device,
    )


def load(key: str, directory: Path | None = None) -> dict[Cell, float]:
    """Seconds per cell of a stored table; empty if none (or unreadable)."""
    return cache.read_json((directory or costs_dir()) / f"{key}.json", _cells, "cost table") or {}


def _cells(data: dict) -> dict[Cell, float]:
    return {(tuple(int(n) for n in shape.split(",")), int(batch)): float(seconds) for shape, by_batch in data["seconds"].items() for batch, seconds in by_batch.items()}


def store(key: str, seconds: Mapping[Cell, float], directory: Path | None = None) -> Path:
    """Keep a table (atomically: a reader never sees half a file)."""
    cells: dict[str, dict[str, float]] = {}
    for (shape, batch), value in sorted(seconds.items()):
        cells.setdefault(",".join(map(str, shape)), {})[str(batch)] = value
    return cache.write_json((directory or costs_dir()) / f"{key}.json", {"seconds": cells}, indent=1)
