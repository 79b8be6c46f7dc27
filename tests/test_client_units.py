"""The client package without a server: inputs from metadata, rows and
percentiles, writers, retry classification, perf_analyzer plumbing, plots."""

from __future__ import annotations

import base64
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from matplotlib.backends.backend_agg import FigureCanvasAgg
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from client import api, bench, perf, plots
from client.__main__ import main as client_main
from client.__main__ import class_scores, summarize_classes, summarize_output
from client.inputs import InputError, ModelInfo, TensorInfo, load_inputs, model_info, random_inputs

# --- inputs from metadata and config --------------------------------------------------

# What the gRPC client returns with as_json=True: int64 values as strings.
GRPC_METADATA = {
    "name": "ranked",
    "versions": ["1"],
    "platform": "python",
    "inputs": [
        {"name": "sparse", "datatype": "INT64", "shape": ["-1", "3"]},
        {"name": "dense", "datatype": "FP32", "shape": ["-1", "4"]},
        {"name": "ids", "datatype": "INT32", "shape": ["-1", "5"]},
        {"name": "mask", "datatype": "INT64", "shape": ["-1", "5"]},
    ],
    "outputs": [{"name": "score", "datatype": "FP32", "shape": ["-1", "1"]}],
}
GRPC_CONFIG = {
    "config": {
        "name": "ranked",
        "max_batch_size": 512,
        "input": [{"name": "sparse", "data_type": "TYPE_INT64", "dims": ["3"]}],
        "parameters": {
            "upper_bounds.sparse": {"string_value": "3,50,1000"},
            "value_range.ids": {"string_value": "10,20"},
        },
    }
}


def ranked() -> ModelInfo:
    return model_info(api.normalize_metadata(GRPC_METADATA), api.normalize_config(GRPC_CONFIG))


def test_model_info_drops_the_batch_dimension_and_reads_ranges_from_the_config():
    info = ranked()
    assert info.max_batch_size == 512 and info.batching
    by_name = {t.name: t for t in info.inputs}
    assert by_name["sparse"] == TensorInfo("sparse", "INT64", (3,), None, (3, 50, 1000))
    assert by_name["ids"].value_range == (10, 20)
    assert by_name["mask"].value_range is None and by_name["dense"].shape == (4,)
    assert info.outputs == (TensorInfo("score", "FP32", (1,)),)


def test_random_inputs_respect_dtypes_shapes_and_id_ranges():
    arrays = random_inputs(ranked(), batch=400, seed=3)
    assert arrays["dense"].dtype == np.float32 and arrays["dense"].shape == (400, 4)
    sparse = arrays["sparse"]
    assert sparse.dtype == np.int64 and sparse.shape == (400, 3)
    assert (sparse >= 0).all() and (sparse < np.array([3, 50, 1000])).all()
    assert sparse[:, 0].max() == 2 and sparse[:, 2].max() > 50, "ids should cover each field's own range"
    assert arrays["ids"].dtype == np.int32 and arrays["ids"].min() >= 10 and arrays["ids"].max() < 20
    assert set(np.unique(arrays["mask"])) <= {0, 1}, "integers without a declared range are 0 or 1"
    np.testing.assert_array_equal(
        random_inputs(ranked(), 2, seed=1)["dense"], random_inputs(ranked(), 2, seed=1)["dense"]
    )


def test_random_inputs_refuse_what_the_model_cannot_take():
    with pytest.raises(InputError, match="max_batch_size 512"):
        random_inputs(ranked(), batch=513)
    variable = ModelInfo("v", 4, (TensorInfo("text", "INT64", (-1,)),), ())
    with pytest.raises(InputError, match="variable shape"):
        random_inputs(variable, 1)
    unbatched = ModelInfo("u", 0, (TensorInfo("x", "FP32", (2, 3)),), ())
    assert random_inputs(unbatched, 1)["x"].shape == (2, 3)
    with pytest.raises(InputError, match="does not batch"):
        random_inputs(unbatched, 2)


def image_model() -> ModelInfo:
    return ModelInfo("img", 32, (TensorInfo("image", "FP32", (3, 4, 4)),), (TensorInfo("logits", "FP32", (10,)),))


def test_load_inputs_from_npy_repeats_a_row_or_keeps_a_batch(tmp_path):
    row = np.arange(48, dtype=np.float64).reshape(3, 4, 4)
    np.save(tmp_path / "row.npy", row)
    loaded = load_inputs(image_model(), [str(tmp_path / "row.npy")], batch=3)["image"]
    assert loaded.dtype == np.float32 and loaded.shape == (3, 3, 4, 4)
    np.testing.assert_array_equal(loaded[2], row.astype(np.float32))
    np.save(tmp_path / "batch.npy", np.zeros((5, 3, 4, 4), np.float32))
    assert load_inputs(image_model(), [f"image={tmp_path / 'batch.npy'}"])["image"].shape == (5, 3, 4, 4)
    with pytest.raises(InputError, match="--batch is 2"):
        load_inputs(image_model(), [str(tmp_path / "batch.npy")], batch=2)


def test_load_inputs_names_the_problem(tmp_path):
    np.save(tmp_path / "wrong.npy", np.zeros((3, 5, 5), np.float32))
    with pytest.raises(InputError, match=r"per-row shape \[3, 4, 4\]"):
        load_inputs(image_model(), [str(tmp_path / "wrong.npy")])
    np.save(tmp_path / "ints.npy", np.zeros((3, 4, 4), np.int64))
    with pytest.raises(InputError, match="FP32"):
        load_inputs(image_model(), [str(tmp_path / "ints.npy")])
    with pytest.raises(InputError, match="cannot read"):
        load_inputs(image_model(), [str(tmp_path / "missing.npy")])
    with pytest.raises(InputError, match="name the one"):
        load_inputs(ranked(), [str(tmp_path / "ints.npy")])
    np.save(tmp_path / "x.npy", np.zeros((3,), np.int64))
    with pytest.raises(InputError, match="no input 'nope'"):
        load_inputs(ranked(), [f"nope={tmp_path / 'x.npy'}"])


def test_load_inputs_from_npz_fills_the_rest_with_random_data(tmp_path):
    np.savez(tmp_path / "some.npz", sparse=np.array([[1, 2, 3], [0, 0, 0]]))
    arrays = load_inputs(ranked(), [str(tmp_path / "some.npz")])
    np.testing.assert_array_equal(arrays["sparse"], [[1, 2, 3], [0, 0, 0]])
    assert arrays["dense"].shape == (2, 4) and set(arrays) == {"sparse", "dense", "ids", "mask"}


# --- rows, percentiles and the server split -------------------------------------------


def test_summarize_computes_percentiles_over_successes_and_counts_errors():
    latencies_ns = [int(ms * 1e6) for ms in range(1, 101)]  # 1..100 ms
    row = bench.summarize(2, latencies_ns, errors=5, elapsed_s=10.0)
    assert (row.concurrency, row.requests, row.errors) == (2, 105, 5)
    assert (
        row.p50_ms == pytest.approx(50.5) and row.p90_ms == pytest.approx(90.1) and row.p99_ms == pytest.approx(99.01)
    )
    assert row.mean_ms == pytest.approx(50.5)
    assert row.throughput_rps == pytest.approx(10.0), "throughput counts successful requests only"


def test_summarize_with_only_errors_has_no_latency():
    row = bench.summarize(1, [], errors=7, elapsed_s=1.0)
    assert row.requests == 7 and row.errors == 7 and row.throughput_rps == 0.0
    assert row.p50_ms is None and row.mean_ms is None


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=10**10), min_size=1, max_size=200))
def test_percentiles_are_ordered_for_any_latencies(latencies_ns):
    row = bench.summarize(1, latencies_ns, 0, 1.0)
    assert row.p50_ms <= row.p90_ms <= row.p99_ms <= max(latencies_ns) / 1e6 + 1e-9


def test_server_split_is_per_request_over_the_interval():
    before = {name: (10, 10_000_000) for name in api.STAT_COMPONENTS}
    after = {
        **before,
        "queue": (14, 18_000_000),
        "compute_infer": (14, 410_000_000),
        "compute_output": (10, 10_000_000),
    }
    split = bench.server_split(before, after)
    assert split["queue"] == pytest.approx(2.0) and split["compute_infer"] == pytest.approx(100.0)
    assert split["compute_output"] is None and split["compute_input"] is None
    assert bench.server_split(None, after) == {name: None for name in bench.SERVER_COMPONENTS}


def test_statistics_normalise_grpc_strings_and_http_ints():
    grpc_style = {
        "model_stats": [
            {
                "inference_stats": {
                    "success": {"count": "3", "ns": "300"},
                    "fail": {},
                    "queue": {"count": "3", "ns": "9"},
                }
            }
        ]
    }
    http_style = {
        "model_stats": [{"inference_stats": {"success": {"count": 3, "ns": 300}, "queue": {"count": 3, "ns": 9}}}] * 2
    }
    assert api.normalize_statistics(grpc_style)["success"] == (3, 300)
    assert api.normalize_statistics(grpc_style)["fail"] == (0, 0)
    assert api.normalize_statistics(http_style)["queue"] == (6, 18), "versions are summed"


def test_shm_status_and_index_normalise_both_protocols():
    assert api.normalize_shm_status([{"name": "b"}, {"name": "a"}]) == ["a", "b"]
    assert api.normalize_shm_status({"regions": {"x": {}}}) == ["x"]
    assert api.normalize_shm_status({}) == []
    assert api.normalize_index({"models": [{"name": "m"}]}) == [{"name": "m"}] == api.normalize_index([{"name": "m"}])


# --- writers and the table -------------------------------------------------------------


def rows() -> tuple[bench.Row, ...]:
    return (
        bench.summarize(
            1,
            [10_000_000, 20_000_000],
            0,
            1.0,
            {"queue": 0.1, "compute_input": 0.2, "compute_infer": 9.0, "compute_output": 0.3},
        ),
        bench.summarize(2, [], 3, 1.0),
    )


def test_json_writer_follows_the_schema(tmp_path):
    config = bench.BenchConfig(model="m", url="h:1", protocol="http", concurrency=(1, 2), requests=2)
    bench.write_json(tmp_path / "r.json", bench.BenchResult(config, rows(), ("boom (3x)",)))
    data = bench.read_json(tmp_path / "r.json")
    assert data["model"] == "m" and data["protocol"] == "http" and data["batch"] == 1
    assert "successful requests" in data["latency"]
    assert [set(r) for r in data["results"]] == [set(bench.ROW_FIELDS)] * 2
    assert data["results"][0]["server_compute_infer_ms"] == 9.0 and data["results"][1]["p50_ms"] is None
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a bench result"):
        bench.read_json(tmp_path / "bad.json")


def test_csv_writer_has_one_row_per_level_and_blank_for_none(tmp_path):
    bench.write_csv(tmp_path / "r.csv", rows())
    with open(tmp_path / "r.csv", newline="") as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == list(bench.ROW_FIELDS)
    assert read[0]["p50_ms"] == "15.0" and read[1]["p50_ms"] == "" and read[1]["errors"] == "3"


def test_table_shows_every_level_and_dashes_for_missing_values():
    lines = bench.format_table(rows()).splitlines()
    assert len(lines) == 3 and "p50 ms" in lines[0] and "infer ms" in lines[0]
    assert lines[2].split()[:3] == ["2", "3", "3"] and "-" in lines[2].split()


def test_bench_config_rejects_contradictions():
    with pytest.raises(ValueError, match="exactly one"):
        bench.BenchConfig(model="m", url="h:1", requests=1, duration_s=1.0)
    with pytest.raises(ValueError, match="shared-memory"):
        bench.BenchConfig(model="m", url="h:1", requests=1, shared_memory="gpu")


# --- errors and retries ----------------------------------------------------------------


@pytest.mark.parametrize(
    "error, kind",
    [
        (InferenceServerException("down", status="StatusCode.UNAVAILABLE"), api.UNAVAILABLE),
        (InferenceServerException("busy", status="503"), api.UNAVAILABLE),
        (ConnectionRefusedError(111, "Connection refused"), api.UNAVAILABLE),
        (OSError(-2, "Name or service not known"), api.UNAVAILABLE),
        (InferenceServerException("late", status="StatusCode.DEADLINE_EXCEEDED"), api.TIMEOUT),
        (TimeoutError("timed out"), api.TIMEOUT),
        (InferenceServerException("bad shape", status="StatusCode.INVALID_ARGUMENT"), api.REJECTED),
        (InferenceServerException("unknown model", status="400"), api.REJECTED),
        (ValueError("bad"), api.REJECTED),
    ],
)
def test_classify(error, kind):
    assert api.classify(error) == kind


def flaky(errors: list[BaseException]):
    calls = []

    def fn():
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "ok"

    return fn, calls


def test_retry_backs_off_on_an_unavailable_server_only(monkeypatch):
    slept = []
    monkeypatch.setattr(api.time, "sleep", slept.append)
    policy = api.RetryPolicy(attempts=4, initial_delay_s=0.1, max_delay_s=0.3)
    assert policy.delays() == [0.1, 0.2, 0.3]
    fn, calls = flaky([ConnectionRefusedError(111, "refused")] * 2)
    assert policy.call(fn) == "ok" and len(calls) == 3 and slept == [0.1, 0.2]
    for error in (InferenceServerException("bad", status="StatusCode.INVALID_ARGUMENT"), TimeoutError("late")):
        fn, calls = flaky([error])
        with pytest.raises(type(error)):
            policy.call(fn)
        assert len(calls) == 1, f"{error!r} must not be retried"
    fn, calls = flaky([ConnectionRefusedError(111, "refused")] * 9)
    with pytest.raises(ConnectionRefusedError):
        policy.call(fn)
    assert len(calls) == 4
    fn, calls = flaky([ConnectionRefusedError(111, "refused")])
    with pytest.raises(ConnectionRefusedError):
        api.NO_RETRY.call(fn)


def test_parse_url():
    assert api.parse_url("localhost", "grpc") == "localhost:8001"
    assert api.parse_url("localhost", "http") == "localhost:8000"
    assert api.parse_url("10.0.0.1:9000", "http") == "10.0.0.1:9000"
    for bad in ("http://localhost:8000", "localhost:port", ":8000"):
        with pytest.raises(ValueError):
            api.parse_url(bad, "http")


# --- shared memory regions, with a stand-in for the server ------------------------------


class RecordingServer:
    """Duck-types the two Client calls SharedMemoryRegions makes."""

    def __init__(self, fail_on: str | None = None, busy: int = 0):
        self.registered: list[str] = []
        self.fail_on = fail_on
        self.busy = busy  # how many unregister calls find the region still in use

    def register_shm(self, name, key, byte_size):
        if self.fail_on and name.endswith(self.fail_on):
            raise api.ClientError("refused")
        self.registered.append(name)

    def unregister_shm(self, name):
        if self.busy:
            self.busy -= 1
            raise api.ClientError(f"Cannot unregister shared memory region '{name}', it is currently in use.")
        self.registered.remove(name)


def our_shm_files() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"{api.SHM_PREFIX}{os.getpid()}_")]


def test_shared_memory_regions_hold_inputs_and_clean_up():
    server = RecordingServer()
    arrays = {"a": np.arange(6, dtype=np.float32), "b": np.arange(3, dtype=np.int64)}
    with api.SharedMemoryRegions(server, arrays, {"out": (np.dtype(np.float32), (2, 3))}) as shm:
        assert shm.input_slots == {"a": (0, 24), "b": (24, 24)}
        assert shm.output_slots["out"][:2] == (0, 24)
        assert sorted(server.registered) == sorted([shm.input_name, shm.output_name])
        assert len(our_shm_files()) == 2
        assert str(os.getpid()) in shm.input_name
        np.testing.assert_array_equal(shm.read_output("out"), np.zeros((2, 3), np.float32))
    assert server.registered == [] and our_shm_files() == []
    shm.close()  # twice is fine


def test_shared_memory_regions_clean_up_when_registration_fails():
    server = RecordingServer(fail_on="_out")
    with pytest.raises(api.ClientError):
        api.SharedMemoryRegions(server, {"a": np.zeros(4, np.float32)}, {"out": (np.dtype(np.float32), (4,))})
    assert server.registered == [] and our_shm_files() == []


def test_shared_memory_waits_while_the_server_still_uses_a_region():
    server = RecordingServer(busy=3)
    api.SharedMemoryRegions(server, {"a": np.zeros(4, np.float32)}, {"out": (np.dtype(np.float32), (4,))}).close()
    assert server.registered == [] and server.busy == 0 and our_shm_files() == []


def test_shared_memory_needs_fixed_output_shapes():
    with pytest.raises(InputError, match="variable shape"):
        api.SharedMemoryRegions(
            RecordingServer(), {"a": np.zeros(4, np.float32)}, {"out": (np.dtype(np.float32), (-1,))}
        )
    assert our_shm_files() == []


def cuda_device_here() -> bool:
    try:
        api.cuda_shared_memory_module()
        return True
    except api.ClientError:
        return False


@pytest.mark.skipif(cuda_device_here(), reason="a CUDA device is here: the cuda mode works")
@pytest.mark.parametrize(
    "command",
    [
        ["client", "infer", "--model", "googlenet"],
        ["client", "bench", "--model", "googlenet", "--concurrency", "1", "--requests", "1"],
        ["client.perf", "run", "--model", "googlenet"],
    ],
)
def test_cuda_shared_memory_without_a_gpu_is_one_error_line(command):
    """No GPU here: `--shared-memory cuda` says so before it looks for a server,
    instead of cuda-python's "unable to create cuda shared memory handle"."""
    done = subprocess.run(
        [sys.executable, "-m", *command, "--url", "127.0.0.1:1", "--shared-memory", "cuda"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: --shared-memory cuda needs") and done.stderr.count("\n") == 1, done.stderr


def test_a_region_kind_must_be_known():
    with pytest.raises(ValueError, match="system, cuda"):
        api.SharedMemoryRegions(RecordingServer(), {"a": np.zeros(4, np.float32)}, {"out": (np.dtype(np.float32), (4,))}, kind="gpu")


# --- perf_analyzer plumbing and plots ---------------------------------------------------


def test_perf_analyzer_command_uses_count_windows_and_one_level(tmp_path):
    config = perf.PerfConfig(model="m", url="localhost:9001", concurrency=(1, 4), batch=2, request_count=20)
    command = perf.perf_analyzer_command(config, 4, tmp_path / "data", tmp_path / "out.csv")
    assert Path(command[0]).name == "perf_analyzer"
    text = " ".join(command)
    for expected in ("-m m", "-u localhost:9001", "-i grpc", "-b 2", "--concurrency-range=4:4", "--measurement-mode=count_windows",
                     "--measurement-request-count=20", f"--input-data={tmp_path / 'data'}", "--percentile=50"):  # fmt: skip
        assert expected in text
    assert "-v" in command, "one line per window, streamed, shows progress"
    assert "--shared-memory" not in text and "-H" not in command
    shm = perf.perf_analyzer_command(
        perf.PerfConfig(model="m", url="h:1", shared_memory="system", admin_key="k" * 20), 1, tmp_path, tmp_path / "o.csv", 4000
    )
    assert "--shared-memory=system" in shm and "--output-shared-memory-size=4000" in shm
    # over gRPC perf_analyzer sends -H as metadata, which Triton reads with its protocol prefix
    assert shm[shm.index("-H") + 1] == "triton-grpc-protocol-admin-key:" + "k" * 20
    http = perf.perf_analyzer_command(
        perf.PerfConfig(model="m", url="h:1", protocol="http", shared_memory="system", admin_key="k" * 20), 1, tmp_path, tmp_path / "o.csv"
    )
    assert http[http.index("-H") + 1] == "admin-key:" + "k" * 20


def test_perf_analyzer_env_finds_libcudart():
    env = perf.perf_analyzer_env({"LD_LIBRARY_PATH": "/x"})
    first = env["LD_LIBRARY_PATH"].split(os.pathsep)[0]
    assert (Path(first) / "libcudart.so.12").exists() and env["LD_LIBRARY_PATH"].endswith("/x")


def test_perf_input_data_is_json_with_one_row_per_request(tmp_path):
    path = perf.write_input_data(ranked(), tmp_path / "data.json", count=3)
    entries = json.loads(path.read_text())["data"]
    assert len(entries) == 3 and all(sorted(e) == ["dense", "ids", "mask", "sparse"] for e in entries)
    sparse = [np.frombuffer(base64.b64decode(e["sparse"]["b64"]), dtype=np.int64) for e in entries]
    assert all(s.shape == (3,) and (s < [3, 50, 1000]).all() for s in sparse)
    assert len(base64.b64decode(entries[0]["dense"]["b64"])) == 4 * 4
    assert any((a != b).any() for a, b in zip(sparse, sparse[1:])), "each request has its own seed"


def test_a_perf_analyzer_run_streams_its_output_and_stops_at_the_timeout(tmp_path, capsys):
    with open(tmp_path / "log", "w") as log_file:
        code, output = perf.run_perf_analyzer(["sh", "-c", "echo first; echo second; exit 3"], log_file, 30)
    assert code == 3 and output == "first\nsecond\n"
    assert capsys.readouterr().out == "  first\n  second\n"
    assert (tmp_path / "log").read_text().endswith("first\nsecond\n")
    with open(tmp_path / "log", "w") as log_file:
        code, output = perf.run_perf_analyzer(["sh", "-c", "echo started; exec sleep 60"], log_file, 0.5, echo=False)
    assert code is None and output.startswith("started\n") and "timed out after" in output


def test_an_unstable_measurement_names_the_options_to_raise():
    config = perf.PerfConfig(model="m", url="h:1", max_trials=10, request_count=50, stability_percentage=20)
    line = perf.failure_line(config, 2, 1, "Failed to obtain stable measurement within 10 measurement windows for concurrency 2.")
    assert "m at concurrency 2" in line
    for option in ("--max-trials", "--stability-percentage", "--request-count", "PERF_ARGS"):
        assert option in line
    assert perf.failure_line(config, 1, 99, "a\nconnection refused\n").endswith("perf_analyzer exit 99: connection refused")


def test_a_rough_measurement_is_a_fixed_count_without_the_stability_check():
    config = perf.PerfConfig(model="m", url="h:1", max_trials=10, request_count=12, rough_windows=3, binary="pa")
    stable = perf.perf_analyzer_command(config, 2, Path("d.json"), Path("o.csv"))
    rough = perf.perf_analyzer_command(config, 2, Path("d.json"), Path("o.csv"), total=36)
    assert "--max-trials=10" in stable and not any(arg.startswith("--request-count") for arg in stable)
    assert "--request-count=36" in rough
    assert not any(arg.startswith(("--max-trials", "--stability", "--measurement")) for arg in rough)
    line = perf.rough_line(config, 2)
    assert line.startswith("m at concurrency 2: no stable measurement in 10 windows of 12 requests")
    assert "measured 36 requests once" in line and "Settled=no" in line and "PERF_ARGS" in line


def test_the_perf_analyzer_wrapper_finds_its_library():
    """`.venv/bin/perf_analyzer` alone fails on libcudart.so.12; the wrapper runs it."""
    code = "import sys; sys.argv = ['opara-perf-analyzer', '--version']; from client.perf import exec_perf_analyzer; exec_perf_analyzer()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Perf Analyzer Version 2.51" in done.stdout + done.stderr, done.stderr


def test_perf_rows_in_milliseconds():
    row = perf.perf_row({"Concurrency": "4", "Inferences/Second": "20.5", "p50 latency": "1500", "Server Queue": "", "Client Send": "x"})
    assert row["concurrency"] == 4 and row["throughput"] == 20.5 and row["p50_ms"] == 1.5
    assert row["server_queue_ms"] == 0 and row["client_send_ms"] == 0 and row["p99_ms"] == 0


def test_plot_points_convert_units_and_batch():
    pa = perf.perf_points(
        [{"Concurrency": "2", "Inferences/Second": "8.5", "p50 latency": "120000", "p99 latency": "250000"}]
    )
    assert pa == [{"concurrency": 2, "throughput": 8.5, "p50_ms": 120.0, "p99_ms": 250.0}]
    data = {
        "batch": 4,
        "results": [
            {"concurrency": 1, "throughput_rps": 2.0, "p50_ms": 5.0, "p99_ms": 9.0},
            {"concurrency": 2, "throughput_rps": 0.0, "p50_ms": None, "p99_ms": None},
        ],
    }
    assert perf.bench_points(data) == [{"concurrency": 1, "throughput": 8.0, "p50_ms": 5.0, "p99_ms": 9.0}]


def test_plots_write_png_files(tmp_path):
    rows_as_dicts = [bench.asdict(r) for r in rows()]
    assert plots.plot_bench(rows_as_dicts, tmp_path / "b.png", "t").read_bytes()[:4] == b"\x89PNG"
    series = [{"label": "a", "points": [{"concurrency": 1, "throughput": 1.0, "p50_ms": 2.0, "p99_ms": 3.0}]}]
    assert plots.plot_latency_vs_throughput(series, tmp_path / "c.png", "t").stat().st_size > 1000


def test_comparison_plot_runs_in_throughput_order_with_labels_inside():
    """More concurrency can give less throughput: the line still runs left to
    right, and the label of the rightmost point stays inside the axes."""
    points = [
        {"concurrency": c, "throughput": t, "p50_ms": l, "p99_ms": l * 1.5}
        for c, t, l in ((1, 9.0, 100.0), (2, 12.4, 160.0), (4, 11.8, 330.0), (8, 12.9, 610.0))
    ]
    fig = plots.latency_vs_throughput([{"label": "pa", "points": points}], "t")
    axes = fig.axes[0]
    for line in axes.get_lines():
        assert list(line.get_xdata()) == sorted(line.get_xdata())
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    inside = axes.get_window_extent(renderer)
    labels = [t for t in axes.texts if t.get_text().startswith("c=")]
    assert len(labels) == 4
    for label in labels:
        box = label.get_window_extent(renderer)
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, label.get_text()


def test_perf_plot_command_draws_both_tools(tmp_path):
    with open(tmp_path / "googlenet.csv", "w") as f:
        f.write("Concurrency,Inferences/Second,p50 latency,p99 latency\n1,10,90000,120000\n2,12,160000,200000\n")
    config = bench.BenchConfig(model="googlenet", url="h:1", concurrency=(1, 2), requests=2)
    bench.write_json(tmp_path / "b.json", bench.BenchResult(config, rows()))
    code = perf.main(
        [
            "plot",
            "--perf-csv",
            str(tmp_path / "googlenet.csv"),
            "--bench-json",
            str(tmp_path / "b.json"),
            "--output",
            str(tmp_path / "cmp.png"),
        ]
    )
    assert code == 0 and (tmp_path / "cmp.png").stat().st_size > 1000


# --- the CLI without a server -----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--model", "m", "--concurrency", "1"], "one of the arguments --requests --duration is required"),
        (["bench", "--model", "m", "--concurrency", "0,1", "--requests", "1"], "--concurrency"),
        (["bench", "--model", "m", "--concurrency", "1", "--requests", "1", "--protocol", "udp"], "--protocol"),
        (
            ["bench", "--model", "m", "--concurrency", "1", "--requests", "1", "--shared-memory", "gpu"],
            "--shared-memory",
        ),
        (["infer"], "--model"),
    ],
)
def test_bad_arguments_give_one_error_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        client_main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_class_summary_reads_tritons_classification_entries():
    entries = np.array([[b"5.0:7", b"4.0:3", b"3.5:1:cat"]] * 6, dtype=object)
    text = summarize_classes("logits", entries, "float32 [6, 10]")
    assert text.splitlines()[0].startswith("logits: float32 [6, 10] (top 3 per row")
    assert "  row 0 top-3: 7 (5.000), 3 (4.000), 1 cat (3.500)" in text and "... 2 more rows" in text
    assert summarize_output("ids", np.zeros((1, 3), np.int64)) == "ids: int64 [1, 3]  min 0  mean 0  max 0"


def test_only_float_vectors_per_row_count_as_class_scores():
    assert class_scores(TensorInfo("logits", "FP32", (1000,)))
    assert not class_scores(TensorInfo("probability", "FP32", (1,)))
    assert not class_scores(TensorInfo("hidden", "FP32", (128, 768)))
    assert not class_scores(TensorInfo("ids", "INT64", (26,)))


def test_json_written_by_the_writer_is_plain_json(tmp_path):
    config = bench.BenchConfig(model="m", url="h:1", concurrency=(1,), duration_s=1.0)
    bench.write_json(tmp_path / "r.json", bench.BenchResult(config, rows()[:1]))
    assert json.loads((tmp_path / "r.json").read_text())["results"][0]["concurrency"] == 1


def test_the_client_imports_no_torch():
    """A client-only install (`pip install '.[client]'`) has no torch: nothing
    the client runs may import it."""
    code = (
        "import sys\n"
        "import client, client.api, client.bench, client.cli, client.inputs, client.perf, client.plots, client.__main__\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- variable-length models --------------------------------------------------------------

VARIABLE = ModelInfo(
    "bert",
    32,
    (
        TensorInfo("input_ids", "INT64", (-1,), (0, 30522), max_length=512),
        TensorInfo("attention_mask", "INT64", (-1,), (0, 2), max_length=512),
    ),
    (TensorInfo("last_hidden_state", "FP32", (-1, 768)),),
)


def test_model_info_reads_max_length_from_the_config():
    metadata = {"name": "bert", "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}], "outputs": []}
    config = {"max_batch_size": 8, "parameters": {"max_length.input_ids": {"string_value": "512"}}}
    assert model_info(metadata, config).inputs[0].max_length == 512
    config["parameters"]["max_length.input_ids"] = {"string_value": "long"}
    with pytest.raises(InputError, match="max_length.input_ids must be a positive integer"):
        model_info(metadata, config)


def test_random_inputs_of_a_variable_length_model_take_the_length_asked_capped_at_the_limit():
    arrays = random_inputs(VARIABLE, batch=2, seed=1, length=17)
    assert arrays["input_ids"].shape == arrays["attention_mask"].shape == (2, 17)
    assert (arrays["attention_mask"] == 1).all(), "a mask hides nothing: the length is the request's own"
    assert random_inputs(VARIABLE, 1, length=4000)["input_ids"].shape == (1, 512)
    assert random_inputs(VARIABLE, 1)["input_ids"].shape == (1, 128), "fixed-length clients' 128 by default"


def test_perf_input_data_gives_each_variable_tensor_its_shape(tmp_path):
    path = perf.write_input_data(VARIABLE, tmp_path / "data.json", count=3, lengths=np.array([5, 9]))
    entries = json.loads(path.read_text())["data"]
    assert [e["input_ids"]["shape"] for e in entries] == [[5], [9], [5]]
    assert [len(base64.b64decode(e["attention_mask"]["b64"])) for e in entries] == [40, 72, 40]


def test_a_variable_output_gets_a_shared_memory_slot_for_the_longest_input():
    """perf_analyzer refused every shared-memory level of bert and t5 on the GPU
    (2026-11-26): their -1 output had been counted as no bytes (a 4 KB slot for
    393,216 bytes of last_hidden_state at 128 tokens)."""
    assert perf.output_bytes(VARIABLE, 1) == 128 * 768 * 4
    assert perf.output_bytes(VARIABLE, 2, length=300) == 2 * 300 * 768 * 4


def test_bench_config_with_lengths_refuses_shared_memory_and_bad_specs():
    with pytest.raises(ValueError, match="--lengths draws random inputs"):
        bench.BenchConfig(model="m", url="h:1", requests=1, shared_memory="system", lengths="fixed:3")
    with pytest.raises(ValueError, match="use lognormal"):
        bench.BenchConfig(model="m", url="h:1", requests=1, lengths="gauss")


def test_a_load_summary_reports_latency_per_token_with_the_wait_included():
    from client.generate import LoadResult, Outcome

    # a request that waited: 10 tokens, first after 100 ms, then 2 ms apart; another of 4 tokens in 10 ms
    waited = Outcome(8, 10, tokens=10, ttft_s=0.100, tpot_s=0.002, latency_s=0.118)
    quick = Outcome(8, 4, tokens=4, ttft_s=0.004, tpot_s=0.002, latency_s=0.010)
    failed = Outcome(8, 4, error="overloaded")
    summary = LoadResult(config={}, outcomes=[waited, quick, failed], duration_s=1.0).summary()
    assert waited.normalized_latency_s == pytest.approx(0.0118) and failed.normalized_latency_s is None
    assert summary["norm_latency_p50_ms"] == pytest.approx((11.8 + 2.5) / 2)
    assert summary["tpot_p50_ms"] == pytest.approx(2.0)  # TPOT leaves the wait out
    assert summary["errors"] == 1


def test_load_output_lengths_come_from_a_range_or_a_seeded_distribution():
    import argparse

    from client.generate import LoadConfig, output_lengths, plan_load

    assert output_lengths("4,256") == (4, 256)
    spec = output_lengths("lognormal:mean=64,cap=384,seed=1")
    config = LoadConfig(model="m", url="h:1", rate=10, requests=2000, prompt_len=(4, 8), output_len=spec)
    drawn = np.array([max_tokens for _, _, max_tokens in plan_load(config)])
    assert drawn.min() >= 1 and drawn.max() == 384  # capped, and the tail reaches the cap in 2,000 draws
    assert 50 < drawn.mean() < 70 and np.median(drawn) < 50  # mean near 64, most requests short
    assert [t for _, _, t in plan_load(config)] == drawn.tolist()  # seeded
    uniform = LoadConfig(model="m", url="h:1", rate=10, requests=500, prompt_len=(4, 8), output_len=(4, 256))
    assert {t for _, _, t in plan_load(uniform)} <= set(range(4, 257))
    for bad, problem in (("4", "LOW,HIGH"), ("lognormal:mean=64", "give lognormal:mean=M,cap=C"), ("gauss:3", "use lognormal")):
        with pytest.raises(argparse.ArgumentTypeError, match=problem):
            output_lengths(bad)
