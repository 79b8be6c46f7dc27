"""dev/gpu_queue.py: jobs spread over the GPUs until a deadline, and a later
call doing only what an earlier one left (real subprocesses; no GPU needed)."""

from __future__ import annotations

import json
import os
import tarfile
import time

import pytest
from conftest import load_script

gpu_queue = load_script("gpu_queue", "dev")


def bench_json(path, *rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {}, "rows": [{"model": m, "batch": b, "timings": {c: {"median_ms": 1.0} for c in cols}} for m, b, cols in rows]}))


def test_a_bench_job_measures_only_the_batches_no_earlier_json_holds(tmp_path):
    done, out, cache = tmp_path / "done", tmp_path / "out", tmp_path / "cache"
    full = ("eager", "compile", "sequential", "fused sequential", "auto")
    bench_json(done / "call1.json", ("bert", 1, full), ("bert", 8, ("eager", "compile")), ("t5", 1, full))  # batch 8 was cut mid-row
    job = gpu_queue.job_for("bench:bert", out, done, cache)
    assert f"--models bert --batch 8,32 --cache-dir {cache / 'bert'} " in job.command  # its cache empty: the build is timed
    (cache / "bert" / "traces").mkdir(parents=True)
    (cache / "bert" / "traces" / "bert.pt2").write_bytes(b"x")  # an earlier job's cache on this machine: reused
    job = gpu_queue.job_for("bench:bert", out, done, cache)
    assert f"--models bert --batch 8,32 --no-plan-capture --cache-dir {cache / 'bert'} " in job.command
    bench_json(out / "this_call.json", ("bert", 8, full), ("bert", 32, full))
    assert gpu_queue.job_for("bench:bert", out, done, cache).command is None
    assert gpu_queue.job_for("bench:t5:1", out, done, cache).command is None
    # a job of some columns is done when its rows hold those columns
    job = gpu_queue.job_for("bench:t5:1,8:fused sequential,auto", out, done, cache)
    assert "--batch 8 " in job.command and job.command.endswith("--columns 'fused sequential,auto'")
    # more bench arguments after the columns, each quoted on its own
    job = gpu_queue.job_for("bench:t5:32:compile max-autotune:--compile-autotune t5 --cache-dir '/tmp/a b'", out, done, cache)
    assert job.command.endswith("--columns 'compile max-autotune' --compile-autotune t5 --cache-dir '/tmp/a b'")
    # a model of no zoo: its directory under --model-repository
    (tmp_path / "repo" / "mine").mkdir(parents=True)
    (tmp_path / "repo" / "mine" / "config.pbtxt").write_text('name: "mine"')
    job = gpu_queue.job_for("bench:mine:1", out, done, cache, tmp_path / "repo")
    assert f"--models {tmp_path / 'repo' / 'mine'} --batch 1 --cache-dir {cache / 'mine'} " in job.command
    assert "--models googlenet " in gpu_queue.job_for("bench:googlenet:1", out, done, cache, tmp_path / "repo").command


def test_rows_count_only_for_jobs_of_the_same_bench_arguments(tmp_path):
    """A row measured with --fused-lanes-autotune is not one measured without
    it (run 41 lost a device call to that): rows count only for a job whose
    ARGS the run had; a JSON from before the bench recorded its arguments
    counts for any job."""
    done, out, cache = tmp_path / "done", tmp_path / "out", tmp_path / "cache"
    columns = ("auto", "served")

    def written(name, argv, *rows):
        bench_json(done / name, *rows)
        data = json.loads((done / name).read_text())
        data["meta"]["argv"] = argv
        (done / name).write_text(json.dumps(data))

    plain = ["--models", "googlenet", "--batch", "1,8", "--no-plan-capture", "--cache-dir", "/c/googlenet", "--json", "/o/a.json", "--columns", "auto,served"]
    written("plain.json", plain, ("googlenet", 1, columns), ("googlenet", 8, columns))
    tuned = "bench:googlenet:1,8:auto,served:--fused-lanes-autotune googlenet --cache-dir " + str(tmp_path / "tuned")
    job = gpu_queue.job_for(tuned, out, done, cache)
    assert job.command is not None and "--batch 1,8 " in job.command
    assert " --no-plan-capture" not in job.command  # its own cache folder is empty: the build is timed there
    (tmp_path / "tuned" / "traces").mkdir(parents=True)
    (tmp_path / "tuned" / "traces" / "googlenet.pt2").write_bytes(b"x")
    assert " --no-plan-capture" in gpu_queue.job_for(tuned, out, done, cache).command
    written("tuned.json", ["--models", "googlenet", "--batch", "1", "--cache-dir", "/c/googlenet", "--json", "/o/b.json", "--columns", "auto,served",
                           "--fused-lanes-autotune", "googlenet", "--cache-dir", str(tmp_path / "tuned")], ("googlenet", 1, columns))
    assert "--batch 8 " in gpu_queue.job_for(tuned, out, done, cache).command
    assert gpu_queue.job_for("bench:googlenet:1,8:auto,served", out, done, cache).command is None
    bench_json(done / "old.json", ("resnet50", 1, columns))  # no arguments recorded
    assert gpu_queue.job_for("bench:resnet50:1:auto,served:--fused-lanes-autotune resnet50", out, done, cache).command is None


def test_the_bench_records_its_arguments_as_the_queue_reads_them(tmp_path, monkeypatch):
    from opara_core import bench

    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "none")
    argv = ["--models", "t5", "--batch", "1", "--cache-dir", "/c/t5", "--json", str(tmp_path / "t.json"), "--columns", "auto", "--compile-autotune", "t5"]
    bench._write_json(tmp_path / "t.json", [bench.Row("t5", 1)], argv)
    meta = json.loads((tmp_path / "t.json").read_text())["meta"]
    assert gpu_queue.extra_arguments(meta["argv"]) == ["--compile-autotune", "t5"]


def test_a_bench_job_that_ended_well_is_done_though_the_model_lacks_a_column(tmp_path):
    # BERT has no convolution: its rows never hold `fused opara cudnn`, which the job names
    done, out = tmp_path / "done", tmp_path / "out"
    spec = "bench:bert:1:compile,fused opara cudnn,auto"
    bench_json(done / "call1.json", ("bert", 1, ("compile", "auto")))
    job = gpu_queue.job_for(spec, out, done, tmp_path / "cache")
    assert job.command is not None
    (done / f"{job.name}.done").touch()  # as the call that ran it left it
    assert gpu_queue.job_for(spec, out, done, tmp_path / "cache").command is None


def test_a_tests_job_passes_its_arguments_to_pytest_one_by_one(tmp_path):
    node = "tests/test_fused_lanes.py::test_fused_lanes_replays_equal_the_single_lane_graph_of_the_same_segments[nasnet]"
    job = gpu_queue.job_for(f"tests:tests/test_fused_lanes.py,--deselect,{node}", tmp_path, tmp_path, tmp_path)
    assert job.command.endswith(f"-m gpu -q -rfE --durations=10 tests/test_fused_lanes.py --deselect '{node}'")


def test_malformed_jobs_are_refused_before_anything_runs(tmp_path):
    for spec in ("bench", "bench:nasnet:8x", "bench:t5:1::--x 'unclosed", "nasnet:8", "run:=echo", "run:a b=echo"):
        with pytest.raises(ValueError, match="job"):
            gpu_queue.run_queue(["run:first=touch {out}/ran", spec], 1, 10, tmp_path, tmp_path / "done", tmp_path)
    assert not (tmp_path / "ran").exists()


def test_jobs_share_the_gpus_and_the_deadline_cuts_what_is_still_running(tmp_path):
    out = tmp_path / "out"
    jobs = ["run:slow=sleep 60", "run:a=echo $CUDA_VISIBLE_DEVICES > {out}/a.txt", "run:b=echo $CUDA_VISIBLE_DEVICES > {out}/b.txt"]
    started = time.monotonic()
    summary = gpu_queue.run_queue(jobs, 2, 3, out, tmp_path / "done", tmp_path)
    assert time.monotonic() - started < 20
    status = {spec: (gpu, exit_status) for spec, gpu, exit_status, _ in summary}
    slow_gpu, cut = status["run:slow=sleep 60"]
    other = 1 - slow_gpu  # either thread may take the first job; the other GPU then runs both quick ones
    assert cut == "cut" and status[jobs[1]] == (other, "0") and status[jobs[2]] == (other, "0")
    # everything went into the tarball, alone in the folder (a device call returns 8 files)
    assert [path.name for path in out.iterdir()] == ["queue.tgz"]
    with tarfile.open(out / "queue.tgz") as tar:
        assert {"a.txt", "a.log", "a.done", "slow.log", "b.done"} <= set(tar.getnames()) and "slow.done" not in tar.getnames()
        assert tar.extractfile("a.txt").read().decode() == f"{other}\n"


def test_each_job_gets_its_gpu_and_its_share_of_the_cores_for_openmp(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(gpu_queue, "usable_cpus", lambda: 64)
    assert gpu_queue.job_env(3, 4)["CUDA_VISIBLE_DEVICES"] == "3" and gpu_queue.job_env(3, 4)["OMP_NUM_THREADS"] == "16"
    assert gpu_queue.job_env(0, 128)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's value stays
    assert gpu_queue.job_env(0, 4)["OMP_NUM_THREADS"] == "5"
    out = tmp_path / "out"
    monkeypatch.delenv("OMP_NUM_THREADS")
    gpu_queue.run_queue(["run:t=echo $OMP_NUM_THREADS > {out}/t.txt"], 2, 10, out, tmp_path / "done", tmp_path)
    with tarfile.open(out / "queue.tgz") as tar:
        assert tar.extractfile("t.txt").read().decode() == "32\n"  # what the job's process saw


def test_a_later_call_skips_the_jobs_an_earlier_one_finished(tmp_path):
    first, done, second = tmp_path / "first", tmp_path / "done", tmp_path / "second"
    gpu_queue.run_queue(["run:once=echo x >> {out}/count", "run:nested=mkdir -p {out}/a/b && touch {out}/a/b/c"], 1, 10, first, tmp_path / "none", tmp_path)
    assert [path.name for path in first.iterdir()] == ["queue.tgz"]
    with tarfile.open(first / "queue.tgz") as tar:
        tar.extractall(done, filter="data")  # as between two device calls
    assert (done / "a" / "b" / "c").exists()
    summary = gpu_queue.run_queue(["run:once=echo x >> {out}/count", "run:other=true"], 1, 10, second, done, tmp_path)
    assert [(spec, exit_status) for spec, _, exit_status, _ in summary] == [("run:once=echo x >> {out}/count", "done before"), ("run:other=true", "0")]
    assert not (second / "count").exists()


def test_long_jobs_sharing_their_first_80_characters_keep_their_own_done_markers(tmp_path):
    """Session 28's second call skipped two test cases as 'done before' that had
    never run: their node ids differ past the 80th character of the job's name."""
    out, done = tmp_path / "out", tmp_path / "done"
    out.mkdir(), done.mkdir()
    node = "tests/test_varlen.py::test_on_a_gpu_every_scheduler_answers_each_row_as_eager_with_measured_costs"
    finished, other = gpu_queue.job_for(f"tests:{node}[t5-inductor]", out, done, tmp_path), gpu_queue.job_for(f"tests:{node}[t5-saved]", out, done, tmp_path)
    assert finished.name != other.name
    (done / f"{finished.name}.done").touch()
    assert gpu_queue.job_for(finished.spec, out, done, tmp_path).command is None
    assert "[t5-saved]" in gpu_queue.job_for(other.spec, out, done, tmp_path).command
    columns = "eager,compile,sequential,opara,fused sequential,fused opara,auto"
    fewer, more = gpu_queue.job_for(f"bench:nasnet:32:{columns}", out, done, tmp_path), gpu_queue.job_for(f"bench:nasnet:32:{columns},fused opara cudnn", out, done, tmp_path)
    assert fewer.name != more.name
    (done / f"{more.name}.done").touch()
    assert gpu_queue.job_for(fewer.spec, out, done, tmp_path).command is not None
    assert gpu_queue.job_name("run:short=true") == "run_short_true"


def test_on_several_gpus_each_job_runs_on_its_gpus_share_of_the_cores(tmp_path):
    """So that one GPU's cold build cannot slow the timing on another (run 40)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    out = tmp_path / "out"
    # each job holds its GPU for 2 s after writing, so the other GPU takes the other job
    write = 'python3 -c "import os; print(sorted(os.sched_getaffinity(0)))" > {out}/%s.txt; echo $CUDA_VISIBLE_DEVICES >> {out}/%s.txt; sleep 2'
    gpu_queue.run_queue([f"run:a={write % ('a', 'a')}", f"run:b={write % ('b', 'b')}"], 2, 30, out, tmp_path / "done", tmp_path)
    with tarfile.open(out / "queue.tgz") as tar:
        seen = [tar.extractfile(f"{name}.txt").read().decode().split("\n") for name in "ab"]
    assert {gpu for _, gpu, _ in seen} == {"0", "1"}
    first, second = (set(json.loads(affinity)) for affinity, _, _ in seen)
    assert first and second and not first & second and first | second <= set(cpus)  # two shares of this machine's cores
    assert abs(len(first) - len(second)) <= max(1, len(cpus) // 8)  # about half each (whole cores: hyperthreads stay together)
    assert sorted(os.sched_getaffinity(0)) == cpus  # the queue's own process is left as it was
    # one GPU: the job keeps every core
    gpu_queue.run_queue([f"run:c={write % ('c', 'c')}"], 1, 30, tmp_path / "one", tmp_path / "done", tmp_path)
    with tarfile.open(tmp_path / "one" / "queue.tgz") as tar:
        assert json.loads(tar.extractfile("c.txt").read().decode().split("\n")[0]) == cpus


def test_linux_cpu_lists_are_read_and_every_core_falls_in_one_group():
    assert gpu_queue._cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    cpus = sorted(os.sched_getaffinity(0))
    groups = gpu_queue.core_groups(cpus)
    assert sorted(cpu for group in groups for cpu in group) == cpus
