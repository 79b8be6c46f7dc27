"""One small interface over tritonclient's gRPC and HTTP clients.

`Client` offers the same calls for both protocols: health, metadata, config,
statistics, system and CUDA shared memory and inference with binary tensors. They hide what differs between the protocols
(gRPC's JSON gives int64 values as strings, HTTP sets its timeout on the
connection, the two report an unreachable server differently) and raise one
exception type, `ClientError`, whose `kind` says whether retrying can help.

Only an unavailable server is retried, with exponential backoff: a rejected
request (bad input, unknown model) fails the same way every time, and a timed
out one may already have run.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import time
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from client.inputs import InputError, ModelInfo, model_info
from opara_core.serving.admin_key import ADMIN_KEY_ENV, admin_key_dir, read_admin_key

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http")
DEFAULT_PORTS = {"http": 8000, "grpc": 8001}
DEFAULT_TIMEOUT_S = 60.0

# ClientError kinds
UNAVAILABLE = "unavailable"  # nobody answered: retrying may help
TIMEOUT = "timeout"  # no answer in time: the request may have run
REJECTED = "rejected"  # the server answered with an error: retrying cannot help


# Statistics components, in the order Triton's pipeline runs them.
STAT_COMPONENTS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


class ClientError(Exception):
    """A failed call, with a one-line message and the `kind` of failure."""

    def __init__(self, message: str, kind: str = REJECTED):
        super().__init__(message)
        self.kind = kind


def classify(error: BaseException) -> str:
    """UNAVAILABLE, TIMEOUT or REJECTED for any exception a call can raise."""
    if isinstance(error, ClientError):
        return error.kind
    if isinstance(error, InferenceServerException):
        status = str(error.status() or "")
        if "is restricted" in str(error.message()):  # gRPC says UNAVAILABLE, yet a retry cannot help
            return REJECTED
        if status in ("StatusCode.UNAVAILABLE", "503"):
            return UNAVAILABLE
        if status == "StatusCode.DEADLINE_EXCEEDED":
            return TIMEOUT
        return REJECTED
    if isinstance(error, TimeoutError):  # socket.timeout included
        return TIMEOUT
    if isinstance(error, OSError):  # refused, reset, unknown host; aiohttp's connection errors too
        return UNAVAILABLE
    return REJECTED


def describe(error: BaseException) -> str:
    """A one-line message for an exception from tritonclient or the network."""
    if isinstance(error, InferenceServerException):
        text = error.message() or str(error)
    elif isinstance(error, OSError) and error.strerror:
        text = error.strerror
    else:
        text = str(error) or type(error).__name__
    if "is restricted" in str(text):
        text = (
            f"{text} (set {ADMIN_KEY_ENV} to the server's key, or run on the server's machine as the user who "
            f"started it: `make serve` writes each server's key to {admin_key_dir()}/<port>)"
        )
    return " ".join(str(text).split())


def admin_headers(protocol: str, url: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The header carrying the admin key for Triton's restricted APIs of the
    server at `url`: from OPARA_ADMIN_KEY, else the key file the launcher
    wrote for that server's port (none when neither has one); gRPC prefixes
    Triton's protocol name."""
    key = read_admin_key(url, env)
    if not key:
        return {}
    return {"admin-key" if protocol == "http" else "triton-grpc-protocol-admin-key": key}


@dataclass(frozen=True)
class RetryPolicy:
    """Retry unavailable-server errors: `attempts` tries in all, waiting
    `initial_delay_s`, then twice that, and so on up to `max_delay_s`."""

    attempts: int = 4
    initial_delay_s: float = 0.2
    max_delay_s: float = 2.0

    def delays(self) -> list[float]:
        return [min(self.initial_delay_s * 2**i, self.max_delay_s) for i in range(max(self.attempts - 1, 0))]

    def call(self, fn: Callable[[], Any]) -> Any:
        for delay in [*self.delays(), None]:
            try:
                return fn()
            except Exception as error:
                if delay is None or classify(error) != UNAVAILABLE:
                    raise
                log.info("server unavailable (%s); retrying in %.1f s", describe(error), delay)
                time.sleep(delay)


NO_RETRY = RetryPolicy(attempts=1)


def parse_url(url: str, protocol: str) -> str:
    """HOST:PORT as tritonclient wants it; a missing port gets the protocol's default."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if "://" in url:
        raise ValueError(f"--url takes HOST:PORT without a scheme, got {url!r}")
    host, sep, port = url.rpartition(":")
    if not sep:
        return f"{url}:{DEFAULT_PORTS[protocol]}"
    if not host or not port.isdigit():
        raise ValueError(f"--url must be HOST:PORT, got {url!r}")
    return url


# --- protocol differences, normalised -------------------------------------------------


def _module(protocol: str) -> types.ModuleType:
    """tritonclient.grpc or .http, imported on first use."""
    return importlib.import_module(f"tritonclient.{protocol}")


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def normalize_metadata(metadata: dict) -> dict:
    """Model metadata with int shapes (gRPC's JSON gives int64 as strings)."""
    out = dict(metadata)
    for kind in ("inputs", "outputs"):
        out[kind] = [{**t, "shape": _ints(t.get("shape", []))} for t in metadata.get(kind, [])]
    return out


def normalize_config(config: dict) -> dict:
    """The model config as HTTP gives it: unwrapped, int dims and batch size."""
    config = dict(config.get("config", config))
    config["max_batch_size"] = int(config.get("max_batch_size", 0))
    for kind in ("input", "output"):
        config[kind] = [{**t, "dims": _ints(t.get("dims", []))} for t in config.get(kind, [])]
    return config


def normalize_statistics(statistics: dict) -> dict[str, tuple[int, int]]:
    """Cumulative (count, ns) per component, summed over the model's versions."""
    totals = {name: [0, 0] for name in STAT_COMPONENTS}
    for model in statistics.get("model_stats", []):
        stats = model.get("inference_stats", {})
        for name in STAT_COMPONENTS:
            part = stats.get(name) or {}
            totals[name][0] += int(part.get("count", 0))
            totals[name][1] += int(part.get("ns", 0))
    return {name: (count, ns) for name, (count, ns) in totals.items()}


def normalize_shm_status(status: Any) -> list[str]:
    """Names of registered system shared-memory regions (HTTP: a list, gRPC: a dict)."""
    if isinstance(status, dict):
        return sorted(status.get("regions", {}))
    return sorted(region["name"] for region in status or [])


def normalize_index(index: Any) -> list[dict]:
    return list(index.get("models", [])) if isinstance(index, dict) else list(index or [])


# --- requests ------------------------------------------------------------------------


@dataclass(frozen=True)
class InferRequest:
    """A ready-to-send request: tritonclient inputs and requested outputs,
    built once and sent many times by a load generator."""

    model: str
    inputs: tuple
    outputs: tuple | None
    shm: "SharedMemoryRegions | None" = None
    parameters: tuple[tuple[str, str], ...] = ()  # request parameters, e.g. (("scheduler", "dp"),)


def build_request(
    protocol: str,
    model: str,
    arrays: dict[str, np.ndarray],
    shm: "SharedMemoryRegions | None" = None,
    class_count: dict[str, int] | None = None,
) -> InferRequest:
    """Binary tensors in the message, or references into `shm` when given
    (inputs and every output then travel through shared memory).
    `class_count` {output: k} names the outputs to return: k > 0 asks Triton's
    classification extension for the top k classes instead of the tensor, 0
    for the whole tensor."""
    module = _module(protocol)
    inputs = []
    for name, array in arrays.items():
        datatype = np_to_triton_dtype(array.dtype)
        tensor = module.InferInput(name, list(array.shape), datatype)
        if shm is not None:
            offset, nbytes = shm.input_slots[name]
            tensor.set_shared_memory(shm.input_name, nbytes, offset)
        else:
            tensor.set_data_from_numpy(array)  # binary by default for HTTP too
        inputs.append(tensor)
    outputs = None  # all outputs, binary
    if class_count:
        if shm is not None:
            raise InputError("classification (class_count) and shared-memory outputs do not mix")
        outputs = [module.InferRequestedOutput(name, class_count=k) for name, k in class_count.items()]
    if shm is not None:
        outputs = []
        for name, (offset, nbytes, _, _) in shm.output_slots.items():
            requested = module.InferRequestedOutput(name)
            requested.set_shared_memory(shm.output_name, nbytes, offset)
            outputs.append(requested)
    return InferRequest(model, tuple(inputs), tuple(outputs) if outputs is not None else None, shm)


def _outputs(request: InferRequest) -> list | None:
    return None if request.outputs is None else list(request.outputs)


def result_arrays(request: InferRequest, result: Any, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The named outputs of a result, read from shared memory where they went there."""
    if request.shm is not None:
        return {name: request.shm.read_output(name) for name in names}
    return {name: result.as_numpy(name) for name in names}


# --- clients -------------------------------------------------------------------------


class Client:
    """A blocking client for one server over gRPC or HTTP.

    Not to be shared between threads (tritonclient's HTTP client is not
    thread-safe): a load generator gives each worker its own.
    """

    def __init__(
        self,
        url: str,
        protocol: str = "grpc",
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy = RetryPolicy(),
    ):
        self.url = parse_url(url, protocol)
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.retry = retry
        module = _module(protocol)
        if protocol == "grpc":
            self._raw = module.InferenceServerClient(self.url)
            self._kw: dict = {"client_timeout": timeout_s}
        else:
            network = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S
            self._raw = module.InferenceServerClient(self.url, connection_timeout=network, network_timeout=network)
            self._kw = {}
        self._json = {"as_json": True} if protocol == "grpc" else {}
        self._admin = {**self._kw, "headers": admin_headers(protocol, self.url)}  # for the restricted APIs

    def _call(self, fn: Callable[[], Any], retry: RetryPolicy | None = None) -> Any:
        try:
            return (retry or self.retry).call(fn)
        except ClientError:
            raise
        except Exception as error:
            raise ClientError(describe(error), classify(error)) from error

    def live(self) -> bool:
        return self._call(lambda: self._raw.is_server_live(**self._kw))

    def ready(self) -> bool:
        return self._call(lambda: self._raw.is_server_ready(**self._kw))

    def model_ready(self, model: str) -> bool:
        return self._call(lambda: self._raw.is_model_ready(model, **self._kw))

    def server_metadata(self) -> dict:
        return self._call(lambda: self._raw.get_server_metadata(**self._json, **self._kw))

    def model_metadata(self, model: str) -> dict:
        return normalize_metadata(self._call(lambda: self._raw.get_model_metadata(model, **self._json, **self._kw)))

    def model_config(self, model: str) -> dict:
        return normalize_config(self._call(lambda: self._raw.get_model_config(model, **self._json, **self._kw)))

    def model_info(self, model: str) -> ModelInfo:
        return model_info(self.model_metadata(model), self.model_config(model))

    def ready_models(self) -> list[str]:
        index = normalize_index(self._call(lambda: self._raw.get_model_repository_index(**self._json, **self._admin)))
        return sorted({m["name"] for m in index if m.get("state") == "READY"})

    def statistics(self, model: str) -> dict[str, tuple[int, int]]:
        raw = self._call(lambda: self._raw.get_inference_statistics(model, **self._json, **self._kw))
        return normalize_statistics(raw)

    def shm_regions(self) -> list[str]:
        return normalize_shm_status(
            self._call(lambda: self._raw.get_system_shared_memory_status(**self._json, **self._admin))
        )

    def register_shm(self, name: str, key: str, byte_size: int) -> None:
        self._call(lambda: self._raw.register_system_shared_memory(name, key, byte_size, **self._admin))

    def unregister_shm(self, name: str) -> None:
        self._call(lambda: self._raw.unregister_system_shared_memory(name, **self._admin))

    def cuda_shm_regions(self) -> list[str]:
        return normalize_shm_status(
            self._call(lambda: self._raw.get_cuda_shared_memory_status(**self._json, **self._admin))
        )

    def register_cuda_shm(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._call(lambda: self._raw.register_cuda_shared_memory(name, raw_handle, device_id, byte_size, **self._admin))

    def unregister_cuda_shm(self, name: str) -> None:
        self._call(lambda: self._raw.unregister_cuda_shared_memory(name, **self._admin))

    def request(
        self,
        model: str,
        arrays: dict[str, np.ndarray],
        shm: "SharedMemoryRegions | None" = None,
        class_count: dict[str, int] | None = None,
    ) -> InferRequest:
        return build_request(self.protocol, model, arrays, shm, class_count)

    def infer(self, request: InferRequest) -> Any:
        """Send one request; returns tritonclient's result (see `result_arrays`)."""
        return self._call(
            lambda: self._raw.infer(
                request.model, list(request.inputs), outputs=_outputs(request), parameters=dict(request.parameters) or None, **self._kw
            )
        )

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- system and CUDA shared memory ---------------------------------------------------

SHM_PREFIX = "opara_client_"
SHARED_MEMORY_KINDS = ("system", "cuda")
_region_ids = itertools.count()


def shared_memory_module() -> types.ModuleType:
    """tritonclient.utils.shared_memory, imported on first use (it loads a
    native library and needs setuptools' pkg_resources, pinned below 81)."""
    return _quiet_import("tritonclient.utils.shared_memory")


def _quiet_import(name: str) -> types.ModuleType:
    """Import without pkg_resources' and cuda-python's deprecation warnings,
    which say nothing to a user of the client."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(name)


def cuda_shared_memory_module(device_id: int = 0) -> types.ModuleType:
    """tritonclient.utils.cuda_shared_memory, once it is clear that CUDA
    device `device_id` is there: on a machine without one the module fails
    deep inside cuda-python ("unable to create cuda shared memory handle");
    this says why in one line instead."""
    try:
        cudart = _quiet_import("cuda.cudart")
        cudashm = _quiet_import("tritonclient.utils.cuda_shared_memory")
    except (ImportError, RuntimeError) as error:
        raise ClientError(f"--shared-memory cuda needs the cuda-python package (pip install '.[client]'): {error}") from None
    try:
        status, count = cudart.cudaGetDeviceCount()
    except RuntimeError as error:  # no driver: "Failed to dlopen libcuda.so.1"
        raise ClientError(f"--shared-memory cuda needs an NVIDIA GPU and its driver on this machine ({error})") from None
    if status != cudart.cudaError_t.cudaSuccess or count <= device_id:
        found = "no CUDA device" if status != cudart.cudaError_t.cudaSuccess else f"{count} CUDA device(s)"
        raise ClientError(f"--shared-memory cuda needs CUDA device {device_id} on this machine; found {found}")
    return cudashm


def check_shared_memory(kind: str) -> None:
    """Fail early, with the reason, when this machine cannot give `kind` shared memory."""
    if kind == "cuda":
        cuda_shared_memory_module()


class SharedMemoryRegions:
    """One shared-memory region holding a worker's inputs and one for its
    outputs, registered with the server under names unique to this process:
    system shared memory (/dev/shm, for a client on the server's host) or CUDA
    memory on GPU `device_id` shared by CUDA IPC (for a client on the server's
    GPU host: the tensors never touch the host). `close()` unregisters and
    destroys both, and is safe to call twice; build it in a `with` or
    try/finally so Ctrl-C cleans up too.
    """

    def __init__(
        self,
        client: Client,
        arrays: dict[str, np.ndarray],
        outputs: dict[str, tuple[np.dtype, tuple[int, ...]]],
        kind: str = "system",
        device_id: int = 0,
    ):
        if kind not in SHARED_MEMORY_KINDS:
            raise ValueError(f"shared memory kind must be one of {', '.join(SHARED_MEMORY_KINDS)}, got {kind!r}")
        self.kind, self.device_id = kind, device_id
        self._shm = cuda_shared_memory_module(device_id) if kind == "cuda" else shared_memory_module()
        self._client = client
        self._made: list[tuple[str, Any, bool]] = []  # (name, handle, registered)
        tag = f"{SHM_PREFIX}{os.getpid()}_{next(_region_ids)}"
        self.input_name, self.output_name = f"{tag}_in", f"{tag}_out"
        self.input_slots = _slots({k: v.nbytes for k, v in arrays.items()}, {k: v.dtype for k, v in arrays.items()})
        sizes = {}
        for name, (dtype, shape) in outputs.items():
            if any(d < 0 for d in shape):
                raise InputError(
                    f"output {name!r} has a variable shape {list(shape)}; shared memory needs fixed output shapes"
                )
            sizes[name] = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.output_slots = {
            name: (offset, nbytes, np.dtype(outputs[name][0]), tuple(outputs[name][1]))
            for name, (offset, nbytes) in _slots(sizes, {k: v[0] for k, v in outputs.items()}).items()
        }
        try:
            handle = self._create(self.input_name, sum(n for _, n in self.input_slots.values()))
            if handle is not None:
                self._shm.set_shared_memory_region(handle, list(arrays.values()))
            self._create(self.output_name, sum(s[1] for s in self.output_slots.values()))
        except BaseException:
            self.close()
            raise

    def _create(self, name: str, byte_size: int) -> Any:
        if byte_size == 0:
            return None
        if self.kind == "cuda":
            handle = self._shm.create_shared_memory_region(name, byte_size, self.device_id)
            self._made.append((name, handle, False))
            self._client.register_cuda_shm(name, self._shm.get_raw_handle(handle), self.device_id, byte_size)
        else:
            handle = self._shm.create_shared_memory_region(name, "/" + name, byte_size)
            self._made.append((name, handle, False))
            self._client.register_shm(name, "/" + name, byte_size)
        self._made[-1] = (name, handle, True)
        return handle

    def read_output(self, name: str) -> np.ndarray:
        """An output, copied out of its region (CUDA regions have no offsets to
        read at: the region's bytes come back whole and the slot is cut out)."""
        offset, nbytes, dtype, shape = self.output_slots[name]
        handle = next(h for n, h, _ in self._made if n == self.output_name)
        raw = self._shm.get_contents_as_numpy(handle, np.uint8, [sum(s[1] for s in self.output_slots.values())])
        return np.array(raw[offset : offset + nbytes]).view(dtype).reshape(shape)

    def close(self) -> None:
        while self._made:
            name, handle, registered = self._made.pop()
            if registered:
                self._unregister(name)
            try:
                self._shm.destroy_shared_memory_region(handle)
            except Exception as error:  # noqa: BLE001 - keep cleaning the others
                log.warning("could not destroy shared memory region %s: %s", name, error)

    def _unregister(self, name: str, wait_s: float = 5.0) -> None:
        """Unregister, waiting while the server says the region is in use:
        Triton lets go of a region just after sending the response that used it."""
        deadline = time.monotonic() + wait_s
        unregister = self._client.unregister_cuda_shm if self.kind == "cuda" else self._client.unregister_shm
        while True:
            try:
                unregister(name)
                return
            except ClientError as error:
                if "in use" not in str(error) or time.monotonic() > deadline:
                    log.warning("could not unregister shared memory region %s: %s", name, error)
                    return
            time.sleep(0.01)

    def __enter__(self) -> "SharedMemoryRegions":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _slots(sizes: dict[str, int], dtypes: dict[str, np.dtype]) -> dict[str, tuple[int, int]]:
    """(offset, nbytes) for each tensor packed back to back into one region."""
    slots, offset = {}, 0
    for name, nbytes in sizes.items():
        if np.dtype(dtypes[name]) == np.object_:
            raise InputError(f"tensor {name!r} is BYTES; shared memory here needs fixed-size datatypes")
        slots[name] = (offset, int(nbytes))
        offset += int(nbytes)
    return slots
