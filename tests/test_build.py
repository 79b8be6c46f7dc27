"""Building runners without a GPU: layouts of the traced graph, settings."""

from __future__ import annotations

import functools
import operator
import re

import pytest
import torch

from opara_core import zoo
from opara_core.engine.build import AUTO_DROP, AUTO_KEEP, BuildReport, Candidate, EngineSettings, channels_last_graph, next_candidates, traced_graphs
from opara_core.engine.trace import trace_model
from opara_core.engine.fusion import CONV

CPU = torch.device("cpu")


@functools.lru_cache(maxsize=None)
def googlenet():
    entry = zoo.get("googlenet")
    module = entry.build().eval()
    return entry, module, trace_model(entry, module, CPU)


def conv_weights(graph):
    nodes = [n for n in graph.module.graph.nodes if n.op == "call_function" and n.target is CONV]
    return [operator.attrgetter(n.args[1].target)(graph.module) for n in nodes]


def test_the_channels_last_graph_has_nhwc_weights_the_same_nodes_and_the_same_outputs():
    entry, _, graph = googlenet()
    nhwc = channels_last_graph(graph)
    assert [n.name for n in nhwc.module.graph.nodes] == [n.name for n in graph.module.graph.nodes]
    assert nhwc.dag is graph.dag and nhwc.fingerprint == graph.fingerprint
    weights = conv_weights(nhwc)
    assert len(weights) == 57
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    assert any(not w.is_contiguous() for w in weights)  # (1x1 kernels are both)
    assert all(w.is_contiguous() for w in conv_weights(graph)), "the original graph must stay NCHW"
    (x,) = entry.example_inputs(2, seed=3)
    with torch.inference_mode():
        want, got = graph.module(x), nhwc.module(x)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_auto_layout_traces_once_and_offers_both_layouts_for_convolutional_models():
    entry, module, _ = googlenet()
    report = BuildReport()
    graphs = traced_graphs(module, entry, CPU, EngineSettings(fusion=False), report)
    assert sorted(graphs) == ["nchw", "nhwc"]
    assert [k for k in report.seconds if k.startswith("trace")] == ["trace"]
    assert not report.fallbacks


@pytest.mark.parametrize("layout, expected", [("nchw", ["nchw"]), ("nhwc", ["nhwc"])])
def test_a_fixed_layout_gives_one_graph(layout, expected):
    entry, module, _ = googlenet()
    assert sorted(traced_graphs(module, entry, CPU, EngineSettings(fusion=False, layout=layout), BuildReport())) == expected


def test_models_without_convolutions_get_one_layout():
    entry = zoo.get("deepfm")
    graphs = traced_graphs(entry.build().eval(), entry, CPU, EngineSettings(fusion=False), BuildReport())
    assert list(graphs) == ["nchw"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"layout": "nhcw"}, "parameter layout is 'nhcw'; allowed: auto, nchw, nhwc"),
        ({"max_streams": 0}, "parameter max_streams is '0'; allowed: an integer >= 1"),
        ({"policy": "x"}, "parameter policy is 'x'; allowed: auto, sequential, opara, nimble, asap, wavefront"),
        ({"buckets": ()}, "parameter buckets is ''; allowed: comma-separated integers >= 1"),
        ({"guard": 1}, "parameter guard is '1'; allowed: true, false"),
        ({"fused_lanes_autotune": True, "autotune": False}, "parameter fused_lanes_autotune is true, which needs autotune true too"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(bad, message):
    """Settings made in code are checked against the same declarations as a config's."""
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineSettings(**bad)


class WrongAtOneBucket:
    """An eager runner whose answers at one batch size are off by 1%."""

    def __init__(self, runner, wrong: int):
        self.runner, self.wrong, self.device = runner, wrong, runner.device

    def run(self, inputs):
        outputs = self.runner.run(inputs)
        return [out * 1.01 for out in outputs] if inputs[0].shape[0] == self.wrong else outputs


def test_rows_checked_against_one_eager_run_of_the_largest_bucket():
    """Every bucket is compared with the leading rows of one eager run: a
    runner right at every bucket passes, one wrong at a single bucket is named."""
    from opara_core.engine.build import GuardError, check_rows_against_eager
    from opara_core.engine.runtime import EagerRunner

    entry = zoo.get("deepfm")
    module = entry.build().eval()
    runner = EagerRunner(module, entry.inputs, entry.outputs, CPU, 8)
    check_rows_against_eager(runner, module, [1, 2, 8], entry, 1e-5)
    with pytest.raises(GuardError, match="bucket 2: replay differs from eager"):
        check_rows_against_eager(WrongAtOneBucket(runner, 2), module, [1, 2, 8], entry, 1e-5)


def test_the_cudnn_fused_lanes_graph_is_offered_with_the_fused_policies_only():
    # its one-segment graph measured slower than `inductor`'s (Inception-v3, H200): no sequential candidate
    from opara_core.engine.build import FUSED_CANDIDATES, Candidate, candidates

    entry, module, _ = googlenet()
    graph = traced_graphs(module, entry, CPU, EngineSettings(fusion=False, layout="nchw"), BuildReport())["nchw"]
    found = candidates({"nchw": graph, "inductor": graph, "inductor-cudnn": graph}, EngineSettings())
    cudnn = {c for c in found if c.graph == "inductor-cudnn"}
    # side's plan of GoogLeNet is one lane (no branch holds 5% of the cost): the whole graph, not offered
    assert {c.policy for c in cudnn} == {policy for policy, _ in FUSED_CANDIDATES} - {"side"}
    assert not any(c.fused and c.policy != "sequential" and c.lanes == 1 for c in found)
    assert Candidate("inductor", "sequential", 1) in found and Candidate("nchw", "sequential", 1) in found
    assert all(c.fused for c in cudnn) and not any(c.fused for c in found if c.graph == "nchw")
    for candidate in found:
        assert Candidate.parse(str(candidate)) == candidate


@pytest.mark.parametrize("model, autotune, fused", [
    ("googlenet", False, ["inductor", "inductor-cudnn"]),
    ("googlenet", True, ["inductor", "inductor-cudnn", "inductor-timed", "inductor-cudnn-timed"]),
    ("deepfm", True, ["inductor"]),  # no convolution to time
])  # fmt: skip
def test_fused_lanes_autotune_adds_the_timed_graphs_of_models_with_convolutions(model, autotune, fused):
    from opara_core.engine.build import graph_names

    module = zoo.get(model).build().eval()
    names = graph_names(module, EngineSettings(fused_lanes=True, fused_lanes_autotune=autotune), torch.device("cuda"))
    assert [n for n in names if n not in ("nchw", "nhwc")] == fused
    assert not [n for n in graph_names(module, EngineSettings(fused_lanes=True, fused_lanes_autotune=autotune), CPU) if n.startswith("inductor")]


def test_a_timed_graph_is_offered_as_its_base_graph_is():
    from opara_core.engine.build import candidates

    entry, module, _ = googlenet()
    graph = traced_graphs(module, entry, CPU, EngineSettings(fusion=False, layout="nchw"), BuildReport())["nchw"]
    names = ("inductor", "inductor-cudnn", "inductor-timed", "inductor-cudnn-timed")
    found = candidates(dict.fromkeys(names, graph), EngineSettings())
    offered = {name: {(c.policy, c.lanes) for c in found if c.graph == name} for name in names}
    assert offered["inductor-timed"] == offered["inductor"] and offered["inductor-cudnn-timed"] == offered["inductor-cudnn"]
    assert ("sequential", 1) not in offered["inductor-cudnn-timed"]
    for candidate in found:
        assert candidate.fused and candidate.timed == candidate.graph.endswith("-timed")
        assert Candidate.parse(str(candidate)) == candidate
    assert not Candidate("nchw", "opara", 4).timed


@pytest.mark.gpu
def test_the_cudnn_fused_lanes_graph_is_the_inductor_graph_with_the_cudnn_passes(strict_fp32, tmp_path, monkeypatch):
    # made from the `inductor` graph (NASNet's warm build fused the traced graph twice
    # before): the same kernels as the cuDNN passes run in one go, the same outputs as eager
    from opara_core.engine import build
    from opara_core.engine.compare import max_relative_error
    from opara_core.engine.fusion import count_kernels, fuse_graph

    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))  # the fusion checks' markers
    device = torch.device("cuda")
    entry = zoo.get("resnet50")
    module = entry.build().to(device).eval()
    traced = trace_model(entry, module, device)
    checks = [tuple(t.to(device) for t in entry.example_inputs(2, seed=7))]
    graphs = build._fused_lanes_graphs(traced, device, EngineSettings(), BuildReport(), checks, True, None, build.FUSION_TOLERANCE)
    at_once, report = fuse_graph(traced, device, passes=build.INDUCTOR_CUDNN_PASSES)
    assert report.rewrites["conv_add_relu"] > 0 and report.rewrites["conv_relu"] > 0
    assert count_kernels(graphs["inductor-cudnn"].module) == count_kernels(at_once.module) < count_kernels(graphs["inductor"].module)
    assert sorted(build._fused_lanes_graphs(traced, device, EngineSettings(), BuildReport(), checks, True, {"inductor-cudnn"}, build.FUSION_TOLERANCE)) == ["inductor-cudnn"]
    with torch.inference_mode():
        for batch in (1, 4):
            inputs = tuple(x.to(device) for x in entry.example_inputs(batch, seed=batch))
            want = module(*inputs)
            for name, graph in graphs.items():
                assert max_relative_error(graph.module(*inputs), want) <= 1e-4, (name, batch)


def test_a_graph_whose_candidates_all_lost_by_more_than_auto_drop_is_not_timed_at_larger_buckets():
    fused, fused_seq = Candidate("inductor", "opara", 8), Candidate("inductor", "sequential", 1)
    nhwc, nhwc_seq = Candidate("nhwc", "asap", 8), Candidate("nhwc", "sequential", 1)
    nchw, nchw_seq = Candidate("nchw", "opara", 8), Candidate("nchw", "sequential", 1)
    sequential = [fused_seq, nhwc_seq, nchw_seq]
    # nhwc's best within AUTO_DROP of the fastest keeps its sequential graph too, though that is slower
    timings = {fused: 1.0, fused_seq: 2.6, nhwc: 0.99 * AUTO_DROP, nhwc_seq: 2.5, nchw: 1.01 * AUTO_DROP, nchw_seq: 3.0}
    kept_sequential, shortlist = next_candidates(timings, sequential)
    assert kept_sequential == [fused_seq, nhwc_seq]
    assert shortlist == [fused, nhwc]
    # a sequential graph the bucket could not capture is tried again where its graph stays
    kept_sequential, _ = next_candidates({fused: 1.0, nhwc: 1.2}, sequential)
    assert kept_sequential == [fused_seq, nhwc_seq]


def test_the_shortlist_keeps_the_auto_keep_fastest_multi_stream_candidates():
    many = {Candidate("inductor", "opara", k): 1.0 + k / 100 for k in range(1, 8)}
    _, shortlist = next_candidates(many, [])
    assert shortlist == sorted(many, key=many.get)[:AUTO_KEEP]
