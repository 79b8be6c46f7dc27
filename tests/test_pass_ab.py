"""scripts/pass_ab.py: a fusion pass's A/B through the bench (the comparison, the
argument checks and the child's pass lists; the bench itself needs a GPU)."""

from __future__ import annotations

import pytest
from conftest import load_script

from opara_core.engine import build

pass_ab = load_script("pass_ab")


def row(model, batch, **medians):
    return {"model": model, "batch": batch, "timings": {c: None if ms is None else {"median_ms": ms, "p99_ms": ms} for c, ms in medians.items()}}


def test_columns_both_runs_timed_are_compared_with_the_pass_over_without():
    without = [row("nasnet", 8, compile=8.0, auto=8.0), row("nasnet", 32, auto=25.0)]
    with_ = [row("nasnet", 8, compile=8.2, auto=6.0, **{"fused sequential": 6.1}), row("nasnet", 32, auto=None), row("bert", 1, auto=1.0)]
    found = pass_ab.compare(without, with_)
    assert [(f["batch"], f["column"], f["without_ms"], f["with_ms"]) for f in found] == [(8, "compile", 8.0, 8.2), (8, "auto", 8.0, 6.0)]
    assert found[1]["ratio"] == pytest.approx(0.75)
    text = pass_ab.table(found, ["depthwise_convs"])
    assert "with depthwise_convs ms" in text and "| nasnet | 8 | auto | 8.000 | 6.000 | 0.750 |" in text


def test_an_unknown_pass_or_a_json_for_the_bench_is_refused_before_anything_runs(capsys):
    assert pass_ab.main(["--passes", "depthwise_conv", "--", "--models", "nasnet"]) == 2
    err = capsys.readouterr().err
    assert "'depthwise_conv'" in err and "depthwise_convs" in err  # the typo, and the passes there are
    assert pass_ab.main(["--passes", "merge_convs", "--", "--json", "x.json"]) == 2
    assert "--json before" in capsys.readouterr().err


def test_the_child_adds_the_passes_to_both_fused_lanes_graphs_once(monkeypatch, capsys):
    monkeypatch.setattr(build, "INDUCTOR_PASSES", build.INDUCTOR_PASSES)
    monkeypatch.setattr(build, "INDUCTOR_CUDNN_PASSES", build.INDUCTOR_CUDNN_PASSES)
    before = build.INDUCTOR_CUDNN_PASSES
    assert "merge_convs" not in before and "cse" in build.INDUCTOR_PASSES
    code = pass_ab.main(["--passes", "merge_convs,cse", "--child", "--", "--models", "nasnet", "--batch", "8"])
    assert code == 2 and "needs a CUDA GPU" in capsys.readouterr().err  # the real bench, on this CPU
    assert build.INDUCTOR_PASSES.count("merge_convs") == 1 and build.INDUCTOR_PASSES.count("cse") == 1
    assert build.INDUCTOR_CUDNN_PASSES == (*before, "merge_convs")


def test_with_remove_the_child_takes_the_passes_out_of_both_graphs(monkeypatch, capsys):
    monkeypatch.setattr(build, "INDUCTOR_PASSES", ("cse", "depthwise_convs"))
    monkeypatch.setattr(build, "INDUCTOR_CUDNN_PASSES", ("cse", "depthwise_convs", "conv_relu"))
    code = pass_ab.main(["--passes", "depthwise_convs", "--remove", "--child", "--", "--models", "nasnet", "--batch", "8"])
    assert code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert build.INDUCTOR_PASSES == ("cse",) and build.INDUCTOR_CUDNN_PASSES == ("cse", "conv_relu")


def test_adding_a_pass_both_graphs_have_or_removing_one_neither_has_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(build, "INDUCTOR_PASSES", ("cse", "depthwise_convs"))
    monkeypatch.setattr(build, "INDUCTOR_CUDNN_PASSES", ("cse", "depthwise_convs", "conv_relu"))
    assert pass_ab.main(["--passes", "depthwise_convs", "--", "--models", "nasnet"]) == 2
    err = capsys.readouterr().err
    assert "already in both" in err and "--remove" in err
    assert pass_ab.main(["--passes", "merge_convs", "--remove", "--", "--models", "nasnet"]) == 2
    assert "['merge_convs'] in neither" in capsys.readouterr().err
    assert build.INDUCTOR_PASSES == ("cse", "depthwise_convs")  # nothing changed, nothing ran


def test_with_remove_the_run_as_is_comes_first_and_the_failure_names_it(tmp_path, capsys):
    code = pass_ab.main(["--passes", "depthwise_convs", "--remove", "--json", str(tmp_path / "ab.json"), "--", "--models", "nasnet", "--batch", "8"])
    assert code == 2  # no GPU here: the first run (the engine as it is, the pass in) fails
    assert "the bench with depthwise_convs exited 2" in capsys.readouterr().err


def test_a_bench_that_fails_ends_the_ab_with_its_exit_status(tmp_path, capsys):
    code = pass_ab.main(["--passes", "merge_convs", "--json", str(tmp_path / "ab.json"), "--", "--models", "nasnet", "--batch", "8"])
    assert code == 2  # the bench without the pass: no GPU here
    assert "the bench without merge_convs exited 2" in capsys.readouterr().err
    assert not (tmp_path / "ab.json").exists()
