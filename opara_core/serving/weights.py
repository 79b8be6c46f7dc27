"""User weights: serve a zoo architecture with weights from a file instead of the seed.

A model's config.pbtxt names the file with `parameters { key: "weights" value:
{ string_value: "weights.pt" } }`, relative to the version directory. Two kinds:

- a state_dict (`*.pt`, `*.pth`), loaded with `torch.load(weights_only=True)`,
  so a pickle that would run code is refused, and applied with strict key
  checking to the zoo architecture;
- a `torch.export` archive (`*.pt2`, from `torch.export.save`), whose module
  replaces the zoo architecture altogether (its inputs must match the config).

Without a file the model serves its seeded random weights. Drawing them is
slow (BERT's 110M numbers, NASNet's BatchNorm calibration), so `seeded_module`
keeps them under $OPARA_CACHE_DIR/weights and a warm start builds the module on
the meta device and maps them in.
"""

from __future__ import annotations

import inspect
import logging
import pickle
from pathlib import Path

import torch

from opara_core import zoo
from opara_core.engine import cache
from opara_core.engine.trace_cache import module_fingerprint, named_tensors, put_tensor

log = logging.getLogger(__name__)

EXPORT_SUFFIX = ".pt2"
SAFETENSORS_SUFFIX = ".safetensors"
FORMAT = 2  # of the seeded weights' key (2: keyed through engine.cache)


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
        return seeded_module(entry)
    if path.suffix == EXPORT_SUFFIX:
        program = load_program(path)
        log.info("serving the exported program %s", path)
        return program_module(program)
    module = entry.build()
    load_into(module, path, entry.name)
    log.info("serving %s with weights from %s", entry.name, path)
    return module.eval()


def load_program(path: Path) -> torch.export.ExportedProgram:
    """The torch.export archive at `path`; an unreadable one is a WeightsError."""
    try:
        return torch.export.load(str(path))
    except Exception as error:  # noqa: BLE001 - any unreadable archive is the user's error
        raise WeightsError(f"cannot load the torch.export archive {path.name}: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from None


def program_module(program: torch.export.ExportedProgram) -> torch.nn.Module:
    """The program's module as the engine can take it. torch refuses train()
    and eval() on it (the graph was fixed at export, in whatever mode); the
    build puts every module it gets in eval mode, which on a graph of ATen
    operators changes nothing, so the module's own train() and eval() are back."""
    module = program.module()
    for name in ("train", "eval"):
        module.__dict__.pop(name, None)
    return module


def load_into(module: torch.nn.Module, path: Path, model: str) -> None:
    """Put the weights at `path` into `module`, every key matched: a
    safetensors file, or a plain state_dict (`torch.load(weights_only=True)`,
    so a pickle that would run code is refused)."""
    if path.suffix == SAFETENSORS_SUFFIX:
        state = _safetensors_state(module, path)
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise WeightsError(f"refusing {path.name}: it is not a plain state_dict ({str(error).splitlines()[0]})") from None
        except Exception as error:  # noqa: BLE001
            raise WeightsError(f"cannot read {path.name}: {error}") from None
        if not isinstance(state, dict):
            raise WeightsError(f"{path.name} holds a {type(state).__name__}, not a state_dict")
    try:
        module.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError) as error:
        raise WeightsError(f"{path.name} does not fit {model}: {str(error).splitlines()[0]}") from None


def _safetensors_state(module: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as a state_dict `module` accepts. A safetensors file
    keeps one name of tensors the module ties (`save_model`), so the other
    names take the kept one's tensor; and it has no per-module versions, which
    some classes' loaders demand (torchvision's MNASNet refuses a state without
    one), so the state carries the module's own, the code the file came from."""
    from collections import OrderedDict

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = OrderedDict(load_file(str(path), device="cpu"))
    except (SafetensorError, OSError) as error:
        raise WeightsError(f"cannot read {path.name}: {error}") from None
    own = module.state_dict()
    kept = {(tensor.data_ptr(), tensor.shape): name for name, tensor in own.items() if name in state and tensor.numel()}
    for name, tensor in own.items():
        twin = kept.get((tensor.data_ptr(), tensor.shape)) if tensor.numel() else None
        if name not in state and twin is not None:
            state[name] = state[twin]
    state._metadata = getattr(own, "_metadata", None)  # type: ignore[attr-defined]
    return state


def seeded_module(entry: zoo.ZooModel, directory: Path | None = None) -> torch.nn.Module:
    """`entry.build()`, its tensors read from `directory` (default
    $OPARA_CACHE_DIR/weights) when an earlier start saved them there; a
    module that cannot be built on the meta device, or whose file is
    unreadable, is built as usual."""
    directory = cache.directory("weights") if directory is None else Path(directory)
    try:
        with torch.device("meta"):
            skeleton = entry.builder().eval()
    except Exception as error:  # noqa: BLE001 - any builder that needs real tensors: no cache
        log.info("%s cannot be built on the meta device (%s: %s); drawing its weights", entry.name, type(error).__name__, error)
        return entry.build()
    path = directory / f"{entry.name}-{_seeded_key(entry, skeleton)[:24]}.pt"
    # a damaged or foreign file: drawn and saved again
    filled = cache.read(path, lambda p: _fill(skeleton, torch.load(p, mmap=True, weights_only=True)), "seeded weights")
    if filled is not None:
        log.info("%s: seeded weights from the cache (%s)", entry.name, path.name)
        return filled
    module = entry.build()
    try:
        cache.write_torch(path, dict(named_tensors(module)))
    except (OSError, RuntimeError) as error:  # a full or read-only disk: the next start draws them again
        log.info("seeded weights not saved to %s (%s)", path, error)
    return module


def _seeded_key(entry: zoo.ZooModel, skeleton: torch.nn.Module) -> str:
    """The key (engine.cache) of what the seeded weights depend on: the model,
    the seed, torch, the zoo's code (its builders and the BatchNorm
    calibration) and the module's structure."""
    return cache.key(
        {"format": FORMAT, "model": entry.name, "seed": zoo.SEED, "zoo": cache.digest(inspect.getsource(zoo)), "structure": module_fingerprint(skeleton)},
        ("torch",),
    )


def _fill(skeleton: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Put the saved tensors in place of the skeleton's meta ones (and return
    it); every tensor the module holds must come from the file."""
    expected = {name for name, _ in named_tensors(skeleton)}
    if set(tensors) != expected:
        raise KeyError(f"the file holds {len(tensors)} tensors, the module {len(expected)}")
    for name, tensor in tensors.items():
        put_tensor(skeleton, name, tensor)
    left = [f"{name}.{k}" for name, m in skeleton.named_modules() for k, v in vars(m).items() if isinstance(v, torch.Tensor) and v.is_meta]
    if left:
        raise ValueError(f"{left[0]} is not a parameter or buffer; it stays on the meta device")
    return skeleton
