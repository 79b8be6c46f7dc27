"""A variable-length model's measured cost table, kept on disk for `capture` "first_use".

A start that captures every shape ("load", and `launcher warm`, which fills a
container image's cache) times every cell's replay. A "first_use" start builds
only the smallest shape, so without these timings its scheduler would plan
with the token-count model until each shape has run once (T5: the DP then lost
to greedy, docs/benchmarks.md variable lengths run 5). So a start that timed
every cell stores them, and a "first_use" start on the same GPU, software and
model structure plans with them; a shape built later replaces its cells with
its own timings. The tables lie as JSON under $OPARA_CACHE_DIR/costs (default
~/.cache/opara/costs), one file per key; delete them to plan from the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from opara_core.engine.inductor_cache import cache_root, write_json_atomically
from opara_core.engine.trace_cache import module_fingerprint

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the key or the file changes shape

Cell = tuple[tuple[int, ...], int]  # (shape, batch bucket)


def costs_dir() -> Path:
    return cache_root() / "costs"


def costs_key(model: str, module: torch.nn.Module, compiler: str, axes: Sequence[Sequence[int]], batches: Sequence[int], device: torch.device) -> str:
    """sha256 of what the timings depend on: the model and its structure, the
    compiler, the grid, the GPU and the software."""
    text = json.dumps(
        {
            "model": model,
            "structure": module_fingerprint(module),
            "compiler": compiler,
            "axes": [list(buckets) for buckets in axes],
            "batches": sorted(batches),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "torch": torch.__version__,
            "format": FORMAT,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def load(key: str, directory: Path | None = None) -> dict[Cell, float]:
    """Seconds per cell of a stored table; empty if none (or unreadable)."""
    path = (directory or costs_dir()) / f"{key}.json"
    try:
        cells = json.loads(path.read_text())["seconds"]
        return {(tuple(int(n) for n in shape.split(",")), int(batch)): float(seconds) for shape, by_batch in cells.items() for batch, seconds in by_batch.items()}
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("ignoring unreadable cost table %s: %s", path, error)
        return {}


def store(key: str, seconds: Mapping[Cell, float], directory: Path | None = None) -> Path:
    """Keep a table (atomically: a reader never sees half a file)."""
    cells: dict[str, dict[str, float]] = {}
    for (shape, batch), value in sorted(seconds.items()):
        cells.setdefault(",".join(map(str, shape)), {})[str(batch)] = value
    return write_json_atomically((directory or costs_dir()) / f"{key}.json", {"seconds": cells}, indent=1)
