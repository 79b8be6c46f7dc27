"""The walking skeleton: the real tritonserver serves googlenet over HTTP and gRPC."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import server_config
from serving import assert_close, assert_served, eager, example, infer, served_tolerance
from tritonclient.utils import InferenceServerException

from opara_core.serving import launcher
from opara_core.serving.launcher import (
    REPO_ROOT,
    ServerConfig,
    TritonServer,
    alive,
    find_server,
    free_port,
    free_ports,
    gpu_present,
    server_command,
    spawn,
)
from opara_core.serving.startup import NO_GPU_NOTE

pytestmark = pytest.mark.server

MODEL = "googlenet"


def full_log(terminal: str) -> str:
    """The whole output of a server whose terminal said `full log: PATH`,
    without the seconds since the start that begin each of its lines."""
    found = re.search(r"full log: (\S+)", terminal)
    assert found, terminal[:3000]
    lines = Path(found.group(1)).read_text().splitlines()
    stamped = [re.fullmatch(r" *\d+\.\d\d (.*)", line) for line in lines]
    assert all(stamped), [line for line, m in zip(lines, stamped) if not m][:5]
    return "\n".join(m[1] for m in stamped) + "\n"


def images(batch: int, seed: int) -> np.ndarray:
    return example(MODEL, batch, seed)[0]


def infer_http(client, x: np.ndarray) -> np.ndarray:
    return infer(client, MODEL, [x])


def infer_grpc(client, x: np.ndarray) -> np.ndarray:
    return infer(client, MODEL, [x])


def test_the_server_answering_is_our_own_process(server, http_client, grpc_client):
    assert server.returncode is None
    assert http_client.get_server_metadata()["name"] == server.config.server_id
    assert grpc_client.get_server_metadata().name == server.config.server_id
    assert http_client.is_model_ready(MODEL) and grpc_client.is_model_ready(MODEL)


def test_server_binds_loopback_only(server):
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    for port in (server.config.http_port, server.config.grpc_port, server.config.metrics_port):
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((address, port)) != 0, f"port {port} answers on {address}"


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outbound interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_http_and_grpc_match_eager(http_client, grpc_client):
    x = images(1, seed=1)
    expected = eager(MODEL, [x])
    over_http = infer_http(http_client, x)
    over_grpc = infer_grpc(grpc_client, x)
    assert over_http.shape == (1, 1000) and over_http.dtype == np.float32
    assert_close(over_http, expected, served_tolerance(MODEL))
    assert_close(over_grpc, expected, served_tolerance(MODEL))
    np.testing.assert_array_equal(over_http, over_grpc)


def test_outputs_depend_on_the_input(http_client):
    """Guards the oracle: a model whose output ignores its input would let any
    wrong answer pass the equality tests."""
    a, b = infer_http(http_client, images(1, seed=2)), infer_http(http_client, images(1, seed=3))
    assert np.abs(a - b).max() > 1e-3 * np.abs(a).max()


def test_a_batch_equals_its_rows_sent_alone(http_client, grpc_client):
    x = images(4, seed=4)
    batched = infer_grpc(grpc_client, x)
    singles = np.concatenate([infer_http(http_client, x[i : i + 1]) for i in range(4)])
    assert_close(batched, singles, served_tolerance(MODEL))
    assert_served(batched, MODEL, [x])


def test_wrong_shape_is_a_clear_client_error(http_client, grpc_client):
    x = np.zeros((1, 3, 100, 100), np.float32)
    with pytest.raises(InferenceServerException) as over_http:
        infer_http(http_client, x)
    assert over_http.value.status() == "400"
    assert "image" in over_http.value.message() and "Traceback" not in over_http.value.message()
    with pytest.raises(InferenceServerException) as over_grpc:
        infer_grpc(grpc_client, x)
    assert over_grpc.value.status() == "StatusCode.INVALID_ARGUMENT"


def readme_models() -> dict[str, dict[str, list[tuple[str, str, list[int]]]]]:
    """The README's model table: model -> {"inputs": [...], "outputs": [...]},
    each a list of (name, datatype, dims without the batch dimension)."""
    text = (REPO_ROOT / "README.md").read_text().split("\n## Models\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| (.+?) \|", text, flags=re.M)
    table = {}
    for model, inputs, outputs in rows:
        table[model] = {"inputs": _tensors(inputs), "outputs": _tensors(outputs)}
    return table


def _tensors(cell: str) -> list[tuple[str, str, list[int]]]:
    found = re.findall(r"`(\w+)` (\w+) \[([-\d, ]+)\]", cell)
    return [(name, dtype, [int(d) for d in dims.split(",")]) for name, dtype, dims in found]


def test_metadata_and_config_match_the_readme(http_client, grpc_client):
    documented = readme_models()[MODEL]
    metadata = http_client.get_model_metadata(MODEL)
    for kind in ("inputs", "outputs"):
        served = [(t["name"], t["datatype"], t["shape"][1:]) for t in metadata[kind]]
        assert served == documented[kind]
        assert all(t["shape"][0] == -1 for t in metadata[kind]), "batch dimension must be variable"
    config = grpc_client.get_model_config(MODEL, as_json=True)["config"]
    assert config["backend"] == "python"
    assert config["max_batch_size"] >= 8
    assert "dynamic_batching" in config
    assert all(group.get("kind") in (None, "KIND_CPU", "KIND_GPU", "KIND_AUTO") for group in config["instance_group"])


def test_config_file_leaves_instance_kind_to_triton():
    text = (REPO_ROOT / "model_repository" / MODEL / "config.pbtxt").read_text()
    assert "kind" not in re.sub(r"#.*", "", text)


def test_server_config_reads_ports_from_the_environment():
    config = ServerConfig.from_env({"HTTP_PORT": "9100", "GRPC_PORT": "9101", "METRICS_PORT": "9102"})
    assert (config.http_port, config.grpc_port, config.metrics_port) == (9100, 9101, 9102)
    assert ServerConfig.from_env({}).http_port == 8000
    with pytest.raises(ValueError, match="HTTP_PORT"):
        ServerConfig.from_env({"HTTP_PORT": "eighty"})
    command = server_command(config, Path("/backends"))
    assert "--model-control-mode=none" in command
    assert "--http-address=127.0.0.1" in command and "--grpc-address=127.0.0.1" in command


def test_the_stubs_find_libpython_alone_not_the_rest_of_pythons_libdir(tmp_path):
    """LD_LIBRARY_PATH gets a directory holding only a link to libpython: a system
    Python's LIBDIR (/usr/lib/<arch>) would put everything else there ahead of the
    libraries torch finds itself (on the H100 machine, the CUDA image's cuDNN 9.14
    against torch's 9.19). The real-server tests show the stubs still load."""
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not name or not (Path(libdir) / name).exists():
        pytest.skip("this Python has no shared library")
    for _ in range(2):  # a second server start finds the link in place
        env = launcher.server_env({"LD_LIBRARY_PATH": "/x"}, workdir=tmp_path)
    directories = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libdir not in directories and directories[-1] == "/x"
    holders = [d for d in directories if (Path(d) / name).exists()]
    assert len(holders) == 1 and os.listdir(holders[0]) == [name]
    assert (Path(holders[0]) / name).resolve() == (Path(libdir) / name).resolve()


def test_the_guards_internal_port_is_none_of_the_public_ones_chosen_but_not_bound_yet(monkeypatch):
    # CI, 2026-11-25: the OS handed the chosen gRPC port out again for tritonserver's internal
    # HTTP port (nothing listened on it yet), and the gRPC service failed "already in use"
    config = ServerConfig(http_port=41001, grpc_port=41002, metrics_port=41003)
    offered = iter([41002, 41003, 41001, 41004])
    monkeypatch.setattr(launcher, "_unbound_port", lambda: next(offered))
    assert TritonServer(config, None).upstream == ("127.0.0.1", 41004)
    monkeypatch.setattr(launcher, "_unbound_port", lambda: 41002)
    with pytest.raises(OSError, match="41002"):
        launcher.free_port(avoid=[41002])


def test_make_serve_runs_in_the_foreground_comes_back_after_sigkill_and_stops_on_sigterm(tmp_path):
    """The README's first command, on free ports with a one-model repository
    and an extra tritonserver flag in TRITON_ARGS. It says what it is doing: a
    line when the model has loaded (what it built), one when the server is
    ready (its URLs), and on a host without a GPU no alarming CUDA lines.
    tritonserver killed with SIGKILL comes back by itself (the HTTP guard keeps
    the port and answers 503 meanwhile), the restart and its reason are in the
    log and in the guard's /metrics; SIGTERM then stops everything."""
    repository = tmp_path / "models"
    (repository / MODEL / "1").mkdir(parents=True)
    source = REPO_ROOT / "model_repository" / MODEL
    (repository / MODEL / "config.pbtxt").write_text((source / "config.pbtxt").read_text())
    (repository / MODEL / "1" / "model.py").write_text((source / "1" / "model.py").read_text())
    ports = dict(zip(("HTTP_PORT", "GRPC_PORT", "METRICS_PORT"), free_ports(3)))
    env = {**os.environ, **{k: str(v) for k, v in ports.items()}, "MODEL_REPOSITORY": str(repository)}
    env["TRITON_ARGS"] = "--metrics-interval-ms 500"
    log_path = tmp_path / "make_serve.log"
    with open(log_path, "wb") as log_file:
        make = subprocess.Popen(["make", "-s", "serve"], cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP_PORT']}")

    def wait_ready() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and make.poll() is None:
            try:
                if client.is_model_ready(MODEL):
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.5)
        assert make.poll() is None, log_path.read_text()[-3000:]
        assert client.is_model_ready(MODEL)

    def wait_ready_line(count: int) -> None:
        # The guard may answer ready a moment before the supervisor's own poll
        # sees the server and prints its ready line (until then a dying server
        # is a failed start, not a restart: CI, 2026-11-25); wait for that line.
        deadline = time.monotonic() + 60
        while len(re.findall(r"^ready after ", log_path.read_text(), re.M)) < count and time.monotonic() < deadline:
            time.sleep(0.25)

    try:
        wait_ready()
        wait_ready_line(1)
        x = images(1, seed=5)
        assert_served(infer_http(client, x), MODEL, [x])
        first = find_server(ports["HTTP_PORT"])
        assert first is not None and find_server(ports["GRPC_PORT"]) == first
        arguments = Path(f"/proc/{first}/cmdline").read_bytes().split(b"\0")
        assert arguments[-3:-1] == [b"--metrics-interval-ms", b"500"], arguments
        os.kill(first, signal.SIGKILL)
        wait_ready()
        second = find_server(ports["HTTP_PORT"])
        assert second not in (None, first)
        assert_served(infer_http(client, x), MODEL, [x])
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['HTTP_PORT']}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        assert 'opara_server_restarts_total{reason="server exited"} 1' in metrics, metrics
        client.close()
        wait_ready_line(2)
        make.send_signal(signal.SIGTERM)
        assert make.wait(60) != -signal.SIGKILL
    finally:
        if make.poll() is None:
            make.kill()
    log = log_path.read_text()
    assert "tritonserver was killed by SIGKILL; the server restarts in" in log, log[-3000:]
    device = "cuda:0" if gpu_present() else "cpu"
    built = "(multi-stream|sequential) graph, \\d+ buckets" if gpu_present() else "eager"
    loaded = re.findall(rf"^loaded 1/1: {MODEL} \({built} on {device}, [\d.]+ s to initialize; \d+ s after start\)$", log, re.M)
    assert len(loaded) == 2, log[-3000:]  # the first start and the restart
    http = f"HTTP http://127.0.0.1:{ports['HTTP_PORT']}"
    ready = re.findall(rf"^ready after \d+ s: 1 of 1 models loaded; {re.escape(http)}.*, gRPC 127.0.0.1:{ports['GRPC_PORT']}, "
                       rf"metrics http://127.0.0.1:{ports['METRICS_PORT']}/metrics$", log, re.M)  # fmt: skip
    assert len(ready) == 2, log[-3000:]
    whole = full_log(log)
    summaries = [line for line in whole.splitlines() if f"model {MODEL} ready on" in line]
    assert len(summaries) == 2 and all(line.startswith(f"INFO [{MODEL}] ") for line in summaries), summaries
    # the terminal holds what a person reads; Triton's and the model's chatter is in the full log only
    assert not re.search(r"^I\d{4} |^INFO ", log, re.M), log[:3000]
    assert re.search(r"^I\d{4} .*successfully loaded", whole, re.M), whole[:3000]
    if not gpu_present():
        assert "CudaDriverHelper" not in log.replace(NO_GPU_NOTE, ""), log[:3000]
        assert log.count(NO_GPU_NOTE) == 1
    assert "successfully unloaded" in whole.lower(), whole[-2000:]
    for port in ports.values():
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still open after SIGTERM"


PARENT = """
import sys, time
from pathlib import Path
from opara_core.serving.launcher import ServerConfig, TritonServer
ports = [int(p) for p in sys.argv[2:5]]
server = TritonServer(ServerConfig(Path(sys.argv[1]), *ports), Path(sys.argv[5]))
server.start()
server.wait_ready(120)
print(server.process.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_parent_takes_its_server_down(tmp_path):
    """The launcher starts tritonserver under `setpriv --pdeathsig`, so a test
    run or `make serve` killed with SIGKILL leaves no server holding ports."""
    (tmp_path / "models").mkdir()
    ports = [str(port) for port in free_ports(3)]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "models"), *ports, str(tmp_path / "server.log")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pid = int(parent.stdout.readline() or 0)
        assert pid > 0, (tmp_path / "server.log").read_text()
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 60
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not alive(pid), "tritonserver outlived its killed parent"
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", int(ports[0]))) != 0
    finally:
        parent.kill()
        parent.wait()


def test_spawning_beside_busy_grpc_clients_never_kills_the_child(tmp_path):
    """gRPC's at-fork handlers killed servers the launcher had just forked
    (their log: only gRPC's epoll error). `spawn` must start children safely
    while gRPC clients in this process are busy: /bin/true, 300 times."""
    stop = threading.Event()

    def call_nobody(client) -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                client.is_server_live(client_timeout=0.01)

    clients = [grpcclient.InferenceServerClient(f"127.0.0.1:{free_port()}") for _ in range(4)]
    threads = [threading.Thread(target=call_nobody, args=(c,), daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    try:
        with open(tmp_path / "children.log", "wb") as log_file:
            codes = [spawn(["/bin/true"], dict(os.environ), log_file).wait(30) for _ in range(300)]
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        for client in clients:
            client.close()
    failed = sum(code != 0 for code in codes)
    assert failed == 0, f"{failed} of 300 children died: {(tmp_path / 'children.log').read_text()[-500:]}"


def test_serve_without_a_key_writes_a_new_one_where_the_client_reads_it(tmp_path):
    from opara_core.serving.admin_key import read_admin_key
    from opara_core.serving.launcher import with_admin_key

    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    config, where = with_admin_key(ServerConfig(admin_key=None, http_port=41000, grpc_port=41001), env)
    assert config.admin_key and config.key_files
    assert read_admin_key("localhost:41000", env) == read_admin_key("localhost:41001", env) == config.admin_key
    for port in (41000, 41001):
        path = tmp_path / "opara" / "admin-keys" / str(port)
        assert str(path) in where and (path.stat().st_mode & 0o777) == 0o600
    other, _ = with_admin_key(ServerConfig(admin_key=None, http_port=42000, grpc_port=42001), env)
    assert other.admin_key != config.admin_key, "a new key per server"
    assert read_admin_key("localhost:41001", env) == config.admin_key, "the second server left the first one's key alone"


def test_serve_with_a_key_leaves_it_and_writes_nothing(tmp_path):
    from opara_core.serving.launcher import with_admin_key

    key = "k" * 32
    config, where = with_admin_key(ServerConfig(admin_key=key), {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert config.admin_key == key and "OPARA_ADMIN_KEY" in where
    assert not (tmp_path / "opara").exists()


def test_a_busy_port_is_refused_at_once_with_its_name(tmp_path):
    """Before, tritonserver loaded every model first and failed only when it
    opened its ports (minutes on a CPU)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**os.environ, "HTTP_PORT": str(free_port()), "GRPC_PORT": str(port), "METRICS_PORT": str(free_port()), "XDG_RUNTIME_DIR": str(tmp_path)}
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "opara_core.serving.launcher", "serve"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"gRPC port {port} (GRPC_PORT) is in use" in done.stderr
    assert time.monotonic() - start < 30
    assert not (tmp_path / "opara").exists(), "no key written for a server that never started"


def test_extra_flags_reach_tritonserver_and_replace_the_defaults_they_name():
    env = {"TRITON_ARGS": "--model-control-mode=explicit --load-model bert --trace-config 'triton,file=/tmp/a b.json'"}
    config = ServerConfig.from_env(env, extra_args=("--log-verbose=1",))
    command = server_command(config, Path("/backends"))
    assert command[-6:] == ["--model-control-mode=explicit", "--load-model", "bert", "--trace-config", "triton,file=/tmp/a b.json", "--log-verbose=1"]
    assert "--model-control-mode=none" not in command and "--log-verbose=0" not in command
    assert sum(arg.startswith("--allow-gpu-metrics") for arg in command) == 1  # the default stays


def test_every_model_of_the_repository_loads_at_once_unless_a_flag_says_otherwise(tmp_path):
    """Triton loads 4 models at a time by default: the shipped repository's
    eight then started one build after another, T5 about 110 s late."""
    for name in ("a", "b", "c", "d", "e", "f"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(f'name: "{name}"')
    command = server_command(ServerConfig.from_env({}, model_repository=tmp_path), Path("/backends"))
    assert "--model-load-thread-count=6" in command
    given = server_command(ServerConfig.from_env({}, model_repository=tmp_path, extra_args=("--model-load-thread-count=2",)), Path("/backends"))
    assert [arg for arg in given if arg.startswith("--model-load-thread-count")] == ["--model-load-thread-count=2"]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--grpc-port=9000"], "--grpc-port (use GRPC_PORT"),
        (["--http-port", "9000"], "--http-port (use HTTP_PORT"),
        (["--model-repository=/elsewhere"], "--model-repository (use MODEL_REPOSITORY"),
        (["--http-address=0.0.0.0"], "--http-address (make serve binds 127.0.0.1"),
        (["--grpc-restricted-protocol=shared-memory:k=v"], "--grpc-restricted-protocol (set OPARA_ADMIN_KEY"),
        (["--backend-config", "python,shm-region-prefix-name=x"], "shm-region-prefix-name=x (the launcher gives"),
        (["--log-file=/tmp/triton.log"], "--log-file (the launcher reads tritonserver's output"),
        (["trace"], "'trace' is not a flag"),
    ],
)
def test_an_extra_flag_the_launcher_owns_is_refused_with_what_to_do_instead(flags, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        ServerConfig(extra_args=("--trace-config=rate=10", *flags))


def test_serve_refuses_an_owned_flag_before_anything_starts(tmp_path):
    env = {**os.environ, "TRITON_ARGS": "--metrics-port=1", "XDG_RUNTIME_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "opara_core.serving.launcher", "serve", "--", "--grpc-port", "2"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "--metrics-port (use METRICS_PORT" in done.stderr and "--grpc-port (use GRPC_PORT" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "opara").exists()


def test_gpu_detection_needs_a_gpu_device_node(tmp_path):
    (tmp_path / "nvidiactl").touch()
    (tmp_path / "nvidia-uvm").touch()
    assert not gpu_present(tmp_path, {})
    (tmp_path / "nvidia0").touch()
    assert gpu_present(tmp_path, {})
    assert gpu_present(tmp_path, {"CUDA_VISIBLE_DEVICES": "0"})
    assert not gpu_present(tmp_path, {"CUDA_VISIBLE_DEVICES": ""})
    assert not gpu_present(tmp_path, {"CUDA_VISIBLE_DEVICES": "-1"})


def test_gpu_detection_agrees_with_torch():
    import torch

    assert gpu_present() == torch.cuda.is_available()


def test_gpu_metrics_are_on_exactly_where_there_is_a_gpu(tmp_path):
    """Triton's nv_gpu_* metrics (DCGM) on a GPU host; on a host without one
    the flag stays off, since DCGM and NVML would only print errors there."""
    (tmp_path / "empty").mkdir()
    log_path = tmp_path / "server.log"
    with TritonServer(server_config(tmp_path / "empty"), log_path) as server:
        assert f"--allow-gpu-metrics={str(gpu_present()).lower()}" in Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode().split("\0")
        deadline = time.monotonic() + 30
        while True:  # GPU metrics appear at the first collection after start
            with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
                metrics = response.read().decode()
            if "nv_gpu_utilization" in metrics or not gpu_present() or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    log = log_path.read_text()
    if gpu_present():
        assert "nv_gpu_utilization" in metrics and "nv_gpu_memory_used_bytes" in metrics, log[-2000:]
    else:
        assert "nv_gpu_" not in metrics
        assert "NVML" not in log and "DCGM" not in log, log[-2000:]


def test_with_explicit_model_control_an_unload_is_no_failure_but_a_dead_stub_is(tmp_path, admin_key):
    """Model Analyzer loads and unloads models through the repository API
    (TRITON_ARGS="--model-control-mode=explicit ..."): an unload ends the
    model's backend process on purpose, which must not restart the server; a
    stub killed under a model that stays loaded still does."""
    repository = tmp_path / "models"
    shutil.copytree(REPO_ROOT / "model_repository" / "deepfm", repository / "deepfm")
    config = server_config(repository, extra_args=("--model-control-mode=explicit", "--load-model=deepfm"))
    key = {"admin-key": admin_key}

    def until(condition, what: str):
        deadline = time.monotonic() + 120
        while not (value := condition()):
            assert time.monotonic() < deadline, what
            time.sleep(0.25)
        return value

    with TritonServer(config, tmp_path / "server.log") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        watched = server.stubs()
        assert list(watched) == ["deepfm_0_0"]
        client.unload_model("deepfm", headers=key)
        until(lambda: "deepfm_0_0" not in server.stubs(), "the unloaded model's stub still runs")
        assert server.failure(watched) is None and watched == {}
        client.load_model("deepfm", headers=key)
        until(lambda: "deepfm_0_0" in server.stubs() and client.is_model_ready("deepfm"), "deepfm did not load again")
        assert server.failure(watched) is None and watched == server.stubs()
        os.kill(watched["deepfm_0_0"], signal.SIGKILL)
        reason, _ = until(lambda: server.failure(watched), "a killed stub went unnoticed")
        assert reason == "backend process died"
        client.close()


def test_a_client_that_asks_for_no_encoding_gets_plain_json(server):
    """curl sends no Accept-Encoding; the HTTP guard's own client asked Triton
    for gzip and passed the compressed answer on (the README's curl example
    printed gzip bytes)."""
    import http.client
    import json

    body = json.dumps({"inputs": [{"name": "image", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": [0.5] * 150528}]})
    host, port = server.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.putrequest("POST", f"/v2/models/{MODEL}/infer", skip_accept_encoding=True)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body.encode())
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    assert response.status == 200 and response.getheader("Content-Encoding") in (None, "identity")
    assert json.loads(raw)["outputs"][0]["shape"] == [1, 1000]


def test_stop_ends_a_backend_process_its_killed_server_left_behind(tmp_path):
    """A SIGKILLed server's stub normally exits by itself; one was seen hung in
    a futex wait for minutes, holding its model. Here a stopped (SIGSTOP) stub
    stands in for a hung one."""
    repository = tmp_path / "models"
    shutil.copytree(REPO_ROOT / "model_repository" / "deepfm", repository / "deepfm")
    server = TritonServer(server_config(repository), tmp_path / "server.log")
    with server:
        (stub,) = server.stubs().values()
        os.kill(stub, signal.SIGSTOP)
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(30)
    try:
        assert not alive(stub), "the hung backend process outlived its server"
    finally:
        with contextlib.suppress(OSError):
            os.kill(stub, signal.SIGKILL)


def test_warm_loads_every_model_once_and_stops(tmp_path):
    repository = tmp_path / "models"
    shutil.copytree(REPO_ROOT / "model_repository" / "deepfm", repository / "deepfm")
    command = [sys.executable, "-m", "opara_core.serving.launcher", "warm", "--model-repository", str(repository)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^loaded 1/1: deepfm \(", done.stdout, re.M), done.stdout[-3000:]
    assert "1 of 1 models loaded" in done.stdout


def test_warm_fails_naming_a_model_that_cannot_load(tmp_path):
    repository = tmp_path / "models"
    shutil.copytree(REPO_ROOT / "model_repository" / "deepfm", repository / "deepfm")
    config = repository / "deepfm" / "config.pbtxt"
    config.write_text(config.read_text() + '\nparameters { key: "policy" value: { string_value: "fastest" } }\n')
    command = [sys.executable, "-m", "opara_core.serving.launcher", "warm", "--model-repository", str(repository)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "deepfm" in done.stderr and "fastest" in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]


def test_warm_builds_every_shape_of_a_first_use_model(tmp_path):
    """`capture` "first_use" builds only the smallest shape at load; warming an
    image's cache must build all six, so that later starts only load them."""
    repository = tmp_path / "models"
    shutil.copytree(REPO_ROOT / "model_repository" / "bert", repository / "bert")
    config = repository / "bert" / "config.pbtxt"
    config.write_text(config.read_text() + '\nparameters { key: "capture" value: { string_value: "first_use" } }\n')
    command = [sys.executable, "-m", "opara_core.serving.launcher", "warm", "--model-repository", str(repository)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OPARA_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ready = re.search(r"model bert ready on .*", full_log(done.stdout))
    assert ready, done.stdout[-3000:]
    assert sorted(int(n) for n in re.findall(r"shape (\d+): ", ready.group(0))) == [16, 32, 64, 128, 256, 512]


# --- a start has no deadline while it makes progress -------------------------------------

TOY_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""
# initialize says one thing in the model's own log format, then does `body`
TOY_MODEL = """import logging, time
import numpy as np
import triton_python_backend_utils as pb_utils
from opara_core.serving.startup import model_log_format


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format=model_log_format(args["model_name"]))
        logging.getLogger("toy").info("{says}")
        {body}

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", np.ones(1, np.float32))]) for _ in requests]
"""
SPIN = "end = time.monotonic() + {seconds}\n        while time.monotonic() < end:\n            pass"


def toy_repository(root: Path, models: dict[str, tuple[str, str]]) -> Path:
    """Python models that only initialize: {name: (what it logs, what it then does)}."""
    for name, (says, body) in models.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(TOY_CONFIG.format(name=name))
        (root / name / "1" / "model.py").write_text(TOY_MODEL.format(says=says, body=body))
    return root


def launch(repository: Path, stall_s: int, timeout_s: float) -> tuple[int, str, float]:
    """`serve` on free ports with OPARA_START_STALL_S; (exit code, terminal output, seconds):
    killed with SIGTERM once ready (exit 0), else whatever it exits with."""
    ports = dict(zip(("HTTP_PORT", "GRPC_PORT", "METRICS_PORT"), map(str, free_ports(3))))
    env = {**os.environ, **ports, "OPARA_START_STALL_S": str(stall_s)}
    command = [sys.executable, "-m", "opara_core.serving.launcher", "serve", "--model-repository", str(repository)]
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        while process.poll() is None and time.monotonic() - started < timeout_s:
            if any(line.startswith("ready after ") for line in lines):
                process.send_signal(signal.SIGTERM)
                break
            time.sleep(0.25)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(10)
    return code, "".join(lines), time.monotonic() - started


def test_a_start_that_keeps_working_is_never_given_up_however_long_it_takes(tmp_path):
    """A model that initializes for longer than the stall limit, silently but
    busy (as Inductor compiling segments is), and one that talks while it
    waits: the server comes up."""
    talk = "for _ in range(16):\n            logging.getLogger('toy').info('still here')\n            time.sleep(1)"
    repository = toy_repository(tmp_path / "models", {"busy": ("spinning silently", SPIN.format(seconds=16)), "talker": ("talking", talk)})
    code, out, seconds = launch(repository, stall_s=6, timeout_s=120)
    assert re.search(r"^ready after \d+ s: 2 of 2 models loaded", out, re.M), out[-3000:]
    assert seconds > 16 and code == 0, out[-3000:]
    assert "no progress" not in out


def test_a_stalled_start_is_given_up_naming_the_model_and_what_it_last_did(tmp_path):
    repository = toy_repository(
        tmp_path / "models",
        {"stuck": ("waiting for a lock nobody releases", "time.sleep(600)"), "quick": ("ready at once", "pass")},
    )
    code, out, seconds = launch(repository, stall_s=6, timeout_s=120)
    assert code == 1 and seconds < 90, out[-3000:]
    message = next(line for line in out.splitlines() if "made no progress" in line)
    assert re.search(r"no progress for \d+ s", message), message
    assert "stuck: waiting for a lock nobody releases (" in message and "quick" not in message.split("still loading:")[1], message
    assert "OPARA_START_STALL_S (now 6 s)" in message, message
    assert re.search(r"^loaded 1/2: quick ", out, re.M), out[-3000:]


def test_the_stall_limit_comes_from_the_environment_and_must_be_positive():
    assert ServerConfig.from_env({"OPARA_START_STALL_S": "900"}).start_stall_s == 900
    assert ServerConfig.from_env({}).start_stall_s == launcher.DEFAULT_START_STALL_S
    for bad in ("soon", "0", "-5"):
        with pytest.raises(ValueError, match="OPARA_START_STALL_S"):
            ServerConfig.from_env({"OPARA_START_STALL_S": bad})


def test_the_guards_workers_come_from_the_environment_within_1_to_64():
    assert ServerConfig.from_env({"OPARA_GUARD_WORKERS": "3"}).guard_workers == 3
    assert ServerConfig.from_env({}).guard_workers is None  # the guard's own default
    for bad in ("many", "0", "65"):
        with pytest.raises(ValueError, match="OPARA_GUARD_WORKERS"):
            ServerConfig.from_env({"OPARA_GUARD_WORKERS": bad})
