"""Variable-length serving (BERT, T5): one runner per shape bucket, and
TurboTransformers' batch scheduler between them.

Requests of any length up to each axis's limit arrive together in one
`execute` (the config allows ragged batching on the variable inputs, and the
Python backend hands over each request's tensors separately, with its own
shape, so no server-side concatenation has to be undone). Each request row is
scheduled on its own: `planning.batching` splits the rows into sub-batches by a
cost table `cost[shape bucket][batch bucket]`, each sub-batch is padded with
zeros to the cheapest cell that holds it, usually its own shape bucket (ids 0
are valid; attention-mask 0 hides the padded keys; T5's decoder is causal, so
padding after a row's last decoder id changes none of its positions) and run on
that shape's runner; each row's outputs are cut back to its own length.

Runners: one per shape bucket, each with one CUDA graph per batch bucket, every
shape's graphs in one memory pool (on a CPU: eager). `compiler` "saved" (the
default) exports the whole model once with dynamic sizes, compiles it with
Inductor into an artifact saved in the cache directory (weights not frozen:
graph inputs) and captures it at every cell, on one stream; later starts load
the artifact and run no Dynamo (BERT's warm start on an H100: 10.7 s against
66 s for torch.compile, with cells as fast; docs/benchmarks.md, variable
lengths run 12); "engine" builds each shape with `engine.build.build_runner`
(the plan `auto` picks, ATen kernels on several lanes). (`compiler` "inductor",
torch.compile at every start, and "aot", an AOTInductor package, whose loader
died of SIGSEGV on the GPU machine, were removed.) A shape whose whole-model
graph fails to capture or disagrees with eager falls back to the engine's
build. `capture` "load" builds every shape
when the model loads, largest first; "first_use" builds the smallest shape at
load (the compile) and any other the first time a sub-batch needs it, after
the largest, so that the graph pool fills as at load (the environment
variable OPARA_CAPTURE overrides it for every model: `launcher warm` builds
every shape). The cost table comes from replay timings of the captured graphs
(a shape built on first use replaces its cells with its timings); for shapes
not built yet, from the timings an earlier start that built every shape kept
(`serving.varlen_costs`: `launcher warm` fills them); else, and for eager
runners, from a token-count model (`modelled_seconds`) in the timed cells'
units, never below a timed cell that the shape holds.

Config parameters (besides the engine's; all declared in opara_core.parameters,
docs/configuration.md): `scheduler` (a request may choose another with its own
parameter `scheduler`, which benchmarks use to compare them on one server),
`compiler`, `capture`, `length_buckets.<axis>` (ascending, the last one the
axis's limit) and `max_length.<input>` (published to clients; must equal the
model's limit).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from opara_core import parameters
from opara_core.engine import cache, gpu_turn, precision
from opara_core.engine.build import BuildReport, EngineSettings, GuardError, build_runner, check_against_fp32, check_rows_against_eager, static_inputs
from opara_core.engine.capture import CapturedGraph, CaptureError, GraphPool, pool_mb, time_replays
from opara_core.engine.inductor_cache import use_inductor_cache
from opara_core.engine.runtime import GraphRunner, PackedInputs, Runner, RunnerInfo
from opara_core.engine.whole_model import DynamicDims, WholeModelSaved
from opara_core.planning import batching
from opara_core.planning.batching import CostTable
from opara_core.serving import varlen_costs
from opara_core.serving.triton_backend import TRITON_DTYPES, OparaModel, RequestError, request_tensors
from opara_core.spec import LengthAxis, ModelSpec, TensorSpec

log = logging.getLogger(__name__)

DEFAULT_LENGTH_BUCKETS = parameters.LENGTH_BUCKETS
# overrides every model's `capture` (declared with it in opara_core.parameters): the launcher's
# `warm` sets it to "load", so that an image's cache holds every shape
CAPTURE_ENV = parameters.get("capture").env
# the token-count model: a run costs its padded tokens, attention adding one token's
# worth per ATTENTION_SPAN tokens of length, plus a fixed overhead worth OVERHEAD_TOKENS
ATTENTION_SPAN = 512
OVERHEAD_TOKENS = 64
# the cost table's replay timings: about 5 ms of replays three times a cell, at least one;
# with time_replays' defaults (20 ms and 3 replays, five times) what followed the captures of a
# warm start took 4.0 s for BERT's 36 cells and 18.4 s for T5's 144, with these 1.7 and 3.3 s
# (H100, 2026-11-27, docs/benchmarks.md variable lengths run 12), where 10 s is the budget of it all
COST_TIMING = {"seconds": 0.005, "repeats": 3, "warmup": 1, "least": 1}


_DEFAULT = parameters.defaults(parameters.VARLEN_GROUP)


@dataclass(frozen=True)
class VarLenSettings:
    """How a variable-length model is served: its sequence buckets per variable
    axis (`length_buckets.<axis>`) and the parameters declared, with their
    defaults and allowed values, in opara_core.parameters (checked there)."""

    axes: tuple[tuple[int, ...], ...]  # sequence buckets per variable axis
    scheduler: str = _DEFAULT["scheduler"]
    capture: str = _DEFAULT["capture"]
    compiler: str = _DEFAULT["compiler"]

    def __post_init__(self) -> None:
        parameters.check_fields(self, parameters.VARLEN_GROUP)


def axis_buckets(axis: LengthAxis, lengths: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS) -> tuple[int, ...]:
    """The sequence buckets of `lengths` below the axis's limit, then the limit."""
    return tuple(b for b in lengths if b < axis.limit) + (axis.limit,)


def varlen_settings(entry: ModelSpec, values: parameters.Values) -> VarLenSettings:
    """VarLenSettings from a variable-length model's parameters (`parameters.parse`),
    checked against the model's axes and inputs."""
    given = values.family("length_buckets")
    names = [axis.name for axis in entry.lengths]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"parameter length_buckets.{unknown[0]} names no variable axis of the model; its axes: {', '.join(names)}")
    axes = []
    for axis in entry.lengths:
        buckets = given.get(axis.name) or axis_buckets(axis)
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] != axis.limit:
            raise ValueError(f"parameter length_buckets.{axis.name} must ascend from 1 or more to the axis's limit {axis.limit}, got {parameters.show(buckets)!r}")
        axes.append(buckets)
    declared = values.family("max_length")
    limits = {name: axis.limit for axis in entry.lengths for name in axis.inputs}
    for name in sorted(set(declared) | set(limits)):
        if name not in limits:
            raise ValueError(f"parameter max_length.{name} names no variable-length input of the model; they are: {', '.join(limits)}")
        if declared.get(name) != limits[name]:
            shown = "not set" if name not in declared else repr(str(declared[name]))
            raise ValueError(f"parameter max_length.{name} is {shown}, the model's is '{limits[name]}'")
    return VarLenSettings(tuple(axes), **values.settings(parameters.VARLEN_GROUP))


def check_config(entry: ModelSpec, config: dict) -> None:
    """Inputs and outputs as the model spec's, with -1 on every variable axis."""
    variable = {n: -1 for axis in entry.lengths for n in axis.inputs}
    leading = {n: 0 for axis in entry.lengths for n in axis.outputs}
    for kind, specs in (("input", entry.inputs), ("output", entry.outputs)):
        declared = {t["name"]: t for t in config.get(kind, [])}
        if sorted(declared) != sorted(s.name for s in specs):
            raise ValueError(f"config {kind}s {sorted(declared)} differ from the model's {[s.name for s in specs]}")
        for spec in specs:
            shape = list(spec.shape)
            if spec.name in variable:
                shape[-1] = -1
            if spec.name in leading:
                shape[0] = -1
            tensor = declared[spec.name]
            dims = [int(d) for d in tensor["dims"]]
            if dims != shape or tensor["data_type"] != TRITON_DTYPES[spec.dtype]:
                raise ValueError(f"config {kind} {spec.name!r} is {tensor['data_type']} {dims}, the model needs {TRITON_DTYPES[spec.dtype]} {shape}")


def request_lengths(entry: ModelSpec, tensors: dict[str, torch.Tensor | None]) -> tuple[int, ...]:
    """A request's length on each variable axis; a RequestError names the input
    whose length is out of range or disagrees with the others on its axis."""
    lengths = []
    for axis in entry.lengths:
        found: dict[str, int] = {n: tensors[n].shape[-1] for n in axis.inputs if tensors.get(n) is not None and tensors[n].ndim == 2}
        if not found:
            lengths.append(1)  # a missing or misshapen input: request_tensors names it
            continue
        for name, length in found.items():
            if not 1 <= length <= axis.limit:
                raise RequestError(f"input {name!r} has length {length}; the model takes 1 to {axis.limit} tokens")
        if len(set(found.values())) > 1:
            raise RequestError(f"inputs {sorted(found)} have different lengths {sorted(found.values())}; they must be equal")
        lengths.append(next(iter(found.values())))
    return tuple(lengths)


@dataclass
class VarLenRequest:
    """One checked request: its lengths, its inputs in model order, its scheduler."""

    lengths: tuple[int, ...]
    tensors: list[torch.Tensor]
    scheduler: str

    @property
    def rows(self) -> int:
        return self.tensors[0].shape[0]


def check_request(entry: ModelSpec, tensors: dict[str, torch.Tensor | None], scheduler: str) -> VarLenRequest:
    lengths = request_lengths(entry, tensors)
    return VarLenRequest(lengths, request_tensors(_at(entry, lengths), tensors), scheduler)


def dynamic_dims(entry: ModelSpec, max_batch: int) -> DynamicDims:
    """Per input, the dimensions a request may vary: the batch, and the length of
    each variable axis the input is on (what the exported whole-model graph must allow)."""
    dims = []
    for spec in entry.inputs:
        dim = {0: ("batch", 1, max_batch)}
        dim.update({len(spec.shape): (axis.name, 1, axis.limit) for axis in entry.lengths if spec.name in axis.inputs})
        dims.append(dim)
    return dims


def export_example(entry: ModelSpec, device: torch.device) -> list[torch.Tensor]:
    """Inputs to export with: no size 1 and no two sizes alike (export would
    specialise or tie them), within every axis's limit."""
    lengths = tuple(max(min(axis.limit, 24 - 4 * k), 2) for k, axis in enumerate(entry.lengths))
    return [t.to(device) for t in entry.at(lengths).example_inputs(3)]


@functools.lru_cache(maxsize=4096)
def _at(entry: ModelSpec, lengths: tuple[int, ...]) -> ModelSpec:
    """`entry.at(lengths)`, once per length (it took about a third of a request's check)."""
    return entry.at(lengths)


def modelled_seconds(shape: tuple[int, ...], batch: int) -> float:
    """The cost model for runners that were not timed: padded tokens, with
    attention's share growing with length, plus a fixed overhead (relative
    units; only the ratios matter to the scheduler)."""
    return (OVERHEAD_TOKENS + batch * sum(n * (1 + n / ATTENTION_SPAN) for n in shape)) * 1e-6


@dataclass
class VarLenReport:
    """What was built, what it cost and the scheduler's cost table."""

    runner: str = "eager"
    capture: str = "load"
    scheduler: str = "dp"
    compiler: str = "saved"
    compiler_fallback: str = ""  # why no shape could use the whole-model graph
    whole_model: str = ""  # what the saved whole-model compile did (compiled or loaded, seconds)
    shapes: dict[tuple[int, ...], BuildReport] = field(default_factory=dict)
    build_seconds: dict[tuple[int, ...], float] = field(default_factory=dict)
    memory_bytes: dict[tuple[int, ...], int] = field(default_factory=dict)  # device memory reserved by each shape's build
    pool_bytes: int = 0  # the shared graph pool's segments
    graph_bytes: dict[tuple[tuple[int, ...], int], int] = field(default_factory=dict)  # (shape, batch) -> its capture's own peak
    costs: CostTable | None = None
    measured: set[tuple[int, ...]] = field(default_factory=set)  # shapes whose costs are replay timings
    stored: set[tuple[int, ...]] = field(default_factory=set)  # shapes not built yet, costed by an earlier start's timings

    @property
    def choices(self) -> dict[tuple[int, ...], str]:
        """What each shape built (the model's ready line counts them as a batch model's buckets)."""
        return {shape: report.runner for shape, report in self.shapes.items()}

    @property
    def precision(self) -> str:
        """What the shapes compute in (engine.precision), "+"-joined where they differ."""
        return "+".join(sorted({report.precision for report in self.shapes.values()})) or "fp32"

    @property
    def precision_error(self) -> dict[str, float]:
        """`shape x batch` -> max relative error against the fp32 module, where one was measured."""
        return {f"{_label(s)}x{b}": e for s, report in self.shapes.items() for b, e in report.precision_error.items()}

    @property
    def fallbacks(self) -> list[str]:
        # the reason first: the metrics label a fallback by the text before its first colon
        shapes = [f"{reason} (shape {_label(s)})" for s, report in self.shapes.items() for reason in report.fallbacks]
        return [self.compiler_fallback, *shapes] if self.compiler_fallback else shapes

    def summary(self) -> str:
        lines = [f"variable lengths: runner {self.runner}, compiler {self.compiler}, capture {self.capture}, scheduler {self.scheduler}"]
        lines += [f"fallback: {self.compiler_fallback}"] if self.compiler_fallback else []
        lines += [self.whole_model] if self.whole_model else []
        for shape, report in sorted(self.shapes.items()):
            memory = f", {self.memory_bytes[shape] / 2**20:.0f} MiB" if shape in self.memory_bytes else ""
            lines.append(f"shape {_label(shape)}: {report.runner}, built in {self.build_seconds.get(shape, 0):.1f} s{memory}")
            if report.choices or report.fallbacks:  # the precision's line comes once, for every shape, below
                lines += ["  " + line for line in report.summary().splitlines()[1:] if not line.startswith("precision ")]
        accuracies = {(shape, batch): a for shape, report in self.shapes.items() for batch, a in report.precision_error.items()}
        if accuracies:
            lines.append(f"precision {self.precision}: " + precision.describe(accuracies))
        elif self.precision != precision.FP32:
            lines.append(f"precision {self.precision}")
        if self.memory_bytes:
            lines.append(f"device memory reserved by the shapes' builds: {sum(self.memory_bytes.values()) / 2**20:.0f} MiB "
                         f"(largest shape {max(self.memory_bytes.values()) / 2**20:.0f} MiB)")
        if self.graph_bytes:
            largest = max(self.graph_bytes, key=self.graph_bytes.get)
            lines.append(
                f"graph pool, shared by {len(self.graph_bytes)} graphs: {self.pool_bytes / 2**20:.0f} MiB; "
                f"their own peaks sum to {sum(self.graph_bytes.values()) / 2**20:.0f} MiB, the largest "
                f"({_label(largest[0])}x{largest[1]}) {self.graph_bytes[largest] / 2**20:.0f} MiB: "
                f"pool / largest {self.pool_bytes / max(self.graph_bytes[largest], 1):.2f}"
            )
        if self.costs is not None:
            lines.append(
                "cost table, ms per run (m: measured replays, s: an earlier start's replays, c: token-count model; "
                "a run takes the cheapest cell that holds it):"
            )
            lines.append("shape \\ batch " + " ".join(f"{b:>8}" for b in self.costs.batches))
            for shape in self.costs.shapes():
                tag = "m" if shape in self.measured else "s" if shape in self.stored else "c"
                cells = " ".join(f"{self.costs.seconds[(shape, b)] * 1e3:8.3f}" for b in self.costs.batches)
                lines.append(f"{_label(shape):>11} {tag} {cells}")
        return "\n".join(lines)


def _label(shape: tuple[int, ...]) -> str:
    return ",".join(map(str, shape))


class VarLenRunners:
    """The shape buckets' runners, the cost table and the scheduler: runs the
    rows of several variable-length requests and returns each request's outputs
    at its own lengths. Follows enough of the Runner protocol for the metrics
    (`info`, `batches` keyed by "shape x batch", `padded_rows`).

    On a GPU every shape's graphs are captured into one memory pool (largest
    shape first, so the smaller ones fit in the blocks it freed): sub-batches
    replay one after another on one stream, under one lock, and each one's
    outputs are copied off (queued on that stream) before the next replays:
    one copy per output and sub-batch, its real rows up to their longest length,
    into a pinned buffer whose views are the requests' outputs.
    The sub-batches of one `run` are queued without waiting for each other;
    then `run` waits for them in turn, and hands each request's outputs over
    (`answered`) as soon as its last sub-batch has landed, while the later ones
    still run: the adapter builds that request's response then, not after the
    last replay. The whole-model graph's cells read their
    inputs from a pinned host buffer that the graph copies up itself
    (`engine.runtime.PackedInputs`): a sub-batch's rows are padded straight
    into it, and the replay is the first thing sent to the GPU.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        entry: ModelSpec,
        device: torch.device,
        settings: EngineSettings,
        varlen: VarLenSettings,
    ):
        self.module, self.entry, self.device = module, entry, device
        self.engine_settings = settings
        # the whole-model graph computes in this precision (the engine's builds choose their own, the same way)
        self.precision = precision.on_device(settings.precision, device)[0]
        served = precision.cast(module, entry, self.precision)
        self.max_batch = max(settings.buckets)
        self.report = VarLenReport(capture=varlen.capture, scheduler=varlen.scheduler, compiler=varlen.compiler)
        self.inductor_cache = ""
        self.runners: dict[tuple[int, ...], Runner] = {}
        self.batches: Counter[str] = Counter()
        self.padded_rows = 0
        self._lock = threading.Lock()
        self._cuda = device.type == "cuda"
        self.pool = GraphPool.new(device) if self._cuda else None
        self.whole_model = self._whole_model(served, varlen.compiler)
        # from here it captures its shapes and times their replays: the GPU turn (engine.gpu_turn), taken
        # only now, so that casting the module and loading its saved artifact never wait for other builds
        gpu_turn.take()
        self._inputs = {shape: entry.at(shape).inputs for shape in batching.grid(varlen.axes)}
        self._along = {n: a for a, axis in enumerate(entry.lengths) for n in axis.outputs}
        self._axes, self._batches = varlen.axes, tuple(sorted(settings.buckets))
        self._modelled = {(s, b): modelled_seconds(s, b) for s in batching.grid(varlen.axes) for b in self._batches}
        self._measured: dict[tuple[tuple[int, ...], int], float] = {}
        # timings of every cell from an earlier start that built every shape (serving.varlen_costs)
        self._costs_key = varlen_costs.costs_key(entry.name, served, varlen.compiler, varlen.axes, self._batches, device)
        self._stored = varlen_costs.load(self._costs_key)
        self._packed: dict[tuple[tuple[int, ...], int], PackedInputs] = {}  # cells of the whole-model graph
        self._events: list[torch.cuda.Event] = []  # see _landed
        # "load": every shape, largest first (the smaller ones fit in the blocks it freed);
        # "first_use": the smallest only, so that the compile happens at load, not in a request
        shapes = batching.grid(varlen.axes)
        self._largest = shapes[-1]
        for shape in reversed(shapes) if varlen.capture == "load" else shapes[:1]:
            self._measured.update(self._build(shape))
        self._set_costs()
        kinds = {r.info.kind for r in self.runners.values()} or {"eager" if device.type != "cuda" else "cuda-graph"}
        self.report.runner = "+".join(sorted(kinds))
        self.info = RunnerInfo(self.report.runner, str(device), self._batches)

    def _whole_model(self, module: torch.nn.Module, compiler: str) -> WholeModelSaved | None:
        """The model compiled once for every shape (compiler "saved", on a GPU)."""
        if not self._cuda or compiler == "engine":
            return None
        start = time.perf_counter()
        try:
            self.inductor_cache = str(use_inductor_cache(self.engine_settings.inductor_cache))
            module = module.to(self.device).eval()
            with precision.numerics(self.precision):
                kept = WholeModelSaved(module, export_example(self.entry, self.device), dynamic_dims(self.entry, self.max_batch), cache.directory(compiler))
        except Exception as error:  # noqa: BLE001 - an unwritable cache, export and compile errors: the engine's builds still serve
            self.report.compiler_fallback = f"{WholeModelSaved.label}: {type(error).__name__}: {error}"
            log.warning("%s; building every shape with the engine instead", self.report.compiler_fallback)
            return None
        done = "compiled" if kept.compiled_now else "loaded"
        self.report.whole_model = f"{WholeModelSaved.label} {done} in {time.perf_counter() - start:.1f} s: {kept.path}"
        log.info("%s", self.report.whole_model)
        return kept

    def _build(self, shape: tuple[int, ...]) -> dict[tuple[tuple[int, ...], int], float]:
        """Build the runner of one shape; its replay timings, where it has graphs."""
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device) if self._cuda else 0
        runner, report = self._whole_model_runner(shape) if self.whole_model is not None else (None, BuildReport())
        if runner is None:
            runner, engine_report = build_runner(self.module, self.entry.at(shape), self.device, self.max_batch, self.engine_settings, self.pool)
            engine_report.fallbacks[:0] = report.fallbacks
            report = engine_report
        self.runners[shape], self.report.shapes[shape] = runner, report
        self.report.build_seconds[shape] = time.perf_counter() - start
        timings = {}
        if self._cuda:
            torch.cuda.empty_cache()  # the pools of the candidates auto timed and dropped
            self.report.memory_bytes[shape] = torch.cuda.memory_reserved(self.device) - reserved
        if isinstance(runner, GraphRunner):
            timings = {(shape, b): time_replays(graph, **COST_TIMING) * 1e-3 for b, graph in runner.graphs.items()}
            self.report.measured.add(shape)
            self.report.graph_bytes.update({(shape, b): graph.peak_bytes for b, graph in runner.graphs.items()})
            self.report.pool_bytes = round(pool_mb(self.pool.handle) * 2**20)
        log.info("shape %s built in %.1f s (%s)", _label(shape), self.report.build_seconds[shape], report.runner)
        return timings

    def _whole_model_runner(self, shape: tuple[int, ...]) -> tuple[GraphRunner | None, BuildReport]:
        """The shape's graphs captured from the whole-model graph (the saved artifact), largest
        batch first, each checked against the eager model; None (and the reason
        in the report's fallbacks) if a capture or a check fails."""
        entry, settings = self.entry.at(shape), self.engine_settings
        label = self.whole_model.label
        report = BuildReport(runner=label, inductor=self.inductor_cache, precision=self.precision)
        start = time.perf_counter()
        packed = {b: PackedInputs(entry.inputs, b, self.device) for b in settings.buckets} if PackedInputs.fits(entry.inputs) else {}
        try:
            with precision.numerics(self.precision):
                graphs = {b: self._capture(entry, b, packed.get(b)) for b in sorted(settings.buckets, reverse=True)}
            runner = GraphRunner(graphs, entry.inputs, entry.outputs, self.device, self.max_batch)
            if settings.guard and self.precision != precision.FP32:  # against the module as written
                reference, at = self.module.to(self.device).eval(), dataclasses.replace(settings, precision=self.precision)
                report.precision_error = check_against_fp32(runner, self.whole_model.module, reference, entry, sorted(graphs), at, rows=True)
            elif settings.guard:
                check_rows_against_eager(runner, self.whole_model.module, sorted(graphs), entry, settings.fused_tolerance)
        except (CaptureError, GuardError, RuntimeError) as error:
            report.fallbacks.append(f"{label}: {error}")
            log.warning("shape %s: %s failed, building it with the engine instead: %s", _label(shape), label, error)
            return None, report
        report.choices = dict.fromkeys(sorted(graphs), label)
        report.seconds["capture" + (" and check" if settings.guard else "")] = time.perf_counter() - start
        self._packed.update({(shape, b): inputs for b, inputs in packed.items()})
        return runner, report

    def _capture(self, entry: ModelSpec, batch: int, packed: PackedInputs | None) -> CapturedGraph:
        """One cell's graph from the whole-model graph; with packed inputs, the
        graph copies them up itself and its inputs are the pinned host views."""
        if packed is None:
            return self.whole_model.capture(static_inputs(entry, batch, self.device), self.pool.handle)
        for view, spec in zip(packed.refill(), entry.inputs):
            view.copy_(spec.random(batch))  # valid values for the warm-up runs
        captured = self.whole_model.capture(packed.device_inputs, self.pool.handle, prologue=packed.copy_up)
        return dataclasses.replace(captured, inputs=tuple(packed.host_inputs))

    def _set_costs(self) -> None:
        """The cost table: replay timings where a shape has graphs; elsewhere (not
        built yet, or a fallback to eager) an earlier start's timings where one
        stored them, else the token-count model, in the timed cells' units. A
        start that timed every cell stores them."""
        seconds = self._modelled
        known = {cell: self._stored[cell] for cell in seconds if cell in self._stored and cell not in self._measured}
        self.report.stored = {shape for shape, _ in known} - self.report.measured
        known.update(self._measured)
        if known:
            scale = statistics.median(ms / seconds[cell] for cell, ms in known.items())
            seconds = {cell: known.get(cell, modelled * scale) for cell, modelled in seconds.items()}
            # a cell not timed yet costs at least what a timed cell it holds costs at that batch: the
            # scaled model made BERT's unbuilt (32, 1) cheaper than its timed (16, 1) on an H100, so a
            # lone 16-token request built shape 32 on first use and ran there
            for (shape, batch), cost in list(seconds.items()):
                if (shape, batch) not in known:
                    held = [ms for (s, b), ms in known.items() if b == batch and all(x <= y for x, y in zip(s, shape))]
                    seconds[(shape, batch)] = max([cost, *held])
        if self._measured.keys() == self._modelled.keys() and self._measured != self._stored:
            try:
                varlen_costs.store(self._costs_key, self._measured)
            except OSError as error:  # an unwritable cache: this start serves all the same
                log.warning("could not keep the cost table: %s", error)
            self._stored = dict(self._measured)
        self.costs = self.report.costs = CostTable(self._axes, self._batches, seconds)

    def runner_for(self, shape: tuple[int, ...]) -> Runner:
        if shape not in self.runners:  # capture "first_use": from now on the scheduler plans with its timings
            # the largest shape first, as "load" builds them: every later shape's graphs then fit in the
            # blocks its captures freed (T5's 144 graphs built in traffic order held 1,492-1,544 MiB, run 13;
            # with the largest first 1,288 MiB, as at load: docs/benchmarks.md variable lengths run 14)
            for needed in dict.fromkeys((self._largest, shape)):
                if needed not in self.runners:
                    self._measured.update(self._build(needed))
            self._set_costs()
        return self.runners[shape]

    def run(
        self,
        requests: list[VarLenRequest],
        queued: Callable[[], None] | None = None,
        answered: Callable[[int, list[torch.Tensor]], None] | None = None,
    ) -> list[list[torch.Tensor]]:
        """Each request's outputs (host tensors), rows at the request's own
        lengths. `queued` is called once every sub-batch is queued on the GPU,
        before the wait for them (the adapter's stage clock); `answered(k,
        outputs)` once request k's outputs are on the host, in the order the
        sub-batches ran, while later sub-batches may still be running."""
        rows = [(k, r) for k, request in enumerate(requests) for r in range(request.rows)]
        results: list[list[torch.Tensor]] = [[] for _ in requests]
        left = [request.rows for request in requests]
        with self._lock:
            landings = []
            for name in sorted({request.scheduler for request in requests}):
                chosen = [row for row in rows if requests[row[0]].scheduler == name]
                for group in batching.SCHEDULERS[name]([requests[k].lengths for k, _ in chosen], self.costs):
                    landings.append(self._run_group(group, [chosen[i] for i in group.items], requests, len(landings)))
            if queued is not None:
                queued()
            for landing in landings:
                for q, r, outputs in landing.rows():
                    _place(results, requests[q], q, r, outputs)
                    left[q] -= 1
                    if left[q] == 0 and answered is not None:
                        answered(q, results[q])
        return results

    def _run_group(self, group: batching.Group, members: list[tuple[int, int]], requests: list[VarLenRequest], index: int) -> _Landing:
        """Pad the group's rows to its cell (shape, and batch for graphs), run
        them, queue the copy of their outputs to the host; what will land where."""
        runner = self.runner_for(group.shape)
        packed = self._packed.get((group.shape, group.batch))
        size = group.batch if isinstance(runner, GraphRunner) else len(members)  # eager runs the rows as they are
        if packed is not None:  # the rows straight into the cell's pinned buffer; its graph copies them up
            _pad_into(packed.refill(), members, requests)
            captured = runner.graphs[size]
            captured.replay()
            packed.replayed()
            outputs = captured.outputs
        else:  # on the host, from where a graph runner copies them through its staging into its graph's inputs
            inputs = [torch.zeros((size, *spec.shape), dtype=spec.dtype) for spec in self._inputs[group.shape]]
            _pad_into(inputs, members, requests)
            outputs = runner.run(inputs, outputs_on_device=True)
        self.batches[f"{_label(group.shape)}x{size}"] += 1
        self.padded_rows += size - len(members)
        # before another graph of the pool replays (its intermediates may lie where these
        # outputs are): the real rows, up to the longest of them, in one copy per output
        hosts = []
        for spec, out in zip(self.entry.outputs, outputs):
            part = out[: len(members)]
            if spec.name in self._along:
                part = part[:, : max(requests[q].lengths[self._along[spec.name]] for q, _ in members)]
            if self._cuda:
                host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
                host.copy_(part, non_blocking=True)  # a strided part goes through one gather on the GPU first
                part = host
            hosts.append(part)
        done = self._landed(index) if self._cuda else None
        rows = [(q, r, [self._cut(spec, host[i], requests[q]) for spec, host in zip(self.entry.outputs, hosts)]) for i, (q, r) in enumerate(members)]
        return _Landing(done, rows)

    def _landed(self, index: int) -> torch.cuda.Event:
        """The event of a run's index-th sub-batch, recorded after its copies; one set
        serves every run (`run` waits for them all before it returns)."""
        while len(self._events) <= index:
            self._events.append(torch.cuda.Event())
        self._events[index].record()
        return self._events[index]

    def _cut(self, spec: TensorSpec, row: torch.Tensor, request: VarLenRequest) -> torch.Tensor:
        """One row's output at the request's own length (a view)."""
        return row[: request.lengths[self._along[spec.name]]] if spec.name in self._along else row


@dataclass(frozen=True)
class _Landing:
    """A sub-batch's outputs on their way to the host: each member row's
    (request, row, outputs), readable once `done` (None: already there)."""

    done: torch.cuda.Event | None
    members: list[tuple[int, int, list[torch.Tensor]]]

    def rows(self) -> list[tuple[int, int, list[torch.Tensor]]]:
        if self.done is not None:
            self.done.synchronize()
        return self.members


def _place(results: list[list[torch.Tensor]], request: VarLenRequest, q: int, r: int, row: list[torch.Tensor]) -> None:
    """Row r of request q into `results`: a one-row request's outputs are views
    of its sub-batch's host buffer; rows of a larger one are copied together."""
    if request.rows == 1:
        results[q] = [out.unsqueeze(0) for out in row]
        return
    if not results[q]:
        results[q] = [torch.empty((request.rows, *out.shape), dtype=out.dtype) for out in row]
    for target, out in zip(results[q], row):
        target[r].copy_(out)


def _pad_into(batch: list[torch.Tensor], members: list[tuple[int, int]], requests: list[VarLenRequest]) -> None:
    """Each member row (request, row) at the head of its row of the zeroed `batch`,
    one tensor per input (zeros: valid ids, and masks that hide the padding)."""
    for k, inputs in enumerate(batch):
        for i, (q, r) in enumerate(members):
            row = requests[q].tensors[k][r]
            inputs[i, ..., : row.shape[-1]] = row


def request_scheduler(request, default: str) -> str:
    """The scheduler a request asks for with its parameter `scheduler`, else the default."""
    try:
        parameters = request.parameters()
        if parameters in ("", "{}"):  # most requests: no json.loads on a request's time
            return default
        asked = json.loads(parameters).get("scheduler", default)
    except (AttributeError, ValueError):
        return default
    if asked not in batching.SCHEDULERS:
        raise RequestError(f"parameter 'scheduler' is {asked!r}; known: {', '.join(batching.SCHEDULERS)}")
    return asked


def on_host(arrived: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The inputs of an execute's requests on the host: every one on a GPU
    queued first, then one wait per device for the lot (`.cpu()` on each
    waits once per input, and a wait per request would be one per request)."""
    devices = [tensor.device for tensors in arrived for tensor in tensors.values() if tensor.is_cuda]
    if not devices:
        return arrived
    copies = [{name: tensor.to("cpu", non_blocking=True) for name, tensor in tensors.items()} for tensors in arrived]
    for device in dict.fromkeys(devices):
        torch.cuda.current_stream(device).synchronize()
    return copies


class VarLenModel(OparaModel):
    """The adapter for models with variable sequence axes (model.py of bert, t5)."""

    PARAMETER_KIND = parameters.VARLEN

    def _check_config(self, config: dict, values: parameters.Values) -> None:
        check_config(self.entry, config)
        self.varlen = varlen_settings(self.entry, values)

    def _build(self, module: torch.nn.Module, settings: EngineSettings, config: dict):
        runners = VarLenRunners(module, self.entry, self.device, settings, self.varlen)
        return runners, runners.report

    def _arrived(self, arrived: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        return on_host(arrived)  # ids from CUDA shared memory come on the GPU; lengths and ranges are checked on the host

    def _request(self, request, tensors: dict[str, torch.Tensor]) -> VarLenRequest:
        return check_request(self.entry, tensors, request_scheduler(request, self.varlen.scheduler))

    def _in_graph(self, module: torch.nn.Module) -> tuple[torch.nn.Module, ModelSpec]:
        return module, self.entry  # _request checks each request's ids against its own length

    def _place(self, good: list) -> bool:
        return False  # the requests were brought to the host by _arrived; the runners copy them up

    def _run(self, good: list[tuple[int, VarLenRequest]], on_device: bool = False) -> list:
        # stage: schedule, pad, queue every sub-batch (copy up, replay, copy back); then, sub-batch
        # by sub-batch, run: wait for its outputs, respond: its requests' responses, while the
        # later sub-batches still run on the GPU
        clock = self.metrics.clock
        responses: list = [None] * len(good)

        def answered(k: int, outputs: list[torch.Tensor]) -> None:
            clock.lap("run")
            responses[k] = self._response([tensor.contiguous() for tensor in outputs])
            clock.lap("respond")

        self.runner.run([request for _, request in good], queued=lambda: clock.lap("stage"), answered=answered)
        return responses
