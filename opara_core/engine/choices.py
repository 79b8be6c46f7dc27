"""What `auto` chose per bucket, kept on disk so that a later build captures only that.

`auto` captures and times every candidate at every bucket: a build's biggest
cost once compiled code is cached. A later build of the same traced graphs with
the same candidates, buckets and switches on the same GPU and software would
time the same replays, so it takes the earlier choice and captures only it (the
guard still checks every bucket against eager). The choices lie as JSON under
$OPARA_CACHE_DIR/choices (default ~/.cache/opara/choices), one file per key;
delete the directory, or set `remember_choices` false, to time everything again.
Beside them, a recipe per traced graph and settings names the graphs the
choices use, so that such a build fuses and profiles only those.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from opara_core.engine.inductor_cache import cache_root, write_json_atomically

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the key or the file changes shape


def cache_dir() -> Path:
    return cache_root() / "choices"


def choices_key(graphs: Mapping[str, str], candidates: Iterable[str], buckets: Iterable[int], device: torch.device) -> str:
    """sha256 of what the choice depends on: each graph's fingerprint by name,
    the candidates, the buckets, the GPU, the software and the switches that
    change kernels."""
    text = json.dumps(
        {
            "graphs": dict(sorted(graphs.items())),
            "candidates": sorted(candidates),
            "buckets": sorted(set(buckets)),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(),
            "switches": [torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32],
            "format": FORMAT,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def load(key: str, directory: Path | None = None) -> tuple[dict[int, str], dict[int, dict[str, float]]] | None:
    """The remembered choice per bucket and the timings it was made from, or None."""
    path = (directory or cache_dir()) / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        return {int(b): str(c) for b, c in data["choices"].items()}, {int(b): dict(t) for b, t in data["timings_ms"].items()}
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("ignoring unreadable remembered choices %s: %s", path, error)
        return None


def store(key: str, choices: Mapping[int, object], timings_ms: Mapping[int, Mapping[object, float]], directory: Path | None = None) -> Path:
    """Remember a build's choices (atomically: a reader never sees half a file)."""
    data = {
        "choices": {str(b): str(c) for b, c in choices.items()},
        "timings_ms": {str(b): {str(c): t for c, t in times.items()} for b, times in timings_ms.items()},
    }
    return write_json_atomically((directory or cache_dir()) / f"{key}.json", data, indent=1, sort_keys=True)


def store_recipe(recipe: str, key: str, graphs: Mapping[str, str], directory: Path | None = None) -> Path:
    """Remember, under a key of what a build starts from (its traced graph, its
    settings and the engine's code), the key its choices are stored under and
    the fingerprint of each graph they use: a later build then fuses only those
    graphs (engine.build)."""
    return write_json_atomically((directory or cache_dir()) / f"recipe-{recipe}.json", {"key": key, "graphs": dict(graphs)}, indent=1, sort_keys=True)


def load_recipe(recipe: str, directory: Path | None = None) -> tuple[str, dict[str, str]] | None:
    """The choices' key and the fingerprints of the graphs they use, or None."""
    path = (directory or cache_dir()) / f"recipe-{recipe}.json"
    try:
        data = json.loads(path.read_text())
        return str(data["key"]), {str(name): str(fingerprint) for name, fingerprint in data["graphs"].items()}
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("ignoring unreadable remembered recipe %s: %s", path, error)
        return None


def forget_recipe(recipe: str, directory: Path | None = None) -> None:
    ((directory or cache_dir()) / f"recipe-{recipe}.json").unlink(missing_ok=True)


def forget(key: str, directory: Path | None = None) -> None:
    """Drop a remembered choice (it failed its guard)."""
    ((directory or cache_dir()) / f"{key}.json").unlink(missing_ok=True)
