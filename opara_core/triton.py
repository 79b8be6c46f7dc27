"""The Triton Python-backend adapter that every model.py delegates to.

`initialize` builds the zoo model once and wraps it in a runner (CUDA graphs on
a GPU instance, eager on a CPU instance); `execute` validates each request,
concatenates the good ones into the runner's staging buffers, runs the batch
once and splits the outputs. A bad request gets its own INVALID_ARG error; the
others in the batch are still answered; no Python traceback ever reaches a
client.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np
import torch

from . import zoo
from .build import EngineSettings, build_runner

log = logging.getLogger(__name__)

# Triton datatype names of the dtypes the zoo uses.
TRITON_DTYPES = {
    torch.float32: "TYPE_FP32",
    torch.float16: "TYPE_FP16",
    torch.int64: "TYPE_INT64",
    torch.int32: "TYPE_INT32",
}


class RequestError(ValueError):
    """A problem with one request: reported to its client as INVALID_ARG."""


def engine_settings(config: dict) -> EngineSettings:
    """EngineSettings from config.pbtxt `parameters` (all values are strings there)."""
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    parsers = {
        "policy": str,
        "max_streams": int,
        "buckets": lambda text: tuple(int(b) for b in text.split(",")),
        "guard": _boolean,
        "guard_tolerance": float,
        "fail_capture": _boolean,
    }
    unknown = sorted(set(params) - set(parsers))
    if unknown:
        raise ValueError(f"unknown parameters {unknown}; known: {sorted(parsers)}")
    values = {}
    for key, text in params.items():
        try:
            values[key] = parsers[key](text.strip())
        except ValueError:
            raise ValueError(f"parameter {key} has an invalid value {text!r}") from None
    return EngineSettings(**values)


def _boolean(text: str) -> bool:
    if text.lower() in ("true", "yes", "1", "on"):
        return True
    if text.lower() in ("false", "no", "0", "off"):
        return False
    raise ValueError(text)


def check_config(entry: zoo.ZooModel, config: dict) -> None:
    """The config's inputs and outputs must be exactly the zoo model's, so a
    wrong config fails at load time instead of on the first request."""
    for kind, specs in (("input", entry.inputs), ("output", entry.outputs)):
        declared = {t["name"]: t for t in config.get(kind, [])}
        if sorted(declared) != sorted(s.name for s in specs):
            raise ValueError(f"config {kind}s {sorted(declared)} differ from the model's {[s.name for s in specs]}")
        for spec in specs:
            tensor = declared[spec.name]
            dims = tuple(int(d) for d in tensor["dims"])
            if dims != spec.shape or tensor["data_type"] != TRITON_DTYPES[spec.dtype]:
                raise ValueError(
                    f"config {kind} {spec.name!r} is {tensor['data_type']} {list(dims)}, "
                    f"the model needs {TRITON_DTYPES[spec.dtype]} {list(spec.shape)}"
                )


def request_arrays(entry: zoo.ZooModel, tensors: dict[str, np.ndarray | None]) -> list[np.ndarray]:
    """Validate one request's inputs against the model; return them in model order.

    Raises RequestError with a message that names the input and the problem.
    """
    unknown = sorted(set(tensors) - {s.name for s in entry.inputs})
    if unknown:
        raise RequestError(f"unknown input {unknown[0]!r}; the model takes {[s.name for s in entry.inputs]}")
    arrays, rows = [], None
    for spec in entry.inputs:
        array = tensors.get(spec.name)
        if array is None:
            raise RequestError(f"missing input {spec.name!r}")
        expected_dtype = np.dtype(torch.empty((), dtype=spec.dtype).numpy().dtype)
        if array.dtype != expected_dtype:
            raise RequestError(f"input {spec.name!r} has datatype {array.dtype}, expected {expected_dtype}")
        if array.ndim != len(spec.shape) + 1 or tuple(array.shape[1:]) != spec.shape:
            raise RequestError(
                f"input {spec.name!r} has shape {list(array.shape)}, expected [batch, {', '.join(map(str, spec.shape))}]"
            )
        if rows is not None and array.shape[0] != rows:
            raise RequestError(f"input {spec.name!r} has batch {array.shape[0]}, other inputs have {rows}")
        rows = array.shape[0]
        if rows == 0:
            raise RequestError(f"input {spec.name!r} has an empty batch")
        problem = spec.check(array)
        if problem:
            raise RequestError(problem)
        arrays.append(array)
    return arrays


class OparaModel:
    """Base class for model.py files: a subclass names its zoo model.

    The class is imported by the Python backend stub; triton_python_backend_utils
    exists only there, so it is imported in `initialize`.
    """

    zoo_name: str = ""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self._pb = pb_utils
        config = json.loads(args["model_config"])
        try:
            self.entry = zoo.get(self.zoo_name or args["model_name"])
            check_config(self.entry, config)
            settings = engine_settings(config)
        except (KeyError, ValueError) as error:
            raise pb_utils.TritonModelException(f"model {args['model_name']}: {error}") from None
        self.max_batch = max(int(config.get("max_batch_size", 0)), 1)
        self.device = select_device(args)
        module = self.entry.build()
        self.runner, self.report = build_runner(module, self.entry, self.device, self.max_batch, settings)
        log.info("model %s ready on %s:\n%s", args["model_name"], self.device, self.report.summary())

    def execute(self, requests: list) -> list:
        pb_utils = self._pb
        responses: list = [None] * len(requests)
        good: list[tuple[int, list[np.ndarray]]] = []
        for i, request in enumerate(requests):
            try:
                tensors = {t.name(): t.as_numpy() for t in request.inputs()}
                good.append((i, request_arrays(self.entry, tensors)))
            except RequestError as error:
                responses[i] = _error(pb_utils, str(error), pb_utils.TritonError.INVALID_ARG)
        if good:
            try:
                with torch.inference_mode():
                    outputs = self._run(good)
                for (i, _), tensors in zip(good, outputs):
                    responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
            except Exception:  # noqa: BLE001 - reported per request, never as a traceback
                log.exception("inference failed for a batch of %d requests", len(good))
                for i, _ in good:
                    responses[i] = _error(pb_utils, "inference failed inside the model; see the server log", pb_utils.TritonError.INTERNAL)
        return responses

    def _run(self, good: list[tuple[int, list[np.ndarray]]]) -> list[list]:
        """Concatenate, run the batch once, split the outputs per request."""
        pb_utils = self._pb
        sizes = [arrays[0].shape[0] for _, arrays in good]
        total = sum(sizes)
        results: list[list] = [[] for _ in good]
        # Triton's batcher keeps the sum of request batches <= max_batch_size
        staging = self.runner.host_inputs(total)
        for k, buffer in enumerate(staging):
            np.concatenate([arrays[k] for _, arrays in good], axis=0, out=buffer)
        outputs = self.runner.run(total)
        offset = 0
        for r, size in enumerate(sizes):
            results[r] = [
                pb_utils.Tensor(spec.name, out[offset : offset + size]) for spec, out in zip(self.entry.outputs, outputs)
            ]
            offset += size
        return results


def _error(pb_utils, message: str, code):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def select_device(args: dict) -> torch.device:
    """The instance's device: Triton's `instance_group` without `kind` gives a
    GPU instance when a GPU exists and a CPU instance otherwise."""
    if args.get("model_instance_kind") == "GPU":
        if not torch.cuda.is_available():
            raise RuntimeError("a GPU instance was requested but torch sees no CUDA device")
        device = torch.device("cuda", int(args.get("model_instance_device_id", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")

