"""The model a Triton model directory serves, outside Triton.

`python -m opara_core.bench --model-dir DIR/NAME` times a user's model as it
times the zoo's: it needs the module and the description that the server
would build from the same files. This reads DIR/NAME/config.pbtxt (protobuf's
text format, Triton's ModelConfig message, turned into the JSON form Triton
hands to `initialize`), imports the newest version's model.py and runs its
`TritonPythonModel.load`, the first half of `initialize`: the same parameters,
checks, description and module the server gets.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from opara_core.serving import model_config
from opara_core.spec import ModelSpec


class ModelDirError(ValueError):
    """A directory that is not a model directory this project serves."""


def read_config(directory: Path) -> dict:
    """DIR/config.pbtxt as the JSON object Triton passes to a Python model."""
    path = Path(directory) / "config.pbtxt"
    if not path.is_file():
        raise ModelDirError(f"{directory} holds no config.pbtxt: give a model directory (e.g. model_repository/googlenet)")
    try:
        config = model_config.as_json(model_config.read(path))
    except model_config.ModelConfigError as error:
        raise ModelDirError(str(error)) from None
    config.setdefault("name", Path(directory).name)
    return config


def version_dir(directory: Path) -> Path:
    """The newest version directory (Triton's default version policy: latest 1)."""
    versions = sorted((p for p in Path(directory).iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not versions or not (versions[-1] / "model.py").is_file():
        raise ModelDirError(f"{directory} has no version directory with a model.py (e.g. {directory}/1/model.py)")
    return versions[-1]


def load(directory: Path) -> tuple[ModelSpec, torch.nn.Module]:
    """The description and the module that serving DIR would build (eval mode, on the CPU)."""
    directory = Path(directory)
    config = read_config(directory)
    version = version_dir(directory)
    name = f"opara_model_dir_{config['name']}"
    loader = importlib.util.spec_from_file_location(name, version / "model.py")
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    loader.loader.exec_module(module)
    model_class = getattr(module, "TritonPythonModel", None)
    if model_class is None or not hasattr(model_class, "load"):
        raise ModelDirError(f"{version / 'model.py'} defines no TritonPythonModel of opara_core's adapters")
    served = model_class()
    _, network = served.load(config, version)
    return served.graph_entry, network.eval()  # what the engine builds: ids checked in the graph (serving.id_guard)
