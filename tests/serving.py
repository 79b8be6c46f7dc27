"""Helpers for tests that talk to the real server (not a test module).

The oracle is the same seeded zoo model run eagerly in the test process; each
model is built at most once per session.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from opara_core import zoo


@functools.lru_cache(maxsize=None)
def built(model: str) -> torch.nn.Module:
    return zoo.get(model).build()


def eager(model: str, arrays: list[np.ndarray]) -> np.ndarray:
    """The oracle's output for a batch given as numpy arrays in the model's input order."""
    with torch.inference_mode():
        return built(model)(*(torch.from_numpy(a) for a in arrays)).numpy()


def example(model: str, batch: int, seed: int) -> list[np.ndarray]:
    """Valid random inputs for `model`, in its input order."""
    return [t.numpy() for t in zoo.get(model).example_inputs(batch, seed)]


def infer(client, model: str, arrays: list[np.ndarray]) -> np.ndarray:
    """One request over HTTP or gRPC (by the client's type); the first output."""
    module = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    entry = zoo.get(model)
    tensors = []
    for spec, array in zip(entry.inputs, arrays):
        tensor = module.InferInput(spec.name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return client.infer(model, tensors).as_numpy(entry.outputs[0].name)


def assert_close(actual: np.ndarray, expected: np.ndarray, tolerance: float | None = None) -> None:
    """Equal within `tolerance` relative to the largest magnitude (default: what a
    server on this machine's device may differ from the CPU oracle)."""
    tolerance = zoo.oracle_tolerance() if tolerance is None else tolerance
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(float(np.abs(expected).max()), 1e-12)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance * scale)
