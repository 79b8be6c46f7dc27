"""scripts/dynamic_batch_probe.py: its dynamic artifact really serves every batch
size and every artifact computes what the eager cell does (CPU; the replay times
are the GPU's)."""

import json
import os

import pytest
import torch

from conftest import load_script

probe = load_script("dynamic_batch_probe")


def test_only_the_batch_dimension_of_the_traced_cell_is_a_symbol():
    graph = probe.dynamic_batch_graph(0, probe.example_inputs(4, "cpu"))
    x, weight, bias = (node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder")
    assert isinstance(x.shape[0], torch.SymInt) and all(isinstance(size, int) for size in x.shape[1:])
    assert all(isinstance(size, int) for size in (*weight.shape, *bias.shape))


def test_each_artifact_answers_as_the_eager_cell_at_every_batch_it_serves(tmp_path, capsys):
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    assert probe.main(["--out", str(tmp_path), "--cells", "1", "--batches", "2,3"]) == 0
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before  # the test process's cache is left as it was
    assert any((tmp_path / "inductor").iterdir())  # compiled into the probe's own
    result = json.loads((tmp_path / "dynamic_batch_probe.json").read_text())
    assert sorted(result["runs"]) == ["d0@2", "d0@3", "s0_2@2", "s0_3@3"]  # one dynamic artifact for both sizes
    assert all(run["relative_error"] < 1e-4 for run in result["runs"].values())
    assert sorted(result["loads"]) == ["d0", "s0_2", "s0_3"] and all(load["rest_s"] > 0 for load in result["loads"].values())
    assert "load per artifact, mean over 3" in capsys.readouterr().out


def test_a_batch_of_one_is_refused_with_the_reason(tmp_path, capsys):
    with pytest.raises(SystemExit):
        probe.main(["--out", str(tmp_path), "--batches", "1,4"])
    assert "at least 2" in capsys.readouterr().err
