"""Inductor-compiled segments: one compilation per structure, saved and loaded
by a later process without compiling, equal to the segments run eagerly (CPU)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.fx import Graph, GraphModule

from conftest import turn_is_free
from opara_core.engine.fused_lanes import fused_lanes
from opara_core.engine.interpreter import plan_graph, run_plan
from opara_core.engine import gpu_turn, segment_compiler
from opara_core.engine.segment_compiler import CompiledSegment, TensorMeta, canonical, prepare, segment_key
from opara_core.engine.trace import trace

REPO_ROOT = Path(__file__).resolve().parent.parent


class Twins(torch.nn.Module):
    """Two branches of the same structure with different weights, and a join."""

    def __init__(self):
        super().__init__()
        self.left = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.right = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.Tanh())

    def forward(self, x):
        return (self.left(x) * self.right(x)).softmax(-1)


def _fused(module, x):
    graph = trace(module, (x,))
    plan = plan_graph(graph, "opara", 4)
    return fused_lanes(graph, plan)


def test_segments_of_one_structure_get_one_key_and_keep_their_own_weights():
    torch.manual_seed(0)
    fused, plan = _fused(Twins().eval(), torch.randn(2, 16))
    assert plan.num_streams > 1
    segments = [m for m in fused.module.children() if isinstance(m, CompiledSegment)]
    x = torch.randn(3, 16)
    keys = {}
    for segment in segments:
        n_inputs = len([n for n in segment.eager.graph.nodes if n.op == "placeholder"])
        metas = [TensorMeta.of(t) for t in (*[x] * n_inputs, *segment.weights)]
        keys.setdefault(segment_key(segment.code.code, metas), []).append(segment)
    twins = [group for group in keys.values() if len(group) == 2]
    assert twins, "the two branches should share a key"
    left, right = twins[0]
    assert left.code.code == right.code.code
    assert not all(torch.equal(a, b) for a, b in zip(left.weights, right.weights))


def test_canonical_code_takes_weights_as_inputs_and_computes_what_the_segment_does():
    torch.manual_seed(1)
    fused, _ = _fused(Twins().eval(), torch.randn(2, 16))
    segment = next(m for m in fused.module.children() if isinstance(m, CompiledSegment) and m.weights)
    code, weights = canonical(segment.eager)
    assert not [n for n in code.graph.nodes if n.op == "get_attr"]
    x = torch.randn(5, 16)
    n_inputs = len([n for n in segment.eager.graph.nodes if n.op == "placeholder"])
    args = [x] * n_inputs
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(code(*args, *weights), segment.eager(*args)))


def test_compiled_segments_equal_eager_and_twins_compile_once(tmp_path):
    torch.manual_seed(2)
    module = Twins().eval()
    fused, plan = _fused(module, torch.randn(2, 16))
    x = torch.randn(4, 16)
    count = prepare([(fused.module, [x])], tmp_path, workers=1)
    assert count.compiled == count.distinct < count.segments, count
    assert count.loaded == 0
    with torch.inference_mode():
        got = run_plan(fused, plan, x)
        expected = module(x)
    segments = [m for m in fused.module.children() if isinstance(m, CompiledSegment)]
    assert all(m.eager_calls == 0 for m in segments)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    # a batch size not prepared runs eagerly, and says so
    with torch.inference_mode():
        assert torch.allclose(run_plan(fused, plan, x[:3]), module(x[:3]), rtol=1e-5, atol=1e-6)
    assert any(m.eager_calls for m in segments)


@pytest.mark.parametrize("autotune", [True, False])
def test_the_runs_that_call_segments_first_pick_convolution_algorithms_as_asked(tmp_path, monkeypatch, autotune):
    # PyTorch keeps the cuDNN algorithm a convolution's first call picked: the recording
    # run and the check of fresh code are first calls, so they run under the build's choice
    torch.manual_seed(3)
    fused, _ = _fused(Twins().eval(), torch.randn(2, 16))
    seen = []

    def spy(name, real):
        def call(*args, **kwargs):
            seen.append((name, torch.backends.cudnn.benchmark))
            return real(*args, **kwargs)

        monkeypatch.setattr(segment_compiler, name, call)

    spy("_record", segment_compiler._record)
    spy("_checked", segment_compiler._checked)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not autotune)
    prepare([(fused.module, [torch.randn(4, 16)])], tmp_path, workers=1, autotune=autotune)
    assert {name for name, _ in seen} == {"_record", "_checked"}
    assert all(flag is autotune for _, flag in seen), seen
    assert torch.backends.cudnn.benchmark is (not autotune)  # the process's own setting back


def _compile_all(jobs, cache_dir, workers):
    """Every job through one set of compile workers (segment_compiler._Workers), as a build's runs submit
    them: the keys that compiled but could not be saved."""
    with segment_compiler._Workers(cache_dir, workers) as compiler:
        for job in jobs:
            compiler.submit(*job)
        return compiler.wait()


def test_segments_go_to_the_compile_workers_while_later_runs_still_record(tmp_path, monkeypatch):
    # recording a run plans its convolutions with cuDNN (MobileNet-V3-large: 35.6 s of six buckets before
    # 41.3 s of compiling, H200): the workers start on a run's segments before the next run records
    torch.manual_seed(3)
    monkeypatch.setattr(segment_compiler, "_loaded", {})
    module = Twins().eval()
    fused, plan = _fused(module, torch.randn(2, 16))
    events = []
    real_record, real_submit, real_wait = segment_compiler._record, segment_compiler._Workers.submit, segment_compiler._Workers.wait
    monkeypatch.setattr(segment_compiler, "_record", lambda *a: events.append("record") or real_record(*a))
    monkeypatch.setattr(segment_compiler._Workers, "submit", lambda self, *a: events.append("submit") or real_submit(self, *a))
    monkeypatch.setattr(segment_compiler._Workers, "wait", lambda self: events.append(f"wait {len(self.futures)}") or real_wait(self))
    runs = [(fused.module, [torch.randn(rows, 16)]) for rows in (3, 5)]
    count = prepare(runs, tmp_path, workers=2)
    first = events.index("submit")
    assert events[0] == "record" and "record" in events[first:], events  # submitted before the second run recorded
    assert events[-1] == f"wait {count.compiled}" and count.compiled == count.distinct > 1, (events, count)
    with torch.inference_mode():
        for _, (x,) in runs:  # the workers' code at both shapes
            assert torch.allclose(run_plan(fused, plan, x), module(x), rtol=1e-5, atol=1e-6)


def test_compile_workers_run_below_the_building_process_cpu_priority(tmp_path):
    # at a cold start several builds share the CPU with their compile workers: the builds' own steps go first
    segment = _segment_with_weights()
    metas = [TensorMeta.of(torch.randn(4, 16)), *map(TensorMeta.of, segment.weights)]
    with segment_compiler._Workers(tmp_path, workers=2) as workers:
        workers.submit("a", segment.code, metas)
        workers.submit("b", segment.code, metas)  # the pool starts with the second segment
        assert workers.pool is not None
        worker_niceness = workers.pool.submit(os.nice, 0).result()
        assert workers.wait() == set()
    assert worker_niceness > os.nice(0) or os.nice(0) == 19


def test_a_lone_segment_compiles_in_this_process_without_starting_workers(tmp_path):
    segment = _segment_with_weights()
    x = torch.randn(4, 16)
    metas = [TensorMeta.of(x), *map(TensorMeta.of, segment.weights)]
    with segment_compiler._Workers(tmp_path, workers=4) as workers:
        workers.submit("a", segment.code, metas)
        assert workers.wait() == set()
        assert workers.pool is None and (tmp_path / "a.bin").exists()


# A later build, in a fresh process: the same module's segments from the same cache directory.
WORKER = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from test_segment_compiler import Twins, _fused
from opara_core.engine.segment_compiler import prepare
from opara_core.engine.interpreter import run_plan
device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
torch.manual_seed(2)
module = Twins().eval().to(device)
fused, plan = _fused(module, torch.randn(2, 16, device=device))
x = torch.randn(4, 16, device=device)
count = prepare([(fused.module, [x])], __import__("pathlib").Path(sys.argv[1]), workers=int(sys.argv[3]))
with torch.inference_mode():
    error = (run_plan(fused, plan, x) - module(x)).abs().max().item()
print(json.dumps({"loaded": count.loaded, "compiled": count.compiled, "distinct": count.distinct, "records_read": count.records_read, "error": error}))
"""


def _build(cache: Path, workers: int, device: str = "cpu") -> dict:
    """The segments built in a new process (Triton's kernels under Inductor's cache directory)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(cache), str(Path(__file__).parent), str(workers), device],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_every_segment_and_compiles_none(tmp_path):
    cold = _build(tmp_path / "segments", workers=2)  # in two worker processes
    assert cold["compiled"] == cold["distinct"] > 1 and cold["loaded"] == 0, cold
    assert cold["error"] < 1e-5, cold
    warm = _build(tmp_path / "segments", workers=2)
    assert warm["compiled"] == 0 and warm["loaded"] == cold["distinct"], (cold, warm)
    assert cold["records_read"] == 0 and warm["records_read"] == 1, (cold, warm)  # the record's key is the same in another process
    assert warm["error"] < 1e-5, warm


@pytest.mark.gpu
def test_a_second_process_on_the_gpu_compiles_no_triton_kernel(tmp_path):
    """What a warm build loads must find every Triton kernel where the cold one
    left it: T5's first warm build compiled 18 kernels again, each the same
    machine code as one the cold build had saved, under a new key (run 31)."""
    cold = _build(tmp_path / "segments", workers=2, device="cuda")
    assert cold["compiled"] == cold["distinct"] > 1 and cold["error"] < 1e-3, cold
    kernels = tmp_path / "segments" / "inductor" / "triton"
    before = {p for p in kernels.rglob("*") if p.is_file()}
    assert any(p.suffix == ".cubin" for p in before), "no Triton kernel in the cache"
    warm = _build(tmp_path / "segments", workers=2, device="cuda")
    assert warm["compiled"] == 0 and warm["loaded"] == cold["distinct"] and warm["error"] < 1e-3, warm
    written = sorted(str(p.relative_to(kernels)) for p in {p for p in kernels.rglob("*") if p.is_file()} - before)
    assert not written, f"the warm build compiled {len(written)} files of kernels: {written[:8]}"


def _segment_with_weights():
    torch.manual_seed(3)
    fused, _ = _fused(Twins().eval(), torch.randn(2, 16))
    return next(m for m in fused.module.children() if isinstance(m, CompiledSegment) and m.weights)


def test_inductor_code_is_used_only_if_it_computes_what_the_segment_does(tmp_path):
    segment = _segment_with_weights()
    n_inputs = len([n for n in segment.eager.graph.nodes if n.op == "placeholder"])
    sample = tuple(torch.randn(4, 16) for _ in range(n_inputs))
    with torch.inference_mode():
        want = segment.eager(*sample)
    right_code = lambda *args: segment.code(*args)  # noqa: E731
    right = segment_compiler._checked(segment, right_code, sample, tmp_path, "right")
    assert right is right_code and not (tmp_path / "right.wrong").exists()

    def broken(*args):  # torch 2.11's runtime wrapper on BERT's attention mask segment
        raise IndexError("list index out of range")

    def wrong(*args):
        return tuple(t + 1 for t in segment.code(*args))

    for name, code in (("broken", broken), ("wrong", wrong)):
        marker = tmp_path / f"{name}.wrong"
        fallback = segment_compiler._checked(segment, code, sample, tmp_path, name)
        assert fallback is not code and marker.read_text(), name
        assert not (tmp_path / f"{name}.passed").exists(), name
        with torch.inference_mode():
            got = fallback(*sample, *segment.weights)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name


class _Functional(torch.nn.Module):
    """A segment as fused lanes make one: functional operators on its inputs and weights."""

    def __init__(self, weight: torch.Tensor, forward):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self._forward = forward

    def forward(self, x):
        return (self._forward(x, self.weight),)


def _half_segment(forward, weight: torch.Tensor) -> CompiledSegment:
    return CompiledSegment(torch.fx.symbolic_trace(_Functional(weight, forward)))


def test_half_precision_code_that_rounds_otherwise_than_aten_passes_where_it_is_as_close_to_fp32(tmp_path):
    # (x * w + 1) - x * w: in bf16 the 1 is lost next to x * w of about 1000, so ATen's bf16 kernels are far
    # from fp32's 1, and code that computes it right is far from ATen's
    segment = _half_segment(lambda x, w: (x * w + 1.0) - x * w, torch.full((16,), 1000.0, dtype=torch.bfloat16))
    sample = (torch.linspace(0.5, 1.5, 64, dtype=torch.bfloat16).reshape(4, 16),)
    with torch.inference_mode():
        aten = segment.code(*sample, *segment.weights)
    exact = (torch.ones(4, 16, dtype=torch.bfloat16),)
    assert segment_compiler.max_relative_error(exact, tuple(aten)) > segment_compiler.CHECK_TOLERANCE  # the case at hand

    def right(*args):
        return exact

    assert segment_compiler._checked(segment, right, sample, tmp_path, "right") is right
    assert (tmp_path / "right.passed").exists()


def test_half_precision_code_beyond_twice_atens_own_error_runs_the_aten_operators(tmp_path):
    torch.manual_seed(5)
    segment = _half_segment(lambda x, w: torch.nn.functional.linear(x, w), torch.randn(16, 16, dtype=torch.bfloat16))
    sample = (torch.randn(4, 16, dtype=torch.bfloat16),)

    def wrong(*args):  # 10% off: beyond CHECK_TOLERANCE's 5%, and far beyond bf16's rounding
        return tuple(t * 1.1 for t in segment.code(*args))

    assert segment_compiler._checked(segment, wrong, sample, tmp_path, "wrong") is segment.code
    problem = (tmp_path / "wrong.wrong").read_text()
    assert "against the segment's ATen operators; against them in fp32" in problem, problem


def test_only_a_half_precision_segment_is_checked_against_fp32_and_its_own_casts_become_fp32():
    weight = torch.randn(16, 16)
    fp32 = _half_segment(lambda x, w: torch.nn.functional.linear(x, w), weight)
    assert segment_compiler._in_fp32(fp32, (torch.randn(4, 16),)) is None  # nothing in half precision: ATen alone
    half = _half_segment(lambda x, w: torch.nn.functional.linear(x, w), weight.bfloat16())
    sample = (torch.randn(4, 16, dtype=torch.bfloat16),)
    (got,) = segment_compiler._in_fp32(half, sample)
    assert got.dtype == torch.float32 and torch.allclose(got, torch.nn.functional.linear(sample[0].float(), weight.bfloat16().float()))
    # a segment that casts its fp32 input to bf16 itself (a model's first segment) runs without the cast
    casting = _half_segment(lambda x, w: torch.nn.functional.linear(x.to(torch.bfloat16), w), weight.bfloat16())
    x = torch.randn(4, 16) * 1000 + 1  # bf16 would round away the 1
    (got,) = segment_compiler._in_fp32(casting, (x,))
    assert got.dtype == torch.float32 and torch.allclose(got, torch.nn.functional.linear(x, weight.bfloat16().float()))
    # and one that casts with no half-precision tensor in sight is still half precision
    alone = CompiledSegment(torch.fx.symbolic_trace(lambda x: (x.to(torch.bfloat16) * 3,)))
    (got,) = segment_compiler._in_fp32(alone, (x,))
    assert got.dtype == torch.float32 and torch.equal(got, x * 3)


def test_the_fp32_reference_runs_atens_depthwise_convolution_not_the_engines_op(monkeypatch):
    # the engine's op in fp32 times each shape it meets (139 of NASNet's in its bf16 cold build's checks)
    from opara_core.engine import custom_ops, depthwise_conv

    op = custom_ops.register_all()[1]
    engine_calls = []
    monkeypatch.setattr(depthwise_conv, "depthwise_conv", lambda *args: engine_calls.append(args) or depthwise_conv.cudnn_conv2d(*args))
    torch.manual_seed(6)
    weight = torch.randn(8, 1, 3, 3, dtype=torch.bfloat16)
    segment = _half_segment(lambda x, w: op(x, w, None, [1, 1], [1, 1], [1, 1]), weight)
    sample = (torch.randn(2, 8, 5, 5, dtype=torch.bfloat16),)
    (got,) = segment_compiler._in_fp32(segment, sample)
    assert not engine_calls
    want = torch.nn.functional.conv2d(sample[0].float(), weight.float(), padding=1, groups=8)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5)
    with torch.inference_mode():
        segment.code(*sample, *segment.weights)  # the segment itself still calls the engine's op
    assert len(engine_calls) == 1


def test_segments_an_earlier_build_found_wrong_run_their_aten_operators_with_their_own_weights(tmp_path, monkeypatch):
    torch.manual_seed(4)
    module = Twins().eval()
    x = torch.randn(4, 16)
    monkeypatch.setattr(segment_compiler, "_loaded", {})  # the structure compiled by earlier tests is kept in memory
    fused, plan = _fused(module, torch.randn(2, 16))
    first = prepare([(fused.module, [x])], tmp_path, workers=1)
    for saved in tmp_path.glob("*.bin"):  # as if each segment's code had failed its check
        saved.with_suffix(".wrong").write_text("IndexError: list index out of range")
    monkeypatch.setattr(segment_compiler, "_loaded", {})  # a later build, in a fresh process
    fused, plan = _fused(module, torch.randn(2, 16))
    again = prepare([(fused.module, [x])], tmp_path, workers=1)
    assert again.loaded == again.compiled == 0 and again.distinct == first.distinct < again.segments, (first, again)
    with torch.inference_mode():
        got = run_plan(fused, plan, x)
        expected = module(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)  # the twins share a key, not weights


def test_saved_code_that_passed_its_check_once_is_not_checked_again(tmp_path):
    # a later build loads the same bytes: checking them again cost 1.5 s of GoogLeNet's warm build
    segment = _segment_with_weights()
    n_inputs = len([n for n in segment.eager.graph.nodes if n.op == "placeholder"])
    sample = tuple(torch.randn(4, 16) for _ in range(n_inputs))
    right_code = lambda *args: segment.code(*args)  # noqa: E731
    assert segment_compiler._checked(segment, right_code, sample, tmp_path, "k") is right_code
    assert (tmp_path / "k.passed").exists()

    def broken(*args):
        raise IndexError("list index out of range")

    assert segment_compiler._checked(segment, broken, sample, tmp_path, "k") is broken  # trusted: passed before
    # code that could not be saved is compiled anew by every build: always checked
    assert segment_compiler._checked(segment, broken, sample, tmp_path, "k", saved=False) is not broken
    assert (tmp_path / "k.wrong").exists()


def test_code_in_memory_from_another_cache_directory_is_saved_in_this_one_too(tmp_path, monkeypatch):
    # a process that builds two models (the benchmark) must leave each cache whole:
    # a segment both share was once compiled for the first and missing from the second's
    monkeypatch.setattr(segment_compiler, "_loaded", {})
    torch.manual_seed(5)
    module = Twins().eval()
    x = torch.randn(4, 16)
    fused, _ = _fused(module, torch.randn(2, 16))
    first = prepare([(fused.module, [x])], tmp_path / "a", workers=1)
    fused, _ = _fused(module, torch.randn(2, 16))
    second = prepare([(fused.module, [x])], tmp_path / "b", workers=1)
    assert second.compiled == first.compiled == first.distinct > 0, (first, second)
    assert {p.name for p in (tmp_path / "a").glob("*.bin")} == {p.name for p in (tmp_path / "b").glob("*.bin")}
    fused, _ = _fused(module, torch.randn(2, 16))
    again = prepare([(fused.module, [x])], tmp_path / "b", workers=1)
    assert again.compiled == again.loaded == 0, again  # in memory for this directory now


def test_code_from_a_compile_worker_that_fails_its_check_is_compiled_again_here(tmp_path, monkeypatch, caplog):
    # torch 2.11 on the H100: BERT's whole-model graph failed its check when the build's workers
    # compiled it and ran when compiled in the building process; here the loaded code is made to fail
    monkeypatch.setattr(segment_compiler, "_loaded", {})
    torch.manual_seed(6)
    module = Twins().eval()
    x = torch.randn(4, 16)
    fused, plan = _fused(module, torch.randn(2, 16))

    def broken(*args):
        raise IndexError("list index out of range")

    real_load = segment_compiler.load_saved
    monkeypatch.setattr(segment_compiler, "load_saved", lambda path: broken)
    with caplog.at_level(logging.INFO, logger=segment_compiler.__name__):
        count = prepare([(fused.module, [x])], tmp_path, workers=1)
    assert count.compiled == count.distinct > 0, count
    # the worker's failure is no warning: the code compiled here passed, and the segments run it
    assert [r for r in caplog.records if "compiling it again" in r.message] and not [r for r in caplog.records if r.name == segment_compiler.__name__ and r.levelno >= logging.WARNING]
    assert not list(tmp_path.glob("*.wrong")) and len(list(tmp_path.glob("*.passed"))) == count.distinct
    segments = [m for m in fused.module.children() if isinstance(m, CompiledSegment)]
    assert all(code is not broken and code is not m.code for m in segments for code in m.compiled.values())
    with torch.inference_mode():
        assert torch.allclose(run_plan(fused, plan, x), module(x), rtol=1e-5, atol=1e-6)
    # what it saved is what a later build loads, checked already: nothing compiled again
    monkeypatch.setattr(segment_compiler, "load_saved", real_load)
    monkeypatch.setattr(segment_compiler, "_loaded", {})
    fused, plan = _fused(module, torch.randn(2, 16))
    again = prepare([(fused.module, [x])], tmp_path, workers=1)
    assert again.compiled == 0 and again.loaded == count.distinct, again
    with torch.inference_mode():
        assert torch.allclose(run_plan(fused, plan, x), module(x), rtol=1e-5, atol=1e-6)


class MaskedLinear(torch.nn.Module):
    """A linear layer whose output is masked by a tensor no input feeds (as
    BERT's attention mask starts with `arange(0, 128)`)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        keep = (torch.arange(16) % 3).unsqueeze(0) > 0
        return self.linear(x).masked_fill(keep, 0.0).softmax(-1)


def test_code_a_worker_compiled_runs_where_it_is_loaded_even_with_input_free_tensors(tmp_path, monkeypatch):
    # A pickled GraphModule is rebuilt by tracing its code, which computes `keep` and keeps it
    # as a tensor constant; Inductor then takes it as an input the saved artifact lacks, and the
    # code loaded in the building process expected more inputs than it got (session 28: BERT's
    # and T5's whole-model segments, every one compiled twice). Workers get the graph node by node.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the workers' too: no earlier test's entries
    torch.manual_seed(7)
    module = MaskedLinear().eval()
    x = torch.randn(4, 16)
    graph = trace(module, (x,))
    fused, _ = fused_lanes(graph, plan_graph(graph, "sequential"))  # one segment: the mask inside it
    (segment,) = [m for m in fused.module.children() if isinstance(m, CompiledSegment)]
    assert segment_compiler.PortableGraph.of(segment.code).module().code == segment.code.code
    metas = [TensorMeta.of(x), *map(TensorMeta.of, segment.weights)]
    # on lanes of their own the mask's operators are a segment that reads no input: rebuilt from
    # pickled code it only returned a constant, which Inductor saved nothing for (BERT's four
    # "not saved" segments, compiled again by every build)
    fused, _ = _fused(module, x)
    free = [m for m in fused.module.children() if isinstance(m, CompiledSegment) and not any(n.op == "placeholder" and not n.name.startswith("w") for n in m.code.graph.nodes)]
    assert free, fused.module.code
    free_metas = [TensorMeta.of(w) for w in free[0].weights]
    # two jobs of each: compiled in two worker processes (one pool for both: each pool's
    # workers import torch, which costs more than the compiling)
    jobs = [("a", segment.code, metas), ("b", segment.code, metas), ("c", free[0].code, free_metas), ("d", free[0].code, free_metas)]
    assert _compile_all(jobs, tmp_path, workers=2) == set()
    with torch.inference_mode():
        want = segment.eager(x)
        for key in ("a", "b"):
            got = torch._inductor.CompiledArtifact.load(path=str(tmp_path / f"{key}.bin"), format="binary")(x, *segment.weights)
            assert len(got) == len(want) and all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))
        got = torch._inductor.CompiledArtifact.load(path=str(tmp_path / "c.bin"), format="binary")(*free[0].weights)
        assert all(torch.equal(g, w) for g, w in zip(got, free[0].eager()))


def test_a_saved_segment_is_looked_up_in_inductors_cache_and_loaded_whole_where_that_lacks_it(tmp_path, monkeypatch):
    # a warm build's Inductor cache holds what the cold build compiled there: nothing is written
    # again (load_cache_artifacts, a third of each load); a cache without the entries gets them from the file
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the worker's too
    segment = _segment_with_weights()
    x = torch.randn(4, 16)
    metas = [TensorMeta.of(x), *map(TensorMeta.of, segment.weights)]
    assert _compile_all([("a", segment.code, metas)], tmp_path, workers=1) == set()
    real = torch.compiler.load_cache_artifacts
    writes = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda *a, **k: writes.append(1) or real(*a, **k))
    with torch.inference_mode():
        want = segment.eager(x)
        got = segment_compiler.load_saved(tmp_path / "a.bin")(x, *segment.weights)
        assert writes == [] and all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))  # e.g. a cache filled on another machine
        got = segment_compiler.load_saved(tmp_path / "a.bin")(x, *segment.weights)
    assert writes == [1] and any((tmp_path / "elsewhere").rglob("*")), "the whole artifact was not loaded"
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))


def test_tensor_meta_round_trips_through_json_and_gives_the_layout_of_its_tensor():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    tensors = [base, base.transpose(0, 2), base[1:, ::2], torch.ones(2, 3, dtype=torch.int64), torch.zeros(4, dtype=torch.bool)]
    metas = [TensorMeta.of(t) for t in tensors]
    assert [TensorMeta.from_json(json.loads(json.dumps(m.to_json()))) for m in metas] == metas
    assert tuple(m.layout for m in metas) == segment_compiler.layout(tensors)


def _refuse_to_run(*args, **kwargs):
    raise AssertionError("the module ran: its record was not read")


def _cold_build(tmp_path, monkeypatch, seed):
    """A first build into an empty cache directory, then a fresh process's view of it."""
    monkeypatch.setattr(segment_compiler, "_loaded", {})
    torch.manual_seed(seed)
    module = Twins().eval()
    x = torch.randn(4, 16)
    fused, _ = _fused(module, torch.randn(2, 16))
    cold = prepare([(fused.module, [x])], tmp_path, workers=1)
    assert cold.records_read == 0 and cold.compiled == cold.distinct > 0, cold
    monkeypatch.setattr(segment_compiler, "_loaded", {})  # a later build, in a fresh process
    return module, x, cold


def test_a_later_build_reads_its_segments_inputs_instead_of_running_the_module(tmp_path, monkeypatch):
    module, x, cold = _cold_build(tmp_path, monkeypatch, seed=7)
    monkeypatch.setattr(segment_compiler._Recorder, "run", _refuse_to_run)
    fused, plan = _fused(module, torch.randn(2, 16))
    warm = prepare([(fused.module, [x])], tmp_path, workers=1)
    assert warm.records_read == 1 and warm.compiled == 0 and warm.loaded == cold.distinct, warm
    assert warm.segments == cold.segments, (cold, warm)
    with torch.inference_mode():
        assert torch.allclose(run_plan(fused, plan, x), module(x), rtol=1e-5, atol=1e-6)
    assert all(m.eager_calls == 0 for m in fused.module.children() if isinstance(m, CompiledSegment))
    # inputs of another shape were never recorded: the module has to run
    monkeypatch.undo()
    monkeypatch.setattr(segment_compiler, "_loaded", {})
    other = prepare([(fused.module, [x[:3]])], tmp_path, workers=1)
    assert other.records_read == 0 and other.compiled > 0, other


def test_a_record_is_not_read_while_a_segment_still_needs_its_check(tmp_path, monkeypatch):
    module, x, cold = _cold_build(tmp_path, monkeypatch, seed=8)
    passed = sorted(tmp_path.glob("*.passed"))
    assert len(passed) == cold.distinct and list((tmp_path / "records").glob("*.json")), cold
    passed[0].unlink()  # as if this code had been saved but never checked
    fused, plan = _fused(module, torch.randn(2, 16))
    warm = prepare([(fused.module, [x])], tmp_path, workers=1)
    assert warm.records_read == 0 and warm.loaded == cold.distinct and warm.compiled == 0, warm
    assert passed[0].exists()  # checked against the inputs the run found
    with torch.inference_mode():
        assert torch.allclose(run_plan(fused, plan, x), module(x), rtol=1e-5, atol=1e-6)


def test_a_warm_build_loads_and_runs_its_modules_once_while_other_builds_have_the_gpu(tmp_path, monkeypatch):
    module, x, cold = _cold_build(tmp_path, monkeypatch, seed=9)
    lock = tmp_path / "turn.lock"
    fused, plan = _fused(module, torch.randn(2, 16))
    runs = []
    fused.module.register_forward_pre_hook(lambda top, args: runs.append(turn_is_free(lock)))
    loads = []
    load_saved = segment_compiler.load_saved
    monkeypatch.setattr(segment_compiler, "load_saved", lambda path: loads.append(turn_is_free(lock)) or load_saved(path))
    with gpu_turn.held(lock):
        warm = prepare([(fused.module, [x])], tmp_path, workers=1)
        assert gpu_turn.holding() and not turn_is_free(lock), "the turn was not taken back"
    assert warm.records_read == 1 and warm.compiled == 0 and warm.first_run_s > 0, warm
    assert runs == [True], f"one run of the module, with the turn free: {runs}"
    assert loads and all(loads), f"code loaded while the turn was held: {loads}"
    with torch.inference_mode():
        assert torch.allclose(run_plan(fused, plan, x), module(x), rtol=1e-5, atol=1e-6)
    # a build that has to record (inputs of another shape) checks its new code inside its turn
    checks = []
    checked = segment_compiler._checked
    monkeypatch.setattr(segment_compiler, "_checked", lambda *a, **k: checks.append(turn_is_free(lock)) or checked(*a, **k))
    monkeypatch.setattr(segment_compiler, "_loaded", {})
    with gpu_turn.held(lock):
        other = prepare([(fused.module, [x[:3]])], tmp_path, workers=1)
    assert other.records_read == 0 and other.first_run_s == 0 and checks and not any(checks), (other, checks)
    # autotune's first runs time cuDNN's algorithms: they stay in the turn, for the captures to do
    monkeypatch.setattr(segment_compiler, "_loaded", {})
    runs.clear()
    loads.clear()
    fused, _ = _fused(module, torch.randn(2, 16))
    fused.module.register_forward_pre_hook(lambda top, args: runs.append(turn_is_free(lock)))
    with gpu_turn.held(lock):
        timed = prepare([(fused.module, [x])], tmp_path, workers=1, autotune=True)
    assert timed.records_read == 1 and timed.first_run_s == 0 and runs == [] and loads and not any(loads), (timed, runs, loads)
    # a turn held lazily (a serving build of remembered choices takes it only to capture): autotune takes it first
    monkeypatch.setattr(segment_compiler, "_loaded", {})
    loads.clear()
    fused, _ = _fused(module, torch.randn(2, 16))
    with gpu_turn.held(lock, lazily=True):
        prepare([(fused.module, [x])], tmp_path, workers=1, autotune=True)
        assert gpu_turn.holding()
    assert loads and not any(loads), loads


def _calls_custom_ops() -> list[tuple[GraphModule, list[torch.Tensor], torch.Tensor]]:
    """Segments as the fusion passes leave them: calls of the project's depthwise
    and skinny-GEMM ops between ATen operators (their CPU paths run cuDNN's and
    cuBLAS's stand-ins), each with inputs and what eager computes."""
    from opara_core.engine import custom_ops

    skinny, depthwise, _ = custom_ops.register_all()
    conv = Graph()
    x, w = conv.placeholder("x"), conv.placeholder("w")
    conv.output(conv.call_function(torch.ops.aten.relu.default, (conv.call_function(depthwise, (x, w, None, [1, 1], [1, 1], [1, 1])),)))
    linear = Graph()
    a, b, bt = linear.placeholder("a"), linear.placeholder("b"), linear.placeholder("bt")
    linear.output(linear.call_function(torch.ops.aten.tanh.default, (linear.call_function(skinny, (a, b, bt)),)))
    torch.manual_seed(7)
    images, filters = torch.randn(2, 8, 6, 6), torch.randn(8, 1, 3, 3)
    rows, weight = torch.randn(4, 16), torch.randn(8, 16)
    return [
        (GraphModule(torch.nn.Module(), conv), [images, filters], torch.relu(torch.nn.functional.conv2d(images, filters, None, 1, 1, 1, 8))),
        (GraphModule(torch.nn.Module(), linear), [rows, weight, weight.t().contiguous()], torch.tanh(rows @ weight.t())),
    ]


def test_segments_calling_the_projects_ops_compile_in_the_worker_processes(tmp_path, caplog):
    # the workers are spawned: each registers the ops before a segment that calls one arrives
    # (run 27: NASNet's depthwise op was missing there, the pool broke, the build compiled alone)
    jobs, checks = [], {}
    for n, (code, inputs, expected) in enumerate(_calls_custom_ops()):
        key = f"custom{n}"
        jobs.append((key, code, [TensorMeta.of(t) for t in inputs]))
        checks[key] = (inputs, expected)
    with caplog.at_level(logging.WARNING, logger=segment_compiler.__name__):
        unsaved = _compile_all(jobs, tmp_path, workers=2)
    assert not [r.message for r in caplog.records if r.name == segment_compiler.__name__], "the worker pool should compile them"
    assert unsaved == set()
    for key, (inputs, expected) in checks.items():
        code = torch._inductor.CompiledArtifact.load(path=str(segment_compiler._path(tmp_path, key)), format="binary")
        with torch.inference_mode():
            (got,) = code(*inputs)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), key
