"""From a module to the fastest runner that is still right.

On a GPU: trace the module, plan it, capture one CUDA graph per batch bucket
(with `auto`, the fastest of several captured plans per bucket, never slower
than the sequential graph of the same traced graph), and check a replay against
eager. The candidates run ATen kernels in NCHW or NHWC, or are fused lanes
(`engine.fused_lanes`: each segment of a plan compiled by Inductor). Any
failure falls back, with the reason logged and kept in the runner's info:
multi-stream graph -> sequential graph -> eager. On a CPU: eager.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import torch

from opara_core import parameters
from opara_core.engine import cache, choices, gpu_turn, heap, precision, runtime, trace_cache
from opara_core.engine.capture import CapturedGraph, CaptureError, GraphPool, LanePool, PlanCapture, capture_module, time_replays, time_served
from opara_core.engine.interpreter import reordered_graph
from opara_core.engine.fused_lanes import InductorCapture, prepare_captures
from opara_core.engine.inductor_cache import use_inductor_cache
from opara_core.engine.segment_compiler import CompileCount
from opara_core.engine.fusion import CONV, CONV_ADD_RELU, CONV_RELU, FusionReport, fuse_graph
from opara_core.engine.compare import max_relative_error, no_cudnn_autotuning
from opara_core.engine.trace import OpGraph, trace_model
from opara_core.engine.interpreter import plan_graph
from opara_core.engine.profile import apply_profile, profile_graph
from opara_core.planning.plan import Plan
from opara_core.spec import ModelSpec

log = logging.getLogger(__name__)

# What `auto` captures and times at the smallest bucket, per layout; larger
# buckets re-time only the best few of the bucket before, plus the sequential graph.
AUTO_CANDIDATES: tuple[tuple[str, int], ...] = (
    ("opara", 8),
    ("nimble", 8),
    ("asap", 4),
    ("asap", 8),
    ("wavefront", 8),
)
AUTO_KEEP = 3
# A traced graph (a layout's ATen graph, or a fused-lanes graph) none of whose
# candidates came within this factor of a bucket's fastest is not captured at the
# larger buckets. Its lead does not turn between two batch sizes: on a GPU with fused
# lanes the ATen graphs lost by 1.4-2.2x at batch 1 and were picked at no batch (the
# shipped repository in bf16 on an H100, 2026-12-06: NASNet's NHWC graph 1.43x at 1 and
# 1.52-1.89x at 2-32, its NCHW graph 1.95x, then 3.4-3.5x; every pick in the tables of
# docs/benchmarks.md is fused), and each capture costs a cold build about a second
# (NASNet's larger buckets captured six candidates in 6.0-6.4 s each).
AUTO_DROP = 1.5
# Fused lanes: the plans auto tries with Inductor-compiled segments (sequential
# is one segment, i.e. torch.compile of the whole graph). On an H100 the
# policies were within 2% of each other with Inductor (docs/benchmarks.md).
# `side` cuts a transformer into a few segments where opara cuts it into
# hundreds: T5-small bf16 at batch 8 (H100, 2026-12-07) replayed 0.789 ms
# with side/2 against 0.830 sequential and 0.911 opara/8 (at batch 1 0.611
# against 0.597: sequential kept).
FUSED_CANDIDATES: tuple[tuple[str, int], ...] = (("opara", 8), ("side", 8))
# The graph Inductor compiles: the project's rewrites that Inductor does not
# do itself; cuDNN's fused convolution ops would hide the convolutions from it.
# Inductor merges linear layers only with freezing, which lifted weights rule out;
# it keeps a linear layer with one output a GEMM (fusion.single_column_linears),
# and runs cuBLAS's fp32 GEMMs of few rows, which skinny_linears replaces where measured faster.
# depthwise_convs does the same for depthwise convolutions against cuDNN: on NASNet
# (H200, 2026-11-28, docs/benchmarks.md run 26) auto replayed 8.02 -> 7.53 ms at
# batch 8 with it and the same at 32 (25.0 ms both); at batch 1, 1.736 ms with it
# (run 27) against 1.799 without (run 23, another H200).
INDUCTOR_PASSES = ("drop_identities", "cse", "fold_batchnorm", "merge_linears", "single_column_linears", "skinny_linears", "depthwise_convs")
# A second fused-lanes graph for convolutional models: cuDNN's conv + ReLU as one
# library call, so that no segment launches a bias-and-ReLU kernel of its own
# after a convolution. On Inception-v3 (H200, docs/benchmarks.md run 22) its
# opara plan replayed faster (0.561 -> 0.501 ms at batch 1, 1.460 -> 1.353 at 8)
# and its single segment slower (0.859 -> 1.038, 1.762 -> 2.157): it is
# offered with FUSED_CANDIDATES only, never as the one-segment graph. It also
# joins a residual add and its ReLU into the convolution (conv_add_relu): on
# ResNet-50 (H200, 2026-11-28, docs/benchmarks.md run 24) its opara plan replayed
# 2.41 -> 2.02 ms at batch 32, the same within 1.5% at 1 and 8.
# Made from the `inductor` graph, with only the passes it lacks (_fused_lanes_graphs).
INDUCTOR_CUDNN_PASSES = (*INDUCTOR_PASSES, "conv_add_relu", "conv_relu")
FUSION_TOLERANCE = 1e-4  # a rewrite against the graph it rewrites, in fp32 (engine.fusion.fuse_graph)
ATEN_GRAPHS = ("nchw", "nhwc")  # graphs of ATen kernels, one per layout
FUSED_BASES = ("inductor", "inductor-cudnn")  # the graphs fused lanes compile
# `fused_lanes_autotune`: each also as `<name>-timed`, the same graph whose fused
# lanes' convolutions take cuDNN's timed algorithms instead of its heuristics'
# (neither wins everywhere: timed, Inception-v3 bf16 at batch 8 0.930 ms against
# 1.129, ResNet-50 bf16 at batch 1 0.419 against 0.389; H200, 2026-12-03)
TIMED = "-timed"
FUSED_GRAPHS = (*FUSED_BASES, *(name + TIMED for name in FUSED_BASES))  # graphs whose candidates are fused lanes


def base_graph(name: str) -> str:
    """The graph a `-timed` graph is (itself for the others)."""
    return name.removesuffix(TIMED)


def fusion_checks_dir() -> Path:
    """Where passed fusion checks are remembered (fusion.fuse_graph's `cache`; engine.cache)."""
    return cache.directory("fusion")


_DEFAULT = parameters.defaults(parameters.ENGINE)


@dataclass(frozen=True)
class EngineSettings:
    """How a model is compiled; each field is the config.pbtxt parameter of its
    name, declared (type, default, allowed values, help) in opara_core.parameters
    and checked there: fields and declarations are one list (tests/test_parameters.py)."""

    policy: str = _DEFAULT["policy"]  # "auto", or one of planning.policies
    max_streams: int = _DEFAULT["max_streams"]
    buckets: tuple[int, ...] = _DEFAULT["buckets"]
    guard: bool = _DEFAULT["guard"]
    guard_tolerance: float = _DEFAULT["guard_tolerance"]
    precision: str = _DEFAULT["precision"]  # engine.precision
    precision_tolerance: float | str = _DEFAULT["precision_tolerance"]
    fusion: bool = _DEFAULT["fusion"]
    layout: str = _DEFAULT["layout"]
    autotune: bool = _DEFAULT["autotune"]
    fused_lanes: bool = _DEFAULT["fused_lanes"]
    fused_lanes_autotune: bool = _DEFAULT["fused_lanes_autotune"]
    remember_choices: bool = _DEFAULT["remember_choices"]
    profile: bool = _DEFAULT["profile"]
    inductor_cache: str = _DEFAULT["inductor_cache"]
    fused_tolerance: float = _DEFAULT["fused_tolerance"]

    def __post_init__(self) -> None:
        parameters.check_fields(self, parameters.ENGINE)


@dataclass(frozen=True, order=True)
class Candidate:
    """One way to capture the model: which traced graph (ATen kernels in the
    `nchw` or `nhwc` layout, or fused lanes: `inductor`, `inductor-cudnn`)
    and a policy with its lanes. Shown as `graph:policy/lanes` in reports."""

    graph: str
    policy: str
    lanes: int

    def __str__(self) -> str:
        return f"{self.graph}:{self.policy}/{self.lanes}"

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """The candidate `str` shows as `text` ("graph:policy/lanes")."""
        graph, rest = text.split(":")
        policy, lanes = rest.split("/")
        return cls(graph, policy, int(lanes))

    @property
    def sequential(self) -> bool:
        return self.policy == "sequential"

    @property
    def fused(self) -> bool:
        """Fused lanes: segments compiled by Inductor."""
        return self.graph in FUSED_GRAPHS

    @property
    def timed(self) -> bool:
        """Fused lanes whose convolutions take cuDNN's timed algorithms."""
        return self.fused and self.graph.endswith(TIMED)


@dataclass
class BuildReport:
    """What was built and why: shown in logs, plan summaries and metrics."""

    runner: str = "eager"
    choices: dict[int, Candidate | str] = field(default_factory=dict)  # bucket -> candidate ("module" when untraced)
    timings_ms: dict[int, dict[Candidate, float]] = field(default_factory=dict)  # bucket -> candidate -> median ms
    served_ms: dict[int, float] = field(default_factory=dict)  # bucket -> median ms of the runner's graph as a request runs it
    fallbacks: list[str] = field(default_factory=list)
    remembered: bool = False  # the choices came from an earlier build (engine.choices)
    seconds: dict[str, float] = field(default_factory=dict)
    fusion: FusionReport | None = None  # of the traced graph (both layouts share it)
    inductor: str = ""  # fused lanes: the cache directory and what this build loaded and compiled
    precision: str = "fp32"  # what the runner computes in (engine.precision)
    precision_error: dict[int, precision.Accuracy] = field(default_factory=dict)  # bucket -> against the fp32 module

    def summary(self) -> str:
        lines = [f"runner {self.runner}"]
        if self.precision_error:
            lines.append(f"precision {self.precision}: " + precision.describe(self.precision_error))
        elif self.precision != "fp32":
            lines.append(f"precision {self.precision}")
        lines += [f"fusion: {self.fusion}"] if self.fusion else []
        lines += [f"inductor cache: {self.inductor}"] if self.inductor else []
        lines += ["choices: remembered from an earlier build"] if self.remembered else []
        for bucket, choice in sorted(self.choices.items()):
            times = ", ".join(f"{k} {v:.3f}" for k, v in sorted(self.timings_ms.get(bucket, {}).items(), key=lambda kv: kv[1]))
            served = f" served {self.served_ms[bucket]:.3f} ms" if bucket in self.served_ms else ""
            lines.append(f"bucket {bucket}: {choice}{served}" + (f" (median ms: {times})" if times else ""))
        lines += [f"fallback: {reason}" for reason in self.fallbacks]
        lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items()))
        return "\n".join(lines)


class GuardError(RuntimeError):
    """A captured graph disagreed with eager."""


def build_runner(
    module: torch.nn.Module,
    model: ModelSpec,
    device: torch.device,
    max_batch: int,
    settings: EngineSettings = EngineSettings(),
    pool: GraphPool | None = None,
) -> tuple[runtime.Runner, BuildReport]:
    """The fastest correct runner for `module` (whose interface `model`
    describes) on `device`, and how it was chosen.

    `pool`: the graph memory pool and lane streams to capture into, shared
    with other runners whose graphs never replay concurrently with these
    (serving.varlen: one pool for every shape of a model); a new one if None.

    `module` computes as written (fp32); the runner computes in
    `settings.precision` (engine.precision), checked against `module` where
    that is another one: where no graph of that precision passes, the build
    starts again in fp32 and the report says why."""
    asked = settings.precision
    used, why = precision.on_device(asked, device)
    settings = dataclasses.replace(settings, precision=used)
    if device.type != "cuda":
        runner, report = _build_eager(module, model, device, max_batch, settings)
    else:
        with heap.long_lived_frozen():  # full collections skip what the build keeps
            runner, report = _build_on_gpu(module, model, device, max_batch, settings, pool)
            if report.runner == "eager" and used != precision.FP32:
                log.warning("no %s graph passed its guard; building in fp32", used)
                earlier = report.fallbacks
                runner, report = _build_on_gpu(module, model, device, max_batch, dataclasses.replace(settings, precision=precision.FP32), pool)
                report.fallbacks[:0] = [*earlier, f"precision {used}: no graph passed its guard; built in fp32"]
    if why:
        log.warning("precision %s: %s", asked, why)
        report.fallbacks.insert(0, f"precision {asked}: {why}")
    return runner, report


# rows of the one check a CPU instance's eager module in another precision gets (its rows never interact)
CPU_CHECK_ROWS = 4


def _build_eager(module: torch.nn.Module, model: ModelSpec, device: torch.device, max_batch: int, settings: EngineSettings) -> tuple[runtime.Runner, BuildReport]:
    """A CPU instance: the module run eagerly in the settings' precision, held
    to its tolerance against the fp32 module on one batch (fp32 otherwise)."""
    served = precision.cast(module, model, settings.precision)
    runner = runtime.EagerRunner(served, model.inputs, model.outputs, device, max_batch)
    report = BuildReport(precision=settings.precision)
    if served is module or not settings.guard:
        return runner, report
    rows = min(max(settings.buckets), CPU_CHECK_ROWS)
    try:
        report.precision_error = check_against_fp32(runner, served, module, model, [rows], settings)
    except GuardError as error:
        log.warning("precision %s: %s; running fp32", settings.precision, error)
        return runtime.EagerRunner(module, model.inputs, model.outputs, device, max_batch), BuildReport(fallbacks=[f"precision {settings.precision}: {error}; runs fp32"])
    return runner, report


@dataclass(frozen=True)
class Attempt:
    """One way a build may end, tried in order until one passes its guard:
    remembered choices, then every candidate timed, then the sequential graph
    (then, outside the list, eager). `graphs`: the graphs it needs (None:
    every graph); `known`: a choice per bucket to capture without timing, and
    `fingerprints` what its graphs must be."""

    kind: str  # "multi-stream graph" or "sequential graph": the runner it makes
    graphs: frozenset[str] | None = None
    known: Mapping[int, Candidate] | None = None
    fingerprints: Mapping[str, str] | None = None
    timings_ms: Mapping[int, Mapping[Candidate, float]] | None = None

    @property
    def label(self) -> str:
        return "remembered choices" if self.known is not None else self.kind


@dataclass
class Build:
    """One build's state, filled stage by stage: trace, then per attempt
    fuse and profile (the graphs it needs, each made once), plan, capture,
    check, remember."""

    module: torch.nn.Module
    model: ModelSpec
    device: torch.device
    settings: EngineSettings
    pool: GraphPool | None
    report: BuildReport
    lane_pool: LanePool
    reference: torch.nn.Module | None = None  # the fp32 module a build in another precision is checked against
    traced: OpGraph | None = None
    key: str | None = None  # where its choices are remembered (engine.choices)
    graphs: dict[str, OpGraph] = field(default_factory=dict)  # made so far, by name
    rewrite_bound: float | None = None  # fusion's bound for a rewrite, measured once (rewrite_tolerance)
    inductor_dir: str = ""  # fused lanes: Inductor's cache directory (set with the fused graphs)


def _build_on_gpu(
    module: torch.nn.Module, model: ModelSpec, device: torch.device, max_batch: int, settings: EngineSettings, pool: GraphPool | None
) -> tuple[runtime.Runner, BuildReport]:
    with precision.numerics(settings.precision):
        return _build_in_precision(module.to(device).eval(), model, device, max_batch, settings, pool)


def _build_in_precision(
    reference: torch.nn.Module, model: ModelSpec, device: torch.device, max_batch: int, settings: EngineSettings, pool: GraphPool | None
) -> tuple[runtime.Runner, BuildReport]:
    module = precision.cast(reference, model, settings.precision).to(device)
    torch.backends.cudnn.benchmark = settings.autotune
    build = Build(module, model, device, settings, pool, BuildReport(precision=settings.precision), LanePool(device) if pool is None else pool.lanes)
    build.reference = reference if settings.precision != precision.FP32 else None
    build.traced = trace_for_build(module, model, device, build.report)
    heap.freeze_more()
    if build.traced is not None and settings.remember_choices:
        build.key = recipe_key(build.traced, settings, device)
    tried = attempts(build)
    for number, attempt in enumerate(tried):
        if attempt.known is None:  # it profiles and times candidates: the GPU to itself from the start (engine.gpu_turn)
            gpu_turn.take()
        start = time.perf_counter()
        try:
            captured, references = (capture_multi_stream if attempt.kind == "multi-stream graph" else capture_sequential)(build, attempt)
            runner = runtime.GraphRunner(captured, model.inputs, model.outputs, device, max_batch)
            if settings.guard:
                check(build, runner, references, attempt.kind)
            time_served_graphs(runner, build.report)
        except Exception as error:  # noqa: BLE001 - any failure falls to the next attempt, the reason kept
            if attempt.known is not None:
                choices.forget(build.key)
            reason = str(error) if isinstance(error, (CaptureError, GuardError)) else f"{type(error).__name__}: {error}"
            build.report.fallbacks.append(f"{attempt.label}: {reason}")
            after = f"a {tried[number + 1].kind}" if number + 1 < len(tried) else "eager"
            log.warning("%s failed, falling back to %s: %s", attempt.label, after, reason)
            build.report.choices.clear()
            build.report.timings_ms.clear()
            build.report.served_ms.clear()
            build.report.precision_error.clear()
            build.report.remembered = False
            continue
        build.report.seconds["plan+capture" if attempt.kind == "multi-stream graph" else "capture"] = time.perf_counter() - start
        build.report.runner = attempt.kind
        remember(build, attempt)
        return runner, build.report
    build.report.runner = "eager"
    return runtime.EagerRunner(module, model.inputs, model.outputs, device, max_batch), build.report


def time_served_graphs(runner: runtime.GraphRunner, report: BuildReport) -> None:
    """Each bucket's graph timed as a request runs it (`capture.time_served`),
    for the ready line: the sweep's back-to-back medians rank candidates but
    leave out the input copy and each call's start, and a build on remembered
    choices times no candidate at all."""
    start = time.perf_counter()
    report.served_ms = {bucket: time_served(graph).median_ms for bucket, graph in runner.graphs.items()}
    report.seconds["served timing"] = time.perf_counter() - start


def attempts(build: Build) -> list[Attempt]:
    """What the build tries, in order: the remembered choices (only the
    graphs they use), every candidate timed, the sequential graph of the ATen
    graph (or of the untraced module where tracing failed)."""
    tried = []
    if build.traced is not None and build.settings.policy != "sequential":
        found = choices.load(build.key) if build.key is not None else None
        known = _parsed(found, build.settings.buckets)
        if known is not None:
            tried.append(Attempt("multi-stream graph", frozenset(found.graphs), known[0], dict(found.graphs), known[1]))
        tried.append(Attempt("multi-stream graph"))
    aten = [layout for layout in graph_names(build.module, build.settings, build.device) if layout in ATEN_GRAPHS]
    tried.append(Attempt("sequential graph", frozenset(aten[:1])))
    return tried


def _parsed(found: choices.Remembered | None, buckets: Sequence[int]) -> tuple[dict[int, Candidate], dict[int, dict[Candidate, float]]] | None:
    """Remembered choices as candidates, where they cover every bucket."""
    if found is None or not set(found.choices) >= set(buckets):
        return None
    try:
        known = {bucket: Candidate.parse(text) for bucket, text in found.choices.items()}
        timings = {b: {Candidate.parse(c): t for c, t in per.items()} for b, per in found.timings_ms.items()}
    except ValueError:
        return None
    return known, timings


def graphs_for(build: Build, names: frozenset[str] | None) -> dict[str, OpGraph]:
    """The fused and profiled graphs `names` (None: every graph), each made
    once per build: a later attempt that needs more makes only the rest."""
    wanted = set(graph_names(build.module, build.settings, build.device)) if names is None else set(names)
    missing = wanted - set(build.graphs)
    if missing:
        tolerance = rewrite_tolerance(build)
        build.graphs.update(traced_graphs(build.module, build.model, build.device, build.settings, build.report, traced=build.traced, only=missing, tolerance=tolerance))
        build.inductor_dir = build.inductor_dir or build.report.inductor  # where fused lanes keep compiled code
    heap.freeze_more()  # the graphs live as long as the runner
    return {name: graph for name, graph in build.graphs.items() if name in wanted}


def capture_multi_stream(build: Build, attempt: Attempt) -> tuple[dict[int, CapturedGraph], dict[int, torch.nn.Module]]:
    """Plan every candidate of the attempt's graphs, capture them and keep the
    fastest per bucket (or the remembered one)."""
    settings, report = build.settings, build.report
    graphs = graphs_for(build, attempt.graphs)
    if attempt.fingerprints is not None and {name: g.fingerprint for name, g in graphs.items()} != dict(attempt.fingerprints):
        raise CaptureError("the remembered choices' graphs came out otherwise; timing every candidate")
    plans = candidates(graphs, settings)
    known = attempt.known
    if known is not None:
        if not all(c in plans for c in known.values()):
            raise CaptureError("a remembered choice is no longer a candidate; timing every candidate")
        report.choices.update(known)
        report.timings_ms.update(attempt.timings_ms or {})
        report.remembered = True
    start = time.perf_counter()
    segment_cache = Path(build.inductor_dir) / "segments" if build.inductor_dir else None
    captures = {c: plan_capture(c, graphs[c.graph], plan, build.lane_pool, segment_cache) for c, plan in needed(plans, known, settings.buckets).items()}
    report.seconds["captures made"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = _prepare_fused(captures, build.model, build.device, settings.buckets, known)
    if segment_cache is not None:
        report.seconds["fused lanes prepare"] = time.perf_counter() - start
    gpu_turn.take()  # remembered choices: fused, loaded and run once before the turn; captured and timed in it
    chosen = capture_fastest(captures, build.model, build.device, settings.buckets, report, None if build.pool is None else build.pool.handle, known)
    if segment_cache is not None:
        counts = [compiled, *(c.count for c in captures.values() if isinstance(c, InductorCapture))]
        report.inductor = f"{build.inductor_dir}: {sum(counts, CompileCount())}"
    return chosen, {b: graphs[c.graph].module for b, c in report.choices.items()}


def capture_sequential(build: Build, attempt: Attempt) -> tuple[dict[int, CapturedGraph], dict[int, torch.nn.Module]]:
    """One stream, topological order: of the ATen graph, or of the untraced
    module where tracing failed."""
    model, device, buckets = build.model, build.device, sorted(build.settings.buckets, reverse=True)
    shared = torch.cuda.graph_pool_handle() if build.pool is None else build.pool.handle
    graphs = graphs_for(build, attempt.graphs) if build.traced is not None else {}
    with torch.inference_mode():  # no autograd state in the graphs or their outputs
        if graphs:
            layout, graph = next(iter(graphs.items()))
            capture = PlanCapture(graph, plan_graph(graph, "sequential"), build.lane_pool)
            captured = {b: capture(static_inputs(model, b, device), shared) for b in buckets}
            reference, choice = graph.module, Candidate(layout, "sequential", 1)
        else:
            captured = {b: capture_module(build.module, static_inputs(model, b, device), shared) for b in buckets}
            reference, choice = build.module, "module"
    build.report.choices = dict.fromkeys(captured, choice)
    return captured, dict.fromkeys(captured, reference)


def check(build: Build, runner: runtime.Runner, references: Mapping[int, torch.nn.Module], kind: str) -> None:
    """The guard: every bucket's replay against its graph run eagerly, fused
    lanes with their own tolerance; in another precision than fp32, against
    the fp32 module instead, within `precision_tolerance` (the same graph run
    eagerly in half precision rounds otherwise too, and only the distance
    from what the user's module computes matters)."""
    settings, report = build.settings, build.report
    start = time.perf_counter()
    if build.reference is not None:
        log.info("checking the %s of %d buckets against the fp32 module (%s)", kind, len(references), settings.precision)
        report.precision_error = check_against_fp32(runner, build.module, build.reference, build.model, sorted(references), settings)
    else:
        fused = {b for b, c in report.choices.items() if isinstance(c, Candidate) and c.fused}
        tolerances = {b: settings.fused_tolerance if b in fused else settings.guard_tolerance for b in report.choices}
        log.info("checking the %s of %d buckets against eager", kind, len(references))
        check_against_eager(runner, dict(references), build.model, tolerances)
    report.seconds["guard"] = time.perf_counter() - start


def remember(build: Build, attempt: Attempt) -> None:
    """Keep a multi-stream build's timed choices for the next build (engine.choices)."""
    report = build.report
    if attempt.kind != "multi-stream graph" or attempt.known is not None or build.key is None:
        return
    used = {c.graph for c in report.choices.values() if isinstance(c, Candidate)}
    choices.store(build.key, report.choices, report.timings_ms, {name: build.graphs[name].fingerprint for name in sorted(used)})


@functools.cache
def _code_digest() -> str:
    """The engine's and the planners' code: a change anywhere times the candidates again."""
    paths = sorted([*Path(__file__).parent.glob("*.py"), *(Path(__file__).parents[1] / "planning").rglob("*.py")])
    return cache.digest(*(path.read_bytes() for path in paths))[:16]


def recipe_key(traced: OpGraph, settings: EngineSettings, device: torch.device) -> str:
    """The key of what a build starts from: the traced graph, the settings and
    the code that fuses, plans and chooses (engine.choices)."""
    return choices.key({"traced": traced.fingerprint, "code": _code_digest(), "settings": repr(settings)}, settings.buckets, device)


def _has_convs(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in module.modules())


def graph_names(module: torch.nn.Module, settings: EngineSettings, device: torch.device) -> tuple[str, ...]:
    """The graphs `traced_graphs` makes for `module` (inductor-cudnn only where
    some convolution fuses with cuDNN; it may then be absent; the `-timed`
    ones with `fused_lanes_autotune` where there are convolutions to time)."""
    has_convs = _has_convs(module)
    names = {"auto": ("nchw", "nhwc") if has_convs else ("nchw",), "nchw": ("nchw",), "nhwc": ("nhwc",)}[settings.layout]
    if settings.fused_lanes and torch.device(device).type == "cuda":
        fused = FUSED_BASES if has_convs else FUSED_BASES[:1]
        names += fused + (tuple(name + TIMED for name in fused) if has_convs and settings.fused_lanes_autotune else ())
    return names


def static_inputs(model: ModelSpec, bucket: int, device: torch.device) -> list[torch.Tensor]:
    """A bucket's static input tensors, filled with valid random values."""
    return [spec.random(bucket, device=device) for spec in model.inputs]


def capture_fastest(
    captures: dict[Candidate, PlanCapture],
    model: ModelSpec,
    device: torch.device,
    buckets: Sequence[int],
    report: BuildReport,
    pool: Any = None,
    known: Mapping[int, Candidate] | None = None,
) -> dict[int, CapturedGraph]:
    """`auto`: per bucket, capture the candidates, time their replays and keep
    the fastest; then capture the chosen ones, every bucket in one memory pool
    (`pool`, or a new one), the largest bucket first: the smaller graphs then
    fit in the blocks its intermediates freed.

    Buckets go smallest first (batch 1 is where latency matters most): the
    smallest times every candidate, each larger bucket what `next_candidates`
    keeps of the bucket before it. The sequential graph of a traced graph is
    timed wherever its multi-stream candidates are, so a bucket's choice is
    never slower than it (within timing noise).
    Candidates are timed in pools of their own, dropped with them, and the
    chosen ones captured again at the end: the runner's pool holds only the
    graphs it replays, not the leftovers of the candidates it dropped.

    `known`: a choice per bucket made by an earlier build (engine.choices):
    those buckets capture only it, nothing is timed.

    Each graph keeps the traced module it reads alive (`CapturedGraph.owner`):
    before it did, the module's folded weights were freed when the build
    returned, and a later build in the same process overwrote them (the
    illegal memory accesses and out-of-bounds gathers seen on the H100).
    """
    sequential = [c for c in captures if c.sequential]
    shortlist = [c for c in captures if not c.sequential]
    with torch.inference_mode():  # no autograd state in the graphs or their outputs
        for bucket in sorted(set(buckets)):
            if known and bucket in known:
                continue
            static_in = static_inputs(model, bucket, device)
            log.info("bucket %d: capturing and timing %d candidates", bucket, len(sequential) + len(shortlist))
            timings: dict[Candidate, float] = {}
            failures = []
            seconds = {"capture": 0.0, "timing": 0.0}
            for candidate in [*sequential, *shortlist]:
                start = time.perf_counter()
                try:
                    captured = captures[candidate](static_in, torch.cuda.graph_pool_handle())
                except CaptureError as error:
                    log.warning("auto: %s not captured at bucket %d: %s", candidate, bucket, error)
                    failures.append(f"{candidate}: {error}")
                    continue
                finally:
                    seconds["capture"] += time.perf_counter() - start
                start = time.perf_counter()
                timings[candidate] = time_replays(captured)
                seconds["timing"] += time.perf_counter() - start
                del captured
            if not timings:
                raise CaptureError(f"no candidate could be captured at bucket {bucket}: {'; '.join(failures)[:1000]}")
            ranked = sorted(timings, key=timings.get)
            report.choices[bucket], report.timings_ms[bucket] = ranked[0], timings
            sequential, shortlist = next_candidates(timings, sequential)
            for stage, spent in seconds.items():
                report.seconds[f"{stage} b{bucket}"] = spent
            log.info("auto: bucket %d -> %s (%s)", bucket, ranked[0], ", ".join(f"{c} {timings[c]:.3f} ms" for c in ranked))
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        chosen = {b: captures[report.choices[b]](static_inputs(model, b, device), pool) for b in sorted(set(buckets), reverse=True)}
        report.seconds["capture chosen"] = time.perf_counter() - start
    return chosen


def next_candidates(timings: Mapping[Candidate, float], sequential: Sequence[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """What the next bucket times after one that timed `timings`: of the
    traced graphs with a candidate within AUTO_DROP times the fastest, the
    sequential graphs and the AUTO_KEEP fastest multi-stream candidates."""
    fastest = min(timings.values())
    kept = {c.graph for c, ms in timings.items() if ms <= AUTO_DROP * fastest}
    ranked = sorted(timings, key=timings.get)
    return [c for c in sequential if c.graph in kept], [c for c in ranked if not c.sequential and c.graph in kept][:AUTO_KEEP]


def trace_for_build(module, model: ModelSpec, device: torch.device, report: BuildReport) -> OpGraph | None:
    """The model traced (through the trace cache); None, with the reason in the report, if tracing fails."""
    start = time.perf_counter()
    log.info("tracing the module")
    try:
        # CPU work (torch.export on fake tensors, or reading the trace cache: NASNet's 11 s
        # of the shipped repository's warm start, H200 2026-12-02): the GPU is free meanwhile
        with gpu_turn.aside("tracing the module"):
            graph = trace_model(model, module, device, cache=trace_cache.cache_dir())
    except Exception as error:  # noqa: BLE001 - any tracing failure falls back
        report.fallbacks.append(f"tracing: {error}")
        return None
    report.seconds["trace"] = time.perf_counter() - start
    return graph


def traced_graphs(
    module,
    model: ModelSpec,
    device: torch.device,
    settings: EngineSettings,
    report: BuildReport,
    traced: OpGraph | None = None,
    only: Collection[str] | None = None,
    tolerance: float = FUSION_TOLERANCE,
) -> dict[str, OpGraph]:
    """The model traced (and fused) in each layout to try; empty if tracing fails.
    `traced`: the model already traced (trace_for_build); `only`: just these of
    the graphs (a build whose remembered choices use only them); `tolerance`:
    fusion's bound for a rewrite (rewrite_tolerance).

    The guard later compares each replay with its own graph run eagerly (same
    kernels): fusion is checked on its own here, against the unfused graph in
    plain fp32, since with TF32 folded weights round differently. With fused
    lanes on a GPU, `inductor` is the graph for Inductor (INDUCTOR_PASSES only)
    and, where cuDNN fuses some convolution with its ReLU (or residual add and
    ReLU), `inductor-cudnn` the same with those fused (INDUCTOR_CUDNN_PASSES).
    """
    has_convs = _has_convs(module)
    layouts = tuple(name for name in graph_names(module, settings, device) if name in ATEN_GRAPHS)
    if only is not None:
        layouts = tuple(layout for layout in layouts if layout in only)
    traced = traced if traced is not None else trace_for_build(module, model, device, report)
    if traced is None:
        return {}
    graph = traced
    buckets = sorted({min(settings.buckets), max(settings.buckets)})
    checks = [tuple(t.to(device) for t in model.example_inputs(b, seed=7)) for b in buckets]
    if settings.fusion and layouts:
        start = time.perf_counter()
        log.info("fusing the traced graph (%d ops)", len(graph.dag.nodes))
        try:
            graph, report.fusion = fuse_graph(graph, device, check_inputs=checks, tolerance=tolerance, cache=fusion_checks_dir())
        except Exception as error:  # noqa: BLE001 - the unfused graph is still right
            report.fallbacks.append(f"fusion: {error}")
        report.seconds["fusion"] = time.perf_counter() - start
    # kernels measured on the GPU at the smallest bucket, the latency-bound one
    on_gpu = torch.device(device).type == "cuda"
    profile_inputs = [t.to(device) for t in model.example_inputs(min(settings.buckets), seed=5)]
    if settings.profile and on_gpu and layouts:
        graph = profiled(graph, profile_inputs, device, report)
    # NHWC is the same traced and fused graph with channels-last convolution
    # weights (tracing and fusing it again took as long as the first time)
    graphs = {layout: graph if layout == "nchw" else channels_last_graph(graph) for layout in layouts}
    if settings.fused_lanes and on_gpu:
        try:
            report.inductor = str(use_inductor_cache(settings.inductor_cache))
        except ValueError as error:  # the ATen candidates still serve
            report.fallbacks.append(f"fused lanes: {error}")
            return graphs
        bases = None if only is None else {base_graph(name) for name in only}
        wanted = set(graph_names(module, settings, device)) if only is None else set(only)
        for name, inductor in _fused_lanes_graphs(traced, device, settings, report, checks, has_convs, bases, tolerance).items():
            if settings.profile:
                inductor = profiled(inductor, profile_inputs, device, report)
            # segments take their weights as inputs, and Inductor converts a
            # convolution weight to channels-last at every call unless it already is
            made = channels_last_graph(inductor) if has_convs else inductor
            graphs.update({variant: made for variant in (name, name + TIMED) if variant in wanted})
    return graphs


def rewrite_tolerance(build: Build) -> float:
    """Fusion's bound for a rewrite of the build's graphs (`fusion_tolerance`), once per build."""
    if build.rewrite_bound is None:
        build.rewrite_bound = fusion_tolerance(build.settings, build.model, build.module, build.reference, build.device)
    return build.rewrite_bound


def fusion_tolerance(settings: EngineSettings, model: ModelSpec, served: torch.nn.Module, reference: torch.nn.Module | None, device: torch.device) -> float:
    """Fusion's bound for a rewrite against the graph it rewrites: in fp32
    FUSION_TOLERANCE; in half precision a folded or merged weight rounds
    otherwise, and a rounding anywhere grows through the network as much as
    the precision's own do, so the bound the guard holds the build to against
    the fp32 module `reference` (engine.precision.tolerance, on fusion's check
    inputs; `served`: the module in the settings' precision)."""
    if settings.precision not in precision.HALF or reference is None:
        return FUSION_TOLERANCE
    worst = 0.0
    for bucket in sorted({min(settings.buckets), max(settings.buckets)}):
        inputs = model.example_inputs(bucket, seed=7)
        with precision.fp32_reference():
            expected = _eager(reference, inputs, device)
        worst = max(worst, max_relative_error(_eager(served, inputs, device), expected))
    return precision.tolerance(settings.precision, settings.precision_tolerance, worst)


def _fused_lanes_graphs(
    traced: OpGraph, device: torch.device, settings: EngineSettings, report: BuildReport, checks: list, has_convs: bool, only: Collection[str] | None, tolerance: float
) -> dict[str, OpGraph]:
    """The graphs fused lanes compile: `inductor` (INDUCTOR_PASSES) and, for a
    convolutional model where cuDNN fuses some convolution, `inductor-cudnn`.
    The second is the first with the cuDNN passes run on it (they touch only
    ungrouped convolutions, depthwise_convs only grouped ones): fusing the
    traced graph twice from scratch spent ~1.3 s per graph of NASNet's warm
    build (docs/benchmarks.md run 35). `only`: the graphs a build needs (the
    first is made anyway where the second is wanted)."""
    wanted_names = [name for name in FUSED_BASES if only is None or name in only]
    if not settings.fusion or not wanted_names:
        return {"inductor": traced} if "inductor" in wanted_names else {}
    start = time.perf_counter()
    made = {"inductor": fuse_graph(traced, device, passes=INDUCTOR_PASSES, check_inputs=checks, tolerance=tolerance, cache=fusion_checks_dir())[0]}
    if has_convs and "inductor-cudnn" in wanted_names:
        wanted = [p for p in INDUCTOR_CUDNN_PASSES if p not in INDUCTOR_PASSES]
        cudnn, fusion = fuse_graph(made["inductor"], device, passes=wanted, check_inputs=checks, tolerance=tolerance, cache=fusion_checks_dir())
        if fusion.rewrites.get("conv_relu") or fusion.rewrites.get("conv_add_relu"):  # else the same graph as `inductor`
            made["inductor-cudnn"] = cudnn
    report.seconds["fusion"] = report.seconds.get("fusion", 0.0) + time.perf_counter() - start  # every graph's fusion is the build's
    return {name: graph for name, graph in made.items() if name in wanted_names}


def profiled(graph: OpGraph, inputs: Sequence[torch.Tensor], device: torch.device, report: BuildReport) -> OpGraph:
    """`graph` with each kernel's measured time and launch resources (engine.profile,
    cached on disk), for the plans' costs and Alg. 2's resource demand; the
    graph as it was (static estimates) if profiling fails."""
    start = time.perf_counter()
    log.info("profiling the kernels of a graph of %d ops", len(graph.dag.nodes))
    try:
        measured = apply_profile(graph, profile_graph(graph, inputs, device))
    except Exception as error:  # noqa: BLE001 - static estimates still plan correctly
        report.fallbacks.append(f"profile: {type(error).__name__}: {error}")
        measured = graph
    report.seconds["profile"] = report.seconds.get("profile", 0.0) + time.perf_counter() - start
    return measured


def candidates(graphs: dict[str, OpGraph], settings: EngineSettings) -> dict[Candidate, Plan]:
    """What `auto` captures and times, with its plan: the sequential graph of
    every graph (but `inductor-cudnn`'s), plus the configured policy (or, with
    `auto`, every AUTO_CANDIDATES policy, FUSED_CANDIDATES for fused lanes) per graph."""
    found: dict[Candidate, Plan] = {}
    for name, graph in graphs.items():
        wanted = (FUSED_CANDIDATES if name in FUSED_GRAPHS else AUTO_CANDIDATES) if settings.policy == "auto" else ((settings.policy, settings.max_streams),)
        for policy, lanes in ((("sequential", 1),) if base_graph(name) != "inductor-cudnn" else ()) + tuple(wanted):
            plan = plan_graph(graph, policy, min(lanes, settings.max_streams))
            if name in FUSED_GRAPHS and policy != "sequential" and plan.num_streams == 1:
                continue  # one lane is one segment: the whole-graph compile `sequential` is
            found.setdefault(Candidate(name, policy, plan.num_streams), plan)
    return found


def plan_capture(
    candidate: Candidate, graph: OpGraph, plan: Plan, lane_pool: LanePool, segment_cache: Path | None = None, autotune: bool = False
) -> PlanCapture:
    """The capture of one candidate: fused lanes compile their segments with
    Inductor, keeping the code in `segment_cache` (default: under Inductor's
    cache directory, engine.inductor_cache), and time their convolutions'
    algorithms where the candidate is `timed` or with `autotune` (the bench's
    fused-lanes columns)."""
    if candidate.fused:
        return InductorCapture(graph, plan, lane_pool, segment_cache or use_inductor_cache() / "segments", autotune=autotune or candidate.timed)
    return PlanCapture(graph, plan, lane_pool)


def _prepare_fused(captures: Mapping[Candidate, PlanCapture], model: ModelSpec, device: torch.device, buckets: Sequence[int], known: Mapping[int, Candidate] | None) -> CompileCount:
    """Load or compile the segments of every fused-lanes candidate at every
    bucket (only the remembered ones with `known`) in one go, so that one pool
    of compile workers gets all of it. A failure here is left to the candidate's
    own capture, which then drops only that candidate."""
    runs = [(capture, static_inputs(model, bucket, device)) for bucket in sorted(set(buckets)) for candidate, capture in captures.items()
            if isinstance(capture, InductorCapture) and (known is None or known.get(bucket) == candidate)]
    if not runs:
        return CompileCount()
    start = time.perf_counter()
    log.info("fused lanes: loading or compiling the segments of %d captures (Inductor; minutes on a cold cache)", len(runs))
    try:
        with torch.inference_mode():
            count = prepare_captures(runs)
    except Exception as error:  # noqa: BLE001 - see the docstring
        log.warning("preparing fused lanes failed, each candidate tries alone: %s: %s", type(error).__name__, error)
        return CompileCount()
    log.info("fused lanes: %s in %.1f s", count, time.perf_counter() - start)
    return count


def needed(plans: Mapping[Candidate, Plan], known: Mapping[int, Candidate] | None, buckets: Sequence[int]) -> dict[Candidate, Plan]:
    """The candidates a build must make captures of: only the remembered ones
    where every bucket's choice is remembered, else all. Making a fused-lanes
    capture splits its plan into segments, Python work: NASNet's three fused
    candidates took 1.3, 2.7 and 2.0 s on the 2-core CPU machine (2026-11-29),
    where its warm build spent 3.1 s outside loading segments and capturing,
    the guard included (H200, docs/benchmarks.md run 29); it replays one."""
    if known is None or not set(known) >= set(buckets):
        return dict(plans)
    return {c: p for c, p in plans.items() if c in known.values()}


def channels_last_graph(graph: OpGraph) -> OpGraph:
    """A copy of `graph` whose 2-d convolution weights are channels-last: cuDNN
    then runs the whole network in NHWC, the layout its tensor-core kernels
    prefer. Same nodes and DAG, so plans made for one fit the other; other
    attributes are shared, not copied."""
    old = graph.module
    nodes = old.graph.nodes
    attributes: dict[str, Any] = {n.target: old.get_submodule(n.target) for n in nodes if n.op == "call_module"}
    for node in nodes:
        if node.op == "get_attr":
            attributes[node.target] = operator.attrgetter(node.target)(old)
    for node in nodes:
        if node.op == "call_function" and node.target in (CONV, CONV_RELU, CONV_ADD_RELU) and isinstance(node.args[1], torch.fx.Node):
            weight = node.args[1]
            value = attributes.get(weight.target) if weight.op == "get_attr" else None
            if isinstance(value, torch.Tensor) and value.dim() == 4:
                attributes[weight.target] = value.detach().contiguous(memory_format=torch.channels_last)
    module = torch.fx.GraphModule(attributes, reordered_graph(old.graph, tuple(n.name for n in nodes)))
    return dataclasses.replace(graph, module=module)


def check_against_eager(runner: runtime.Runner, references: dict[int, torch.nn.Module], model: ModelSpec, tolerance: float | dict[int, float]) -> None:
    """Replay every bucket on fresh random inputs and compare with the graph it
    replays, run eagerly (`references`: bucket -> module; `tolerance`: one for
    all, or per bucket)."""
    for bucket, reference in references.items():
        inputs = model.example_inputs(bucket, seed=1000 + bucket)
        outputs = [out.clone() for out in runner.run(inputs)]
        expected = _eager(reference, inputs, runner.device)
        _compare(bucket, outputs, expected, tolerance[bucket] if isinstance(tolerance, dict) else tolerance)


def check_rows_against_eager(runner: runtime.Runner, reference: torch.nn.Module, buckets: list[int], model: ModelSpec, tolerance: float) -> None:
    """`check_against_eager` for a module whose rows never interact (a row's
    answer is the same whatever else is in the batch, which variable-length
    serving relies on anyway): one eager run at the largest bucket, each
    bucket's replay compared with its leading rows. One eager run a bucket
    took T5 144 runs of about 20 ms per start, most of it Python."""
    inputs = model.example_inputs(max(buckets), seed=1000)
    expected = _eager(reference, inputs, runner.device)
    for bucket in buckets:
        outputs = [out.clone() for out in runner.run([x[:bucket] for x in inputs])]
        _compare(bucket, outputs, [want[:bucket] for want in expected], tolerance)


def check_against_fp32(
    runner: runtime.Runner, served: torch.nn.Module, reference: torch.nn.Module, model: ModelSpec, buckets: Sequence[int], settings: EngineSettings, rows: bool = False
) -> dict[int, precision.Accuracy]:
    """The guard of a build in another precision than fp32: each bucket's
    replay against the fp32 module (`reference`, with PyTorch's defaults) on
    fresh random inputs, held to `precision_tolerance` (engine.precision.tolerance:
    by default a multiple of the error of `served`, the module in that
    precision, run eagerly on the same inputs). `rows`: the rows never interact
    (check_rows_against_eager): one eager run each at the largest bucket."""
    def references(inputs: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        with precision.fp32_reference():
            expected = _eager(reference, inputs, runner.device)
        with precision.numerics(settings.precision):
            return expected, _eager(served, inputs, runner.device)

    if rows:
        largest = model.example_inputs(max(buckets), seed=1000)
        both = references(largest)
    found = {}
    for bucket in buckets:
        if rows:
            inputs = [x[:bucket] for x in largest]
            expected, eager = ([t[:bucket] for t in kept] for kept in both)
        else:
            inputs = model.example_inputs(bucket, seed=1000 + bucket)
            expected, eager = references(inputs)
        outputs = [out.clone() for out in runner.run(inputs)]
        eager_error = max_relative_error(eager, expected)
        limit = precision.tolerance(settings.precision, settings.precision_tolerance, eager_error)
        found[bucket] = precision.Accuracy(_compare(bucket, outputs, expected, limit, "the fp32 module"), eager_error, limit)
    return found


def _eager(module: torch.nn.Module, inputs: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode(), no_cudnn_autotuning():  # eager convolutions of every bucket: values only
        return runtime._as_tuple(module(*(x.to(device) for x in inputs)))


def _compare(bucket: int, outputs: list[torch.Tensor], expected: Any, limit: float, against: str = "eager") -> float:
    error = max_relative_error(outputs, expected)
    if not error <= limit:
        raise GuardError(f"bucket {bucket}: replay differs from {against} by {error:.2e} (relative), tolerance {limit:.0e}")
    return error
