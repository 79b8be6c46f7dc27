"""Faults: a model that cannot load, a backend process that dies, SIGTERM under
load, a full shared-memory pool, a failed CUDA-graph capture.

Each runs on its own small server (googlenet and deepfm copied into a
temporary repository) so that the session server never sees a fault.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import server_config
from serving import assert_served, example, infer
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from opara_core.serving.launcher import REPO_ROOT, TritonServer, shm_prefix, supervise

pytestmark = pytest.mark.server


def make_repository(root: Path, models: dict[str, str], parameters: dict[str, str] | None = None) -> Path:
    """`root` holding copies of repository models: {name in root: model copied}.
    A copy under another name gets that name; `parameters` go into every config."""
    for name, source in models.items():
        (root / name / "1").mkdir(parents=True)
        config = (REPO_ROOT / "model_repository" / source / "config.pbtxt").read_text()
        config = config.replace(f'name: "{source}"', f'name: "{name}"')
        for key, value in (parameters or {}).items():
            config += f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text((REPO_ROOT / "model_repository" / source / "1" / "model.py").read_text())
    return root


def wait_for(condition, timeout_s: float, what: str, server: TritonServer | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception:  # noqa: BLE001 - not there yet
            pass
        if server is not None and server.returncode is not None:
            pytest.fail(f"server exited (code {server.returncode}) while waiting for {what}:\n{server.log_tail()}")
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}" + (f":\n{server.log_tail()}" if server else ""))


def assert_clear(message: str, *words: str) -> None:
    assert all(w in message for w in words) and "Traceback" not in message and not re.search(r"\.py\(\d+\)", message), message


# --- a supervised server: a killed backend process, SIGTERM ------------------------------------


class Supervised:
    """`supervise` (what `make serve` runs) in a thread, around a googlenet +
    deepfm server with a short exit timeout."""

    def __init__(self, server: TritonServer):
        self.server = server
        self.stop = threading.Event()
        self.serving = threading.Event()
        self.result: list[int] = []
        self.thread = threading.Thread(
            target=lambda: self.result.append(supervise(server, self.stop, serving=self.serving)), daemon=True
        )

    def sigterm(self) -> None:
        """What serve() does on SIGTERM: stop supervising and pass the signal on."""
        self.stop.set()
        self.server.interrupt(signal.SIGTERM)

    def shutdown(self) -> None:
        self.sigterm()
        self.thread.join(120)


@pytest.fixture(scope="module")
def supervised(tmp_path_factory, admin_key):
    root = tmp_path_factory.mktemp("supervised")
    repository = make_repository(root / "models", {"googlenet": "googlenet", "deepfm": "deepfm"})
    running = Supervised(TritonServer(server_config(repository, exit_timeout_s=15), root / "server.log"))
    running.thread.start()
    wait_for(running.serving.is_set, 300, "the supervised server", running.server)
    yield running
    running.shutdown()


def test_a_killed_backend_process_fails_fast_then_the_server_restarts(supervised, caplog):
    """Triton 2.51 neither restarts a dead stub nor reports its model down, so
    `supervise` restarts the server. During the outage every request ends
    quickly with a clear error (or a refused connection while the server
    restarts); afterwards the model answers correctly again."""
    server = supervised.server
    caplog.set_level(logging.INFO, logger="opara_core.serving.launcher")
    old = server.stubs()["deepfm_0_0"]
    os.kill(old, signal.SIGKILL)
    arrays = example("deepfm", 2, seed=3)
    errors, answered = [], None
    deadline = time.monotonic() + 240
    while answered is None and time.monotonic() < deadline:
        client = httpclient.InferenceServerClient(server.http_url, connection_timeout=10, network_timeout=10)
        start = time.monotonic()
        try:
            answered = infer(client, "deepfm", arrays)
        except InferenceServerException as error:
            errors.append(error.message())
        except Exception as error:  # noqa: BLE001 - refused, reset or closed while the server restarts
            errors.append(f"connection: {type(error).__name__}")
        finally:
            client.close()
        assert time.monotonic() - start < 10, "a request hung during the outage"
        time.sleep(0.2)
    assert answered is not None, errors[-5:]
    assert_served(answered, "deepfm", arrays)
    new = server.stubs()["deepfm_0_0"]
    # the new server may answer before the supervisor's readiness poll has seen it ready
    wait_for(supervised.serving.is_set, 30, "the supervisor to mark the restarted server serving", server)
    assert new != old and server.returncode is None
    for message in errors:  # the HTTP guard answers 503 while tritonserver restarts
        assert message.startswith(("connection: ", "the inference server is unavailable")) or message == "Stub process 'deepfm_0_0' is not healthy.", message
    # the supervisor restarted the server because it saw the stub dead, or because tritonserver itself
    # aborted first (a stub killed while holding a shared-memory lock: boost's lock_exception; a race)
    assert any(
        ("deepfm_0_0 died" in r.getMessage() or r.getMessage().startswith("tritonserver ")) and "the server restarts" in r.getMessage()
        for r in caplog.records
    ), caplog.text
    with grpcclient.InferenceServerClient(server.grpc_url) as grpc_client:
        x = example("googlenet", 1, seed=4)[0]
        assert_served(infer(grpc_client, "googlenet", [x]), "googlenet", [x])


def test_sigterm_lets_in_flight_requests_finish(supervised):
    """Six batches of eight images (seconds of work on a CPU) are sent in full,
    then SIGTERM: the listeners close at once, yet every request already sent
    gets its full, correct answer, and the supervisor exits cleanly."""
    server = supervised.server
    host, port = server.http_url.split(":")
    batches = [example("googlenet", 8, seed=10 + i)[0] for i in range(6)]
    all_sent = threading.Barrier(len(batches) + 1, timeout=120)

    def send(x: np.ndarray) -> np.ndarray:
        header = json.dumps(
            {"inputs": [{"name": "image", "shape": list(x.shape), "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}]}
        ).encode()
        connection = http.client.HTTPConnection(host, int(port), timeout=300)
        try:
            connection.request(
                "POST", "/v2/models/googlenet/infer", header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}
            )
            all_sent.wait()
            response = connection.getresponse()
            body = json.loads(response.read())
            assert response.status == 200, body
            return np.asarray(body["outputs"][0]["data"], np.float32).reshape(body["outputs"][0]["shape"])
        finally:
            connection.close()

    with ThreadPoolExecutor(len(batches)) as pool:
        futures = [pool.submit(send, x) for x in batches]
        all_sent.wait()
        supervised.sigterm()
        answers = [f.result(timeout=300) for f in futures]
    for x, answer in zip(batches, answers):
        assert_served(answer, "googlenet", [x])
    supervised.thread.join(120)
    assert supervised.result == [0] and server.returncode is not None
    with socket.socket() as late:
        assert late.connect_ex((host, int(port))) != 0, "the server still accepts connections"
    # the stub killed before the restart left its shared-memory region; stopping removed it
    assert not list(Path("/dev/shm").glob(f"{shm_prefix(server.config)}*"))


# --- a degraded server: a broken model, a tiny shared-memory limit ---------------------------

FILE_LIMIT = 8 << 20  # bytes: every file the server makes, /dev/shm regions included


@pytest.fixture(scope="module")
def degraded(tmp_path_factory, admin_key):
    """googlenet, plus a deepfm copy whose config has an invalid parameter, on a
    server that keeps going when a model fails to load (`--exit-on-error=false`)
    and whose files may not grow beyond FILE_LIMIT. The Python backend keeps
    its shared-memory pool in /dev/shm files, so requests that need a larger
    pool find it full, as in a container with a small --shm-size."""
    root = tmp_path_factory.mktemp("degraded")
    repository = make_repository(root / "models", {"googlenet": "googlenet"})
    make_repository(repository, {"deepfm_broken": "deepfm"}, {"policy": "no_such_policy"})

    # prlimit caps the size of every file the server writes; the shell makes a
    # write past the cap fail (EFBIG) instead of killing the server (SIGXFSZ)
    wrapper = ("prlimit", f"--fsize={FILE_LIMIT}", "--", "sh", "-c", 'trap "" XFSZ; exec "$0" "$@"')
    config = server_config(repository, exit_timeout_s=5, extra_args=("--exit-on-error=false",))
    server = TritonServer(config, root / "server.log", wrapper=wrapper)
    server.start()
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        wait_for(lambda: client.is_model_ready("googlenet"), 300, "googlenet", server)
        client.close()
        yield server
    finally:
        server.stop()


def test_a_model_that_fails_to_initialize_is_unavailable_while_the_others_serve(degraded, admin_key):
    http_client = httpclient.InferenceServerClient(degraded.http_url)
    grpc_client = grpcclient.InferenceServerClient(degraded.grpc_url)
    try:
        index = http_client.get_model_repository_index(headers={"admin-key": admin_key})
        states = {m["name"]: m for m in index}
        assert states["googlenet"]["state"] == "READY"
        assert states["deepfm_broken"]["state"] == "UNAVAILABLE"
        assert "model deepfm_broken: parameter policy is 'no_such_policy'; allowed: auto, " in states["deepfm_broken"]["reason"]
        assert not http_client.is_model_ready("deepfm_broken") and not grpc_client.is_model_ready("deepfm_broken")
        # strict readiness: the server as a whole says "not ready" while a model is down
        assert http_client.is_server_live() and not http_client.is_server_ready()
        for client, module in ((http_client, httpclient), (grpc_client, grpcclient)):
            inputs = []
            for name, array in zip(("dense", "sparse"), example("deepfm", 1, seed=1)):
                inputs.append(module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
                inputs[-1].set_data_from_numpy(array)
            with pytest.raises(InferenceServerException) as refused:
                client.infer("deepfm_broken", inputs)
            assert_clear(refused.value.message(), "deepfm_broken")
            x = example("googlenet", 2, seed=2)[0]
            assert_served(infer(client, "googlenet", [x]), "googlenet", [x])
    finally:
        http_client.close()
        grpc_client.close()


def test_a_full_shared_memory_pool_gives_an_error_not_a_hang(degraded):
    """Sixteen images (9.6 MB) need a larger pool than the file limit allows: the
    request fails at once with the backend's message; smaller ones still work."""
    for client in (httpclient.InferenceServerClient(degraded.http_url, network_timeout=60), grpcclient.InferenceServerClient(degraded.grpc_url)):
        start = time.monotonic()
        with pytest.raises(InferenceServerException) as full:
            infer(client, "googlenet", example("googlenet", 16, seed=5))
        assert time.monotonic() - start < 10
        assert_clear(full.value.message(), "Failed to increase the shared memory pool size")
        x = example("googlenet", 1, seed=6)[0]
        assert_served(infer(client, "googlenet", [x]), "googlenet", [x])
        assert client.is_model_ready("googlenet")
        client.close()


def test_unsupervised_a_killed_backend_process_fails_every_request_but_looks_ready(degraded):
    """What Triton 2.51 does on its own (this server has no supervisor): no
    restart, the model keeps reporting ready, and each request fails within
    about a second with a clear error. This is why `make serve` supervises."""
    os.kill(degraded.stubs()["googlenet_0_0"], signal.SIGKILL)
    with httpclient.InferenceServerClient(degraded.http_url, network_timeout=30) as client:
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(InferenceServerException) as failed:
                infer(client, "googlenet", example("googlenet", 1, seed=7))
            assert time.monotonic() - start < 5
            assert failed.value.status() == "500"
            assert_clear(failed.value.message(), "Stub process 'googlenet_0_0' is not healthy")
        assert client.is_model_ready("googlenet")
    assert "googlenet_0_0" not in degraded.stubs() and degraded.returncode is None


# --- GPU: a failed capture falls back, with the reason in the log and a metric ------------------


# the googlenet model.py of the test below: in the stub process, before the adapter builds
# anything, the engine's multi-stream capture (auto's capture and timing of its candidate
# plans) raises as a failed capture would, so the build falls back for real
FAILING_CAPTURE_MODEL_PY = '''"""googlenet whose multi-stream capture always fails (tests/test_faults.py)."""

from opara_core.engine import build
from opara_core.engine.capture import CaptureError
from opara_core.serving.triton_backend import OparaModel


def failing_capture(*args, **kwargs):
    raise CaptureError("capture failure forced by the test's model.py")


class TritonPythonModel(OparaModel):
    zoo_name = "googlenet"

    def initialize(self, args):
        build.capture_fastest = failing_capture
        super().initialize(args)
'''


@pytest.mark.gpu
def test_a_forced_capture_failure_falls_back_with_the_reason_in_log_and_metric(tmp_path, admin_key):
    # remember_choices false: a failed build would forget the choices an earlier build remembered
    repository = make_repository(tmp_path / "models", {"googlenet": "googlenet"}, {"remember_choices": "false"})
    (repository / "googlenet" / "1" / "model.py").write_text(FAILING_CAPTURE_MODEL_PY)
    with TritonServer(server_config(repository), tmp_path / "server.log") as server:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            x = example("googlenet", 3, seed=8)[0]
            assert_served(infer(client, "googlenet", [x]), "googlenet", [x])
        with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
            metrics = response.read().decode()
    assert re.search(r'^opara_fallbacks_total\{model="googlenet",stage="multi-stream graph"\} 1$', metrics, re.M), [
        line for line in metrics.splitlines() if "opara" in line
    ]
    log_text = (tmp_path / "server.log").read_text()
    assert "falling back to a sequential graph: capture failure forced by the test's model.py" in log_text
    assert re.search(r"model googlenet ready on cuda:\d+ in [\d.]+ s: sequential graph, \d+ buckets, after 1 fallback\(s\) \| ", log_text)
