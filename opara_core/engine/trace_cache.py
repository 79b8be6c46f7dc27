"""Exported graphs kept on disk, so that a warm start reads its traced graph
instead of exporting the model again.

Tracing (`torch.export` and its decompositions) took 5.4 s of BERT's 14.5 s
warm start on the H100 machine, and a variable-length model traces once per
shape (docs/benchmarks.md, variable lengths' run 7). The decomposed program is
saved without its weights (torch's serialised form of the graph, ~2 MB for
BERT) under $OPARA_CACHE_DIR/traces, named by everything the graph depends on
(`export_key`); read back with the live module's parameters and buffers
attached, the trace took 2.8 s there. A graph that cannot be saved or read back is simply
exported again (logged), and the build's guard still compares every graph it
captures with the eager model.
"""

from __future__ import annotations

import functools
import inspect
import io
import logging
import sys
import time
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from opara_core.engine import cache

log = logging.getLogger(__name__)

FORMAT = 2  # of the saved file and the key; part of the key (2: keyed through engine.cache)


def cache_dir() -> Path:
    """$OPARA_CACHE_DIR/traces, else ~/.cache/opara/traces (engine.cache)."""
    return cache.directory("traces")


def exported_module(module: torch.nn.Module, example_inputs: Sequence[Any], dynamic_shapes: Any, directory: Path | None) -> torch.fx.GraphModule:
    """`torch.export.export(...).run_decompositions().module()`, read from
    `directory` when an earlier start saved it there (None: no cache)."""
    if directory is None:
        return _export(module, example_inputs, dynamic_shapes).module()
    start = time.perf_counter()
    key = export_key(module, example_inputs, dynamic_shapes)
    path = Path(directory) / f"{key}.pt"
    graph_module = cache.read(path, lambda p: load(p, module), "traced graph")  # an unreadable one is exported again
    if graph_module is not None:
        log.info("traced graph from the cache (%s) in %.1f s", key[:12], time.perf_counter() - start)
        return graph_module
    program = _export(module, example_inputs, dynamic_shapes)
    exported = time.perf_counter()
    try:
        save(program, path)
    except Exception as error:  # noqa: BLE001 - the graph is still good; only the next start exports again
        log.info("traced graph not saved to %s (%s: %s)", path, type(error).__name__, error)
    else:
        log.info("exported in %.1f s, saved to the cache (%s) in %.1f s", exported - start, key[:12], time.perf_counter() - exported)
    return program.module()


def _export(module: torch.nn.Module, example_inputs: Sequence[Any], dynamic_shapes: Any) -> torch.export.ExportedProgram:
    return torch.export.export(module, tuple(example_inputs), dynamic_shapes=export_shapes(module, dynamic_shapes)).run_decompositions()


def export_shapes(module: torch.nn.Module, dynamic_shapes: Any) -> Any:
    """`dynamic_shapes` (one entry per input) as torch.export wants it for
    `module`'s forward: wrapped once where that takes its inputs as `*args`
    (engine.precision.AtPrecision, or a user's module), which export sees as
    one argument holding them all."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    if dynamic_shapes is not None and len(parameters) == 1 and parameters[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return (tuple(dynamic_shapes),)
    return dynamic_shapes


def save(program: torch.export.ExportedProgram, path: Path) -> None:
    """The program's graph, constants and signature; of its state only the
    names (and which are parameters): the weights come from the live module."""
    from torch._export.serde.serialize import serialize

    artifact = serialize(program)
    payload = {
        "program": artifact.exported_program,
        "constants": artifact.constants,
        "example_inputs": artifact.example_inputs,
        "state": {name: isinstance(tensor, torch.nn.Parameter) for name, tensor in program.state_dict.items()},
    }
    cache.write_torch(path, payload)  # another process reads the whole file or none


def load(path: Path, module: torch.nn.Module) -> torch.fx.GraphModule:
    """The saved graph as a GraphModule that reads `module`'s own tensors."""
    from torch._export.serde.serialize import SerializedArtifact, deserialize

    _hints_once()
    payload = torch.load(path, weights_only=True)
    live = dict(named_tensors(module))
    missing = sorted(set(payload["state"]) - set(live))
    if missing:
        raise KeyError(f"the module has no {missing[0]!r}")
    # placeholders for the state (deserialising reads its structure, not its values)
    state = {
        name: torch.nn.Parameter(torch.empty_like(live[name], device="meta"), requires_grad=False) if is_parameter else torch.empty_like(live[name], device="meta")
        for name, is_parameter in payload["state"].items()
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    program = deserialize(SerializedArtifact(payload["program"], buffer.getvalue(), payload["constants"], payload["example_inputs"]))
    graph_module = program.module()
    for name in payload["state"]:
        put_tensor(graph_module, name, live[name])
    return graph_module


class _TypingWithHintsOnce:
    """The `typing` module, but `get_type_hints` answers each (class,
    namespace) once: torch.export's deserialiser asks it for every object it
    reads (63,791 times for NASNet's graph, 27 classes; pytorch/pytorch#196452),
    a quarter of NASNet's warm trace: `trace_model` from the cache 6.0-7.0 ->
    4.4-5.2 s on the 2-core CPU machine, 2026-12-06. A schema class's hints
    never change."""

    def __init__(self) -> None:
        self._hints: dict[tuple, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(typing, name)

    def get_type_hints(self, obj: Any, globalns: Any = None, localns: Any = None, include_extras: bool = False) -> dict[str, Any]:
        key = (obj, id(globalns), id(localns), include_extras)
        hints = self._hints.get(key)
        if hints is None:
            hints = self._hints[key] = typing.get_type_hints(obj, globalns, localns, include_extras)
        return hints


def _hints_once() -> None:
    """Give torch's deserialiser `_TypingWithHintsOnce` (once per process;
    left alone where torch reads its hints otherwise)."""
    from torch._export.serde import serialize

    if getattr(serialize, "typing", None) is typing:
        serialize.typing = _TypingWithHintsOnce()


def put_tensor(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make `tensor` the module's parameter or buffer `name` (dotted), in place
    of what is there (a plain tensor becomes a Parameter with the old one's
    requires_grad)."""
    prefix, _, leaf = name.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        requires_grad = old is not None and old.requires_grad
        owner._parameters[leaf] = tensor if isinstance(tensor, torch.nn.Parameter) else torch.nn.Parameter(tensor, requires_grad=requires_grad)
    elif leaf in owner._buffers:
        owner._buffers[leaf] = tensor
    else:
        raise KeyError(f"the module has no parameter or buffer {name!r}")


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by name, tied and non-persistent ones included."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def export_key(module: torch.nn.Module, example_inputs: Sequence[Any], dynamic_shapes: Any) -> str:
    """The key (engine.cache) of what the exported graph depends on: torch, the
    inputs (dtypes, shapes, devices), the dynamic dimensions, and the module's
    structure (`module_fingerprint`). Not the weights' values: the graph reads them."""
    return cache.key(
        {
            "format": FORMAT,
            "inputs": [(str(t.dtype), tuple(t.shape), str(t.device)) for t in tree_leaves(list(example_inputs)) if isinstance(t, torch.Tensor)],
            "dynamic": _dims(dynamic_shapes),
            "module": module_fingerprint(module),
        },
        ("torch",),
    )


def module_fingerprint(module: torch.nn.Module) -> str:
    """sha256 of a module's structure: every tensor's name, shape, dtype and
    device; each submodule's class (its source and its package's version) and
    plain settings (ints, floats, strings: heads, eps, ...), a HuggingFace
    config where there is one, and the code of every GraphModule (a
    torch.export program's module: its class has no source to read)."""
    classes = {type(m) for m in module.modules()}
    return cache.key(
        {
            "training": module.training,
            "graphs": [m.code for m in module.modules() if isinstance(m, torch.fx.GraphModule)],
            "tensors": [(name, tuple(t.shape), str(t.dtype), str(t.device)) for name, t in named_tensors(module)],
            "classes": sorted(_class_fingerprint(cls) for cls in classes),
            "settings": [(name, _settings(m)) for name, m in module.named_modules(remove_duplicate=False)],
        }
    )


@functools.lru_cache(maxsize=None)
def _class_fingerprint(cls: type) -> str:  # once per class and process: every shape's trace asks again
    package = sys.modules.get(cls.__module__.split(".")[0])
    try:
        source = cache.digest(inspect.getsource(cls))[:16]
    except (OSError, TypeError):  # built in, or defined where no source is kept
        source = ""
    return f"{cls.__module__}.{cls.__qualname__}:{getattr(package, '__version__', '')}:{source}"


def _settings(module: torch.nn.Module) -> dict[str, Any]:
    plain = (bool, int, float, str, type(None))
    settings = {k: v for k, v in vars(module).items() if not k.startswith("_") and (isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(x, plain) for x in v)))}
    config = getattr(module, "config", None)
    if hasattr(config, "to_json_string"):
        settings["config"] = config.to_json_string()
    return settings


def _dims(dynamic_shapes: Any) -> Any:
    """A stable description of export's `dynamic_shapes` (Dim objects by name and range)."""
    if isinstance(dynamic_shapes, dict):
        return {str(k): _dims(v) for k, v in dynamic_shapes.items()}
    if isinstance(dynamic_shapes, (list, tuple)):
        return [_dims(v) for v in dynamic_shapes]
    if dynamic_shapes is None or isinstance(dynamic_shapes, (int, str)):
        return dynamic_shapes
    bounds = [getattr(dynamic_shapes, "min", None), getattr(dynamic_shapes, "max", None)]
    return [getattr(dynamic_shapes, "__name__", repr(dynamic_shapes)), *(b if b is None or isinstance(b, int) else str(b) for b in bounds)]
