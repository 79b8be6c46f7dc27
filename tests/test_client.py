"""The client package against the real server (the session `server` fixture).

Request counts are small on purpose: one googlenet inference takes 50-1000 ms
on a shared CPU, and every test here shares that budget.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import server_config
from serving import assert_close, assert_served

from client import bench, perf
from client.__main__ import main as client_main
from client.api import SHM_PREFIX, Client, ClientError, SharedMemoryRegions, result_arrays
from client.cli import UsageError
from client.inputs import random_inputs
from opara_core.serving.launcher import DEFAULT_MODEL_REPOSITORY, REPO_ROOT, TritonServer, free_port

pytestmark = pytest.mark.server

MODEL = "googlenet"
REQUESTS = 4  # per concurrency level in the sweeps


def url_of(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m client ...` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "client", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


def our_leftovers(server, pid: int) -> tuple[list[str], list[str]]:
    """Shared-memory regions of process `pid`: registered on the server, and in /dev/shm."""
    prefix = f"{SHM_PREFIX}{pid}_"
    with Client(server.grpc_url) as client:
        registered = [name for name in client.shm_regions() if name.startswith(prefix)]
    return registered, [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


# --- sweeps over both protocols ----------------------------------------------------------


@pytest.fixture(scope="module", params=["grpc", "http"])
def sweep(request, server, tmp_path_factory) -> tuple[str, Path, int]:
    """One `bench` run per protocol through the CLI, with every output file."""
    protocol = request.param
    out = tmp_path_factory.mktemp(f"sweep_{protocol}")
    code = client_main(
        ["bench", "--model", MODEL, "--protocol", protocol, "--url", url_of(server, protocol), "--concurrency", "1,2",
         "--requests", str(REQUESTS), "--warmup", "1", "--json", str(out / "r.json"), "--csv", str(out / "r.csv"),
         "--plot", str(out / "r.png")]
    )  # fmt: skip
    return protocol, out, code


def test_sweep_gives_consistent_rows(sweep):
    protocol, out, code = sweep
    assert code == 0
    rows = json.loads((out / "r.json").read_text())["results"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["requests"] == REQUESTS and r["errors"] == 0
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["throughput_rps"] > 0 and r["mean_ms"] > 0
        server_ms = sum(r[f"server_{name}_ms"] for name in bench.SERVER_COMPONENTS)
        assert 0 < r["server_compute_infer_ms"] <= server_ms <= r["mean_ms"] * 1.05 + 1, (
            f"{protocol}: the server's time per request cannot exceed the client's: {r}"
        )


def test_sweep_writes_json_csv_and_plot(sweep):
    protocol, out, _ = sweep
    data = json.loads((out / "r.json").read_text())
    assert data["model"] == MODEL and data["protocol"] == protocol and data["batch"] == 1
    assert "successful requests" in data["latency"]
    for row in data["results"]:
        assert list(row) == list(bench.ROW_FIELDS)
        assert all(isinstance(row[k], int) for k in ("concurrency", "requests", "errors"))
        assert all(isinstance(row[k], float) for k in bench.ROW_FIELDS[3:])
    with open(out / "r.csv", newline="") as f:
        assert [int(r["concurrency"]) for r in csv.DictReader(f)] == [1, 2]
    assert (out / "r.png").read_bytes()[:4] == b"\x89PNG"


# --- perf_analyzer -------------------------------------------------------------------------


def perf_analyzer_run(server, out: Path, *extra: str) -> Path:
    """A short perf_analyzer run at concurrency 1: count windows of 5 requests,
    lenient stability (the CPU is shared), stabilised on p50."""
    code = perf.main(
        ["run", "--model", MODEL, "--url", server.grpc_url, "--concurrency", "1", "--request-count", "5",
         "--stability-percentage", "100", "--max-trials", "10", "--out-dir", str(out), *extra]
    )  # fmt: skip
    assert code == 0, (out / f"{MODEL}.log").read_text()[-3000:]
    return out / f"{MODEL}.csv"


@pytest.fixture(scope="module")
def perf_csv(server, tmp_path_factory) -> Path:
    return perf_analyzer_run(server, tmp_path_factory.mktemp("perf"))


def test_perf_analyzer_writes_its_csv(perf_csv):
    rows = perf.read_perf_csv(perf_csv)
    assert len(rows) == 1 and rows[0]["Concurrency"] == "1"
    assert float(rows[0]["Inferences/Second"]) > 0
    assert 0 < float(rows[0]["p50 latency"]) <= float(rows[0]["p99 latency"])
    assert float(rows[0]["Server Compute Infer"]) > 0


def test_perf_analyzer_passes_the_admin_key_over_grpc(server, tmp_path):
    """System shared memory is a restricted API: perf_analyzer registers its
    regions with the key (OPARA_ADMIN_KEY, set by the session fixture) as gRPC
    metadata, and measures."""
    rows = perf.read_perf_csv(perf_analyzer_run(server, tmp_path, "--shared-memory", "system"))
    assert len(rows) == 1 and float(rows[0]["Inferences/Second"]) > 0


def test_a_level_that_cannot_settle_is_measured_once_more_and_marked(server, tmp_path, capsys):
    """Two windows can never settle (perf_analyzer wants three in a row): the
    level is measured once with a fixed count, kept, and marked Settled=no;
    the run succeeds and says which options give a settled number."""
    code = perf.main(
        ["run", "--model", MODEL, "--url", server.grpc_url, "--concurrency", "1", "--request-count", "5",
         "--max-trials", "2", "--rough-windows", "2", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    assert code == 0, (tmp_path / f"{MODEL}.log").read_text()[-3000:]
    rows = perf.read_perf_csv(tmp_path / f"{MODEL}.csv")
    assert [(row["Concurrency"], row["Settled"]) for row in rows] == [("1", "no")]
    assert float(rows[0]["Inferences/Second"]) > 0
    assert f"note: {MODEL} at concurrency 1: no stable measurement in 2 windows" in capsys.readouterr().out


def test_perf_skips_a_decoupled_model_and_names_the_tool_for_it(server, tmp_path, capsys):
    """gpt2 streams a response per token: perf_analyzer's request sweep cannot
    measure it (it used to stop `make perf` with an input error)."""
    with pytest.raises(UsageError, match="nothing to measure: gpt2 only"):
        perf.main(["run", "--model", "gpt2", "--url", server.grpc_url, "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "gpt2: skipped: a decoupled model" in out and "python -m client generate --model gpt2 --rate" in out


def test_windows_hold_about_the_requested_seconds_within_bounds(server, capsys):
    with Client(server.grpc_url) as client:
        info = client.model_info(MODEL)
    assert perf.window_requests(server.grpc_url, "grpc", info, 1, window_s=1e-6) == perf.MIN_WINDOW_REQUESTS
    assert perf.window_requests(server.grpc_url, "grpc", info, 1, window_s=1e6) == perf.MAX_WINDOW_REQUESTS
    assert f"{MODEL}: " in capsys.readouterr().out


def test_client_p50_agrees_with_perf_analyzer(perf_csv, server, tmp_path):
    """Both at concurrency 1 over gRPC, the client right after perf_analyzer.
    Other processes on this shared CPU can change the server's speed between
    two runs, so a disagreement is measured again (up to three rounds) before
    it counts; the tools measure the same thing only under the same load."""
    config = bench.BenchConfig(
        model=MODEL, url=server.grpc_url, protocol="grpc", concurrency=(1,), requests=5, warmup=1, progress=False
    )
    rounds = []
    for attempt in range(3):
        csv_path = perf_csv if attempt == 0 else perf_analyzer_run(server, tmp_path / f"perf{attempt}")
        result = bench.run(config)
        ours, theirs = result.rows[0].p50_ms, float(perf.read_perf_csv(csv_path)[0]["p50 latency"]) / 1000
        rounds.append(f"client p50 {ours:.1f} ms vs perf_analyzer p50 {theirs:.1f} ms")
        if 0.5 <= ours / theirs <= 2.0:
            break
    assert 0.5 <= ours / theirs <= 2.0, "; ".join(rounds)
    bench.write_json(tmp_path / "client.json", result)
    code = perf.main(
        [
            "plot",
            "--perf-csv",
            str(csv_path),
            "--bench-json",
            str(tmp_path / "client.json"),
            "--output",
            str(tmp_path / "cmp.png"),
        ]
    )
    assert code == 0 and (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"


# --- failures ------------------------------------------------------------------------------


def test_bad_model_counts_every_request_as_an_error(server, tmp_path):
    done = cli("bench", "--model", "no_such_model", "--protocol", "http", "--url", server.http_url, "--concurrency", "1,2",
               "--requests", "4", "--json", str(tmp_path / "r.json"), "--no-progress")  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1].startswith(
        "error: 8 of 8 requests failed"
    )
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [(r["requests"], r["errors"]) for r in rows] == [(4, 4), (4, 4)]
    assert all(r["p50_ms"] is None and r["throughput_rps"] == 0 for r in rows)
    assert "no_such_model" in done.stdout + done.stderr


def test_unreachable_server_is_one_error_line():
    done = cli(
        "bench",
        "--model",
        MODEL,
        "--url",
        f"127.0.0.1:{free_port()}",
        "--concurrency",
        "1",
        "--requests",
        "1",
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot reach the server") and done.stderr.count("\n") == 1


# --- infer ------------------------------------------------------------------------


def test_infer_command_sends_real_data_and_prints_top5(server, tmp_path):
    np.save(tmp_path / "images.npy", np.random.default_rng(0).standard_normal((2, 3, 224, 224), dtype=np.float32))
    done = cli(
        "infer",
        "--model",
        MODEL,
        "--protocol",
        "http",
        "--url",
        server.http_url,
        "--input",
        str(tmp_path / "images.npy"),
    )
    assert done.returncode == 0, done.stderr
    assert "logits: float32 [2, 1000] (top 5 per row from Triton's classification extension)" in done.stdout
    assert done.stdout.count("top-5:") == 2


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tritons_top_classes_are_the_largest_scores(server, protocol):
    with Client(url_of(server, protocol), protocol) as client:
        info = client.model_info(MODEL)
        arrays = random_inputs(info, 2, seed=11)
        whole = client.request(MODEL, arrays, class_count={"logits": 0})
        logits = result_arrays(whole, client.infer(whole), ["logits"])["logits"]
        top = client.request(MODEL, arrays, class_count={"logits": 3})
        entries = result_arrays(top, client.infer(top), ["logits"])["logits"]
    assert entries.shape == (2, 3)
    for row, scores in zip(entries, logits):
        indices = [int(e.decode().split(":")[1]) for e in row]
        values = [float(e.decode().split(":")[0]) for e in row]
        # by value, not by index: in bf16 (a CPU with AMX) two classes can tie exactly
        assert len(set(indices)) == 3
        np.testing.assert_allclose(values, np.sort(scores)[::-1][:3], rtol=1e-5)
        np.testing.assert_allclose(values, scores[indices], rtol=1e-5)


# --- system shared memory ------------------------------------------------------------------


def test_shared_memory_gives_the_same_outputs_and_cleans_up(server):
    with Client(server.grpc_url, "grpc") as client:
        info = client.model_info(MODEL)
        arrays = random_inputs(info, 2, seed=3)
        plain = client.request(MODEL, arrays)
        expected = result_arrays(plain, client.infer(plain), ["logits"])["logits"]
        outputs = {t.name: (t.dtype, info.full_shape(t, 2)) for t in info.outputs}
        with SharedMemoryRegions(client, arrays, outputs) as shm:
            assert {shm.input_name, shm.output_name} <= set(client.shm_regions())
            request = client.request(MODEL, arrays, shm)
            # read from the output region, which holds zeros until the server writes there
            got = result_arrays(request, client.infer(request), ["logits"])["logits"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert our_leftovers(server, os.getpid()) == ([], [])


def test_bench_over_shared_memory_leaves_nothing_behind(server):
    config = bench.BenchConfig(model=MODEL, url=server.http_url, protocol="http", concurrency=(2,), requests=3, warmup=0,
                               shared_memory="system", progress=False)  # fmt: skip
    result = bench.run(config)
    assert result.errors == 0 and result.rows[0].requests == 3 and result.rows[0].p50_ms > 0
    assert our_leftovers(server, os.getpid()) == ([], [])


def interrupt_a_bench(url: str, kind: str, registered) -> int:
    """Start `bench --shared-memory KIND` with two workers, Ctrl-C it once its four
    regions are registered (`registered(pid)` lists them), and check that it
    exits as interrupted with none left registered. Returns its pid."""
    command = [sys.executable, "-m", "client", "bench", "--model", MODEL, "--url", url, "--concurrency", "2",
               "--requests", "1000000", "--shared-memory", kind, "--no-progress"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(registered(process.pid)) < 4:
            assert process.poll() is None, process.communicate()
            time.sleep(0.2)
        assert len(registered(process.pid)) == 4, "two workers, one input and one output region each"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130 and stderr.strip().splitlines()[-1] == "error: interrupted"
    assert registered(process.pid) == []
    return process.pid


def test_ctrl_c_unregisters_shared_memory(server):
    pid = interrupt_a_bench(server.grpc_url, "system", lambda pid: our_leftovers(server, pid)[0])
    assert our_leftovers(server, pid) == ([], [])



# --- CUDA shared memory and the adapter's GPU path (GPU host) -------------------------------


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory, admin_key):
    """googlenet and deepfm only, on the GPU: their configs let GPU inputs through."""
    root = tmp_path_factory.mktemp("gpu_server")
    for model in ("googlenet", "deepfm"):
        shutil.copytree(DEFAULT_MODEL_REPOSITORY / model, root / "models" / model)
    with TritonServer(server_config(root / "models"), root / "server.log") as running:
        yield running


def cuda_leftovers(server, pid: int) -> list[str]:
    with Client(server.grpc_url) as client:
        return [name for name in client.cuda_shm_regions() if name.startswith(f"{SHM_PREFIX}{pid}_")]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["googlenet", "deepfm"])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cuda_shared_memory_answers_as_the_message_does_and_cleans_up(gpu_server, model, protocol):
    """The inputs reach the adapter on the GPU (its log says so), the outputs come
    back through the client's CUDA region, equal to the same request sent in the message."""
    url = gpu_server.grpc_url if protocol == "grpc" else gpu_server.http_url
    with Client(url, protocol) as client:
        info = client.model_info(model)
        arrays = random_inputs(info, 3, seed=5)
        plain = client.request(model, arrays)
        names = [t.name for t in info.outputs]
        expected = result_arrays(plain, client.infer(plain), names)
        outputs = {t.name: (t.dtype, info.full_shape(t, 3)) for t in info.outputs}
        with SharedMemoryRegions(client, arrays, outputs, "cuda") as shm:
            assert {shm.input_name, shm.output_name} <= set(client.cuda_shm_regions())
            request = client.request(model, arrays, shm)
            got = result_arrays(request, client.infer(request), names)
    for name in names:
        assert_close(got[name], expected[name])
    assert cuda_leftovers(gpu_server, os.getpid()) == []
    assert f"model {model}: a batch arrived on cuda" in Path(gpu_server.log_path).read_text()


@pytest.mark.gpu
def test_bad_ids_on_the_gpu_are_refused_per_request_while_others_succeed(gpu_server):
    """Requests through CUDA shared memory batched together, every third with an id
    outside its field's vocabulary, and some in the message among them (batches
    that mix host and GPU inputs): each bad one gets INVALID_ARGUMENT naming the
    position, the good ones their answers, and the model stays ready."""
    model = "deepfm"

    def send(k: int):
        with Client(gpu_server.grpc_url) as client:
            info = client.model_info(model)
            arrays = random_inputs(info, 1, seed=60 + k)
            if k % 3 == 0:
                arrays["sparse"][0, 8] = 3  # field 8 has a vocabulary of 3
            outputs = {t.name: (t.dtype, info.full_shape(t, 1)) for t in info.outputs}
            with SharedMemoryRegions(client, arrays, outputs, "cuda") as shm:
                request = client.request(model, arrays, None if k % 4 == 1 else shm)
                try:
                    return arrays, result_arrays(request, client.infer(request), ["probability"])["probability"]
                except ClientError as error:
                    return arrays, error

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(send, range(24)))
    for k, (arrays, result) in enumerate(results):
        if k % 3 == 0:
            assert isinstance(result, ClientError) and "position 8" in str(result), result
        else:
            assert_served(result, model, [arrays["dense"], arrays["sparse"]])
    with Client(gpu_server.grpc_url) as client:
        assert client.model_ready(model)
    assert cuda_leftovers(gpu_server, os.getpid()) == []


@pytest.mark.gpu
def test_the_cli_over_cuda_shared_memory_and_ctrl_c_cleans_up(gpu_server):
    done = cli("infer", "--model", "googlenet", "--url", gpu_server.grpc_url, "--shared-memory", "cuda")
    assert done.returncode == 0 and "cuda shared memory" in done.stdout, done.stderr
    interrupt_a_bench(gpu_server.grpc_url, "cuda", lambda pid: cuda_leftovers(gpu_server, pid))
