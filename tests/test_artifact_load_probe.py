"""scripts/artifact_load_probe.py: every way it loads a saved cell computes what
the eager cell does, and the lookup really writes nothing into Inductor's cache
(CPU; the replay times are the GPU's)."""

import json
import os

import pytest
import torch

from conftest import load_script

probe = load_script("artifact_load_probe")


def test_every_mode_loads_each_cell_and_answers_as_eager(tmp_path, capsys):
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    assert probe.main(["--out", str(tmp_path), "--cells", "2", "--batch", "2"]) == 0
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before  # the test process's cache is left as it was
    result = json.loads((tmp_path / "artifact_load_probe.json").read_text())
    assert set(result["modes"]) == set(probe.MODES)
    for mode, runs in result["modes"].items():
        assert sorted(runs) == (["a0", "a1"] if mode == "aot" else ["c0", "c1"]), mode
        assert all(run["relative_error"] < 1e-4 and run["load_s"] > 0 for run in runs.values()), (mode, runs)
    out = capsys.readouterr().out
    assert all(f"| {mode} | 2 |" in out for mode in probe.MODES), out


def test_the_lookup_leaves_inductors_cache_as_it_found_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    probe.compile_artifacts(tmp_path / "artifacts", "cpu", 1, 2)
    files = lambda: {p: p.stat().st_mtime_ns for p in (tmp_path / "inductor").rglob("*") if p.is_file()}  # noqa: E731
    before = files()
    cells = probe._cells()
    inputs = cells.example_inputs(2, "cpu")
    with torch.inference_mode():
        got = probe.load_from_cache(tmp_path / "artifacts" / "c0.bin")(*inputs)[0]
        assert torch.allclose(got, cells.cell(0)(*inputs)[0], rtol=1e-5, atol=1e-5)
    assert files() == before


def test_a_batch_of_one_is_refused_with_the_reason(tmp_path, capsys):
    with pytest.raises(SystemExit):
        probe.main(["--out", str(tmp_path), "--batch", "1"])
    assert "at least 2" in capsys.readouterr().err
