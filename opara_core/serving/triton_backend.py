"""The Triton Python-backend adapter that every model.py delegates to.

`initialize` builds the zoo model once and wraps it in a runner (CUDA graphs on
a GPU instance, eager on a CPU instance); `execute` validates each request,
hands the good ones to the runner as torch tensors (read through DLPack, on the
host or, with FORCE_CPU_ONLY_INPUT_TENSORS "no", on the GPU), which copies them
once into place and runs the batch once, and splits the outputs, which leave
through DLPack too. Two paths, chosen per batch by where Triton put the inputs:
host inputs are copied once to the GPU, GPU inputs (a client's CUDA shared
memory) device to device into the graph's static inputs. Ids are checked by
the graph itself (serving.id_guard: clamped into their tables, the clamped
rows named in one more output), so neither path checks them first; outputs leave as
host tensors (`output_memory` "host", the default: measured faster than GPU
outputs, which cost the Python backend a round trip more) or, with "auto", as
GPU tensors for a batch whose inputs came on the GPU.
A bad request gets its own INVALID_ARG error; the others in the batch are still
answered; no Python traceback ever reaches a client.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.dlpack import to_dlpack

from opara_core import zoo
from opara_core.spec import ModelSpec, TensorSpec
from opara_core.engine import gpu_turn
from opara_core.engine.build import EngineSettings, build_runner
from opara_core.parameters import BATCH, ENGINE, Values, parse, show, strings, value
from opara_core.serving import id_guard, weights
from opara_core.serving.pinned_host import SharedMemoryPinner
from opara_core.serving.startup import model_log_format, ready_line

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


def engine_settings(values: Values) -> EngineSettings:
    """EngineSettings from a model's parameters (`opara_core.parameters.parse`)."""
    return EngineSettings(**values.settings(ENGINE))


def output_memory(config: dict) -> str:
    """The `output_memory` parameter of a config, checked, the config's other
    parameters left alone (the floor model reads it from a benchmarked model's
    config); FORCE_CPU_ONLY_INPUT_TENSORS is checked too, since the Python
    backend reads it without a word on a typo."""
    params = strings(config)
    value(params, "FORCE_CPU_ONLY_INPUT_TENSORS")
    return value(params, "output_memory")


def torch_threads(setting: str | int, device: torch.device) -> int | None:
    """The stub's intra-op threads for the `torch_threads` parameter, None for torch's default.

    "auto" (the default) is 1 on a GPU instance, whose only CPU work is copying
    a batch into pinned staging: with torch's default (a thread per core) each
    image's copy is an OpenMP region that wakes and spins threads on the cores
    the gRPC front end, the batcher and the client need. A CPU instance runs the
    model on those threads, so it keeps torch's default. 0: torch's default;
    N > 0: N threads.
    """
    if setting == "auto":
        return 1 if device.type == "cuda" else None
    return int(setting) or None


def check_config(entry: ModelSpec, config: dict) -> None:
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


def check_ranges(entry: ModelSpec, values: Values) -> None:
    """The id ranges a config publishes (`value_range.<input>`, `upper_bounds.<input>`)
    must be exactly the model's."""
    declared, expected = {}, {}
    for family in ("value_range", "upper_bounds"):
        declared.update({f"{family}.{name}": bounds for name, bounds in values.family(family).items()})
    for spec in entry.inputs:
        if spec.value_range is not None:
            expected[f"value_range.{spec.name}"] = tuple(spec.value_range)
        if spec.upper_bounds is not None:
            expected[f"upper_bounds.{spec.name}"] = tuple(spec.upper_bounds)
    for key in sorted(set(declared) | set(expected)):
        got, wanted = declared.get(key), expected.get(key)
        if got != wanted:
            raise ValueError(f"parameter {key} is {_shown(got)}, the model's is {_shown(wanted)}")


def _shown(bounds: tuple[int, ...] | None) -> str:
    return "not set" if bounds is None else repr(show(bounds))


def request_tensors(entry: ModelSpec, tensors: dict[str, torch.Tensor | None], check_ids: bool = True) -> list[torch.Tensor]:
    """Validate one request's inputs against the model; return them in model order.

    Ids on the host are range-checked here (numpy, no copy) unless `check_ids`
    is false (a batch model's graph checks them: serving.id_guard); ids on a
    GPU are left to the caller (`RangeCheck` checks a whole batch on the GPU).
    Raises RequestError with a message that names the input and the problem.
    """
    unknown = sorted(set(tensors) - {s.name for s in entry.inputs})
    if unknown:
        raise RequestError(f"unknown input {unknown[0]!r}; the model takes {[s.name for s in entry.inputs]}")
    checked, rows = [], None
    for spec in entry.inputs:
        tensor = tensors.get(spec.name)
        if tensor is None:
            raise RequestError(f"missing input {spec.name!r}")
        if tensor.dtype != spec.dtype:
            raise RequestError(f"input {spec.name!r} has datatype {_dtype_name(tensor.dtype)}, expected {_dtype_name(spec.dtype)}")
        if tensor.ndim != len(spec.shape) + 1 or tuple(tensor.shape[1:]) != spec.shape:
            raise RequestError(
                f"input {spec.name!r} has shape {list(tensor.shape)}, expected [batch, {', '.join(map(str, spec.shape))}]"
            )
        if rows is not None and tensor.shape[0] != rows:
            raise RequestError(f"input {spec.name!r} has batch {tensor.shape[0]}, other inputs have {rows}")
        rows = tensor.shape[0]
        if rows == 0:
            raise RequestError(f"input {spec.name!r} has an empty batch")
        problem = spec.check(tensor) if check_ids and tensor.device.type == "cpu" else None
        if problem:
            raise RequestError(problem)
        checked.append(tensor)
    return checked


def _sized(spec: TensorSpec, values: torch.Tensor) -> TensorSpec:
    """The spec at these values' per-row shape where only its range constrains
    them (a variable-length input, whose shape the spec cannot say); per-position
    bounds keep the spec's own shape."""
    return spec if spec.upper_bounds is not None else replace(spec, shape=tuple(values.shape[1:]))


class RangeCheck:
    """Id ranges of a batch's inputs, checked where the ids are: what a careful
    model.py does before its graph reads them (the peer), and how a request the
    graph clamped (serving.id_guard) learns which id was wrong.

    `problems` waits for the GPU once for the whole batch (a check per request
    and input would wait once each)."""

    def __init__(self, specs: tuple[TensorSpec, ...], device: torch.device):
        self._ranged = []
        for k, spec in enumerate(specs):
            limits = spec.limits()
            if limits is not None:
                low, high = limits
                self._ranged.append((k, spec, low, torch.as_tensor(high, device=device)))

    @staticmethod
    def _ids(batch: list[list[torch.Tensor]], k: int) -> torch.Tensor:
        """Input k of every request, as one tensor of the batch's rows."""
        blocks = [tensors[k] for tensors in batch]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)

    def _bad_rows(self, batch: list[list[torch.Tensor]]) -> torch.Tensor:
        bad_rows = []
        for k, _, low, high in self._ranged:
            ids = self._ids(batch, k)
            bad_rows.append(((ids < low) | (ids >= high)).flatten(1).any(1))
        return torch.stack(bad_rows).any(0)

    def describe(self, tensors: list[torch.Tensor]) -> str | None:
        """A request's first bad id described, or None."""
        return next(filter(None, (_sized(spec, tensors[k]).check(tensors[k]) for k, spec, _, _ in self._ranged)), None)

    def problems(self, batch: list[list[torch.Tensor]]) -> list[str | None]:
        """Per request (its inputs in model order, all on the device): the first
        bad id described, or None."""
        if not self._ranged or not batch:
            return [None] * len(batch)
        return _per_request(batch, self._bad_rows(batch).tolist(), self.describe)  # the batch's one synchronisation


def _per_request(batch: list[list[torch.Tensor]], bad: list[bool], describe) -> list[str | None]:
    problems, offset = [], 0
    for tensors in batch:
        rows = tensors[0].shape[0]
        problems.append(describe(tensors) if any(bad[offset : offset + rows]) else None)
        offset += rows
    return problems


class OparaModel:
    """Base class for model.py files: a subclass names its zoo model
    (serving.user_models: a user's program or module instead).

    The class is imported by the Python backend stub; triton_python_backend_utils
    exists only there, so it is imported in `initialize`.
    """

    zoo_name: str = ""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        started = time.monotonic()
        logging.basicConfig(level=logging.INFO, format=model_log_format(args["model_name"]))
        self._pb = pb_utils
        config = json.loads(args["model_config"])
        try:
            values, module = self.load(config, Path(args["model_repository"]) / args["model_version"])
            settings = engine_settings(values)
            self.output_memory = values["output_memory"]
            self.device = select_device(args)
            threads = torch_threads(values["torch_threads"], self.device)
            log.info("model %s: module built in %.1f s", args["model_name"], time.monotonic() - started)
        except (KeyError, ValueError) as error:
            raise pb_utils.TritonModelException(f"model {args['model_name']}: {error}") from None
        # the server's models take turns on each GPU, stepping aside while they compile (engine.gpu_turn)
        waiting = f"waiting for {self.device}: another model on this machine is building on it"
        lock = gpu_turn.lock_path(self.device) if self.device.type == "cuda" else None
        # held lazily: the build takes it when it first uses the GPU (engine.build, serving.varlen)
        turn = gpu_turn.held(lock, waiting, lazily=True) if lock else contextlib.nullcontext()
        with turn:
            log.info("building on %s", self.device)
            self.runner, self.report = self._build(module, settings, config)
        if threads is not None:  # after the build, which may use every core (tracing, CPU fallbacks)
            torch.set_num_threads(threads)
        self.range_check = RangeCheck(self.entry.inputs, self.device)
        self.ids_checked_in_graph = id_guard.guarded(self.graph_entry)
        self.pinner = SharedMemoryPinner(self.device)
        self.name, self.gpu_path_seen = args["model_name"], False
        self.metrics = ServingMetrics(pb_utils, args["model_name"], self.runner, self.report)
        report = self.report
        built = report.runner + (f", {len(report.choices)} buckets" if report.choices else "")
        built += f", after {len(report.fallbacks)} fallback(s)" if report.fallbacks else ""
        details = [line for line in report.summary().splitlines()[1:] if not line.rstrip().endswith(":")]  # one line
        freeze_heap()
        log.info("%s", ready_line(args["model_name"], str(self.device), time.monotonic() - started, built, details))

    def execute(self, requests: list) -> list:
        pb_utils = self._pb
        clock = self.metrics.clock
        clock.restart()
        responses: list = [None] * len(requests)
        good: list[tuple[int, list[torch.Tensor]]] = []
        arrived = self._arrived([{t.name(): input_tensor(t) for t in request.inputs()} for request in requests])
        for i, (request, tensors) in enumerate(zip(requests, arrived)):
            try:
                good.append((i, self._request(request, tensors)))
            except RequestError as error:
                responses[i] = _error(pb_utils, str(error), pb_utils.TritonError.INVALID_ARG)
        on_device = self._place(good)
        if on_device and not self.gpu_path_seen:  # once: where a test or an operator sees that CUDA shared memory arrived as such
            self.gpu_path_seen = True
            log.info("model %s: a batch arrived on %s: the GPU path (inputs device to device)", self.name, self.device)
        clock.lap("validate")
        if good:
            try:
                with torch.inference_mode():
                    for (i, _), response in zip(good, self._run(good, on_device)):
                        responses[i] = response
                clock.lap("respond")
            except Exception:  # noqa: BLE001 - reported per request, never as a traceback
                log.exception("inference failed for a batch of %d requests", len(good))
                for i, _ in good:
                    responses[i] = _error(pb_utils, "inference failed inside the model; see the server log", pb_utils.TritonError.INTERNAL)
        self.metrics.requests += len(requests)  # pushed by the metrics thread, never on a request's time
        return responses

    def finalize(self) -> None:
        self.metrics.close()
        self.pinner.close()

    # Hooks for subclasses that serve differently (serving.varlen: variable lengths)
    PARAMETER_KIND = BATCH  # which parameters the config may set (opara_core.parameters)

    def load(self, config: dict, version_dir: Path) -> tuple[Values, torch.nn.Module]:
        """What `initialize` does before the build, outside Triton too
        (serving.model_dir, the bench's `--model-dir`): the config's parameters
        read and checked, the model's description (`self.entry`), the module."""
        self.max_batch = max(int(config.get("max_batch_size", 0)), 1)
        values = parse(self.PARAMETER_KIND, strings(config))
        self.entry = self._describe(config, values, version_dir)
        self._check_config(config, values)
        check_ranges(self.entry, values)
        module, self.graph_entry = self._in_graph(self._module(values, version_dir))
        return values, module

    def _in_graph(self, module: torch.nn.Module) -> tuple[torch.nn.Module, ModelSpec]:
        """The module the engine builds and its description: with its id
        ranges checked inside the graph (serving.id_guard)."""
        return id_guard.in_graph(module, self.entry)

    def _describe(self, config: dict, values: Values, version_dir: Path) -> ModelSpec:
        """What the model takes and returns (serving.user_models: from the config)."""
        return zoo.get(self.zoo_name or config["name"])

    def _module(self, values: Values, version_dir: Path) -> torch.nn.Module:
        """The module to serve (serving.user_models: the user's program or module)."""
        weights_file = values["weights"]
        return weights.load_module(self.entry, weights.weights_path(version_dir, weights_file) if weights_file else None)

    def _check_config(self, config: dict, values: Values) -> None:
        check_config(self.entry, config)

    def _build(self, module: torch.nn.Module, settings: EngineSettings, config: dict):
        return build_runner(module, self.graph_entry, self.device, self.max_batch, settings)

    def _arrived(self, arrived: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Every request's inputs by name, where this model reads them (serving.varlen: on the host)."""
        return arrived

    def _request(self, request, tensors: dict[str, torch.Tensor]):
        return request_tensors(self.entry, tensors, check_ids=False)  # ids: the graph checks them (serving.id_guard)

    def _place(self, good: list[tuple[int, list[torch.Tensor]]]) -> bool:
        """Put the whole batch on one device, in place; True when that is the
        instance's GPU. A GPU instance takes the GPU path as soon as one request
        came on a GPU (the host requests of a mixed batch are copied up, a block
        on another GPU copied over); a CPU instance takes everything to the host.
        A GPU instance page-locks the shared memory its host blocks are in
        (serving.pinned_host), so that the runner copies them up in one go."""
        gpu = self.device.type == "cuda"
        on_device = gpu and any(t.is_cuda for _, tensors in good for t in tensors)
        target = self.device if on_device else torch.device("cpu")
        for _, tensors in good:
            for k, tensor in enumerate(tensors):
                if tensor.device != target:
                    tensors[k] = tensor.to(target, non_blocking=on_device)
                elif gpu:
                    self.pinner.pin(tensor)
        return on_device

    def _run(self, good: list[tuple[int, list[torch.Tensor]]], on_device: bool = False) -> list:
        """Run the requests as one batch, split the outputs per request: a
        response per request, in order."""
        sizes = [tensors[0].shape[0] for _, tensors in good]
        # per input, its row blocks in request order; the runner copies them
        # once into place (Triton's batcher keeps the rows <= max_batch_size)
        batch = [[tensors[k] for _, tensors in good] for k in range(len(self.entry.inputs))]
        self.metrics.clock.lap("stage")
        # outputs leave through DLPack, never pb_utils.Tensor(name, ndarray): see input_tensor
        gpu_outputs = self.device.type == "cuda" and (self.output_memory == "gpu" or (self.output_memory == "auto" and on_device))
        outputs = self.runner.run(batch, outputs_on_device=gpu_outputs)
        self.metrics.clock.lap("run")
        # which requests' ids the graph clamped (serving.id_guard): those get the bad id named instead
        clamped = _per_request([tensors for _, tensors in good], outputs[-1].tolist(), self.range_check.describe) if self.ids_checked_in_graph else [None] * len(good)
        results, offset = [], 0
        for size, problem in zip(sizes, clamped):
            if problem:
                results.append(_error(self._pb, problem, self._pb.TritonError.INVALID_ARG))
            else:
                results.append(self._response(outputs if len(sizes) == 1 else [out[offset : offset + size] for out in outputs]))  # a lone request's rows are all of them
            offset += size
        return results

    def _response(self, outputs: list[torch.Tensor]):
        """A request's response from its outputs (model order), handed over through DLPack."""
        tensors = [output_tensor(self._pb, spec.name, out) for spec, out in zip(self.entry.outputs, outputs)]
        return self._pb.InferenceResponse(output_tensors=tensors)


def input_tensor(tensor) -> torch.Tensor:
    """A request's input as a torch tensor (where Triton put it: host or GPU),
    read through DLPack.

    The Python backend's own numpy bridge (`as_numpy`, `Tensor(name, ndarray)`)
    is compiled against numpy 1 and misreads numpy 2 arrays: with numpy 2 in the
    stub's environment, Triton 24.10 answered every request with outputs of the
    right shape and zero bytes (gRPC) or HTTP 500 "output tensor shape does not
    match size of output". torch reads and writes DLPack on any numpy. (numpy's
    own DLPack, `np.from_dlpack(tensor)` or an ndarray given to `from_dlpack`,
    kills the r24.10 stub: "PyCapsule_GetPointer called with incorrect name".)
    """
    return torch.from_dlpack(tensor.to_dlpack())


def output_tensor(pb_utils, name: str, tensor: torch.Tensor):
    """A response's output, handed to the Python backend through DLPack.

    A host tensor goes as a capsule (`torch.utils.dlpack.to_dlpack`, the form
    Triton's examples use): handed the tensor itself, the stub calls its
    `__dlpack_device__` and Python-level `__dlpack__`, which cost a request
    about 20 us more per output (DeepFM, CPU server, 2026-12-06). A GPU tensor
    goes as itself: the stub then has torch order its stream behind the tensor's
    and waits for it, so Triton never reads an output still being written.
    """
    return pb_utils.Tensor.from_dlpack(name, to_dlpack(tensor) if tensor.device.type == "cpu" else tensor)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class StageClock:
    """Seconds spent in each stage of `execute`, summed: `lap(stage)` charges
    the time since the last lap to `stage`."""

    STAGES = ("validate", "stage", "run", "respond")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] += now - self._last
        self._last = now


class ServingMetrics:
    """The model's own Prometheus metrics, next to Triton's on the metrics port.

    opara_batches_total{model,runner,bucket}: batches run, per CUDA-graph bucket
    (runner "cuda-graph") or per batch size (runner "eager"); opara_padded_rows_total:
    rows replayed beyond the real batch to fill a bucket; opara_fallbacks_total:
    fallbacks taken at load (label `stage`: what failed);
    opara_execute_seconds_total{model,stage}: where `execute` spends its time
    (validate the requests, stage them into the pinned buffers, run: copy in,
    replay, copy out; respond: split and build the responses), and
    opara_requests_total{model}: requests seen, to divide them by;
    opara_precision_error{model,precision}: a model built in another precision
    than fp32, its graphs' largest relative error against the fp32 module. Every metric
    update is an IPC round trip to the server, so counts are pushed every
    `FLUSH_SECONDS` by a background thread, never by `execute` (the request
    that paid for a flush waited on a round trip per changed counter), and the
    tail of a burst reaches a scrape without waiting for the next request.
    """

    FLUSH_SECONDS = 0.5

    def __init__(self, pb_utils, model: str, runner, report):
        kind = pb_utils.MetricFamily.COUNTER
        self._batches = pb_utils.MetricFamily(
            name="opara_batches_total", description="Batches run, by runner and bucket", kind=kind
        )
        # a MetricFamily must outlive its Metrics: keep every one
        self._padded_family = pb_utils.MetricFamily(
            name="opara_padded_rows_total", description="Rows replayed beyond the batch to fill a bucket", kind=kind
        )
        self._padded = self._padded_family.Metric(labels={"model": model})
        self._padded.increment(0)  # show the series from the start, also where it stays 0
        self._fallback_family = pb_utils.MetricFamily(
            name="opara_fallbacks_total", description="Fallbacks taken when the model was loaded", kind=kind
        )
        self._fallbacks = [
            self._fallback_family.Metric(labels={"model": model, "stage": reason.split(":", 1)[0]}) for reason in report.fallbacks
        ]
        for metric in self._fallbacks:
            metric.increment(1)
        self._seconds_family = pb_utils.MetricFamily(
            name="opara_execute_seconds_total", description="Seconds spent in execute, by stage", kind=kind
        )
        self._seconds = {stage: self._seconds_family.Metric(labels={"model": model, "stage": stage}) for stage in StageClock.STAGES}
        self._precision_family = pb_utils.MetricFamily(
            name="opara_precision_error",
            description="Largest relative error of the model's graphs against the fp32 module, measured at load",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        if report.precision_error:
            self._precision = self._precision_family.Metric(labels={"model": model, "precision": report.precision})
            self._precision.set(max(accuracy.error for accuracy in report.precision_error.values()))
        self._requests_family = pb_utils.MetricFamily(name="opara_requests_total", description="Requests given to execute", kind=kind)
        self._requests = self._requests_family.Metric(labels={"model": model})
        self.clock = StageClock()
        self.requests = 0
        self._seconds_sent = dict.fromkeys(StageClock.STAGES, 0.0)
        self._requests_sent = 0
        self._model = model
        self._runner = runner
        self._metrics: dict[int, object] = {}
        self._sent: dict[int, int] = {}
        self._padded_sent = 0
        self._flushing = threading.Lock()
        self._stopped = threading.Event()
        self._timer = threading.Thread(target=self._flush_every_interval, name=f"{model}-metrics", daemon=True)
        self._timer.start()

    def _flush_every_interval(self) -> None:
        while not self._stopped.wait(self.FLUSH_SECONDS):
            with self._flushing:
                self._flush()

    def close(self) -> None:
        """Stop the timer and push what is left."""
        self._stopped.set()
        self._timer.join(timeout=5)
        with self._flushing:
            self._flush()

    def _flush(self) -> None:
        for bucket, count in list(self._runner.batches.items()):
            if bucket not in self._metrics:
                labels = {"model": self._model, "runner": self._runner.info.kind, "bucket": str(bucket)}
                self._metrics[bucket] = self._batches.Metric(labels=labels)
                self._sent[bucket] = 0
            if count > self._sent[bucket]:
                self._metrics[bucket].increment(count - self._sent[bucket])
                self._sent[bucket] = count
        if self._runner.padded_rows > self._padded_sent:
            self._padded.increment(self._runner.padded_rows - self._padded_sent)
            self._padded_sent = self._runner.padded_rows
        for stage, spent in self.clock.seconds.items():
            if spent > self._seconds_sent[stage]:
                self._seconds[stage].increment(spent - self._seconds_sent[stage])
                self._seconds_sent[stage] = spent
        if self.requests > self._requests_sent:
            self._requests.increment(self.requests - self._requests_sent)
            self._requests_sent = self.requests


def freeze_heap() -> None:
    """Collect once, then exempt every object alive now (torch, the model, its
    graphs) from later garbage collections: a full collection walks them all
    (GoogLeNet's stub: ~355,000 objects, 0.8 s on a 2-core CPU host, 0.01 ms
    once frozen) and stalls every request in flight meanwhile."""
    gc.collect()
    gc.freeze()


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

