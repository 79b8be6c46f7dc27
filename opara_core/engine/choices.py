"""What `auto` chose per bucket, kept on disk so that a later build captures only that.

`auto` captures and times every candidate at every bucket: a build's biggest
cost once compiled code is cached. A later build that starts from the same
traced graph, with the same settings and engine code, on the same GPU and
software, would time the same replays, so it takes the earlier choice and
captures only it (the guard still checks every bucket against eager). What is
kept per such start (`key`): the choice per bucket, the timings it was made
from, and the fingerprint of each graph the choices use, so that the later
build fuses and profiles only those graphs and can tell when one comes out
otherwise. The files lie as JSON under $OPARA_CACHE_DIR/choices (default
~/.cache/opara/choices; engine.cache); delete the directory, or set
`remember_choices` false, to time everything again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from opara_core.engine import cache

FORMAT = 3  # bump when the key or the file changes shape (3: keyed through engine.cache)


def cache_dir() -> Path:
    return cache.directory("choices")


def key(parts: Mapping[str, str], buckets: Iterable[int], device: torch.device) -> str:
    """The key (engine.cache) of what a choice depends on: `parts` (what the
    build starts from: its traced graph, settings and code), the buckets, and
    the GPU, software and switches that change kernels (`cache.KERNELS`)."""
    return cache.key({"parts": dict(parts), "buckets": sorted(set(buckets)), "format": FORMAT}, cache.KERNELS, device)


@dataclass(frozen=True)
class Remembered:
    """An earlier build's choices, as text (`graph:policy/lanes` per bucket)."""

    choices: dict[int, str]
    timings_ms: dict[int, dict[str, float]]
    graphs: dict[str, str]  # the fingerprint of each graph the choices use, by graph name


def load(key: str, directory: Path | None = None) -> Remembered | None:
    """What was stored under `key`, or None (none, or unreadable)."""
    return cache.read_json((directory or cache_dir()) / f"{key}.json", _remembered, "remembered choices")


def _remembered(data: dict) -> Remembered:
    return Remembered(
        choices={int(b): str(c) for b, c in data["choices"].items()},
        timings_ms={int(b): {str(c): float(t) for c, t in times.items()} for b, times in data["timings_ms"].items()},
        graphs={str(name): str(fingerprint) for name, fingerprint in data["graphs"].items()},
    )


def store(
    key: str,
    choices: Mapping[int, object],
    timings_ms: Mapping[int, Mapping[object, float]],
    graphs: Mapping[str, str],
    directory: Path | None = None,
) -> Path:
    """Remember a build's choices (atomically: a reader never sees half a file)."""
    data = {
        "choices": {str(b): str(c) for b, c in choices.items()},
        "timings_ms": {str(b): {str(c): t for c, t in times.items()} for b, times in timings_ms.items()},
        "graphs": dict(graphs),
    }
    return cache.write_json((directory or cache_dir()) / f"{key}.json", data, indent=1, sort_keys=True)


def forget(key: str, directory: Path | None = None) -> None:
    """Drop remembered choices (they failed their capture or guard)."""
    ((directory or cache_dir()) / f"{key}.json").unlink(missing_ok=True)
