"""What goes in and out of a model: the description the engine and the
serving adapters work from, whoever made the module (the zoo, or a user's
config.pbtxt and network).

Shapes are per sample (no batch dimension). A variable-length model names its
sequence axes (`LengthAxis`); its specs then hold one example length, and
`ModelSpec.at` fixes every axis for one bucket of shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a zoo model, per sample (no batch dimension).

    `value_range` is the half-open range [low, high) of valid values for integer
    inputs (token ids, embedding indices); an id outside it would index out of an
    embedding table, which inside a CUDA graph kills the process.

    `upper_bounds` tightens that per position along the last axis, for inputs
    whose positions index different tables (DeepFM's per-field vocabularies):
    the id at position i must also be below `upper_bounds[i]`.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    value_range: tuple[int, int] | None = None
    upper_bounds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        ranged = self.value_range is not None or self.upper_bounds is not None
        if ranged and self.dtype.is_floating_point:
            raise ValueError(f"{self.name}: value ranges are for integer inputs only")
        if self.value_range is not None and not self.value_range[0] < self.value_range[1]:
            raise ValueError(f"{self.name}: empty value_range {self.value_range}")
        if self.upper_bounds is not None:
            if not self.shape or len(self.upper_bounds) != self.shape[-1]:
                raise ValueError(
                    f"{self.name}: {len(self.upper_bounds)} upper_bounds for shape {self.shape}"
                )
            low = self.value_range[0] if self.value_range else 0
            if min(self.upper_bounds) <= low:
                raise ValueError(f"{self.name}: an upper bound is <= the lowest valid id {low}")

    def limits(self) -> tuple[int, np.ndarray] | None:
        """(low, high) of valid ids; high broadcasts against a per-sample array
        (computed once per range and shared, as the serving path checks every
        request's ids against it: never written to).

        None for inputs without a range (floats, or integers that any value suits).
        """
        return _limits(self.value_range, self.upper_bounds)

    def random(self, batch: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """A random batch that satisfies this spec, drawn on `device` (a
        generator given must be on it): a GPU build's static inputs drawn on
        the host took 0.4 s of NASNet's warm build (H200, run 36)."""
        shape = (batch, *self.shape)
        if self.dtype.is_floating_point:
            return torch.randn(shape, dtype=self.dtype, generator=generator, device=device)
        if self.upper_bounds is None:
            low, high = self.value_range or (0, 2)
            return torch.randint(low, high, shape, dtype=self.dtype, generator=generator, device=device)
        low, high = self.limits()
        span = torch.from_numpy(high - low).to(device)
        # One draw for all positions; the modulo bias of a 62-bit draw is negligible.
        draw = torch.randint(0, 2**62, shape, dtype=torch.int64, generator=generator, device=device)
        return (draw % span + low).to(self.dtype)

    def check(self, values: Any) -> str | None:
        """A one-line description of the first out-of-range id in a batch, or None.

        `values` has a leading batch dimension: a torch tensor on any device or a
        numpy array. Host data is checked with numpy (no copy; cheaper than torch
        for request-sized arrays), GPU data where it is, with one
        synchronisation. Only ranged integer inputs are checked; float inputs
        cannot index out of a table, so they always pass.
        """
        limits = self.limits()
        if limits is None:
            return None
        low, high = limits
        if tuple(values.shape[1:]) != self.shape:
            return f"input {self.name!r}: per-sample shape {tuple(values.shape[1:])}, expected {self.shape}"
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                bad_on_device = (values < low) | (values >= torch.as_tensor(high, device=values.device))
                if not bool(bad_on_device.any()):
                    return None
                values = values.cpu()
            values = values.numpy()
        values = np.asarray(values)
        if high.ndim == 0 and values.size and low <= values.min() and values.max() < high:
            return None  # one range for every position: two reductions, no masks (cheaper on a request's time)
        bad = (values < low) | (values >= high)
        if not bad.any():
            return None
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        sample, position = first[0], first[1:]
        where = position[0] if len(position) == 1 else position
        bound = int(np.broadcast_to(high, self.shape)[position])
        more = int(bad.sum()) - 1
        return (
            f"input {self.name!r}: value {values[first]} at batch item {sample}, position {where} "
            f"is outside [{low}, {bound})" + (f" ({more} more bad values)" if more else "")
        )


@functools.lru_cache(maxsize=None)
def _limits(value_range: tuple[int, int] | None, upper_bounds: tuple[int, ...] | None) -> tuple[int, np.ndarray] | None:
    if value_range is None and upper_bounds is None:
        return None
    low, high = value_range or (0, np.iinfo(np.int64).max)
    bounds = np.asarray(high, dtype=np.int64) if upper_bounds is None else np.minimum(np.asarray(upper_bounds, dtype=np.int64), high)
    return low, bounds


@dataclass(frozen=True)
class LengthAxis:
    """A sequence axis that a request may give at any length from 1 to `limit`:
    the last dimension of each of `inputs` and the first per-sample dimension of
    each of `outputs` (an output follows the request's length on that axis)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    limit: int


BATCH, GENERATE = "batch", "generate"


@dataclass(frozen=True)
class ModelSpec:
    """A servable model's interface: its inputs and outputs (in the module's
    forward order), how Triton serves it ("batch": one response per request;
    "generate": a decoupled model that streams generated tokens) and its
    variable sequence axes."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    serving: str = BATCH
    lengths: tuple[LengthAxis, ...] = ()  # variable sequence axes; the specs hold one example length

    def at(self, lengths: tuple[int, ...]) -> "ModelSpec":
        """This model with every variable axis fixed at the given length, one per
        `self.lengths` axis: what the engine traces and captures for one bucket."""
        if len(lengths) != len(self.lengths):
            raise ValueError(f"{self.name} has {len(self.lengths)} variable axes, got lengths {lengths}")
        inputs = {n: length for axis, length in zip(self.lengths, lengths) for n in axis.inputs}
        outputs = {n: length for axis, length in zip(self.lengths, lengths) for n in axis.outputs}

        def fixed(spec: TensorSpec, at: dict[str, int], dim: int) -> TensorSpec:
            if spec.name not in at:
                return spec
            shape = list(spec.shape)
            shape[dim] = at[spec.name]
            return dataclasses.replace(spec, shape=tuple(shape))

        return dataclasses.replace(
            self,
            inputs=tuple(fixed(s, inputs, -1) for s in self.inputs),
            outputs=tuple(fixed(s, outputs, 0) for s in self.outputs),
        )

    def example_inputs(self, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Valid random inputs of `batch` rows, the same for the same seed."""
        generator = torch.Generator().manual_seed(seed)
        return tuple(spec.random(batch, generator) for spec in self.inputs)

    def dynamic_shapes(self, max_batch: int = 64) -> tuple[dict[int, Any], ...]:
        """torch.export `dynamic_shapes` for the inputs: dim 0 (batch) is dynamic.

        One shared Dim, so the exported program knows all inputs have the same batch.
        Export with an example batch of 2 or more, or 1 gets specialised in.
        """
        batch = torch.export.Dim("batch", min=1, max=max_batch)
        return tuple({0: batch} for _ in self.inputs)
