"""A Python model that does no work: the Python backend's own cost per request.

`scripts/serving_bench.py` serves one beside each benchmarked model, made from
that model's config (the same inputs and outputs, instance kind, dynamic
batching and FORCE_CPU_ONLY_INPUT_TENSORS), so that every row shows the floor
measured in the same run: what Triton's Python backend costs to move a request
into a stub process and a response out, which no model code can remove.

It reads no input data and answers each request with zeros of the output
shapes, placed as the adapter places real outputs under the config's
`output_memory` ("host", the default; "auto": GPU tensors when the request's
inputs came on the instance's GPU, host tensors otherwise; "gpu"), both handed over
through DLPack: GPU outputs cost the Python backend a synchronisation per
tensor and a second round trip to the stub, so the floor must pay what the
model pays.
"""

from __future__ import annotations

import json
import logging

import torch

from opara_core.serving.triton_backend import TRITON_DTYPES, freeze_heap, output_memory, select_device

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: dtype for dtype, name in TRITON_DTYPES.items()}


def zero_outputs(config: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """One zero tensor per output of the config, `max_batch_size` rows, to
    answer every request from slices."""
    rows = int(config.get("max_batch_size", 0))
    if rows < 1:
        raise ValueError("the floor model stands in for batching models (max_batch_size >= 1)")
    outputs = {}
    for tensor in config.get("output", []):
        dims = [int(d) for d in tensor["dims"]]
        if any(d < 0 for d in dims):
            raise ValueError(f"output {tensor['name']!r} has a variable shape {dims}; the floor model needs fixed ones")
        outputs[tensor["name"]] = torch.zeros((rows, *dims), dtype=TORCH_DTYPES[tensor["data_type"]], device=device)
    return outputs


class FloorModel:
    """Base class of the floor model's generated model.py."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self._pb = pb_utils
        config = json.loads(args["model_config"])
        self.device = select_device(args)
        self.output_memory = output_memory(config)
        self.host = zero_outputs(config, torch.device("cpu"))
        self.gpu = zero_outputs(config, self.device) if self.device.type == "cuda" else None
        freeze_heap()  # as the model does: no full collection pauses in either
        log.info("no-op floor %s loaded on %s", args["model_name"], self.device)  # not "model X ready on": serving_bench reads those lines

    def execute(self, requests: list) -> list:
        pb_utils = self._pb
        responses = []
        for request in requests:
            first = request.inputs()[0]
            rows = first.shape()[0]
            on_gpu = self.output_memory == "gpu" or (self.output_memory == "auto" and not first.is_cpu())
            zeros = self.gpu if self.gpu is not None and on_gpu else self.host
            tensors = [pb_utils.Tensor.from_dlpack(name, zero[:rows]) for name, zero in zeros.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
