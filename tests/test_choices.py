"""auto's remembered choices: keyed by everything they depend on, read back as
written, a file that cannot be read is ignored, and only the remembered
candidates get captures (CPU); a second build on the GPU captures only them."""

from __future__ import annotations

import pytest
import torch

from opara_core import zoo
from opara_core.engine import build, choices
from opara_core.engine.build import BuildReport, Candidate, EngineSettings, build_runner, needed, recipe_key, trace_for_build, traced_graphs

CPU = torch.device("cpu")
PARTS = {"traced": "sha256:aaa", "code": "c0de", "settings": "EngineSettings()"}


def test_the_key_changes_with_each_thing_the_choice_depends_on():
    key = choices.key(PARTS, (1, 8), CPU)
    assert key == choices.key(dict(reversed(PARTS.items())), (8, 1, 8), CPU)
    assert key != choices.key({**PARTS, "traced": "sha256:bbb"}, (1, 8), CPU)
    assert key != choices.key({**PARTS, "code": "c0dd"}, (1, 8), CPU)
    assert key != choices.key(PARTS, (1, 8, 32), CPU)
    saved = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = not saved
        assert key != choices.key(PARTS, (1, 8), CPU)
    finally:
        torch.backends.cudnn.benchmark = saved


def test_stored_choices_read_back_and_forget_removes_them(tmp_path):
    picked = {1: Candidate("nchw", "opara", 8), 8: Candidate("nhwc", "asap", 4)}
    timings = {1: {Candidate("nchw", "opara", 8): 0.4, Candidate("nchw", "sequential", 1): 0.6}, 8: {Candidate("nhwc", "asap", 4): 0.9}}
    choices.store("k", picked, timings, {"nchw": "sha256:aaa", "nhwc": "sha256:bbb"}, tmp_path)
    got = choices.load("k", tmp_path)
    assert {b: Candidate.parse(c) for b, c in got.choices.items()} == picked
    assert got.timings_ms == {1: {"nchw:opara/8": 0.4, "nchw:sequential/1": 0.6}, 8: {"nhwc:asap/4": 0.9}}
    assert got.graphs == {"nchw": "sha256:aaa", "nhwc": "sha256:bbb"}
    choices.forget("k", tmp_path)
    assert choices.load("k", tmp_path) is None


def test_an_unreadable_file_is_ignored(tmp_path):
    (tmp_path / "k.json").write_text("{not json")
    assert choices.load("k", tmp_path) is None
    (tmp_path / "k.json").write_text('{"choices": []}')
    assert choices.load("k", tmp_path) is None
    (tmp_path / "k.json").write_text('{"choices": {"1": "nchw:opara/8"}, "timings_ms": {}}')  # no graphs
    assert choices.load("k", tmp_path) is None


def test_remembered_choices_are_offered_only_where_they_cover_every_bucket():
    found = choices.Remembered({1: "nchw:opara/8", 8: "inductor:sequential/1"}, {1: {"nchw:opara/8": 0.3}}, {"nchw": "a", "inductor": "b"})
    known, timings = build._parsed(found, (1, 8))
    assert known == {1: Candidate("nchw", "opara", 8), 8: Candidate("inductor", "sequential", 1)}
    assert timings == {1: {Candidate("nchw", "opara", 8): 0.3}}
    assert build._parsed(found, (1, 8, 32)) is None
    assert build._parsed(choices.Remembered({1: "opara/8"}, {}, {}), (1,)) is None  # not a candidate's text
    assert build._parsed(None, (1,)) is None


def test_the_recipe_key_changes_with_the_traced_graph_and_every_setting():
    entry = zoo.get("deepfm")
    module = entry.build().eval()
    traced = traced_graphs(module, entry, CPU, EngineSettings(fusion=False, layout="nchw"), BuildReport())["nchw"]
    key = recipe_key(traced, EngineSettings(), CPU)
    assert key == recipe_key(traced, EngineSettings(), CPU)
    assert key != recipe_key(traced, EngineSettings(max_streams=4), CPU)
    assert key != recipe_key(traced, EngineSettings(buckets=(1, 8)), CPU)
    assert key != recipe_key(traced, EngineSettings(fused_lanes=False), CPU)
    other = zoo.get("googlenet")
    graph = traced_graphs(other.build().eval(), other, CPU, EngineSettings(fusion=False, layout="nchw"), BuildReport())["nchw"]
    assert key != recipe_key(graph, EngineSettings(), CPU)


def test_only_the_graphs_asked_for_are_made():
    entry = zoo.get("googlenet")
    module = entry.build().eval()
    settings = EngineSettings(fusion=False)
    assert sorted(traced_graphs(module, entry, CPU, settings, BuildReport())) == ["nchw", "nhwc"]
    report = BuildReport()
    assert sorted(traced_graphs(module, entry, CPU, settings, report, only={"nhwc"})) == ["nhwc"]
    assert traced_graphs(module, entry, CPU, EngineSettings(), report, only={"inductor"}) == {}  # fused graphs: GPU only
    assert report.fusion is None  # the ATen graph was not fused for it


def test_candidate_text_round_trips():
    for candidate in (Candidate("nchw", "opara", 8), Candidate("inductor", "sequential", 1)):
        assert Candidate.parse(str(candidate)) == candidate
    with pytest.raises(ValueError):
        Candidate.parse("opara/8")


def test_a_build_makes_captures_of_the_remembered_candidates_only_when_every_bucket_has_one():
    plans = {Candidate.parse(text): text for text in ("nchw:sequential/1", "nchw:opara/8", "inductor:sequential/1", "inductor-cudnn:opara/8")}
    fused, aten = Candidate.parse("inductor-cudnn:opara/8"), Candidate.parse("nchw:opara/8")
    assert needed(plans, {1: fused, 8: aten, 32: fused}, (1, 8, 32)) == {aten: "nchw:opara/8", fused: "inductor-cudnn:opara/8"}
    assert needed(plans, {1: fused, 8: aten}, (1, 8, 32)) == plans  # bucket 32 is timed: every candidate
    assert needed(plans, None, (1, 8, 32)) == plans


@pytest.mark.gpu
def test_a_second_build_captures_only_the_remembered_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    device = torch.device("cuda")
    entry = zoo.get("deepfm")
    settings = EngineSettings(buckets=(1, 4), fused_lanes=False)  # ATen candidates: no minutes of compiling
    first_runner, first = build_runner(entry.build(), entry, device, 4, settings)
    assert first.runner == "multi-stream graph" and not first.remembered, first.summary()
    second_runner, second = build_runner(entry.build(), entry, device, 4, settings)
    assert second.remembered and second.choices == first.choices, second.summary()
    assert not any(k.startswith("timing") for k in second.seconds), second.seconds
    # no candidate timed, yet the ready line says what each bucket's graph costs a request
    assert set(second.served_ms) == {1, 4} and " served " in second.summary(), second.summary()
    # the second build made only the graphs its choices use (engine.choices' recipe)
    used = {c.graph for c in first.choices.values()}
    graphs = choices.load(recipe_key(trace_for_build(entry.build().to(device).eval(), entry, device, BuildReport()), settings, device)).graphs
    assert set(graphs) == used, graphs
    assert (second.fusion is None) == used.isdisjoint({"nchw", "nhwc"}), (used, second.fusion)
    inputs = entry.example_inputs(3, seed=11)
    for a, b in zip(first_runner.run(inputs), second_runner.run(inputs)):
        assert torch.allclose(a.cpu(), b.cpu(), rtol=1e-4, atol=1e-5)


def test_a_build_tries_the_remembered_choices_then_every_candidate_then_the_sequential_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    entry = zoo.get("googlenet")
    module = entry.build().eval()
    settings = EngineSettings(fusion=False)

    def tried(settings: EngineSettings, traced=True) -> list[tuple[str, str, list[str] | None]]:
        state = build.Build(module, entry, CPU, settings, None, BuildReport(), None, traced=object() if traced else None, key="k" if traced else None)
        return [(a.label, a.kind, None if a.graphs is None else sorted(a.graphs)) for a in build.attempts(state)]

    assert tried(settings) == [("multi-stream graph", "multi-stream graph", None), ("sequential graph", "sequential graph", ["nchw"])]
    choices.store("k", {b: Candidate("nhwc", "opara", 8) for b in settings.buckets}, {}, {"nhwc": "sha256:aaa"})
    assert tried(settings)[0] == ("remembered choices", "multi-stream graph", ["nhwc"])
    assert len(tried(settings)) == 3
    assert tried(EngineSettings(fusion=False, buckets=(1, 64))) == tried(settings)[1:]  # the remembered buckets differ
    assert tried(EngineSettings(fusion=False, policy="sequential")) == [("sequential graph", "sequential graph", ["nchw"])]
    assert tried(EngineSettings(fusion=False, layout="nhwc"))[-1] == ("sequential graph", "sequential graph", ["nhwc"])
    assert tried(settings, traced=False) == [("sequential graph", "sequential graph", ["nchw"])]  # of the untraced module
