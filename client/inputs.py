"""Request inputs built from a model's own metadata and config.

Nothing here knows any model: names, datatypes and shapes come from the
server's metadata, the batch limit from the config, and valid id ranges for
integer inputs from the config's `parameters` (see `TensorInfo`). So every
model of the repository can be benchmarked without model-specific code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.utils import triton_to_np_dtype

# Config parameters that carry the valid ids of an integer input, e.g.
#   parameters { key: "value_range.input_ids" value: { string_value: "0,30522" } }
#   parameters { key: "upper_bounds.sparse" value: { string_value: "1460,583,..." } }
# value_range is the half-open [low, high); upper_bounds tightens high per
# position along the last axis (one embedding table per field).
RANGE_KEY = "value_range."
BOUNDS_KEY = "upper_bounds."
# The longest sequence a variable-length input takes (its -1 dimension):
#   parameters { key: "max_length.input_ids" value: { string_value: "512" } }
MAX_LENGTH_KEY = "max_length."
# The length random requests get on a variable dimension unless told otherwise:
# what the fixed-length BERT and T5 took before they took any length.
DEFAULT_LENGTH = 128

# Integer inputs with no declared range get ids 0 and 1: valid for any
# embedding table and any mask, and the server rejects bad ids clearly anyway.
DEFAULT_INT_RANGE = (0, 2)


class InputError(ValueError):
    """Inputs cannot be built for this model as asked; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    """One input or output. `shape` is per request row: without the batch
    dimension when the model batches. -1 marks a variable dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    value_range: tuple[int, int] | None = None
    upper_bounds: tuple[int, ...] | None = None
    max_length: int | None = None  # the longest a variable (-1) dimension may be

    def sized(self, length: int) -> tuple[int, ...]:
        """The per-row shape with every variable dimension at `length`, capped at max_length."""
        if self.max_length is not None:
            length = min(length, self.max_length)
        return tuple(length if d < 0 else d for d in self.shape)

    @property
    def dtype(self) -> np.dtype:
        np_type = triton_to_np_dtype(self.datatype)
        if np_type is None:
            raise InputError(f"{self.name!r}: unsupported datatype {self.datatype}")
        return np.dtype(np_type)

    @property
    def fixed(self) -> bool:
        return all(d >= 0 for d in self.shape)


@dataclass(frozen=True)
class ModelInfo:
    """What a client needs to know to build requests for one model."""

    name: str
    max_batch_size: int
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    def full_shape(self, tensor: TensorInfo, batch: int) -> tuple[int, ...]:
        """The shape on the wire: the batch dimension first when the model batches."""
        return (batch, *tensor.shape) if self.batching else tensor.shape

    def check_batch(self, batch: int) -> None:
        if batch < 1:
            raise InputError(f"batch must be >= 1, got {batch}")
        if not self.batching and batch != 1:
            raise InputError(f"model {self.name!r} does not batch (max_batch_size 0); use batch 1")
        if self.batching and batch > self.max_batch_size:
            raise InputError(f"batch {batch} exceeds max_batch_size {self.max_batch_size} of model {self.name!r}")


def model_info(metadata: dict, config: dict) -> ModelInfo:
    """Combine the model metadata and config (as JSON dicts with int dims, as
    `client.api` returns them) into a ModelInfo."""
    max_batch_size = int(config.get("max_batch_size", 0))
    params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}

    def tensors(kind: str) -> tuple[TensorInfo, ...]:
        found = []
        for t in metadata.get(kind, []):
            shape = tuple(int(d) for d in t["shape"])
            if max_batch_size > 0:
                shape = shape[1:]  # the batch dimension, -1 in the metadata
            name = t["name"]
            found.append(
                TensorInfo(
                    name=name,
                    datatype=t["datatype"],
                    shape=shape,
                    value_range=_ints(params.get(RANGE_KEY + name), name, 2),
                    upper_bounds=_ints(params.get(BOUNDS_KEY + name), name),
                    max_length=_length(params.get(MAX_LENGTH_KEY + name), name),
                )
            )
        return tuple(found)

    return ModelInfo(metadata["name"], max_batch_size, tensors("inputs"), tensors("outputs"))


def _ints(text: str | None, name: str, count: int | None = None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        values = tuple(int(v) for v in text.replace(":", ",").split(","))
    except ValueError:
        raise InputError(f"config parameter for {name!r} must be comma-separated integers, got {text!r}") from None
    if count is not None and len(values) != count:
        raise InputError(f"config value_range for {name!r} must be 'low,high', got {text!r}")
    return values


def _length(text: str | None, name: str) -> int | None:
    if not text:
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise InputError(f"config parameter {MAX_LENGTH_KEY}{name} must be a positive integer, got {text!r}")
    return int(text)


def id_limits(tensor: TensorInfo) -> tuple[int, np.ndarray]:
    """(low, high) of the ids to draw for an integer input; high broadcasts
    along the last axis when the config gives per-position upper bounds."""
    low, high = tensor.value_range or DEFAULT_INT_RANGE
    if tensor.upper_bounds is None:
        return low, np.asarray(high, dtype=np.int64)
    bounds = np.asarray(tensor.upper_bounds, dtype=np.int64)
    if tensor.value_range is not None:
        bounds = np.minimum(bounds, high)
    if not tensor.shape or tensor.shape[-1] != len(bounds):
        raise InputError(f"{tensor.name!r}: {len(bounds)} upper_bounds for per-row shape {list(tensor.shape)}")
    return low, bounds


def random_array(tensor: TensorInfo, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random data of `shape` that the model accepts: normal floats, ids in
    the declared range, random booleans."""
    dtype = tensor.dtype
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "f":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    if dtype.kind in "iu":
        low, high = id_limits(tensor)
        if np.any(high <= low):
            raise InputError(f"{tensor.name!r}: empty id range [{low}, {high})")
        return rng.integers(low, np.broadcast_to(high, shape), shape).astype(dtype)
    if dtype == np.object_:  # BYTES
        return np.array([b"0"] * int(np.prod(shape)), dtype=object).reshape(shape)
    raise InputError(f"{tensor.name!r}: cannot generate data for datatype {tensor.datatype}")


def random_inputs(info: ModelInfo, batch: int = 1, seed: int = 0, length: int | None = None) -> dict[str, np.ndarray]:
    """One random request for every input of the model. A variable dimension
    gets `length` (DEFAULT_LENGTH if None), capped at the input's max_length;
    an input named like a mask gets ones (no padding) there."""
    info.check_batch(batch)
    rng = np.random.default_rng(seed)
    arrays = {}
    for tensor in info.inputs:
        if not tensor.fixed:
            if tensor.max_length is None:
                raise InputError(
                    f"input {tensor.name!r} has a variable shape {list(tensor.shape)} and the config publishes no "
                    f"{MAX_LENGTH_KEY}{tensor.name}; pass real data with --input"
                )
            sized = TensorInfo(tensor.name, tensor.datatype, tensor.sized(length or DEFAULT_LENGTH), tensor.value_range)
            shape = info.full_shape(sized, batch)
            arrays[tensor.name] = np.ones(shape, tensor.dtype) if "mask" in tensor.name else random_array(sized, shape, rng)
            continue
        arrays[tensor.name] = random_array(tensor, info.full_shape(tensor, batch), rng)
    return arrays


def load_inputs(info: ModelInfo, specs: list[str], batch: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs from files, random data for the inputs no file names.

    Each spec is `FILE.npy` (for a one-input model), `NAME=FILE.npy`, or
    `FILE.npz` with one array per input name. An array with the per-row shape
    is repeated `batch` times; one with a leading batch dimension is sent as is.
    """
    given: dict[str, np.ndarray] = {}
    for spec in specs:
        given.update(_read_spec(info, spec))
    unknown = sorted(set(given) - {t.name for t in info.inputs})
    if unknown:
        raise InputError(f"model {info.name!r} has no input {unknown[0]!r}; inputs: {[t.name for t in info.inputs]}")
    arrays = {t.name: _fit(info, t, given[t.name], batch) for t in info.inputs if t.name in given}
    batches = {a.shape[0] for a in arrays.values()} if info.batching else {1}
    if len(batches) > 1:
        raise InputError(f"input files disagree on the batch size: {sorted(batches)}")
    batch = batches.pop() if batches else (batch or 1)
    missing = ModelInfo(info.name, info.max_batch_size, tuple(t for t in info.inputs if t.name not in arrays), ())
    return {**random_inputs(missing, batch, seed), **arrays}


def _read_spec(info: ModelInfo, spec: str) -> dict[str, np.ndarray]:
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = "", spec
    try:
        loaded = np.load(Path(path), allow_pickle=False)
    except (OSError, ValueError) as error:
        raise InputError(f"cannot read {path}: {error}") from None
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            return {key: loaded[key] for key in loaded.files}
    if not name:
        if len(info.inputs) != 1:
            raise InputError(
                f"model {info.name!r} has inputs {[t.name for t in info.inputs]}; name the one in {path} as NAME={path}"
            )
        name = info.inputs[0].name
    return {name: loaded}


def _fit(info: ModelInfo, tensor: TensorInfo, array: np.ndarray, batch: int | None) -> np.ndarray:
    """Check dtype and shape of a user array and give it the batch dimension."""
    dtype = tensor.dtype
    if array.dtype != dtype:
        same_kind = array.dtype.kind == dtype.kind or (array.dtype.kind in "iu" and dtype.kind in "iu")
        if not same_kind:
            raise InputError(f"input {tensor.name!r} is {tensor.datatype}; the file holds {array.dtype}")
        array = array.astype(dtype)
    if _matches(array.shape, tensor.shape):
        if not info.batching:
            return array
        array = np.repeat(array[np.newaxis], batch or 1, axis=0)
    elif info.batching and _matches(array.shape[1:], tensor.shape):
        if batch is not None and array.shape[0] != batch:
            raise InputError(f"input {tensor.name!r} holds a batch of {array.shape[0]}, but --batch is {batch}")
    else:
        raise InputError(
            f"input {tensor.name!r} expects per-row shape {list(tensor.shape)}; the file holds {list(array.shape)}"
        )
    info.check_batch(array.shape[0])
    return np.ascontiguousarray(array)


def _matches(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    return len(shape) == len(dims) and all(d < 0 or s == d for s, d in zip(shape, dims))
