"""The hand-written peer: the model.py a Triton user writes without this project.

`scripts/serving_bench.py` serves one beside each benchmarked model (as
`<model>_peer`, made from that model's config), so that every row shows the
floor, the peer and ours from the same server. It is what issue #73 measured
against: the zoo's own module (the same seeded weights) in the config's
`precision`, and on a GPU `torch.compile` with Inductor's freezing under
`inference_mode`, one CUDA graph captured around the compiled call per batch
bucket (the config's `buckets`) and input shape, the batch padded up to its
bucket, outputs copied to the host. A variable-length model (BERT, T5) pads
the requests of one execute to the longest among them (ids and masks with 0)
and cuts each answer back to its request's length; its graphs are captured
at load for the zoo's example lengths (what the serving benchmark sends) and
on first use for any other. On a CPU it runs the module eagerly under
`inference_mode` (what a CPU model.py runs; the comparison that matters is
the GPU's). Nothing of the engine is used: no plans, no streams, no checks
beyond Triton's own and the id ranges (which a careful model.py checks too).
"""

from __future__ import annotations

import json
import logging

import torch

from opara_core import parameters, zoo
from opara_core.engine.precision import HALF
from opara_core.serving.triton_backend import RangeCheck, output_tensor, select_device

log = logging.getLogger(__name__)

def peer_settings(config: dict) -> tuple[str, list[int]]:
    """The config's `precision` and `buckets` (the batch sizes ours captures), read
    through the project's one schema (opara_core.parameters), with max_batch_size
    as the last bucket where the buckets stop below it."""
    largest = int(config.get("max_batch_size", 0))
    if largest < 1:
        raise ValueError("the peer stands in for batching models (max_batch_size >= 1)")
    given = parameters.strings(config)
    read = {name: parameters.get(name).parse(given[name], name) if name in given else parameters.get(name).default for name in ("precision", "buckets")}
    buckets = sorted({b for b in read["buckets"] if b <= largest} | {largest})
    return read["precision"], buckets


class PeerModel:
    """Base class of the peer's generated model.py; `zoo_name` is the zoo model it serves."""

    zoo_name: str = ""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self._pb = pb_utils
        config = json.loads(args["model_config"])
        precision, self.buckets = peer_settings(config)
        self.dtype = HALF.get(precision, torch.float32)  # tf32: fp32 tensors, TF32 products allowed below
        self.device = select_device(args)
        entry = zoo.get(self.zoo_name)
        self.range_check = RangeCheck(entry.inputs, self.device)
        self.inputs = [spec.name for spec in entry.inputs]  # the module's argument order (the config names the same)
        self.outputs = [spec.name for spec in entry.outputs]
        # each variable output follows the axis of its inputs: (the input that says the length, output)
        self.lengths = [(axis.inputs[0], name) for axis in entry.lengths for name in axis.outputs]
        self.axis_inputs = [[self.inputs.index(name) for name in axis.inputs] for axis in entry.lengths]
        self.module = entry.build().eval().to(self.device, self.dtype)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
            with torch._inductor.config.patch(freezing=True), torch.inference_mode():
                self.compiled = torch.compile(self.module)
            self.pool = torch.cuda.graph_pool_handle()
            for bucket in self.buckets:
                self._graph([x.to(self.device) for x in entry.example_inputs(bucket, seed=bucket)])
        log.info("peer %s loaded on %s in %s (graphs: %s)", args["model_name"], self.device, precision, len(self.graphs) or "none, eager")

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if x.is_floating_point() else x

    def _graph(self, inputs: list[torch.Tensor]) -> tuple:
        """The CUDA graph of this batch's shapes (rows already a bucket), captured on first use."""
        key = tuple(tuple(x.shape) for x in inputs)
        if key not in self.graphs:
            static = [self._cast(x.to(self.device)) for x in inputs]
            with torch._inductor.config.patch(freezing=True), torch.inference_mode():
                for _ in range(2):
                    self.compiled(*static)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    outputs = self.compiled(*static)
            self.graphs[key] = (graph, static, outputs if isinstance(outputs, tuple) else (outputs,))
        return self.graphs[key]

    def _run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        rows = inputs[0].shape[0]
        bucket = next((b for b in self.buckets if b >= rows), None)
        with torch.inference_mode():
            if self.device.type != "cuda" or bucket is None:  # a CPU instance: the module itself
                outputs = self.module(*(self._cast(x.to(self.device)) for x in inputs))
                outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            else:
                padded = [torch.cat([x, x[:1].expand(bucket - rows, *x.shape[1:])]) if bucket > rows else x for x in inputs]
                graph, static, outputs = self._graph(padded)
                for buffer, x in zip(static, inputs):
                    buffer[:rows].copy_(x)
                graph.replay()
            return tuple(out[:rows].float().cpu() for out in outputs)

    def _padded(self, batches: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Each request's inputs, the variable-length ones padded with 0 to the longest of the execute."""
        for positions in self.axis_inputs:
            longest = max(batch[positions[0]].shape[1] for batch in batches)
            for batch in batches:
                for i in positions:
                    batch[i] = torch.nn.functional.pad(batch[i], (0, longest - batch[i].shape[1]))
        return batches

    def execute(self, requests: list) -> list:
        pb_utils = self._pb
        responses: list = [None] * len(requests)
        try:
            batches = [[torch.from_dlpack(pb_utils.get_input_tensor_by_name(r, name).to_dlpack()) for name in self.inputs] for r in requests]
            lengths = [{name: batch[self.inputs.index(by)].shape[1] for by, name in self.lengths} for batch in batches]
            batches = [[x.to(self.device, non_blocking=True) for x in batch] for batch in self._padded(batches)]
            # a careful model.py checks ids before an embedding reads them: on a GPU an id out of its
            # table is a device-side assert that kills the process's CUDA context (one wait per execute)
            for i, problem in enumerate(self.range_check.problems(batches)):
                if problem:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(problem))
            good = [(i, batch) for i, batch in enumerate(batches) if responses[i] is None]
            if not good:
                return responses
            lengths = [lengths[i] for i, _ in good]
            sizes = [batch[0].shape[0] for _, batch in good]
            outputs = self._run([torch.cat([batch[k] for _, batch in good]) for k in range(len(self.inputs))])
        except Exception as error:  # noqa: BLE001 - every request gets the error, the model stays up
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(error).__name__}: {error}")) for _ in requests]
        start = 0
        for (i, _), rows, length in zip(good, sizes, lengths):
            # through DLPack (triton_backend.output_tensor): the stub's numpy bridge sends zero bytes for numpy 2 arrays
            tensors = [
                output_tensor(pb_utils, name, (out[start : start + rows, : length[name]] if name in length else out[start : start + rows]).contiguous())
                for name, out in zip(self.outputs, outputs)
            ]  # fmt: skip
            responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
            start += rows
        return responses
