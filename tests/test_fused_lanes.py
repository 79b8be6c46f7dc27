"""Fused lanes: a plan's segments as submodules (CPU), compiled by Inductor and
captured on their lanes (GPU)."""

from __future__ import annotations

import operator
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import traced

from opara_core import zoo
from opara_core.engine.build import BuildReport, Candidate, EngineSettings, build_runner, static_inputs, traced_graphs
from opara_core.engine.capture import LanePool, PlanCapture, time_replays
from opara_core.engine.compare import max_relative_error
from opara_core.engine import build, segment_compiler
from opara_core.engine.fused_lanes import InductorCapture, fused_lanes, on_planning_thread, prepare_captures
from opara_core.engine.interpreter import plan_graph, run_plan
from opara_core.engine.segment_compiler import CompiledSegment, prepare
from opara_core.engine.trace import trace, trace_model


def _as_list(value):
    return list(value) if isinstance(value, (tuple, list)) else [value]


@pytest.mark.parametrize("model, policy, lanes", [("googlenet", "opara", 8), ("deepfm", "asap", 4), ("bert", "wavefront", 8)])
def test_the_segmented_graph_computes_exactly_what_the_traced_graph_does(model, policy, lanes):
    graph = traced(model)
    plan = plan_graph(graph, policy, lanes)
    fused, segment_plan = fused_lanes(graph, plan, compile_segments=False)
    assert 1 < len(segment_plan.order) < len(plan.order)
    inputs = zoo.get(model).example_inputs(1, seed=4)
    with torch.no_grad():
        expected = _as_list(graph.module(*inputs))
        got = _as_list(run_plan(fused, segment_plan, *inputs))
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_segments_read_only_graph_inputs_and_results_of_segments_before_them():
    graph = traced("googlenet")
    fused, segment_plan = fused_lanes(graph, plan_graph(graph, "opara", 8), compile_segments=False)
    done: set[str] = set()
    for node in fused.module.graph.nodes:
        if node.op == "call_module":
            for arg in node.all_input_nodes:
                source = arg.args[0].target if arg.target is operator.getitem else None
                assert arg.op == "placeholder" or source in done, (node.name, arg.name)
            done.add(node.target)
    assert done == set(segment_plan.order)


def test_each_segments_code_is_generated_once_and_only_when_it_runs(monkeypatch):
    """Making the top module after its segments made every segment's code a
    second time (fx recompiles a GraphModule's GraphModule children): ~0.5 s of
    NASNet's 1.4-1.7 s per fused plan on the 2-core CPU machine, in every build.
    A warm build runs compiled code only: the fx code is made when a segment runs."""
    graph = traced("googlenet")
    made: dict[int, int] = {}
    recompile = torch.fx.GraphModule.recompile

    def counted(module):
        made[id(module)] = made.get(id(module), 0) + 1
        return recompile(module)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    fused, segment_plan = fused_lanes(graph, plan_graph(graph, "opara", 8), compile_segments=False)
    segments = [fused.module.get_submodule(name) for name in segment_plan.order]
    assert len(segments) > 10 and all(isinstance(m, torch.fx.GraphModule) for m in segments)
    assert not any(made.get(id(m)) for m in segments)  # no code made yet
    with torch.inference_mode():
        got = run_plan(fused, segment_plan, *zoo.get("googlenet").example_inputs(1, seed=4))
    assert [made.get(id(m)) for m in segments] == [1] * len(segments)
    with torch.inference_mode():
        assert torch.equal(run_plan(fused, segment_plan, *zoo.get("googlenet").example_inputs(1, seed=4)), got)
    assert [made.get(id(m)) for m in segments] == [1] * len(segments)


class Branches(torch.nn.Module):
    """Two convolution branches and a join: the smallest graph with parallel lanes."""

    def __init__(self):
        super().__init__()
        self.left = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 1))
        self.right = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.Sigmoid())

    def forward(self, x):
        return torch.cat([self.left(x), self.right(x)], dim=1).mean(dim=(2, 3)).softmax(-1)


def test_inductor_compiled_segments_equal_eager_on_the_cpu(tmp_path):
    module = Branches().eval()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    graph = trace(module, (x,))
    plan = plan_graph(graph, "opara", 4)
    assert plan.num_streams > 1
    fused, segment_plan = fused_lanes(graph, plan)
    count = prepare([(fused.module, [x])], tmp_path)
    assert count.compiled == count.distinct == count.segments == len(segment_plan.order), count
    with torch.inference_mode():
        got = run_plan(fused, segment_plan, x)
        expected = module(x)
    assert not [m for m in fused.module.children() if isinstance(m, CompiledSegment) and m.eager_calls]
    assert max_relative_error(_as_list(got), [expected]) < 1e-4


def test_the_planning_thread_is_one_thread_apart_from_the_callers():
    cpu = torch.device("cpu")
    names = {on_planning_thread(lambda: threading.current_thread().name, cpu) for _ in range(3)}
    assert len(names) == 1 and threading.current_thread().name not in names
    nested = on_planning_thread(lambda: on_planning_thread(lambda: threading.current_thread().name, cpu), cpu)
    assert {nested} == names  # work on the thread that asks for the thread runs right there, no deadlock

    def fail():
        raise ValueError("segment 3 does not compile")

    with pytest.raises(ValueError, match="segment 3"):
        on_planning_thread(fail, cpu)
    assert on_planning_thread(lambda: 7, cpu) == 7  # the thread lives on after a failure


def test_timed_convolutions_have_a_planning_thread_of_their_own():
    # one build captures fused lanes both ways (fused_lanes_autotune): each mode's first calls on its own thread
    cpu = torch.device("cpu")
    heuristic = on_planning_thread(lambda: threading.current_thread().name, cpu)
    timed = {on_planning_thread(lambda: threading.current_thread().name, cpu, timed=True) for _ in range(2)}
    assert len(timed) == 1 and heuristic not in timed and threading.current_thread().name not in timed | {heuristic}
    across = on_planning_thread(lambda: on_planning_thread(lambda: threading.current_thread().name, cpu, timed=True), cpu)
    assert {across} == timed  # one thread's work may ask the other's: no deadlock


INTERRUPTED = """
import signal, time, torch
from opara_core.engine.fused_lanes import on_planning_thread
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job starts with SIGINT ignored)
print("compiling", flush=True)
on_planning_thread(lambda: time.sleep(300), torch.device("cpu"))
"""


def test_a_build_interrupted_while_its_planning_thread_works_exits_at_once():
    """Ctrl-C in the middle of a cold build's compilation: the process ends
    without waiting for the planning thread's work to finish."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-c", INTERRUPTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline().strip() == "compiling"
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode != 0 and "KeyboardInterrupt" in stderr, stderr


def _recording_threads(monkeypatch) -> list[threading.Thread]:
    """The threads of the recording runs from now on (segment_compiler._record)."""
    threads = []
    real = segment_compiler._record

    def spy(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(segment_compiler, "_record", spy)
    return threads


def _branches_opara():
    """An input, the traced Branches module and its opara plan on 4 lanes."""
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    graph = trace(Branches().eval(), (x,))
    return x, graph, plan_graph(graph, "opara", 4)


def test_fused_lanes_record_their_convolutions_on_the_planning_thread(tmp_path, monkeypatch):
    """PyTorch keeps one cuDNN plan per convolution per thread, the first it
    made: the recording runs (a fused lane's first call of each convolution) of
    every build in the process go to the one planning thread, never the caller's."""
    threads = _recording_threads(monkeypatch)
    x, graph, plan = _branches_opara()
    for directory in ("first", "second"):  # two builds: nothing read from the other's cache
        fused, _ = fused_lanes(graph, plan)
        prepare_captures([(SimpleNamespace(module=fused.module, cache_dir=tmp_path / directory, prepared=set(), autotune=False), [x])])
    assert len(threads) >= 2 and len(set(threads)) == 1 and threads[0] is not threading.current_thread()


def test_captures_that_time_their_convolutions_prepare_on_their_thread_and_load_the_others_code(tmp_path, monkeypatch):
    threads = _recording_threads(monkeypatch)
    x, graph, plan = _branches_opara()
    both = [SimpleNamespace(module=fused_lanes(graph, plan)[0].module, cache_dir=tmp_path, prepared=set(), autotune=timed) for timed in (True, False)]
    count = prepare_captures([(capture, [x]) for capture in both])
    alone = prepare_captures([(SimpleNamespace(module=fused_lanes(graph, plan)[0].module, cache_dir=tmp_path / "alone", prepared=set(), autotune=False), [x])])
    assert count.segments == 2 * alone.segments and count.compiled == alone.compiled > 0  # the same code, compiled once
    assert threads and {t.name for t in threads} <= {"fused-lanes-planning", "fused-lanes-planning-timed"}
    assert all(capture.prepared for capture in both)


# ---- on the GPU -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["googlenet", "bert"])
def test_fused_lanes_replay_equals_eager_on_the_gpu(model, strict_fp32, tmp_path):
    device = torch.device("cuda")
    entry = zoo.get(model)
    module = entry.build().to(device).eval()
    graph = trace_model(entry, module, device)
    plan = plan_graph(graph, "opara", 8)
    capture = InductorCapture(graph, plan, LanePool(device), tmp_path)
    assert capture.segments > 1 and capture.plan.num_streams > 1
    pool = torch.cuda.graph_pool_handle()  # static inputs are normal tensors: copied into below
    captured = {b: capture(static_inputs(entry, b, device), pool) for b in (1, 4)}
    for batch, graph_ in captured.items():
        for seed in range(3):
            inputs = [t.to(device) for t in entry.example_inputs(batch, seed=seed)]
            with torch.inference_mode():
                expected = _as_list(module(*inputs))
            assert max_relative_error(_replay(graph_, inputs), expected) < 1e-3, (batch, seed)


@pytest.mark.gpu
def test_fused_lanes_that_time_their_convolution_algorithms_equal_eager(strict_fp32, tmp_path):
    # a `-timed` graph's candidate (fused_lanes_autotune): cuDNN's conv + ReLU and conv +
    # residual add + ReLU kernels with the algorithms its benchmark picked, not its heuristics
    device = torch.device("cuda")
    entry = zoo.get("resnet50")
    module = entry.build().to(device).eval()
    settings = EngineSettings(fused_lanes=True, fused_lanes_autotune=True)
    graph = traced_graphs(module, entry, device, settings, BuildReport(), only={"inductor-cudnn-timed"})["inductor-cudnn-timed"]
    assert any(n.target is torch.ops.aten.cudnn_convolution_add_relu.default for n in graph.module.graph.nodes)
    capture = build.plan_capture(Candidate("inductor-cudnn-timed", "opara", 8), graph, plan_graph(graph, "opara", 8), LanePool(device), tmp_path)
    assert capture.autotune
    pool = torch.cuda.graph_pool_handle()
    for batch in (1, 8):
        captured = capture(static_inputs(entry, batch, device), pool)
        inputs = [t.to(device) for t in entry.example_inputs(batch, seed=batch)]
        with torch.inference_mode():
            expected = _as_list(module(*inputs))
        assert max_relative_error(_replay(captured, inputs), expected) < 1e-3, batch


@pytest.mark.gpu
@pytest.mark.parametrize("model", zoo.names())
def test_fused_lanes_replays_equal_the_single_lane_graph_of_the_same_segments(model, tmp_path):
    # 1,000 random inputs: the lanes may change when a segment runs, never what it computes,
    # so the multi-lane graph's outputs equal, bit for bit, those of its segments run in
    # order on one stream (same compiled code, same memory pool rules, no lane waits).
    device = torch.device("cuda")
    entry = zoo.get(model)
    graph = trace_model(entry, entry.build().to(device).eval(), device)
    lane_pool = LanePool(device)
    lanes = InductorCapture(graph, plan_graph(graph, "opara", 8), lane_pool, tmp_path)
    assert lanes.plan.num_streams > 1
    batch = 1
    multi = lanes(static_inputs(entry, batch, device), torch.cuda.graph_pool_handle())
    single_plan = plan_graph(lanes.graph, "sequential")
    assert single_plan.num_streams == 1 and len(single_plan.order) == lanes.segments
    # on the fused lanes' planning thread, whose cuDNN plans the multi-lane capture made: on
    # another thread a convolution gets that thread's own plan, made in whatever mode the
    # thread's first call had (a build earlier in the process leaves cuDNN's benchmark on:
    # run after test_varlen on an H100, the CNNs' graphs differed in every replay)
    with torch.backends.cudnn.flags(enabled=True, benchmark=not lanes.autotune):  # the mode that differs: it must not matter
        single = on_planning_thread(
            lambda: PlanCapture(lanes.graph, single_plan, lane_pool)(static_inputs(entry, batch, device), torch.cuda.graph_pool_handle()), device
        )
    differ = []
    for seed in range(1000):
        inputs = [t.to(device) for t in entry.example_inputs(batch, seed=10_000 + seed)]
        multi_out, single_out = _replay(multi, inputs), _replay(single, inputs)
        if not all(torch.equal(a, b) for a, b in zip(multi_out, single_out)):
            differ.append((seed, max_relative_error(multi_out, single_out)))
    assert not differ, f"{len(differ)} of 1000 replays differ (seed, relative error): {differ[:5]}"


@pytest.mark.gpu
def test_auto_offers_fused_lanes_and_is_never_slower_than_the_aten_sequential_graph():
    device = torch.device("cuda")
    entry = zoo.get("googlenet")
    module = entry.build().to(device).eval()
    settings = EngineSettings(buckets=(1, 8), layout="nchw", fused_lanes=True, remember_choices=False)
    runner, report = build_runner(module, entry, device, 8, settings)
    assert report.runner == "multi-stream graph", report.summary()
    timed = report.timings_ms[1]
    assert any(c.graph == "inductor" and c.policy == "opara" for c in timed), report.summary()
    # GoogLeNet's convolutions feed ReLUs: the graph with cuDNN's conv+ReLU is a candidate too
    assert any(c.graph == "inductor-cudnn" and c.policy == "opara" for c in timed), report.summary()
    chosen = {b: min(time_replays(runner.graphs[b], seconds=0.05) for _ in range(3)) for b in (1, 8)}
    del runner
    graph = trace_zoo_fused(entry, module, device)
    capture, pool = PlanCapture(graph, plan_graph(graph, "sequential"), LanePool(device)), torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        sequential = {b: capture(static_inputs(entry, b, device), pool) for b in (1, 8)}
    alone = {b: min(time_replays(sequential[b], seconds=0.05) for _ in range(3)) for b in (1, 8)}
    for bucket in (1, 8):
        assert chosen[bucket] <= 1.03 * alone[bucket], (bucket, report.choices[bucket], chosen, alone)
        assert isinstance(report.choices[bucket], Candidate)


@pytest.mark.gpu
def test_fused_lanes_autotune_times_each_fused_candidate_both_ways(tmp_path, monkeypatch):
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    device = torch.device("cuda")
    entry = zoo.get("resnet50")
    settings = EngineSettings(buckets=(1, 8), layout="nchw", fused_lanes=True, fused_lanes_autotune=True, remember_choices=False)
    _, report = build_runner(entry.build().to(device).eval(), entry, device, 8, settings)
    assert report.runner == "multi-stream graph", report.summary()
    first = report.timings_ms[1]
    pairs = [c for c in first if c.timed and Candidate(c.graph.removesuffix("-timed"), c.policy, c.lanes) in first]
    assert {c.graph for c in pairs} == {"inductor-timed", "inductor-cudnn-timed"}, report.summary()


def _replay(captured, inputs):
    """Copies `inputs` into the captured graph's static inputs, replays it and returns
    its static outputs (overwritten by the next replay)."""
    for static, x in zip(captured.inputs, inputs):
        static.copy_(x)
    captured.replay()
    return list(captured.outputs)


def trace_zoo_fused(entry, module, device):
    """The fused ATen graph in NCHW that serving's sequential graph is built from."""
    return traced_graphs(module, entry, device, EngineSettings(layout="nchw", fused_lanes=False), BuildReport())["nchw"]
