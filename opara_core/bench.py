"""Benchmark: eager, torch.compile, the sequential graph and every policy, per model and batch.

`python -m opara_core.bench --models googlenet,inception_v3 --batch 1,8,32 --json out.json`
`python -m opara_core.bench --model-dir my_repository/my_model --batch 1,8` (a model of your own)

Every variant is timed the same way: CUDA events around one call (for graphs:
copying a rotating input into the static input, then the replay), after
warm-up, over many calls and several repetitions; the table shows medians and
p99. The baseline for the parallel graphs is the sequential CUDA graph of the
same traced (and fused) graph, so the kernels are the same and only the
schedule differs. The critical-path floor is the longest path through the DAG
weighted by each operator's kernel time measured alone (profiled), the bound no
schedule can beat.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import torch

from opara_core import parameters, zoo
from opara_core.spec import ModelSpec
from opara_core.engine import cache, precision
from opara_core.engine.build import (
    FUSED_GRAPHS, BuildReport, Candidate, EngineSettings, build_runner, candidates, capture_fastest, fusion_tolerance, plan_capture, traced_graphs,
)  # fmt: skip
from opara_core.engine.capture import CapturedGraph, CaptureError, LanePool, PlanCapture, Timing, capture_module, pool_mb, served_call, time_calls
from opara_core.engine.inductor_cache import INDUCTOR_ENV, TRITON_ENV
from opara_core.engine.interpreter import plan_graph
from opara_core.engine.trace import trace_model

# by name: run as `python -m opara_core.bench` this module is `__main__`, whose logger the
# "opara_core" level set in main() does not reach (run 28 lost its INFO lines: the serving
# build's seconds, logged for runs cut before their row is written)
log = logging.getLogger("opara_core.bench")

POLICIES = ("opara", "nimble", "asap", "wavefront")


@dataclass(frozen=True)
class DirectoryModel(ModelSpec):
    """A model directory's model (serving.model_dir): the description and
    module that serving the directory builds, built the same way each time."""

    directory: str = dataclasses.field(default="", kw_only=True)

    def build(self) -> torch.nn.Module:
        from opara_core.serving import model_dir

        return model_dir.load(Path(self.directory))[1]


def model_for(ref: str) -> ModelSpec:
    """What `--models` names: a zoo model, or a model directory (a path that
    holds a config.pbtxt), e.g. one `python -m opara_core add-model` wrote."""
    path = Path(ref)
    if "/" not in ref and not (path / "config.pbtxt").is_file():
        return zoo.get(ref)
    from opara_core.serving import model_dir

    spec, _ = model_dir.load(path)
    return DirectoryModel(spec.name, spec.inputs, spec.outputs, spec.serving, spec.lengths, directory=str(path.resolve()))


def ref_of(entry: ModelSpec) -> str:
    """How a process of the bench's own names `entry` again (its --models, --build-only)."""
    return entry.directory if isinstance(entry, DirectoryModel) else entry.name


@dataclass
class Row:
    """One model at one batch size."""

    model: str
    batch: int
    timings: dict[str, Timing] = field(default_factory=dict)
    precision: str = "fp32"  # what every column of the row computes in (engine.precision)
    streams: dict[str, int] = field(default_factory=dict)
    peak_mb: dict[str, float] = field(default_factory=dict)
    auto_choice: str = ""
    critical_path_ms: float | None = None
    sum_of_ops_ms: float | None = None
    kernels: int = 0
    plan_capture_s: float | None = None  # the serving build, cold
    warm_build_s: float | None = None  # the same build again in a new process
    notes: list[str] = field(default_factory=list)


def rotating_inputs(entry: ModelSpec, batch: int, device: torch.device, count: int = 4) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.to(device) for t in entry.example_inputs(batch, seed=100 + k)) for k in range(count)]


def capture_measured(capture: PlanCapture, static_in) -> tuple[CapturedGraph, float]:
    """Capture into a fresh pool and report the MB the graph holds: every
    segment of its private pool, intermediates and outputs (a pool dies with
    the last graph that used it)."""
    pool = torch.cuda.graph_pool_handle()
    captured = capture(static_in, pool)
    return captured, pool_mb(pool)


def bench_model(
    name: str,
    batches: Sequence[int],
    compile_: bool,
    max_streams: int,
    fusion: bool,
    progress,
    layout: str = "auto",
    time_build: bool = True,
    compile_autotune: bool = False,
    on_row: Callable[[Row], None] | None = None,
    columns: Collection[str] = (),
    cache_dir: Path | None = None,
    cudnn_benchmark: bool = True,
    compile_here: bool = False,
    fused_lanes_autotune: bool = False,
    numerics: str = "fp32",
) -> list[Row]:
    """Every variant of one model at each batch size (see the module docstring);
    `on_row` gets each row as soon as it is measured (a cut run keeps its rows);
    `columns`: only these of COLUMNS (default all), so that a model too slow for
    one call (NASNet) can be measured in several and merged by `--report`;
    `cache_dir`: a build cache to reuse (traces, profiles, compiled segments of
    an earlier run) instead of a fresh one; the build timing needs a fresh one;
    `cudnn_benchmark`: cuDNN times its convolution algorithms per shape (on:
    every column but the fused-lanes ones, which take the heuristics unless
    `fused_lanes_autotune`, engine.fused_lanes) or takes its heuristics' pick (off, every column: the
    engine's `autotune` setting off, torch.compile with the flag off);
    `compile_here`: time the torch.compile columns in this process (the
    process `compiled_elsewhere` starts), not in a process of their own;
    `fused_lanes_autotune`: the fused-lanes columns time their convolutions'
    algorithms; `auto` and the build take the engine setting of that name
    (each fused-lanes candidate both ways);
    `numerics`: the precision every column computes in (engine.precision):
    eager and torch.compile run the module cast to it, the engine's columns
    build from that module, the build and `served` with the engine setting.

    Policy columns use the NCHW graph (NHWC with --layout nhwc); `auto` chooses
    among the layouts `--layout` allows, as serving does. `served` times the
    graphs a warm build captured (a new process on the cold build's cache, as a
    server restarted after an ahead-of-time build): what serving replays, the
    check that `auto`, chosen again in this process, shows it (they differed
    until fused lanes planned their convolutions on a thread of their own:
    docs/benchmarks.md run 41).
    """
    device = torch.device("cuda")
    entry = model_for(name)
    wanted = set(columns or COLUMNS)
    torch.backends.cudnn.benchmark = cudnn_benchmark
    # the serving build first, cold (an empty cache directory of its own, and
    # cuDNN's autotune cache holds none of this model's shapes), then warm, in
    # a new process as a server restart would; the columns below load the
    # fused segments the cold build compiled
    if cache_dir is None:
        _fresh_cache(entry.name)
    else:
        _use_cache(cache_dir)
    served_batches = batches if "served" in wanted else ()
    build = _build_seconds(entry, device, max_streams, fusion, layout, cudnn_benchmark, fused_lanes_autotune, served_batches, numerics) if time_build else None
    served = build.served if build else {}
    if served_batches and not build and cache_dir is not None and _holds_files(cache_dir):  # a warm cache: what a server restarted on it replays
        served = _served_only(entry, max_streams, fusion, layout, cudnn_benchmark, fused_lanes_autotune, served_batches, numerics)
    start = time.perf_counter()
    reference = entry.build().to(device).eval()
    module = precision.cast(reference, entry, numerics).to(device)  # eager and torch.compile
    log.info("%s built and on %s in %.1f s", name, device, time.perf_counter() - start)
    # the engine's graphs only for the engine's columns (NASNet's trace, fusion and profile take a minute)
    unfused = trace_model(entry, module, device) if "sequential (unfused)" in wanted else None
    report = BuildReport()
    graphs, floors = {}, []
    if wanted - {"eager", "compile", "compile max-autotune"}:
        settings = EngineSettings(fusion=fusion, layout=layout, fused_lanes=True, fused_lanes_autotune=fused_lanes_autotune, precision=numerics)
        tolerance = fusion_tolerance(settings, entry, module, reference, device)
        graphs = traced_graphs(module, entry, device, settings, report, tolerance=tolerance)
        profiled = not any(f.startswith("profile") for f in report.fallbacks)
        # measured kernel times (the graphs are profiled at batch 1): the least critical path over the layouts
        floors = [(g.dag.critical_path_us / 1000, sum(g.dag.costs) / 1000) for k, g in graphs.items() if k not in FUSED_GRAPHS] if profiled else []
    primary = "nhwc" if layout == "nhwc" else "nchw"
    graph = graphs.get(primary)
    rows = []
    for batch in batches:
        row = Row(entry.name, batch, kernels=len(graph.dag) if graph is not None else 0, precision=numerics)
        if graph is not None:
            row.notes.append(f"fusion: {report.fusion}" if report.fusion else "fusion off")
            if fused_lanes_autotune:
                row.notes.append("fused lanes autotune: their convolutions' cuDNN algorithms timed (engine setting fused_lanes_autotune)")
        inputs = rotating_inputs(entry, batch, device)
        if "eager" in wanted:
            with torch.inference_mode():
                row.timings["eager"] = time_calls(lambda i: module(*inputs[i % len(inputs)]))
        progress.update()
        compile_columns = [c for c, on in (("compile", compile_), ("compile max-autotune", compile_autotune)) if on and c in wanted]
        if compile_here:
            if "compile" in compile_columns:
                row.timings["compile"] = _time_compiled(module, inputs, row, "default")
            if "compile max-autotune" in compile_columns:
                row.timings["compile max-autotune"] = _time_compiled(module, inputs, row, "max-autotune-no-cudagraphs")
        elif compile_columns:
            compiled_elsewhere(name, batch, compile_columns, row, cache_dir, cudnn_benchmark, numerics)
        progress.update()
        if graph is None:  # eager and compile columns only
            _keep(row, rows, on_row)
            continue
        lane_pool = LanePool(device)
        static_in = [x.clone() for x in inputs[0]]
        variants = [("sequential (unfused)", unfused, "sequential", None), ("sequential", graph, "sequential", None)]
        variants += [(policy, graph, policy, max_streams) for policy in POLICIES]
        if "nhwc" in graphs and primary != "nhwc":
            variants.append(("sequential nhwc", graphs["nhwc"], "sequential", None))
        if "inductor" in graphs:  # fused lanes: one segment (torch.compile's kernels), and the opara plan's segments
            variants += [("fused sequential", graphs["inductor"], "sequential", None), ("fused opara", graphs["inductor"], "opara", max_streams)]
        if "inductor-cudnn" in graphs:  # the opara plan's segments with cuDNN's conv + ReLU
            variants.append(("fused opara cudnn", graphs["inductor-cudnn"], "opara", max_streams))
        with torch.inference_mode():
            for label, g, policy, lanes in (v for v in variants if v[0] in wanted):
                plan = plan_graph(g, policy, lanes)
                fused_graph = "inductor-cudnn" if label.endswith("cudnn") else "inductor"
                kind = Candidate(fused_graph if label.startswith("fused") else primary, policy, plan.num_streams)
                try:
                    captured, peak = capture_measured(plan_capture(kind, g, plan, lane_pool, autotune=fused_lanes_autotune), static_in)
                except CaptureError as error:
                    row.notes.append(f"{label}: {error}")
                    progress.update()
                    continue
                row.timings[label] = time_calls(served_call(captured, inputs))
                row.streams[label] = plan.num_streams
                row.peak_mb[label] = peak
                del captured
                progress.update()
            if "auto" in wanted:  # exactly as the serving build chooses, for this one bucket
                auto_report = BuildReport()
                settings = EngineSettings(max_streams=max_streams, fused_lanes=True, layout=layout, autotune=cudnn_benchmark, fused_lanes_autotune=fused_lanes_autotune, precision=numerics)
                captures = {c: plan_capture(c, graphs[c.graph], plan, lane_pool) for c, plan in candidates(graphs, settings).items()}
                captured = capture_fastest(captures, entry, device, [batch], auto_report)[batch]
                row.timings["auto"] = time_calls(served_call(captured, inputs))
                chosen = auto_report.choices[batch]
                row.auto_choice = str(chosen)
                del captured
                # the memory of the chosen graph alone (auto's pool also held the candidates it dropped)
                captured, row.peak_mb["auto"] = capture_measured(captures[chosen], static_in)
                del captured
                progress.update()
        if floors:
            row.critical_path_ms, row.sum_of_ops_ms = min(floors)
        if batch in served:
            row.timings["served"] = served[batch]
        elif served_batches:
            row.notes.append("served: not measured (it needs the build timed, or --no-plan-capture with a --cache-dir an earlier run filled, and a warm build that ends well at a bucket this size)")
        if build and not rows:
            row.plan_capture_s, row.warm_build_s = build.cold_s, build.warm_s
            row.notes.append(build.notes)
        _keep(row, rows, on_row)
    return rows


def _keep(row: Row, rows: list[Row], on_row: Callable[[Row], None] | None) -> None:
    rows.append(row)
    if on_row is not None:
        on_row(row)


def compiled_elsewhere(name: str, batch: int, columns: Sequence[str], row: Row, cache_dir: Path | None, cudnn_benchmark: bool, numerics: str = "fp32") -> None:
    """Time the torch.compile `columns` of one row in a process of their own
    and put them (and their notes) into `row`. cuDNN keeps the first plan it
    made for a convolution's parameters for the whole process, whichever way it
    made it, and Inductor's channels-last convolutions can have the fused
    lanes' parameters: in one process the serving build's heuristic plans
    (fused lanes take the heuristics) could become torch.compile's at the rows
    timed after it, and torch.compile's benchmarked plans the fused columns'
    at rows timed without that build (run 29's NASNet 8/32, ResNet-50 1/32).
    Its own process gives torch.compile what its user gets (`cudnn.benchmark`
    as the bench sets it) and leaves the engine's columns what serving
    replays. Its Inductor cache is its own (`compile` under `cache_dir`,
    reused with it), never the engine's, whose cold build it would warm."""
    with tempfile.TemporaryDirectory(prefix=f"opara-bench-compile-{Path(name).name}-") as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", "opara_core.bench", "--models", name, "--batch", str(batch), "--columns", ",".join(columns),
                   "--no-plan-capture", "--compile-here", "--json", str(out), "--cache-dir", str((cache_dir or Path(tmp)) / "compile")]  # fmt: skip
        command += ["--compile-autotune", name] if "compile max-autotune" in columns else []
        command += [] if cudnn_benchmark else ["--no-cudnn-benchmark"]
        command += ["--precision", numerics]
        env = {k: v for k, v in os.environ.items() if k not in (cache.ENV, INDUCTOR_ENV, TRITON_ENV)}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        measured = _read_json(out) if out.exists() else []
    for got in measured:
        row.timings.update(got.timings)
        row.notes += [f"{note} (in a process of its own)" for note in got.notes]
    missing = [c for c in columns if c not in row.timings]
    if missing:
        row.notes.append(f"{', '.join(missing)}: its process ended with {done.returncode}: {done.stderr.strip()[-500:]}")
        log.warning("%s b%d: %s not measured: %s", name, batch, ", ".join(missing), done.stderr.strip()[-2000:])


def _time_compiled(module: torch.nn.Module, inputs, row: Row, mode: str) -> Timing | None:
    """The torch.compile column (see `compiled_graph`), timed like every other
    graph column; a failing compile is a note, not fatal."""
    try:
        captured = compiled_graph(module, inputs, mode, row.notes)
        with torch.inference_mode():  # its static inputs are inference tensors
            return time_calls(served_call(captured, inputs))
    except Exception as error:  # noqa: BLE001 - a failing baseline is reported, not fatal
        row.notes.append(f"{_compile_label(mode)} failed: {type(error).__name__}: {str(error)[:200]}")
        return None


def compiled_graph(module: torch.nn.Module, inputs, mode: str = "default", notes: list[str] | None = None) -> CapturedGraph:
    """torch.compile as an inference user runs it: under `inference_mode`, with
    Inductor's freezing (weights folded in as constants), replayed from a CUDA
    graph captured here around the compiled call (copy in, replay). `mode` is
    torch.compile's ("default" or "max-autotune-no-cudagraphs")."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(freezing=True), torch.inference_mode():
        compiled = torch.compile(module, mode=mode)
        start = time.perf_counter()
        for x in inputs:
            compiled(*x)
        torch.cuda.synchronize()
        if notes is not None:
            notes.append(f"{_compile_label(mode)} (freezing) compile and warm-up {time.perf_counter() - start:.0f} s")
        return capture_module(compiled, [x.clone() for x in inputs[0]], torch.cuda.graph_pool_handle())


def _compile_label(mode: str) -> str:
    return "torch.compile" + ("" if mode == "default" else f" {mode}")


def _fresh_cache(name: str) -> Path:
    """An empty build cache directory for this model (compiled segments,
    Inductor's own cache, profiles, remembered choices), for this process and
    the processes it starts."""
    return _use_cache(Path(tempfile.mkdtemp(prefix=f"opara-bench-{name}-")))


def _use_cache(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[cache.ENV] = str(directory)
    os.environ[INDUCTOR_ENV] = str(directory / "inductor")
    return directory


def _holds_files(directory: Path) -> bool:
    return directory.is_dir() and any(path.is_file() for path in directory.rglob("*"))


@dataclass(frozen=True)
class BuildTiming:
    """The serving build timed (`_build_seconds`): seconds cold and warm, where
    they went, and the `served` column: the graphs the first warm build
    captured, timed per batch."""

    cold_s: float
    warm_s: float | None
    notes: str
    served: dict[int, Timing]


def _build_seconds(
    entry: ModelSpec, device: torch.device, max_streams: int, fusion: bool, layout: str, cudnn_benchmark: bool, fused_lanes_autotune: bool = False,
    served_batches: Sequence[int] = (),
    numerics: str = "fp32",
) -> BuildTiming:
    """The serving build of all default buckets with `auto` and fused lanes,
    cold (this process, an empty cache) and warm (a new process, the same
    cache): seconds of each (tracing excluded, fusion and profiling included)
    and where the time went. The warm build runs twice, each in a process of
    its own: the first is what a server started after an ahead-of-time build
    pays (and replays: it times its graphs at `served_batches`), the second
    shows whether the first still did work that the cold build left undone
    (T5 13.1 s, then 5.5 s: docs/benchmarks.md run 30)."""
    cold = _build_report(ref_of(entry), device, max_streams, fusion, layout, cudnn_benchmark, fused_lanes_autotune, numerics=numerics)
    command = _build_command(ref_of(entry), max_streams, fusion, layout, cudnn_benchmark, fused_lanes_autotune, numerics)
    warm, again = _warm_build(command, served_batches), _warm_build(command)
    notes = [f"cold build seconds: {_breakdown(cold)}; {cold['inductor']}"]
    if cold["precision_error"]:
        notes.append(f"cold build in {cold['precision']}: " + precision.describe({b: precision.Accuracy(**a) for b, a in cold["precision_error"].items()}))
    notes += [f"cold build fallback: {reason}" for reason in cold["fallbacks"]]
    notes += [f"warm build seconds: {_breakdown(warm)}; {warm['inductor']}" if warm else "warm build failed"]
    notes += [f"second warm build {_build_total(again):.1f} s: {_breakdown(again)}; {again['inductor']}" if again else "second warm build failed"]
    served = _served(warm)
    notes += [_served_note(served)] if served else []
    timing = BuildTiming(_build_total(cold), _build_total(warm) if warm else None, "; ".join(notes), served)
    # logged now too: the row that keeps them is written only when its columns are done,
    # and a run cut before that (a device call's limit) would lose them
    log.info("%s: serving build %.1f s cold, %s warm; %s", entry.name, timing.cold_s, "-" if warm is None else f"{timing.warm_s:.1f} s", timing.notes)
    return timing


def _served_only(
    entry: ModelSpec, max_streams: int, fusion: bool, layout: str, cudnn_benchmark: bool, fused_lanes_autotune: bool, batches: Sequence[int], numerics: str = "fp32"
) -> dict[int, Timing]:
    """The `served` column where the build is not timed: one warm build on the
    cache (a new process, as a server restarted on it), its graphs timed."""
    served = _served(_warm_build(_build_command(ref_of(entry), max_streams, fusion, layout, cudnn_benchmark, fused_lanes_autotune, numerics), batches))
    if served:
        log.info("%s: %s", entry.name, _served_note(served))
    return served


def _build_command(name: str, max_streams: int, fusion: bool, layout: str, cudnn_benchmark: bool, fused_lanes_autotune: bool, numerics: str = "fp32") -> list[str]:
    command = [sys.executable, "-m", "opara_core.bench", "--build-only", name, "--max-streams", str(max_streams), "--layout", layout, "--precision", numerics]
    command += (["--no-fusion"] if not fusion else []) + (["--no-cudnn-benchmark"] if not cudnn_benchmark else [])
    return command + (["--fused-lanes-autotune", name] if fused_lanes_autotune else [])


def _served(report: dict[str, Any] | None) -> dict[int, Timing]:
    return {int(batch): Timing(**timing) for batch, timing in (report or {}).get("served", {}).items()}


def _served_note(served: dict[int, Timing]) -> str:
    return "served (the warm build's graphs) " + ", ".join(f"b{batch} {t.median_ms:.3f} ms" for batch, t in sorted(served.items()))


def _warm_build(command: list[str], served_batches: Sequence[int] = ()) -> dict[str, Any] | None:
    """One `--build-only` run's report; its log goes to this process's stderr
    (where the warm build's own seconds went, and anything it compiled)."""
    command = command + (["--served-batches", ",".join(map(str, served_batches))] if served_batches else [])
    run = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=900)
    if run.returncode != 0:
        log.warning("a warm build failed with exit status %d (its log is above)", run.returncode)
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def _build_report(
    name: str, device: torch.device, max_streams: int, fusion: bool, layout: str, cudnn_benchmark: bool = True, fused_lanes_autotune: bool = False,
    served_batches: Sequence[int] = (),
    numerics: str = "fp32",
) -> dict[str, Any]:
    """One serving build's report; with `served_batches`, its graphs at those
    buckets timed afterwards as every graph column is (not part of its seconds)."""
    entry = model_for(name)
    # the guard on, as in serving: its check of every bucket against eager is part of the build
    settings = EngineSettings(
        max_streams=max_streams, fusion=fusion, layout=layout, fused_lanes=True, autotune=cudnn_benchmark, fused_lanes_autotune=fused_lanes_autotune, precision=numerics
    )
    runner, report = build_runner(entry.build(), entry, device, max(settings.buckets), settings)
    chosen = {str(bucket): str(choice) for bucket, choice in sorted(report.choices.items())}
    graphs = getattr(runner, "graphs", {})  # a GraphRunner's, one per bucket
    served = {}
    with torch.inference_mode():
        for batch in (b for b in served_batches if b in graphs):
            served[str(batch)] = asdict(time_calls(served_call(graphs[batch], rotating_inputs(entry, batch, device))))
    accuracy = {str(b): asdict(a) for b, a in sorted(report.precision_error.items())}
    return {"seconds": report.seconds, "inductor": report.inductor, "remembered": report.remembered, "runner": report.runner, "choices": chosen, "served": served,
            "precision": report.precision, "precision_error": accuracy, "fallbacks": report.fallbacks}  # fmt: skip


def _build_total(report: dict[str, Any]) -> float:
    return sum(v for k, v in report["seconds"].items() if k in ("fusion", "profile", "plan+capture", "capture"))


def _breakdown(report: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in report["seconds"].items())


# ---- report ------------------------------------------------------------------------

COLUMNS = ("eager", "compile", "compile max-autotune", "sequential (unfused)", "sequential", *POLICIES, "sequential nhwc", "fused sequential", "fused opara", "fused opara cudnn", "auto", "served")


def table(rows: Sequence[Row]) -> str:
    head = ["model", "batch", *COLUMNS, "floor", "best/seq", "auto pick", "peak MB seq/auto", "build s cold/warm"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.model + ("" if row.precision == "fp32" else f" {row.precision}"), str(row.batch)]
        for column in COLUMNS:
            t = row.timings.get(column)
            cells.append("-" if t is None else f"{t.median_ms:.3f} (p99 {t.p99_ms:.3f})")
        cells.append("-" if row.critical_path_ms is None else f"{row.critical_path_ms:.3f}")
        seq = row.timings.get("sequential")
        best = min((row.timings[c].median_ms for c in (*POLICIES, "auto") if c in row.timings), default=None)
        cells.append("-" if seq is None or best is None else f"{seq.median_ms / best:.2f}x")
        cells.append(row.auto_choice or "-")
        cells.append("/".join(f"{row.peak_mb[k]:.0f}" if k in row.peak_mb else "-" for k in ("sequential", "auto")))
        cells.append("-" if row.plan_capture_s is None else f"{row.plan_capture_s:.1f}/" + ("-" if row.warm_build_s is None else f"{row.warm_build_s:.1f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_speedups(rows: Sequence[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.model}\nb{r.batch}" for r in rows]
    columns = [c for c in ("compile", "opara", "nimble", "asap", "wavefront", "auto")]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    width = 0.8 / len(columns)
    for k, column in enumerate(columns):
        values = []
        for r in rows:
            seq, t = r.timings.get("sequential"), r.timings.get(column)
            values.append(seq.median_ms / t.median_ms if seq and t else 0)
        ax.bar([i + k * width for i in range(len(rows))], values, width, label=column)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("speedup over the sequential CUDA graph")
    ax.legend(fontsize=7, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def auto_graph(name: str, batch: int, max_streams: int, fusion: bool, numerics: str = "fp32", fused_lanes_autotune: bool = False) -> tuple[CapturedGraph, str]:
    """The graph `auto` builds for one bucket, as serving does (fused lanes
    among the candidates, in `numerics`), and its choice."""
    device = torch.device("cuda")
    entry = model_for(name)
    module = entry.build().to(device).eval()
    settings = EngineSettings(
        max_streams=max_streams, buckets=(batch,), guard=False, fusion=fusion, fused_lanes=True, fused_lanes_autotune=fused_lanes_autotune, precision=numerics
    )
    with precision.numerics(numerics):
        runner, report = build_runner(module, entry, device, batch, settings)
    return runner.graphs[batch], str(report.choices.get(batch, "?"))


def profile_replays(captured: CapturedGraph, replays: int, trace_path: Path) -> list[list[dict[str, Any]]]:
    """Kineto's device events (kernels, copies, sets) of `replays` replays, one
    list per replay in start order; the chrome trace is kept at `trace_path`."""
    for _ in range(3):
        captured.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            captured.replay()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    device_work = ("kernel", "gpu_memcpy", "gpu_memset")
    events = sorted((e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("cat") in device_work), key=lambda e: e["ts"])
    per = len(events) // replays if replays else 0
    return [events[k * per : (k + 1) * per] for k in range(replays)] if per else []


def draw_timeline(events: Sequence[dict[str, Any]], title: str, path: Path) -> None:
    """One replay's device events as bars, one row per CUDA stream."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(e["ts"] for e in events)
    streams = sorted({e["args"].get("stream", e.get("tid")) for e in events})
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(streams) + 1.5))
    for e in events:
        row = streams.index(e["args"].get("stream", e.get("tid")))
        ax.barh(row, e["dur"], left=e["ts"] - start, height=0.8)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams], fontsize=7)
    ax.set_xlabel("µs since the replay's first kernel")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replay_stats(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One replay's device events summed up (µs): `span` from the first start
    to the last end, `busy` when any stream ran, `idle` (span - busy: waiting
    on launches and cross-stream dependencies), `one_stream` when exactly one
    ran (no overlap), `sum` of the durations, and per stream (busiest first) its
    events and their sum. A schedule cannot end before its busiest stream's sum."""
    streams: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        streams.setdefault(str(e["args"].get("stream", e.get("tid"))), []).append((e["ts"], e["ts"] + e["dur"]))
    edges = sorted([(a, 1) for v in streams.values() for a, _ in v] + [(b, -1) for v in streams.values() for _, b in v])
    busy = one_stream = 0.0
    running, last = 0, edges[0][0]
    for at, step in edges:  # at equal times an end sorts before a start
        busy += at - last if running else 0.0
        one_stream += at - last if running == 1 else 0.0
        running, last = running + step, at
    sums = {s: sum(b - a for a, b in v) for s, v in streams.items()}
    span = edges[-1][0] - edges[0][0]
    return {
        "events": len(events), "span": span, "busy": busy, "idle": span - busy, "one_stream": one_stream, "sum": sum(sums.values()),
        "streams": {s: {"events": len(streams[s]), "sum": sums[s]} for s in sorted(sums, key=lambda s: -sums[s])},
    }  # fmt: skip


def plot_timeline(name: str, batch: int, path: Path, max_streams: int, fusion: bool, numerics: str = "fp32", fused_lanes_autotune: bool = False) -> str:
    """Profile 20 replays of the auto graph, draw the median one's kernels per
    CUDA stream (`path`, PNG) and write every replay's `replay_stats` beside it
    (`path` as .json). Returns a line that says what was drawn."""
    captured, choice = auto_graph(name, batch, max_streams, fusion, numerics, fused_lanes_autotune)
    replays = profile_replays(captured, 20, path.with_suffix(".trace.json"))
    if not replays:
        return "no kernels in the trace"
    stats = [replay_stats(events) for events in replays]
    median = sorted(range(len(stats)), key=lambda k: stats[k]["span"])[len(stats) // 2]
    draw_timeline(replays[median], f"{name} batch {batch}, {numerics}: {choice} graph replay, kernels per stream", path)
    meta = {"model": name, "batch": batch, "precision": numerics, "choice": choice, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "median": stats[median], "replays": stats}, indent=1))
    m = stats[median]
    return f"{choice}, {numerics}; median replay (µs): span {m['span']:.1f}, busy {m['busy']:.1f}, idle {m['idle']:.1f}, one stream {m['one_stream']:.1f}, kernel sum {m['sum']:.1f} on {len(m['streams'])} streams"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opara_core.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help=f"zoo models or model directories, comma-separated (default: every zoo model, {','.join(zoo.names())}, unless --model-dir is given)")
    parser.add_argument("--model-dir", type=Path, action="append", default=[], help="a model directory to time as the zoo's are (config.pbtxt and 1/model.py, e.g. written by `python -m opara_core add-model`); repeatable")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--max-streams", type=int, default=8)
    parser.add_argument("--compile-models", default=None, help="models to time with torch.compile (default: all; it is slow to compile)")
    parser.add_argument("--compile-autotune", default="", help="models to also time with torch.compile max-autotune-no-cudagraphs (slow to compile)")
    parser.add_argument("--fused-lanes-autotune", default="", help="models whose fused lanes time their convolutions' cuDNN algorithms (the engine setting fused_lanes_autotune): fused-lanes columns, auto and build")
    parser.add_argument("--no-fusion", action="store_true")
    parser.add_argument("--columns", default="", help=f"only these columns, comma-separated (default all: {', '.join(COLUMNS)}); --report merges a model's rows from several files")
    parser.add_argument("--no-plan-capture", action="store_true", help="skip timing the serving build of all buckets")
    parser.add_argument("--cache-dir", type=Path, help="keep the build cache (traces, profiles, compiled segments) here instead of a fresh temporary one; a cache that holds files is reused and needs --no-plan-capture (the build timing needs an empty one)")
    parser.add_argument("--no-cudnn-benchmark", action="store_true", help="cuDNN's heuristic convolution algorithms in every column (the engine's autotune setting off) instead of timing them per shape (fused-lanes columns take the heuristics unless --fused-lanes-autotune)")
    parser.add_argument("--layout", choices=("auto", "nchw", "nhwc"), default="auto", help="layouts auto may choose (policy columns: NCHW unless nhwc)")
    parser.add_argument("--precision", default="fp32", help="what every column computes in, comma-separated for a run of each (rows per precision): fp32, tf32, bf16, fp16 (the engine setting `precision`; eager and torch.compile run the module cast to it)")
    parser.add_argument("--plot", type=Path, help="PNG of speedups over the sequential graph")
    parser.add_argument("--timeline", type=Path, help="PNG of the first model's auto graph at batch 1 (the first --precision), its kernels per stream over a median replay, and beside it (.json) per replay: span, busy, idle and one-stream time, kernel sums per stream")
    parser.add_argument("--report", type=Path, nargs="+", help="no run: print the table (and --plot) of these JSON files")
    parser.add_argument("--compile-here", action="store_true", help=argparse.SUPPRESS)  # the torch.compile columns in this process (compiled_elsewhere's)
    parser.add_argument("--build-only", metavar="MODEL", help=argparse.SUPPRESS)  # one serving build, its report as JSON (the warm build)
    parser.add_argument("--served-batches", default="", help=argparse.SUPPRESS)  # with --build-only: time its graphs at these buckets
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the engine's progress notes on stderr, timed: where a build's minutes went
    # (tracing, fusion checks, profiles, each kernel choice, segments compiled)
    logging.getLogger("opara_core").setLevel(logging.INFO)
    if args.build_only:
        if not torch.cuda.is_available():
            print("error: the serving build's timing needs a CUDA GPU", file=sys.stderr)
            return 2
        lanes_autotune = model_for(args.build_only).name in args.fused_lanes_autotune.split(",")
        served_batches = [int(b) for b in args.served_batches.split(",") if b]
        report = _build_report(args.build_only, torch.device("cuda"), args.max_streams, not args.no_fusion, args.layout, not args.no_cudnn_benchmark, lanes_autotune, served_batches, args.precision.split(",")[0])
        print(json.dumps(report))
        return 0
    if args.report:
        read = [row for path in args.report for row in _read_json(path)]
        rows = merge_rows(read)
        log.info("%d rows from %d files, %d after merging", len(read), len(args.report), len(rows))
        print(table(rows))
        if args.plot:
            plot_speedups(rows, args.plot)
        return 0
    try:
        named = args.models if args.models is not None else ("" if args.model_dir else ",".join(zoo.names()))
        entries = [model_for(ref) for ref in [*filter(None, named.split(",")), *map(str, args.model_dir)]]
        models = [ref_of(entry) for entry in entries]
        names = {ref_of(entry): entry.name for entry in entries}
        batches = [int(b) for b in args.batch.split(",")]
        columns = parse_columns(args.columns)
        precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
        for asked in precisions:
            parameters.get("precision").check(asked, "--precision")
        lanes_models = list(filter(None, args.fused_lanes_autotune.split(",")))
        unknown = sorted(set(lanes_models) - set(names.values()))
        if unknown:
            raise KeyError(f"--fused-lanes-autotune {','.join(unknown)}: not among the models timed ({', '.join(names.values())})")
        if lanes_models and args.no_cudnn_benchmark:
            raise ValueError("--fused-lanes-autotune times cuDNN's algorithms, which --no-cudnn-benchmark turns off")
    except (KeyError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.cache_dir and not args.no_plan_capture and (len(models) > 1 or _holds_files(args.cache_dir)):
        print(f"error: --cache-dir {args.cache_dir}: the cold build timing needs an empty cache and one model; "
              "add --no-plan-capture to reuse a cache", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from tqdm import tqdm

    rows: list[Row] = []

    def keep(row: Row) -> None:
        rows.append(row)
        if args.json:
            _write_json(args.json, rows, sys.argv[1:] if argv is None else argv)

    steps = len(models) * len(batches) * len(precisions) * (2 + 3 + len(POLICIES) + 1)
    with tqdm(total=steps, desc="bench", file=sys.stderr) as progress:
        for ref in models:
            name = names[ref]
            progress.set_postfix_str(name)
            compile_ = args.compile_models is None or name in args.compile_models.split(",")
            autotune = name in args.compile_autotune.split(",")
            lanes_autotune = name in lanes_models
            for numerics in precisions:
                with precision.numerics(numerics):
                    bench_model(
                        ref, batches, compile_, args.max_streams, not args.no_fusion, progress, args.layout, not args.no_plan_capture, autotune, keep, columns,
                        args.cache_dir, not args.no_cudnn_benchmark, args.compile_here, lanes_autotune, numerics,
                    )
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{args.precision} (fp32's cuDNN TF32 {'on' if torch.backends.cudnn.allow_tf32 else 'off'}, cuDNN benchmark {'on' if torch.backends.cudnn.benchmark else 'off'}), times in ms: median (p99)")
    print(table(rows))
    for row in rows:
        for note in row.notes:
            print(f"note {row.model} b{row.batch}: {note}")
    if args.plot:
        plot_speedups(rows, args.plot)
    if args.timeline:
        line = plot_timeline(models[0], 1, args.timeline, args.max_streams, not args.no_fusion, precisions[0], names[models[0]] in lanes_models)
        print(f"timeline: {models[0]} batch 1, {line}")
    return 0


def parse_columns(text: str) -> tuple[str, ...]:
    """`--columns`: names of COLUMNS, comma-separated; empty for all."""
    names = tuple(c.strip() for c in text.split(",") if c.strip())
    unknown = [c for c in names if c not in COLUMNS]
    if unknown:
        raise ValueError(f"unknown column(s) {', '.join(map(repr, unknown))}; the columns are {', '.join(COLUMNS)}")
    return names or COLUMNS


def merge_rows(rows: Sequence[Row]) -> list[Row]:
    """One row per (model, batch), in first-seen order: a model measured column
    by column in several runs (`--columns`) becomes one row. Where two runs
    measured the same column, the later one counts and a note says so."""
    merged: dict[tuple[str, int], Row] = {}
    for row in rows:
        key = (row.model, row.batch, row.precision)
        if key not in merged:
            merged[key] = replace(row, timings=dict(row.timings), streams=dict(row.streams), peak_mb=dict(row.peak_mb), notes=list(row.notes))
            continue
        into = merged[key]
        again = sorted(set(into.timings) & set(row.timings))
        if again:
            into.notes.append(f"measured twice, the later run kept: {', '.join(again)}")
        into.timings.update(row.timings)
        into.streams.update(row.streams)
        into.peak_mb.update(row.peak_mb)
        into.notes += [n for n in row.notes if n not in into.notes]
        into.auto_choice = row.auto_choice or into.auto_choice
        into.kernels = into.kernels or row.kernels
        for name in ("critical_path_ms", "sum_of_ops_ms", "plan_capture_s", "warm_build_s"):
            if getattr(row, name) is not None:
                setattr(into, name, getattr(row, name))
    return list(merged.values())


def _read_json(path: Path) -> list[Row]:
    rows = []
    for data in json.loads(path.read_text())["rows"]:
        data["timings"] = {k: Timing(**v) for k, v in data["timings"].items() if v is not None}
        rows.append(Row(**data))
    return rows


def _write_json(path: Path, rows: Sequence[Row], argv: Sequence[str]) -> None:
    """The rows and how they were measured; `argv`: the bench's arguments, as a
    list (dev/gpu_queue.py counts rows only from runs of the same extra arguments)."""
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "argv": list(argv),
    }
    path.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
