"""Helpers for tests that talk to the real server (not a test module).

The oracle is the same seeded zoo model run eagerly on the CPU in the test
process, in the precision a server on this machine serves the model's shipped
config in (`served_precision`); each model is built at most once per session.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from opara_core import parameters, zoo
from opara_core.engine import precision
from opara_core.engine.compare import max_relative_error
from opara_core.serving.launcher import DEFAULT_MODEL_REPOSITORY
from opara_core.serving.model_dir import read_config


@functools.lru_cache(maxsize=None)
def built(model: str) -> torch.nn.Module:
    return zoo.get(model).build()


@functools.lru_cache(maxsize=None)
def served_precision(model: str) -> str:
    """The precision `model`'s shipped config asks for, as a server on this
    machine builds it (engine.precision.on_device: a CPU without native bf16
    runs fp32)."""
    asked = parameters.value(parameters.strings(read_config(DEFAULT_MODEL_REPOSITORY / model)), "precision")
    return precision.on_device(asked, torch.device("cuda" if torch.cuda.is_available() else "cpu"))[0]


@functools.lru_cache(maxsize=None)
def oracle(model: str) -> torch.nn.Module:
    """The seeded module in its served precision (engine.precision.cast: the
    same cast a server makes; floating inputs and outputs stay fp32)."""
    return precision.cast(built(model), zoo.get(model), served_precision(model))


def eager(model: str, arrays: list[np.ndarray]) -> np.ndarray:
    """The oracle's output for a batch given as numpy arrays in the model's input order."""
    with torch.inference_mode():
        return oracle(model)(*(torch.from_numpy(a) for a in arrays)).numpy()


@functools.lru_cache(maxsize=None)
def served_tolerance(model: str) -> float:
    """How far a served answer of `model` may be from `eager`, relative to the
    largest output: zoo.oracle_tolerance for its served precision, with the
    oracle's own error against the fp32 module on seeded inputs."""
    served = served_precision(model)
    if served not in precision.HALF:
        return zoo.oracle_tolerance(served)
    inputs = zoo.get(model).example_inputs(8, seed=0)
    with torch.inference_mode():
        return zoo.oracle_tolerance(served, max_relative_error(oracle(model)(*inputs), built(model)(*inputs)))


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


def assert_served(actual: np.ndarray, model: str, arrays: list[np.ndarray]) -> None:
    """`actual`, a server's answer of `model` to `arrays`, is the oracle's within `served_tolerance`."""
    assert_close(actual, eager(model, arrays), served_tolerance(model))


def assert_close(actual: np.ndarray, expected: np.ndarray, tolerance: float | None = None) -> None:
    """Equal within `tolerance` relative to the largest magnitude (default: what a
    server on this machine's device may differ from the CPU oracle in fp32)."""
    tolerance = zoo.oracle_tolerance() if tolerance is None else tolerance
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(float(np.abs(expected).max()), 1e-12)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance * scale)
