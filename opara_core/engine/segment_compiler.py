"""Inductor-compiled segments, kept on disk by structure and loaded without recompiling.

Fused lanes compile every segment of a plan with Inductor at each bucket's
shapes. Through `torch.compile` every build traced each segment again with
Dynamo, and graphs with frozen weights cannot be saved to load later
(`standalone_compile` refuses them). So a segment is compiled here as a function
of its activations *and* its weights (each weight `get_attr` lifted to an input,
every name made canonical) with `torch._inductor.standalone_compile`:

- the code depends only on the segment's operators and its inputs' shapes,
  strides and dtypes, never on weight values: segments of the same structure
  at the same shapes (BERT's twelve layers) compile once, and new weights for a
  model reuse its code;
- each compilation is saved under that key in the cache directory; a later
  build loads it (`load_saved`) without tracing or compiling;
- what is missing compiles in parallel worker processes, one segment each:
  Inductor's own compile is mostly single-threaded Python;
- which segments a plan calls with which input layouts is found by running it
  once, and kept, so that a warm build need not record: it loads the code and
  runs each plan once, both while other builds have the GPU (`prepare`).

Inductor converts a convolution weight that is an input to channels-last at
every call unless it already is (its convolution lowering), so fused lanes
compile the channels-last graph of convolutional models (engine.build).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import multiprocessing
import operator
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Interpreter, Node
from torch.fx.node import map_aggregate

from opara_core.cpus import usable_cpus
from opara_core.engine import cache, custom_ops, gpu_turn
from opara_core.engine.compare import cudnn_algorithms, max_relative_error
from opara_core.engine.precision import EAGER_FACTOR, HALF

log = logging.getLogger(__name__)

# bump when what a key covers changes (2: compiled without dynamic_scale_rblock; 3: keyed through engine.cache)
FORMAT = 3
# what compiled code depends on of the software: not cuDNN or its benchmark switch (a convolution
# is an ATen call in the code, its algorithm picked at run time; `prepare` sets the switch)
SOFTWARE = ("gpu", "torch", "tf32")
MAX_WORKERS = 8
# Compile workers are throughput work: the builds' own threads (module, export, recording) go first.
# At a cold start several models build at once, each with up to MAX_WORKERS workers; on one H100
# (2026-12-07) NASNet's module took 76.4 s to build beside them, about 4 s alone on a 2-core CPU. Beside
# four busy processes on that CPU it took 6.8 s against 3.0 alone, and 2.8 s with them at nice 10.
WORKER_NICENESS = 10
CHECK_TOLERANCE = 5e-2  # a segment's code against its ATen operators (TF32 either side)

# compiled code by cache directory and key, shared by every segment of that structure in this process
_loaded: dict[str, dict[str, Callable[..., Any]]] = {}


@dataclass(frozen=True)
class TensorMeta:
    """What compiled code assumes about one input."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype, str(tensor.device))

    @property
    def layout(self) -> tuple:
        """This input's entry of `layout`."""
        return (self.shape, self.stride, self.offset, self.dtype)

    def to_json(self) -> list:
        return [list(self.shape), list(self.stride), self.offset, str(self.dtype).removeprefix("torch."), self.device]

    @classmethod
    def from_json(cls, data: list) -> TensorMeta:
        shape, stride, offset, dtype, device = data
        return cls(tuple(shape), tuple(stride), offset, getattr(torch, dtype), device)

    def empty(self) -> torch.Tensor:
        """An uninitialised tensor with exactly this layout (compiling reads no values)."""
        extent = 1 + sum((size - 1) * step for size, step in zip(self.shape, self.stride)) if all(self.shape) else 0
        storage = torch.empty(self.offset + extent, dtype=self.dtype, device=self.device)
        return storage.as_strided(self.shape, self.stride, self.offset)


def canonical(segment: GraphModule) -> tuple[GraphModule, list[torch.Tensor]]:
    """The segment as a function of (inputs..., weights...) with canonical names,
    and its weights in that order: two segments of the same structure get the
    same code, whatever their nodes and weights were called."""
    graph = Graph()
    env: dict[Any, Any] = {}
    placeholders = [n for n in segment.graph.nodes if n.op == "placeholder"]
    weights = [n for n in segment.graph.nodes if n.op == "get_attr"]
    for i, node in enumerate(placeholders):
        env[node] = graph.placeholder(f"x{i}")
    for i, node in enumerate(weights):
        env[node] = graph.placeholder(f"w{i}")
    body = [n for n in segment.graph.nodes if n.op not in ("placeholder", "get_attr")]
    for i, node in enumerate(body):
        args = torch.fx.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.map_arg(node.kwargs, env.__getitem__)
        env[node] = graph.create_node(node.op, node.target, args, kwargs, name=f"v{i}" if node.op != "output" else "output")
    return GraphModule(torch.nn.Module(), graph), [operator.attrgetter(n.target)(segment) for n in weights]


def segment_key(code: str, metas: Sequence[TensorMeta]) -> str:
    """The key (engine.cache) of everything the compiled code depends on: the
    segment's code, its inputs' layouts, and the GPU, torch and TF32 switches."""
    device = metas[0].device if metas else "cpu"
    inputs = [[list(m.shape), list(m.stride), m.offset, str(m.dtype), m.device] for m in metas]
    return cache.key({"code": code, "inputs": inputs, "format": FORMAT}, SOFTWARE, device)


def layout(inputs: Sequence[torch.Tensor]) -> tuple:
    """What tells one compilation of a segment from another: its inputs' layouts."""
    return tuple((tuple(x.shape), x.stride(), x.storage_offset(), x.dtype) for x in inputs)


class CompiledSegment(torch.nn.Module):
    """One segment: Inductor's code for each input layout it was compiled for,
    called with the segment's weights; the segment's own fx module (eager) for
    any other layout."""

    def __init__(self, segment: GraphModule):
        super().__init__()
        self.eager = segment
        self.code, self.weights = canonical(segment)
        self.compiled: dict[tuple, Callable[..., Any]] = {}
        self.eager_calls = 0  # calls at layouts not compiled for (see `prepare`)

    def forward(self, *inputs: torch.Tensor) -> tuple:
        compiled = self.compiled.get(layout(inputs))
        if compiled is None:
            self.eager_calls += 1
            return self.eager(*inputs)
        return tuple(compiled(*inputs, *self.weights))


@dataclass(frozen=True)
class CompileCount:
    """What preparing one set of shapes did, and where its seconds went."""

    segments: int = 0  # segment calls at these shapes
    distinct: int = 0  # distinct keys among them
    loaded: int = 0  # read from the cache directory
    compiled: int = 0  # compiled anew (then saved)
    unsaved: int = 0  # of those, not saved (Inductor's cache bypassed them): compiled again by every build
    record_s: float = 0.0  # running each module once to find its segments' inputs
    compile_s: float = 0.0  # waiting for the compile workers once the runs recorded (they start during them), compiling here
    load_s: float = 0.0  # load_saved
    check_s: float = 0.0  # each new code's check against its ATen operators
    records_read: int = 0  # runs whose segments' inputs came from the cache directory, not a run
    first_run_s: float = 0.0  # where every record was read: running each module once (see `prepare`)

    def __add__(self, other: CompileCount) -> CompileCount:
        return CompileCount(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __str__(self) -> str:
        unsaved = f" ({self.unsaved} not saved: Inductor bypassed its cache)" if self.unsaved else ""
        seconds = f"; seconds: record {self.record_s:.1f}, compile {self.compile_s:.1f}, load {self.load_s:.1f}, check {self.check_s:.1f}"
        seconds += f", first runs {self.first_run_s:.1f}" if self.first_run_s else ""
        read = f"; {self.records_read} recorded runs read from the cache" if self.records_read else ""
        return f"{self.segments} segment calls, {self.distinct} distinct: {self.loaded} loaded, {self.compiled} compiled{unsaved}{seconds}{read}"


class _Recorder(Interpreter):
    """Runs a fused-lanes top module once and keeps each segment's inputs."""

    def __init__(self, module: GraphModule):
        super().__init__(module)
        self.calls: list[tuple[str, tuple]] = []

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        self.calls.append((target, args))
        return super().call_module(target, args, kwargs)


def prepare(
    runs: Sequence[tuple[GraphModule, Sequence[torch.Tensor]]], cache_dir: Path, workers: int | None = None, autotune: bool = False
) -> CompileCount:
    """Make every CompiledSegment of each fused-lanes module ready for its
    inputs' shapes, for every (module, inputs) of `runs` at once: run each
    module once (segments not compiled for these shapes run eagerly) to find
    each segment's inputs, load what the cache directory holds and compile
    the rest, in one pool of workers that takes a run's segments while later
    runs still record (`_Workers`). What a run found is
    kept in the cache directory too, and a later build reads it instead of
    running the module where every segment's code is saved and has passed its
    check. (NASNet's warm recording runs took 31.3 of its 52.3 s, run 19, but
    most of that was cuDNN planning each convolution at its first call, which
    the captures then do instead: warm build 52.3 -> ~49 s, run 20.) Those
    runs pick each convolution's cuDNN algorithm by timing them with
    `autotune`, by cuDNN's heuristics without (engine.fused_lanes).

    Where every run's record was read (a warm build), loading the code and
    one run of each module, which plans its convolutions and loads its
    kernels, happen aside from the build's GPU turn (engine.gpu_turn): it is
    host work, and inside the turn it held every other model's build back
    (NASNet's first captures of remembered choices: 23.8 s of its turn in the
    shipped repository's warm start on an H100, 2026-12-06, with 540 segments
    loaded in 5.1 s before them). The captures then find the plans made: on
    this thread (they run on it, engine.fused_lanes) and in this mode. Not
    with `autotune`: its first runs time cuDNN's algorithms, which needs the
    GPU to itself; its captures run them inside the turn, as before."""
    if autotune:
        gpu_turn.take()  # its runs time cuDNN's algorithms: the GPU to itself (a turn held lazily is taken here)
    with cudnn_algorithms(benchmark=autotune):
        return _prepare(runs, cache_dir, workers, first_runs_aside=not autotune)


def _prepare(
    runs: Sequence[tuple[GraphModule, Sequence[torch.Tensor]]], cache_dir: Path, workers: int | None, first_runs_aside: bool = True
) -> CompileCount:
    wanted: dict[str, list[tuple[CompiledSegment, tuple]]] = {}
    jobs: dict[str, tuple[GraphModule, list[TensorMeta]]] = {}
    samples: dict[str, tuple] = {}  # one call's inputs per key
    # code in memory counts only for the directory it came from, so that each
    # cache directory ends up holding all of its builds' segments
    loaded = _loaded.setdefault(str(cache_dir), {})
    wrong: set[str] = set()  # an earlier build found their code wrong (the marker says how)
    on_disk: list[str] = []
    missing: list[str] = []
    unsaved: set[str] = set()  # segments an earlier build could not save: compiled here at once, not twice
    calls = 0
    read = 0  # runs whose record was read: their module has not run in this process
    seconds = dict.fromkeys(("record", "compile", "load", "check", "first run"), 0.0)
    start = time.perf_counter()
    with _Workers(cache_dir, workers) as compiler:
        for top, inputs in runs:
            record = _record_path(cache_dir, top, inputs)
            found = _read_record(record, top, cache_dir)
            if found is None:
                found = _record(top, inputs)
                _write_record(record, found)
            else:
                read += 1
            for target, arg_metas, args in found:
                segment = top.get_submodule(target)
                shapes = tuple(m.layout for m in arg_metas)
                if shapes in segment.compiled:
                    continue
                calls += 1
                metas = [*arg_metas, *map(TensorMeta.of, segment.weights)]
                key = segment_key(segment.code.code, metas)
                if args is not None:
                    samples.setdefault(key, args)
                if key in wanted:
                    wanted[key].append((segment, shapes))
                    continue
                wanted[key] = [(segment, shapes)]
                jobs[key] = (segment.code, metas)
                if key in loaded:
                    pass
                elif _wrong_marker(cache_dir, key).exists():
                    wrong.add(key)
                elif _path(cache_dir, key).exists():
                    on_disk.append(key)
                else:
                    missing.append(key)
                    if _unsaved_marker(cache_dir, key).exists():
                        unsaved.add(key)
                    else:  # the workers compile it while the next runs record
                        compiler.submit(key, *jobs[key])
        seconds["record"] = time.perf_counter() - start
        start = time.perf_counter()
        if compiler.submitted:
            with gpu_turn.aside(f"fused lanes: compiling {compiler.submitted} segments"):
                unsaved_now = compiler.wait()
            for key in unsaved_now:
                _unsaved_marker(cache_dir, key).touch()
                unsaved.add(key)
        seconds["compile"] = time.perf_counter() - start
    # a warm build only loads (host work) and runs each module once: other builds may have the GPU meanwhile
    warm = first_runs_aside and bool(runs) and read == len(runs)
    with gpu_turn.aside(f"fused lanes: loading {len(on_disk)} segments, running {len(runs)} plans once") if warm else contextlib.nullcontext():
        # loading and checking compile what they still need here, one kernel at a time, as the
        # workers do (_worker_setup): see in_this_process
        with in_this_process():
            for key in wrong:  # an earlier build found its code wrong (the marker says how)
                loaded[key] = wanted[key][0][0].code
            for key in (*on_disk, *missing):
                segment = wanted[key][0][0]
                start = time.perf_counter()
                if key in unsaved:  # Inductor compiled it but could not save it: compile it again here, kept in memory
                    code = _compile(*jobs[key])
                    seconds["compile"] += time.perf_counter() - start
                else:
                    code = load_saved(_path(cache_dir, key))
                    seconds["load"] += time.perf_counter() - start
                start = time.perf_counter()
                fresh = key in missing and key not in unsaved  # compiled by a worker just now: one more try here if wrong
                loaded[key] = _checked(segment, code, samples.get(key), cache_dir, key, saved=key not in unsaved, retry=fresh)
                seconds["check"] += time.perf_counter() - start
                if loaded[key] is segment.code and fresh:
                    start = time.perf_counter()
                    loaded[key] = _compiled_here(segment, jobs[key], samples[key], cache_dir, key)
                    seconds["compile"] += time.perf_counter() - start
        for key, uses in wanted.items():
            for segment, shapes in uses:
                segment.compiled[shapes] = loaded[key]
        for top, _ in runs:
            for segment in top.modules():
                if isinstance(segment, CompiledSegment):
                    segment.eager_calls = 0  # the recording runs' do not count
        if warm:
            start = time.perf_counter()
            _first_runs(runs)
            seconds["first run"] = time.perf_counter() - start
    counts = (seconds[k] for k in ("record", "compile", "load", "check"))
    return CompileCount(calls, len(wanted), len(on_disk), len(missing), len(unsaved), *counts, read, seconds["first run"])


def _first_runs(runs: Sequence[tuple[GraphModule, Sequence[torch.Tensor]]]) -> None:
    """Run each module once on its inputs and wait for it: what a recording
    run does besides recording (cuDNN plans each convolution at its first
    call, CUDA loads each kernel at its first launch)."""
    with torch.inference_mode():
        for top, inputs in runs:
            top(*inputs)
    devices = {x.device for _, inputs in runs for x in inputs if x.is_cuda}
    for device in devices:
        torch.cuda.synchronize(device)
    if devices:  # their activations were cached for this thread's stream, where no graph of the build reuses them
        torch.cuda.empty_cache()


# A segment's inputs: (its submodule's name, their metas, the tensors themselves or None where read from a record).
Call = tuple[str, list[TensorMeta], "tuple | None"]


def _record(top: GraphModule, inputs: Sequence[torch.Tensor]) -> list[Call]:
    """Run `top` once (segments not compiled for these shapes run eagerly) and
    keep each segment's inputs."""
    recorder = _Recorder(top)
    with torch.inference_mode():
        recorder.run(*inputs)
    return [(target, [TensorMeta.of(x) for x in args], args) for target, args in recorder.calls if isinstance(top.get_submodule(target), CompiledSegment)]


def _record_path(cache_dir: Path, top: GraphModule, inputs: Sequence[torch.Tensor]) -> Path:
    """Where the segments' inputs of one run of `top` on inputs like these are
    kept: keyed by everything they depend on (the top graph's code, every
    segment's code and the layouts of its weights and of the inputs)."""
    segments = {name: m.code.code for name, m in top.named_modules() if isinstance(m, CompiledSegment)}
    key = cache.key(
        {
            "top": top.code,
            "segments": segments,
            "tensors": {name: TensorMeta.of(t).to_json() for name, t in top.state_dict(keep_vars=True).items()},
            "inputs": [TensorMeta.of(x).to_json() for x in inputs],
            "format": FORMAT,
        },
        ("gpu", "torch"),
        inputs[0].device if inputs else "cpu",
    )
    return cache_dir / "records" / f"{key}.json"


def _write_record(path: Path, calls: list[Call]) -> None:
    cache.write_json(path, [[target, [m.to_json() for m in metas]] for target, metas, _ in calls])


def _read_record(path: Path, top: GraphModule, cache_dir: Path) -> list[Call] | None:
    """A warm build's segments' inputs without running `top`: only where every
    segment's code is ready without a sample to check or compile it against
    (in memory, found wrong, or saved and checked once), else None."""
    calls = cache.read_json(path, lambda data: [(target, [TensorMeta.from_json(m) for m in metas], None) for target, metas in data], "segments' record")
    if calls is None:  # none yet, or unreadable: run it
        return None
    try:
        segments = [top.get_submodule(target) for target, _, _ in calls]
    except AttributeError:  # a record of another module
        return None
    loaded = _loaded.get(str(cache_dir), {})
    for segment, (_, metas, _) in zip(segments, calls):
        key = segment_key(segment.code.code, [*metas, *map(TensorMeta.of, segment.weights)])
        saved = _path(cache_dir, key).exists() and _passed_marker(cache_dir, key).exists()
        if key not in loaded and not _wrong_marker(cache_dir, key).exists() and not saved:
            return None
    return calls


def _checked(
    segment: CompiledSegment, compiled: Callable[..., Any], sample: tuple | None, cache_dir: Path, key: str, saved: bool = True, retry: bool = False
) -> Callable[..., Any]:
    """Inductor's code for a segment, used only if it computes what the segment
    does on `sample` (torch 2.11's failed on BERT's attention mask with an
    IndexError when a worker had compiled it: see PortableGraph). Otherwise the segment
    runs its ATen operators: its canonical fx module, which takes the weights of
    whichever segment of that structure calls it; the wrong marker says why to
    later builds. Saved code that passed once is not checked again (its passed
    marker): the same bytes load the same kernels. With `retry` the caller
    compiles failing code once more, so the failure is no warning yet."""
    passed = _passed_marker(cache_dir, key)
    if saved and passed.exists():
        return compiled
    if sample is None:  # a record was read only where every segment's code had passed (_read_record)
        raise RuntimeError(f"segment {key}: no inputs to check its code with")
    try:
        with torch.inference_mode():
            got = compiled(*[x.clone() for x in sample], *segment.weights)
            want = segment.eager(*[x.clone() for x in sample])
        error = max_relative_error(tuple(got), tuple(want))
        problem = f"relative error {error:.2g} against the segment's ATen operators"
        if error > CHECK_TOLERANCE and (exact := _in_fp32(segment, sample)) is not None:
            own, aten = max_relative_error(tuple(got), exact), max_relative_error(tuple(want), exact)
            if own <= EAGER_FACTOR * aten:  # as right as half precision allows
                error = 0.0
            problem += f"; against them in fp32 {own:.2g}, theirs {aten:.2g}"
        if error <= CHECK_TOLERANCE:
            if saved:
                passed.touch()
            return compiled
    except Exception as error:  # noqa: BLE001 - the ATen operators still run
        problem = f"{type(error).__name__}: {error}"
    if retry:  # no wrong marker yet: the caller's second compile decides
        log.info("a segment's code from a compile worker fails its check (%s); compiling it again in this process", problem)
    else:
        log.warning("a segment's Inductor code fails its check (%s); it runs its ATen operators", problem)
        cache.write_text(_wrong_marker(cache_dir, key), problem)
    return segment.code


def _in_fp32(segment: CompiledSegment, sample: tuple) -> tuple | None:
    """The segment's ATen operators in fp32 where it computes in bf16 or fp16:
    `sample` and its weights cast up, and every half-precision dtype its
    operators name (a cast to bf16 inside it, a tensor it creates) made fp32;
    else None (also where an operator refuses fp32).

    Two right half-precision codes differ by their roundings: on one H100
    (2026-12-06) six of NASNet's bf16 segments and six of ResNet-50's differed
    from their ATen operators by 0.08-0.19, far beyond CHECK_TOLERANCE, and
    were compiled again one after another (about 90 s of NASNet's cold start)
    to run ATen's kernels. So a half-precision segment's code also passes
    where it is within EAGER_FACTOR times the ATen operators' own error
    against fp32, the bound the model's guard uses (engine.precision). The
    engine's own ops run as ATen's (custom_ops.aten_references): in fp32 they
    would time every shape they meet."""
    half = set(HALF.values())
    named: list[torch.dtype] = []  # the half-precision dtypes the operators name

    def up(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.float() if value.dtype in half else value
        if isinstance(value, torch.dtype) and value in half:
            named.append(value)
            return torch.float32
        return value

    graph = copy.deepcopy(segment.code.graph)
    references = custom_ops.aten_references()
    for node in graph.nodes:
        node.args, node.kwargs = map_aggregate(node.args, up), map_aggregate(node.kwargs, up)
        if node.op == "call_function" and node.target in references:  # ATen's computation, not the engine's timed choice
            node.target = references[node.target]
    if not named and not any(t.dtype in half for t in (*sample, *segment.weights) if isinstance(t, torch.Tensor)):
        return None
    try:
        with torch.inference_mode():
            return tuple(GraphModule(segment.code, graph)(*map(up, sample), *map(up, segment.weights)))
    except (RuntimeError, TypeError) as error:  # an operator without fp32
        log.info("a half-precision segment refused fp32 (%s: %s); it is checked against its ATen operators alone", type(error).__name__, error)
        return None


def _compiled_here(segment: CompiledSegment, job: tuple[GraphModule, Sequence[TensorMeta]], sample: tuple, cache_dir: Path, key: str) -> Callable[..., Any]:
    """A segment whose code from a compile worker failed its check, compiled
    once more in this process and checked again. On the H100 (torch 2.11) the
    whole-model BERT graph failed its check (IndexError) after the build's
    workers compiled it (docs/benchmarks.md run 10: 2.32 ms, its ATen
    operators) and passed when the building process compiled it (run 9: 1.41
    ms): a worker's code of a segment computing tensors from no input expected
    them as inputs (PortableGraph, which now sends workers the graph itself).
    Any other such failure still gets one more compile here. Code that passes
    replaces the worker's on disk; code that fails gets the wrong marker, and
    the ATen operators run."""
    try:
        artifact = _compile(*job)
    except Exception as error:  # noqa: BLE001 - the ATen operators still run
        cache.write_text(_wrong_marker(cache_dir, key), f"compiled again here: {type(error).__name__}: {error}")
        return segment.code
    code = _checked(segment, artifact, sample, cache_dir, key, saved=False)
    if code is artifact:
        try:
            with cache.atomic(_path(cache_dir, key)) as partial:
                artifact.save(path=str(partial), format="binary")
            _passed_marker(cache_dir, key).touch()
        except RuntimeError:  # nothing to save: later builds compile it here, as they do every unsaved segment
            _path(cache_dir, key).unlink(missing_ok=True)
            _unsaved_marker(cache_dir, key).touch()
    log.info("segment %s compiled again in this process: %s", key, "its check passed" if code is artifact else "its check failed again")
    return code


def load_saved(path: Path) -> Callable[..., Any]:
    """A saved segment's code. Where the cold build compiled it into this same
    Inductor cache, the cache holds every entry the file carries, and the code
    is looked up there directly; `CompiledArtifact.load` first writes all of
    them again (`load_cache_artifacts`): 14.1 against 8.9 ms per artifact, on
    NASNet-like cells on an H200 (the probe scripts/artifact_load_probe.py, since removed; docs/benchmarks.md
    run 35), and NASNet's warm build loads 451 (its loads in run 36 were no faster,
    14-19 ms each on slower machine instances: most of a load is Inductor's own
    lookup and the first load's imports there). Where the lookup finds nothing
    (a cache filled elsewhere, entries evicted) or this torch lays its files out
    otherwise, the public load."""
    try:
        return load_from_cache(path)
    except Exception as error:  # noqa: BLE001 - the public load does the same in full
        log.debug("segment %s not found in Inductor's cache (%s: %s); loading the whole artifact", path.name, type(error).__name__, error)
    return torch._inductor.CompiledArtifact.load(path=str(path), format="binary")


def load_from_cache(path: Path) -> Callable[..., Any]:
    """`CompiledArtifact.load` of a file `standalone_compile` saved, without
    its `load_cache_artifacts` (torch's private `CacheCompiledArtifact._load_impl`;
    it raises where Inductor's cache lacks an entry)."""
    from torch._inductor.codecache import torch_key
    from torch._inductor.standalone_compile import CacheCompiledArtifact
    from torch.utils._appending_byte_serializer import BytesReader

    reader = BytesReader(path.read_bytes())
    if reader.read_bytes() != CacheCompiledArtifact.CACHE_HEADER or reader.read_bytes() != torch_key():
        raise ValueError("not a standalone_compile artifact of this torch")
    return CacheCompiledArtifact._load_impl(contextlib.nullcontext(), reader.read_str())


def _path(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"{key}.bin"


def _unsaved_marker(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"{key}.unsaved"


def _wrong_marker(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"{key}.wrong"


def _passed_marker(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"{key}.passed"


def _compile(code: GraphModule, metas: Sequence[TensorMeta]) -> Any:
    """Inductor's code for the segment, without `dynamic_scale_rblock`: that
    adds halved-R0_BLOCK variants of a reduction's configurations at its first
    call, and where one of them wins, torch 2.11 never finds the saved choice
    again (its autotune cache wants the choice among the kernel's original
    configurations), so every warm build timed those kernels again: NASNet's
    classifier-tail reductions, 5 of them, 1.2-1.4 s of each warm build
    (docs/benchmarks.md run 35)."""
    with torch.inference_mode(), torch._inductor.config.patch(dynamic_scale_rblock=False):
        return torch._inductor.standalone_compile(code, [m.empty() for m in metas], dynamic_shapes="from_example_inputs")


def compile_one(key: str, code: GraphModule, metas: Sequence[TensorMeta], cache_dir: Path) -> tuple[str, str | None]:
    """Compile one segment for inputs like `metas` and save it as `key`
    (atomically). Returns the key and, where Inductor's cache bypassed the
    segment so that there is nothing to save, why."""
    bypassed = _BypassReasons()
    with bypassed:
        artifact = _compile(code, metas)
    try:
        with cache.atomic(_path(cache_dir, key)) as partial:
            artifact.save(path=str(partial), format="binary")
    except RuntimeError as error:  # "no artifact to save"
        reason = "; ".join(bypassed.reasons) or str(error)
        log.warning("segment %s compiled but not saved: %s", key, reason)
        return key, reason
    return key, None


class _BypassReasons(logging.Handler):
    """Collects why Inductor's FX graph cache bypassed a compilation (its log)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.reasons: list[str] = []
        self.logger = logging.getLogger("torch._inductor.codecache")
        self.level_before = self.logger.level

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Bypassing" in message:
            self.reasons.append(message)

    def __enter__(self) -> _BypassReasons:
        self.logger.addHandler(self)
        if not self.logger.isEnabledFor(logging.INFO):
            self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


class _Workers:
    """Compile workers that take segments as the recording runs find them, so
    that they compile while the building process records the next runs (each
    run's first calls plan its convolutions with cuDNN: MobileNet-V3-large's
    cold build spent 35.6 s recording six buckets and then 41.3 s compiling, on
    one H200). Spawned processes (clean of this process's CUDA state), at most
    `workers` (default MAX_WORKERS, at most half the usable CPUs) and no more
    than segments: the pool starts with the second segment, so a lone segment
    compiles here, as with one worker. A pool that cannot start or breaks
    leaves the rest to this process; a segment Inductor cannot compile raises
    its error from `wait`."""

    def __init__(self, cache_dir: Path, workers: int | None = None):
        self.cache_dir = cache_dir
        self.workers = min(MAX_WORKERS, usable_cpus() // 2) if workers is None else min(workers, MAX_WORKERS)
        self.jobs: dict[str, tuple[GraphModule, Sequence[TensorMeta]]] = {}
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.broken = self.workers <= 1

    @property
    def submitted(self) -> int:
        return len(self.jobs)

    def submit(self, key: str, code: GraphModule, metas: Sequence[TensorMeta]) -> None:
        self.jobs[key] = (code, metas)
        if self.broken or len(self.jobs) < 2:
            return
        try:
            if self.pool is None:  # ProcessPoolExecutor spawns a worker per job while none is idle, up to its max
                context = multiprocessing.get_context("spawn")
                context.set_executable(python_interpreter())
                self.pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=context, initializer=_worker_setup)
            for queued in [k for k in self.jobs if k not in self.futures]:
                code, metas = self.jobs[queued]
                self.futures[queued] = self.pool.submit(_compile_portable, queued, PortableGraph.of(code), metas, self.cache_dir)
        except (concurrent.futures.process.BrokenProcessPool, OSError, RuntimeError) as error:
            self._give_up(error)

    def wait(self) -> set[str]:
        """Every submitted segment compiled and saved: the keys that could not be saved."""
        done: dict[str, str | None] = {}
        try:
            for future in concurrent.futures.as_completed(self.futures.values()):
                key, reason = future.result()
                done[key] = reason
        except (concurrent.futures.process.BrokenProcessPool, OSError) as error:
            self._give_up(error)
        for key, (code, metas) in self.jobs.items():
            if key not in done:
                done[key] = compile_one(key, code, metas, self.cache_dir)[1]
        return {key for key, reason in done.items() if reason is not None}

    def _give_up(self, error: BaseException) -> None:
        if not self.broken:
            log.warning("parallel compilation failed (%s: %s); compiling the rest here", type(error).__name__, error)
        self.broken = True

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class _NodeRef:
    index: int  # of the node it stands for, in PortableGraph.nodes


@dataclass(frozen=True)
class _OpName:
    """An operator (`torch.ops.NS.OP`, or one overload of it) by name: they do not pickle."""

    namespace: str
    op: str
    overload: str | None  # None: the packet of every overload

    @classmethod
    def of(cls, target: Any) -> Any:
        """`target` itself where it pickles (a Python function, a placeholder's name)."""
        if isinstance(target, torch._ops.OpOverload):
            return cls(target.namespace, target._schema.name.partition("::")[2], target._overloadname)
        if isinstance(target, torch._ops.OpOverloadPacket):
            namespace, _, op = target._qualified_op_name.partition("::")
            return cls(namespace, op, None)
        return target

    def resolve(self) -> Any:
        packet = getattr(getattr(torch.ops, self.namespace), self.op)
        return packet if self.overload is None else getattr(packet, self.overload)


@dataclass(frozen=True)
class PortableGraph:
    """A segment's code for a compile worker, node by node. A pickled GraphModule
    is rebuilt by tracing its Python code, and the tracer runs every call that
    reads no input (BERT's attention mask starts with `arange(0, 128)`) and
    keeps the results as tensor constants; Inductor takes those as inputs of
    its code that a saved artifact does not hold, so the worker's code for
    BERT's and T5's whole-model segments, loaded in the building process,
    expected 4 inputs more than it got, and every such segment was compiled
    again there. Reproduced on the CPU machine (torch 2.14: "not enough values to
    unpack (expected 157, got 153)" for BERT's; tests/test_segment_compiler.py);
    on the GPU machine (torch 2.11) T5's six such segments failed with an
    IndexError and were compiled again, 10-14 s each (docs/benchmarks.md run 28):
    the same cause, not yet confirmed there."""

    nodes: tuple[tuple[str, Any, tuple, dict, str], ...]  # op, target, args, kwargs, name

    @classmethod
    def of(cls, code: GraphModule) -> PortableGraph:
        index = {node: i for i, node in enumerate(code.graph.nodes)}
        def ref(node: Node) -> _NodeRef:
            return _NodeRef(index[node])
        return cls(tuple((n.op, _OpName.of(n.target), torch.fx.map_arg(n.args, ref), torch.fx.map_arg(n.kwargs, ref), n.name) for n in code.graph.nodes))

    def module(self) -> GraphModule:
        graph, built = Graph(), []
        def node(value: Any) -> Any:
            return built[value.index] if isinstance(value, _NodeRef) else value
        for op, target, args, kwargs, name in self.nodes:
            target = target.resolve() if isinstance(target, _OpName) else target
            built.append(graph.create_node(op, target, torch.fx.node.map_aggregate(args, node), torch.fx.node.map_aggregate(kwargs, node), name=name))
        return GraphModule(torch.nn.Module(), graph)


def _compile_portable(key: str, code: PortableGraph, metas: Sequence[TensorMeta], cache_dir: Path) -> tuple[str, str | None]:
    """`compile_one` in a compile worker."""
    return compile_one(key, code.module(), metas, cache_dir)


def in_this_process():
    """Inductor's config while a building process loads and checks segments: it
    compiles any Triton kernel it still needs itself, not in its pool of compile
    workers. That pool (a process per core, each importing torch) otherwise starts
    at the first load, in a process that compiles nothing, a warm build or a
    server, beside the replays it times or serves. (T5's first warm build compiled
    18 kernels again that the cold build had saved under other Triton keys,
    docs/benchmarks.md run 31; not this setting's doing, run 32: the cold build
    compiled without the ptxas Inductor picks, run 33, fixed where the build points
    Triton at the cache, inductor_cache.pin_triton_ptxas.)"""
    return torch._inductor.config.patch(compile_threads=1)


def _worker_setup() -> None:
    """A compile worker: below the building process's CPU priority (WORKER_NICENESS);
    Inductor's own parallel compile would start a pool per worker; the project's custom
    ops registered before any segment that calls one arrives."""
    try:
        os.nice(WORKER_NICENESS)
    except OSError as error:  # a sandbox that refuses it: the worker compiles at the usual priority
        log.debug("compile worker kept its priority: %s", error)
    torch._inductor.config.compile_threads = 1
    custom_ops.register_all()


def python_interpreter() -> str:
    """The interpreter for child processes. Inside Triton's Python backend this process is
    the backend stub, not python: take the environment's own python."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    for candidate in (Path(sys.prefix) / "bin" / "python3", shutil.which("python3")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise RuntimeError("no python interpreter found for compile workers")
