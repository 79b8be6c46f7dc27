"""Models a user brings, served through the same engine as the zoo's.

Two routes, each a base class for the model's `model.py`
(`python -m opara_core add-model` writes both the class and its config):

- `ExportedModel`: a `torch.export` program, `model.pt2` in the version
  directory, exported with a dynamic batch dimension. Its signature must be
  what config.pbtxt declares: a mismatch is a load error naming the tensor.
- `ModuleModel`: a Python module of the user's (their own class, a torchvision
  or timm model) from a factory, `factory = "package.module:function"` or
  `"file.py:function"` (a file in the version directory), with its weights
  from the `weights` parameter (a safetensors file or a plain state_dict).

The model's description (inputs, outputs, id ranges) comes from config.pbtxt:
the config is the contract with clients, and the program or module is checked
against it once, at load.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch

from opara_core.parameters import Values
from opara_core.serving import weights
from opara_core.serving.triton_backend import TRITON_DTYPES, OparaModel
from opara_core.spec import ModelSpec, TensorSpec

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: dtype for dtype, name in TRITON_DTYPES.items()}
PROGRAM_FILE = "model.pt2"


class ModelFileError(ValueError):
    """A user's program, module or config that cannot be served as it is."""


def spec_from_config(config: dict, values: Values) -> ModelSpec:
    """The model's description from its config.pbtxt (Triton's JSON form):
    per-row shapes, dtypes and the id ranges its `value_range.<input>` and
    `upper_bounds.<input>` parameters publish."""
    if int(config.get("max_batch_size", 0)) < 1:
        raise ModelFileError("max_batch_size must be at least 1: the engine batches requests along their first dimension")
    ranges, bounds = values.family("value_range"), values.family("upper_bounds")

    def tensor(kind: str, declared: dict) -> TensorSpec:
        name, type_name = declared["name"], declared["data_type"]
        if type_name not in TORCH_DTYPES:
            raise ModelFileError(f"config {kind} {name!r}: {type_name} is not served (one of {', '.join(sorted(TORCH_DTYPES))})")
        dims = tuple(int(d) for d in declared["dims"])
        if any(d < 1 for d in dims):
            raise ModelFileError(f"config {kind} {name!r}: dims {list(dims)}: every per-row dimension must be fixed here (variable lengths are served for Hugging Face checkpoints)")
        extra = {}
        if kind == "input" and name in ranges:
            extra["value_range"] = tuple(ranges[name])
        if kind == "input" and name in bounds:
            extra["upper_bounds"] = tuple(bounds[name])
        try:
            return TensorSpec(name, TORCH_DTYPES[type_name], dims, **extra)
        except ValueError as error:
            raise ModelFileError(f"config {kind} {name!r}: {error}") from None

    inputs = tuple(tensor("input", t) for t in config.get("input", []))
    outputs = tuple(tensor("output", t) for t in config.get("output", []))
    if not inputs or not outputs:
        raise ModelFileError("the config must declare the model's inputs and outputs")
    unknown = sorted((set(ranges) | set(bounds)) - {s.name for s in inputs})
    if unknown:
        raise ModelFileError(f"id ranges for {unknown}, which are not inputs of the config")
    return ModelSpec(config["name"], inputs, outputs)


# --- torch.export programs


# how to export a program the engine can batch, for the errors that say it is not one
DYNAMIC_BATCH_HINT = ("export it with a dynamic batch dimension (dynamic_shapes={0: torch.export.Dim('batch')} for each input, "
                      "and an example batch of at least 2)")


def load_program(path: Path) -> torch.export.ExportedProgram:
    if not path.is_file():
        raise ModelFileError(f"{path} does not exist: an exported model's version directory holds its {PROGRAM_FILE}")
    return weights.load_program(path)


def program_signature(program: torch.export.ExportedProgram) -> tuple[list[dict], list[dict]]:
    """The program's user inputs and outputs: name, dtype, `shape` (None where
    a dimension is symbolic), the batch dimension's exported range (`batch`:
    (low, high), None where it is fixed) and, for an integer input that indexes
    an embedding table directly, `ids`: the table's row count."""
    nodes = {n.name: n for n in program.graph.nodes}
    signature = program.graph_signature

    def described(node, name: str) -> dict:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise ModelFileError(f"the program's {name!r} is not a tensor ({type(value).__name__}); only tensor inputs and outputs are served")
        shape = tuple(d if isinstance(d, int) else None for d in value.shape)
        batch = None
        if value.dim() and not isinstance(value.shape[0], int):
            bounds = program.range_constraints.get(value.shape[0].node.expr)
            batch = (_finite(bounds.lower), _finite(bounds.upper)) if bounds is not None else (None, None)
        return {"name": name, "dtype": value.dtype, "shape": shape, "batch": batch}

    inputs = []
    for name in signature.user_inputs:
        entry = described(nodes[name], name)
        tables = [u.args[0].meta["val"].shape[0] for u in nodes[name].users if u.target is torch.ops.aten.embedding.default and u.args[1] is nodes[name]]
        entry["ids"] = int(min(tables)) if tables else None
        inputs.append(entry)
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    returned = {a.name: a for a in output_node.args[0] if isinstance(a, torch.fx.Node)}
    outputs = []
    for i, name in enumerate(signature.user_outputs):
        if name not in returned:
            raise ModelFileError(f"the program's output {i} is a constant ({name!r}), not a computed tensor")
        outputs.append(described(returned[name], name))
    return inputs, outputs


def _finite(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _shown(dtype: torch.dtype, shape: tuple) -> str:
    return f"{TRITON_DTYPES.get(dtype, dtype)} [{', '.join('?' if d is None else str(d) for d in shape)}]"


def check_program(program: torch.export.ExportedProgram, spec: ModelSpec, max_batch: int) -> None:
    """The program takes and returns what the config declares, batched: its
    first dimension exported as dynamic up to at least `max_batch`. Inputs
    are matched by name where the names agree, else in order."""
    inputs, outputs = program_signature(program)
    for kind, found, declared in (("input", inputs, spec.inputs), ("output", outputs, spec.outputs)):
        if len(found) != len(declared):
            raise ModelFileError(f"the config declares {len(declared)} {kind}s {[s.name for s in declared]}, the program has {len(found)} {[f['name'] for f in found]}")
        if kind == "input" and {f["name"] for f in found} == {s.name for s in declared}:
            by_name = {f["name"]: f for f in found}
            found = [by_name[s.name] for s in declared]
            if [f["name"] for f in found] != [f["name"] for f in inputs]:
                raise ModelFileError(f"the config lists the inputs as {[s.name for s in declared]}, the program takes them as {[f['name'] for f in inputs]}: list them in the program's order")
        for spec_tensor, got in zip(declared, found):
            what = f"{kind} {spec_tensor.name!r}" + ("" if got["name"] == spec_tensor.name else f" (the program's {got['name']!r})")
            if got["batch"] is None:
                raise ModelFileError(f"{what}: the program was exported with a fixed first dimension {got['shape'][:1]}; {DYNAMIC_BATCH_HINT}")
            if got["dtype"] != spec_tensor.dtype or got["shape"][1:] != spec_tensor.shape:
                raise ModelFileError(f"{what}: the config declares {_shown(spec_tensor.dtype, spec_tensor.shape)} per row, the program has {_shown(got['dtype'], got['shape'][1:])}")
            high = got["batch"][1]
            if kind == "input" and high is not None and high < max_batch:
                raise ModelFileError(f"{what}: the program takes batches of at most {high}, the config's max_batch_size is {max_batch}")


class ExportedModel(OparaModel):
    """Base class of the model.py that serves a torch.export program
    (`model.pt2` in the version directory) as config.pbtxt describes it."""

    def _describe(self, config: dict, values: Values, version_dir: Path) -> ModelSpec:
        return spec_from_config(config, values)

    def _module(self, values: Values, version_dir: Path) -> torch.nn.Module:
        if values["weights"]:
            raise ModelFileError("an exported program holds its own weights: remove the weights parameter")
        program = load_program(version_dir / PROGRAM_FILE)
        check_program(program, self.entry, self.max_batch)
        log.info("serving the exported program %s", version_dir / PROGRAM_FILE)
        return weights.program_module(program)


# --- Python modules


def call_factory(factory: str, version_dir: Path | None = None) -> torch.nn.Module:
    """The module `factory` ("package.module:function", or "file.py:function"
    for a file in `version_dir`) returns, in eval mode."""
    where, _, function = factory.rpartition(":")
    if not where or not function:
        raise ModelFileError(f"factory {factory!r}: expected MODULE:FUNCTION, e.g. torchvision.models:squeezenet1_1")
    try:
        if where.endswith(".py"):
            path = Path(where) if version_dir is None else Path(version_dir) / where
            if not path.is_file():
                raise ModelFileError(f"factory {factory!r}: {path} does not exist")
            loader = importlib.util.spec_from_file_location(f"opara_user_{path.stem}", path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[loader.name] = module  # dataclasses and pickling look their module up
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        built = getattr(module, function)()
    except ModelFileError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the user's code raised, in one line
        raise ModelFileError(f"factory {factory!r} failed: {type(error).__name__}: {error}") from None
    if not isinstance(built, torch.nn.Module):
        raise ModelFileError(f"factory {factory!r} returned a {type(built).__name__}, not a torch.nn.Module")
    return built.eval()


class ModuleModel(OparaModel):
    """Base class of a model.py that serves a Python module: set `factory`
    (or override `module`), and name its weights file with the `weights`
    parameter; without one the module keeps the weights its factory gave it."""

    factory: str = ""

    def module(self, version_dir: Path) -> torch.nn.Module:
        if not self.factory:
            raise ModelFileError(f"{type(self).__name__} sets no factory and does not override module()")
        return call_factory(self.factory, version_dir)

    def _describe(self, config: dict, values: Values, version_dir: Path) -> ModelSpec:
        return spec_from_config(config, values)

    def _module(self, values: Values, version_dir: Path) -> torch.nn.Module:
        module = self.module(version_dir)
        if values["weights"]:
            weights.load_into(module, weights.weights_path(version_dir, values["weights"]), self.entry.name)
        return module.eval()
