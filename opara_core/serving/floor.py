"""A Python model that does no work: the Python backend's own cost per request.

`scripts/serving_bench.py` serves one beside each benchmarked model, made from
that model's config (the same inputs and outputs, instance kind, dynamic
batching and FORCE_CPU_ONLY_INPUT_TENSORS), so that every row shows the floor
measured in the same run: what Triton's Python backend costs to move a request
into a stub process and a response out, which no model code can remove.

It reads no input data and answers each request with zeros of the output
shapes (a variable-length output at the request's length, as the zoo model
it stands in for has it), placed as the adapter places real outputs under the config's
`output_memory` ("host", the default; "auto": GPU tensors when the request's
inputs came on the instance's GPU, host tensors otherwise; "gpu"), both handed over
as the model hands them (`triton_backend.output_tensor`): GPU outputs cost the Python backend a synchronisation per
tensor and a second round trip to the stub, so the floor must pay what the
model pays.

`IOFloorModel` (`serving_bench.py --io-floor`) is the floor plus what moving the
tensors costs any model.py that replays a CUDA graph, with no model and no
checks: the least a GPU model can pay above the floor, so that a row's time
above it is what the model itself adds.
"""

from __future__ import annotations

import json
import logging
import math

import torch

from opara_core import zoo
from opara_core.serving.triton_backend import TRITON_DTYPES, freeze_heap, input_tensor, output_memory, output_tensor, select_device
from opara_core.zoo import LengthAxis

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: dtype for dtype, name in TRITON_DTYPES.items()}


def zero_outputs(config: dict, device: torch.device, limits: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """One flat zero tensor per output of the config, large enough for
    `max_batch_size` rows at the longest length (`limits`: the longest size of
    each variable output), to answer every request from a view of its start."""
    rows = int(config.get("max_batch_size", 0))
    if rows < 1:
        raise ValueError("the floor model stands in for batching models (max_batch_size >= 1)")
    limits = limits or {}
    outputs = {}
    for tensor in config.get("output", []):
        dims = [int(d) for d in tensor["dims"]]
        if any(d < 0 for d in dims) and tensor["name"] not in limits:
            raise ValueError(f"output {tensor['name']!r} has a variable shape {dims} and no zoo model says how long it gets")
        size = rows * math.prod(limits[tensor["name"]] if d < 0 else d for d in dims)
        outputs[tensor["name"]] = torch.zeros(size, dtype=TORCH_DTYPES[tensor["data_type"]], device=device)
    return outputs


def output_shapes(config: dict) -> dict[str, list[int]]:
    """Each output's per-sample dims as the config declares them (-1: variable)."""
    return {tensor["name"]: [int(d) for d in tensor["dims"]] for tensor in config.get("output", [])}


def length_axes(zoo_name: str | None, shapes: dict[str, list[int]]) -> dict[str, LengthAxis]:
    """For each output with a variable dimension (`shapes`: `output_shapes`), the zoo
    model's length axis it follows (its variable dimension has the request's length on that axis)."""
    variable = [name for name, dims in shapes.items() if any(d < 0 for d in dims)]
    if not variable or zoo_name is None:
        return {}
    return {name: axis for axis in zoo.get(zoo_name).lengths for name in axis.outputs if name in variable}


class FloorModel:
    """Base class of the floor model's generated model.py. `zoo_name`: the zoo
    model it stands in for, which says how long a variable-length output is."""

    zoo_name: str | None = None
    kind = "no-op floor"  # in its loaded line

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self._pb = pb_utils
        config = json.loads(args["model_config"])
        self.device = select_device(args)
        self.output_memory = output_memory(config)
        self.shapes = output_shapes(config)
        self.axes = length_axes(self.zoo_name, self.shapes)
        limits = {name: axis.limit for name, axis in self.axes.items()}
        self.host = zero_outputs(config, torch.device("cpu"), limits)
        self.gpu = zero_outputs(config, self.device, limits) if self.device.type == "cuda" else None
        self._prepare(config)
        freeze_heap()  # as the model does: no full collection pauses in either
        log.info("%s %s loaded on %s", self.kind, args["model_name"], self.device)  # not "model X ready on": serving_bench reads those lines

    def _prepare(self, config: dict) -> None:
        """What a floor that does more than answering zeros sets up (`IOFloorModel`)."""

    def shape(self, name: str, rows: int, request) -> list[int]:
        """The output's shape for this request: a variable dimension takes the
        request's length on the output's axis (the last dimension of its first input)."""
        dims = self.shapes[name]
        if name in self.axes:
            length = self._pb.get_input_tensor_by_name(request, self.axes[name].inputs[0]).shape()[-1]
            dims = [length if d < 0 else d for d in dims]
        return [rows, *dims]

    def execute(self, requests: list) -> list:
        pb_utils = self._pb
        responses = []
        for request in requests:
            first = request.inputs()[0]
            rows = first.shape()[0]
            on_gpu = self.output_memory == "gpu" or (self.output_memory == "auto" and not first.is_cpu())
            zeros = self.gpu if self.gpu is not None and on_gpu else self.host
            tensors = []
            for name, zero in zeros.items():
                shape = self.shape(name, rows, request)
                tensors.append(output_tensor(pb_utils, name, zero[: math.prod(shape)].view(shape)))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses


class IOFloorModel(FloorModel):
    """The floor plus moving the tensors: every request's inputs read through
    DLPack, the batch's blocks of each input gathered into page-locked staging
    and sent to the GPU in one copy (gathered on the GPU where they came on
    it), a captured CUDA graph of one memset per output replayed, the outputs
    the responses need copied back into page-locked memory in one copy each
    (left on the GPU where `output_memory` says so), one wait, and the
    responses as views of those buffers. On a CPU instance: the inputs read
    and gathered, zeros answered. Buffers are flat, sized for
    `max_batch_size` rows at the longest length of a variable axis."""

    kind = "I/O floor"

    def _prepare(self, config: dict) -> None:
        rows = int(config["max_batch_size"])
        limits = {name: axis.limit for axis in (zoo.get(self.zoo_name).lengths if self.zoo_name else ()) for name in axis.inputs}
        self.input_names = []
        self.staged: dict[str, torch.Tensor] = {}  # page-locked on a GPU instance
        self.device_in: dict[str, torch.Tensor] = {}
        gpu = self.device.type == "cuda"
        for tensor in config.get("input", []):
            name, dims = tensor["name"], [int(d) for d in tensor["dims"]]
            if any(d < 0 for d in dims) and name not in limits:
                raise ValueError(f"input {name!r} has a variable shape {dims} and no zoo model says how long it gets")
            size = rows * math.prod(limits[name] if d < 0 else d for d in dims)
            dtype = TORCH_DTYPES[tensor["data_type"]]
            self.input_names.append(name)
            self.staged[name] = torch.empty(size, dtype=dtype, pin_memory=gpu)
            if gpu:
                self.device_in[name] = torch.empty(size, dtype=dtype, device=self.device)
        self.graph = None
        if gpu:
            self.host = {name: zero.pin_memory() for name, zero in self.host.items()}
            heads = [zero[: max(1, zero.numel() // rows)] for zero in self.gpu.values()]  # one row of each output
            for head in heads:  # before the capture: the memset kernel loaded
                head.zero_()
            torch.cuda.synchronize(self.device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                for head in heads:
                    head.zero_()

    def execute(self, requests: list) -> list:
        try:
            return self._execute(requests)
        except Exception as error:  # noqa: BLE001 - a request it cannot move (an input missing): every request gets the error, the model stays up
            log.warning("I/O floor: %s: %s", type(error).__name__, error)
            return [self._pb.InferenceResponse(error=self._pb.TritonError(f"{type(error).__name__}: {error}")) for _ in requests]

    def _execute(self, requests: list) -> list:
        pb_utils = self._pb
        arrived = [{t.name(): input_tensor(t) for t in request.inputs()} for request in requests]
        on_gpu = self.graph is not None and any(t.is_cuda for tensors in arrived for t in tensors.values())
        for name in self.input_names:
            blocks = [tensors[name].reshape(-1) for tensors in arrived]
            count = sum(b.numel() for b in blocks)
            if on_gpu:  # CUDA shared memory: gathered where it lies (a host block of a mixed batch copied up)
                torch.cat([b.to(self.device, non_blocking=True) for b in blocks], out=self.device_in[name][:count])
            else:
                torch.cat(blocks, out=self.staged[name][:count])
                if self.graph is not None:
                    self.device_in[name][:count].copy_(self.staged[name][:count], non_blocking=True)
        shapes = [[self.shape(name, tensors[self.input_names[0]].shape[0], request) for name in self.shapes] for request, tensors in zip(requests, arrived)]
        gpu_out = self.graph is not None and (self.output_memory == "gpu" or (self.output_memory == "auto" and on_gpu))
        if self.graph is not None:
            self.graph.replay()
            if not gpu_out:
                for k, name in enumerate(self.shapes):
                    count = sum(math.prod(s[k]) for s in shapes)
                    self.host[name][:count].copy_(self.gpu[name][:count], non_blocking=True)
                torch.cuda.current_stream(self.device).synchronize()
        outputs = self.gpu if gpu_out else self.host
        responses, offsets = [], dict.fromkeys(self.shapes, 0)
        for shape in shapes:
            tensors = []
            for (name, flat), dims in zip(outputs.items(), shape):
                count = math.prod(dims)
                tensors.append(output_tensor(pb_utils, name, flat[offsets[name] : offsets[name] + count].view(dims)))
                offsets[name] += count
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
