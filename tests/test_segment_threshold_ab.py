"""scripts/segment_threshold_ab.py without a GPU: the child's threshold, the table, bad arguments."""

from __future__ import annotations

import json

import pytest

from conftest import load_script

ab = load_script("segment_threshold_ab")


def _result(threshold, warm_s, ms):
    build = {"seconds": {"trace": 9.0, "fusion": 1.0, "profile": 0.0, "plan+capture": warm_s - 1.0}, "inductor": f"{400 // threshold} loaded"}
    rows = [{"model": "nasnet", "batch": 1, "timings": {"fused opara": {"median_ms": ms, "p99_ms": ms}, "auto": None}}]
    return {"model": "nasnet", "threshold": threshold, "bench": {"meta": {}, "rows": rows}, "builds": [build, build, {**build, "seconds": {"fusion": 2.0}}]}


def test_the_table_puts_both_thresholds_side_by_side(tmp_path, capsys):
    paths = []
    for n, (warm, ms) in enumerate(((13.3, 1.650), (10.2, 1.700)), start=1):
        paths.append(tmp_path / f"ab{n}.json")
        paths[-1].write_text(json.dumps(_result(n, warm, ms)))
    assert ab.main(["--report", *map(str, paths)]) == 0
    printed = capsys.readouterr().out
    assert "| 1 | 13.3 | 2.0 | 400 loaded |" in printed and "| 2 | 10.2 | 2.0 | 200 loaded |" in printed  # tracing left out
    assert "| 1 | fused opara | 1.650 | 1.700 |" in printed
    assert "| auto |" not in printed  # a column not timed is no row


def test_the_child_runs_the_bench_with_the_threshold_set(monkeypatch):
    from opara_core import bench
    from opara_core.engine import segment_compiler

    monkeypatch.setattr(segment_compiler, "MIN_KERNELS_TO_COMPILE", segment_compiler.MIN_KERNELS_TO_COMPILE)  # restored after
    seen = []
    monkeypatch.setattr(bench, "main", lambda args: seen.append((segment_compiler.MIN_KERNELS_TO_COMPILE, args)) or 0)
    assert ab.main([ab.CHILD, "2", "--build-only", "nasnet"]) == 0
    assert seen == [(2, ["--build-only", "nasnet"])]


@pytest.mark.parametrize("argv", [["nasnet", "--cache", "c", "--json", "j"], ["nasnet", "--threshold", "0", "--cache", "c", "--json", "j"], ["--threshold", "2"]])
def test_a_run_without_what_it_needs_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        ab.main(argv)
    assert stop.value.code == 2 and "a run needs MODEL, --threshold" in capsys.readouterr().err


def test_a_failed_step_is_an_error_naming_it_not_a_traceback(tmp_path, monkeypatch, capsys):
    import subprocess

    monkeypatch.setattr(ab.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(command, 2, stdout=""))
    assert ab.main(["nasnet", "--threshold", "2", "--cache", str(tmp_path / "c"), "--json", str(tmp_path / "ab.json")]) == 1
    assert "error: the bench with threshold 2 failed (exit 2)" in capsys.readouterr().err
    assert not (tmp_path / "ab.json").exists()


def test_a_run_reports_what_its_steps_wrote(tmp_path, monkeypatch, capsys):
    """The bench's JSON as the bench writes it and the builds' last lines feed the table."""
    import subprocess

    import torch

    from opara_core import bench

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test GPU")

    def step(command, **kwargs):
        if "--json" in command:
            rows = [bench.Row("nasnet", 1, {"fused opara": bench.Timing(1.5, 1.6, 100)})]
            bench._write_json(ab.Path(command[command.index("--json") + 1]), rows)
            return subprocess.CompletedProcess(command, 0, stdout="bench table\n")
        build = {"seconds": {"trace": 7.0, "fusion": 1.5, "plan+capture": 7.0}, "inductor": "238 loaded"}
        return subprocess.CompletedProcess(command, 0, stdout="log\n" + json.dumps(build) + "\n")

    monkeypatch.setattr(ab.subprocess, "run", step)
    assert ab.main(["nasnet", "--threshold", "2", "--cache", str(tmp_path / "c"), "--json", str(tmp_path / "ab.json")]) == 0
    printed = capsys.readouterr().out
    assert "| 2 | 8.5 | 8.5 | 238 loaded |" in printed and "| 1 | fused opara | 1.500 |" in printed
    assert json.loads((tmp_path / "ab.json").read_text())["bench"]["meta"]["device"] == "test GPU"
