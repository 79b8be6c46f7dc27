"""The benchmark's bookkeeping on the CPU: choosing columns, and merging a model
measured column by column in several runs into one row per batch."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from opara_core import bench
from opara_core.bench import COLUMNS, Row, Timing, merge_rows, parse_columns


def _row(model, batch, **columns):
    return Row(model, batch, timings={name.replace("_", " "): Timing(ms, ms * 1.1, 100) for name, ms in columns.items()})


def test_no_columns_means_every_column_and_an_unknown_one_is_named():
    assert parse_columns("") == COLUMNS
    assert parse_columns("compile, auto") == ("compile", "auto")
    with pytest.raises(ValueError, match="'autoo'"):
        parse_columns("compile,autoo")


def test_rows_of_one_model_and_batch_from_several_runs_become_one():
    first = [_row("nasnet", 1, eager=9.0, compile=2.5), _row("nasnet", 8, eager=9.5, compile=4.0)]
    second = [_row("nasnet", 1, auto=2.1, fused_opara=2.2), _row("googlenet", 1, auto=0.3)]
    second[0].auto_choice, second[0].warm_build_s = "inductor:opara/8", 9.5
    merged = merge_rows(first + second)
    assert [(r.model, r.batch) for r in merged] == [("nasnet", 1), ("nasnet", 8), ("googlenet", 1)]
    nasnet = merged[0]
    assert {k: t.median_ms for k, t in nasnet.timings.items()} == {"eager": 9.0, "compile": 2.5, "auto": 2.1, "fused opara": 2.2}
    assert (nasnet.auto_choice, nasnet.warm_build_s) == ("inductor:opara/8", 9.5)
    assert set(first[0].timings) == {"eager", "compile"}  # the inputs are left as they were


def test_a_column_measured_twice_keeps_the_later_run_and_says_so():
    merged = merge_rows([_row("bert", 32, compile=17.0), _row("bert", 32, compile=16.9)])
    assert len(merged) == 1 and merged[0].timings["compile"].median_ms == 16.9
    assert any("compile" in note and "twice" in note for note in merged[0].notes)


def test_report_prints_one_line_per_model_and_batch(tmp_path, capsys):
    paths = []
    for i, rows in enumerate(([_row("nasnet", 1, compile=2.5)], [_row("nasnet", 1, auto=2.1)])):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps({"meta": {}, "rows": [asdict(r) for r in rows]}))
        paths.append(str(path))
    assert bench.main(["--report", *paths]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| nasnet")]
    assert len(lines) == 1 and "2.500" in lines[0] and "2.100" in lines[0], lines
    assert "| -/- |" in lines[0]  # no graph's memory measured: none shown (not 0 MB)


def test_an_unknown_column_is_refused_before_anything_runs(capsys):
    assert bench.main(["--models", "googlenet", "--columns", "fastest"]) == 2
    assert "'fastest'" in capsys.readouterr().err


def test_fused_lanes_autotune_is_refused_for_an_unknown_model_or_without_cudnns_benchmark(capsys):
    assert bench.main(["--models", "resnet50", "--fused-lanes-autotune", "resnet5"]) == 2
    assert "resnet5" in capsys.readouterr().err
    assert bench.main(["--models", "resnet50", "--fused-lanes-autotune", "resnet50", "--no-cudnn-benchmark"]) == 2
    assert "--no-cudnn-benchmark" in capsys.readouterr().err


def test_a_reused_cache_without_no_plan_capture_is_refused(tmp_path, capsys, monkeypatch):
    # the cold build timing needs an empty cache: a reused one would time a warm build as cold
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "googlenet.json").write_text("{}")
    assert bench.main(["--models", "googlenet", "--cache-dir", str(tmp_path)]) == 2
    assert "--no-plan-capture" in capsys.readouterr().err
    # an empty one holds nothing to reuse, but only for one model: the second would find the first's
    assert bench.main(["--models", "googlenet,resnet50", "--cache-dir", str(tmp_path / "empty")]) == 2
    assert "--no-plan-capture" in capsys.readouterr().err
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)  # stop at the next check, even on a GPU machine
    assert bench.main(["--models", "googlenet", "--cache-dir", str(tmp_path / "empty")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_run_as_a_module_its_own_info_lines_reach_stderr(tmp_path):
    """`python -m opara_core.bench` runs this module as `__main__`: its logger
    must still be under "opara_core", whose INFO level main() sets (run 28's
    bench logs lacked the build seconds logged for runs cut before their row)."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"meta": {}, "rows": [asdict(_row("bert", 1, compile=1.5)), asdict(_row("bert", 1, auto=1.2))]}))
    done = subprocess.run([sys.executable, "-m", "opara_core.bench", "--report", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "INFO opara_core.bench: 2 rows from 1 files, 1 after merging" in done.stderr, done.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure path: the child process needs no GPU to fail")
def test_a_compile_column_its_own_process_could_not_measure_is_a_note_naming_why(tmp_path):
    """The torch.compile columns run in a process of their own (cuDNN's plans
    are per process, run 29); when that process fails, the row says which
    columns are missing and what the process said, and nothing else breaks."""
    row = Row("deepfm", 1)
    bench.compiled_elsewhere("deepfm", 1, ["compile"], row, tmp_path, cudnn_benchmark=True)
    assert "compile" not in row.timings
    assert any(note.startswith("compile: its process ended with 2") and "needs a CUDA GPU" in note for note in row.notes), row.notes
    assert not (tmp_path / "inductor").exists()  # its cache is its own, never the engine's


@pytest.mark.gpu
def test_the_compile_column_is_timed_in_a_process_of_its_own(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    row = Row("deepfm", 1)
    bench.compiled_elsewhere("deepfm", 1, ["compile"], row, tmp_path, cudnn_benchmark=True)
    assert row.timings["compile"].median_ms > 0, row.notes
    assert any(note.endswith("(in a process of its own)") and "compile and warm-up" in note for note in row.notes), row.notes
    assert (tmp_path / "compile" / "inductor").is_dir() and not (tmp_path / "inductor").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure path: the child process needs no GPU to fail")
def test_a_warm_build_that_fails_is_none_and_its_own_error_reaches_stderr(capfd, caplog):
    """The warm builds run in processes of their own, their logs on the bench's
    stderr (where a warm build's seconds went); one that fails costs the row its
    warm seconds, not the benchmark."""
    with caplog.at_level("WARNING", logger="opara_core.bench"):
        assert bench._warm_build([sys.executable, "-m", "opara_core.bench", "--build-only", "deepfm"]) is None
    assert "the serving build's timing needs a CUDA GPU" in capfd.readouterr().err
    assert "a warm build failed with exit status 2" in caplog.text


def test_the_warm_build_that_times_the_served_column_is_told_the_batches_and_its_timings_come_back():
    echo = [sys.executable, "-c", "import json, sys; print(json.dumps({'argv': sys.argv[1:], 'served': {'8': {'median_ms': 0.5, 'p99_ms': 0.6, 'calls': 300}}}))"]
    assert bench._warm_build(echo, [1, 8])["argv"] == ["--served-batches", "1,8"]
    report = bench._warm_build(echo)
    assert report["argv"] == [] and bench._served(report) == {8: Timing(0.5, 0.6, 300)}
    assert bench._served(None) == {}  # a warm build that failed


@pytest.mark.gpu
def test_a_build_times_the_graphs_it_captured_at_the_buckets_asked_for(tmp_path, monkeypatch):
    """The `served` column: what a server built on the cache replays, timed
    like every graph column; a batch size that is no bucket has no graph of its own."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for name, value in (("OPARA_CACHE_DIR", tmp_path), (bench.INDUCTOR_ENV, tmp_path / "inductor")):
        monkeypatch.setenv(name, str(value))
    report = bench._build_report("deepfm", torch.device("cuda"), 8, True, "auto", served_batches=[1, 3, 8])
    assert set(report["served"]) == {"1", "8"}, report["served"]
    for timing in (Timing(**t) for t in report["served"].values()):
        assert 0 < timing.median_ms <= timing.p99_ms
    # a build asked for no batches (the second warm build) times nothing
    assert bench._build_report("deepfm", torch.device("cuda"), 8, True, "auto")["served"] == {}


def _event(stream, start, duration):
    return {"ts": start, "dur": duration, "args": {"stream": stream}}


def test_replay_stats_sum_a_two_stream_replay():
    """Stream 7: 0-10 and 12-20; stream 9: 5-15 and 30-34. By hand: span 34,
    busy 0-20 and 30-34 = 24, idle 10, exactly one stream 0-5, 10-12, 15-20
    and 30-34 = 16, kernel sum 32."""
    events = [_event(7, 0, 10), _event(9, 5, 10), _event(7, 12, 8), _event(9, 30, 4)]
    stats = bench.replay_stats(events)
    assert (stats["span"], stats["busy"], stats["idle"], stats["sum"], stats["events"]) == (34, 24, 10, 32, 4)
    assert stats["one_stream"] == 16
    assert stats["streams"] == {"7": {"events": 2, "sum": 18}, "9": {"events": 2, "sum": 14}}
    assert list(stats["streams"]) == ["7", "9"]  # busiest first


def test_replay_stats_of_one_stream_with_back_to_back_kernels():
    stats = bench.replay_stats([_event(3, 0, 4), _event(3, 4, 6), _event(3, 12, 1)])
    assert (stats["span"], stats["busy"], stats["idle"], stats["one_stream"], stats["sum"]) == (13, 11, 2, 11, 11)
