"""User weights: serve a zoo architecture with weights from a file instead of the seed.

A model's config.pbtxt names the file with `parameters { key: "weights" value:
{ string_value: "weights.pt" } }`, relative to the version directory. Two kinds:

- a state_dict (`*.pt`, `*.pth`), loaded with `torch.load(weights_only=True)`,
  so a pickle that would run code is refused, and applied with strict key
  checking to the zoo architecture;
- a `torch.export` archive (`*.pt2`, from `torch.export.save`), whose module
  replaces the zoo architecture altogether (its inputs must match the config).
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch

from opara_core import zoo

log = logging.getLogger(__name__)

EXPORT_SUFFIX = ".pt2"


class WeightsError(ValueError):
    """The weights file is missing, unsafe or does not fit the model."""


def weights_path(version_dir: Path, name: str) -> Path:
    """The weights file `name`, which must lie inside `version_dir`."""
    path = (Path(version_dir) / name).resolve()
    if Path(version_dir).resolve() not in path.parents:
        raise WeightsError(f"weights file {name!r} must be inside the version directory {version_dir}")
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist")
    return path


def load_module(entry: zoo.ZooModel, path: Path | None) -> torch.nn.Module:
    """The module to serve: the seeded zoo model, or the zoo model with the
    state_dict at `path`, or the exported program at `path`; eval mode."""
    if path is None:
        return entry.build()
    if path.suffix == EXPORT_SUFFIX:
        try:
            program = torch.export.load(str(path))
        except Exception as error:  # noqa: BLE001 - any unreadable archive is the user's error
            raise WeightsError(f"cannot load the torch.export archive {path.name}: {error}") from None
        log.info("serving the exported program %s", path)
        return program.module()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise WeightsError(f"refusing {path.name}: it is not a plain state_dict ({str(error).splitlines()[0]})") from None
    except Exception as error:  # noqa: BLE001
        raise WeightsError(f"cannot read {path.name}: {error}") from None
    if not isinstance(state, dict):
        raise WeightsError(f"{path.name} holds a {type(state).__name__}, not a state_dict")
    module = entry.build()
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise WeightsError(f"{path.name} does not fit {entry.name}: {str(error).splitlines()[0]}") from None
    log.info("serving %s with weights from %s", entry.name, path)
    return module.eval()
