"""nginx as the HTTP guard (opara_core.serving.nginx_guard): the container's
guard in front of its tritonserver 2.69; here in front of the 2.51 that this
machine has, on both protocols, with the answers against the eager module."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess

import pytest
import tritonclient.http as httpclient
from conftest import server_config
from serving import assert_served, example, infer
from test_faults import make_repository
from test_fuzz import _deepfm, _json, fuzz, survives

from opara_core.serving.launcher import ServerConfig, TritonServer
from opara_core.serving.nginx_guard import NginxGuard, find_nginx

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def target(tmp_path_factory, admin_key):
    find_nginx()  # `make test` installs it: a missing nginx is a failure, not a skip
    root = tmp_path_factory.mktemp("nginx")
    repository = make_repository(root / "models", {"deepfm": "deepfm"})
    with TritonServer(server_config(repository, exit_timeout_s=5, guard="nginx"), root / "server.log") as server:
        assert server.guard is not None and any(arg.endswith("nginx") for arg in server.guard.args)
        model = fuzz.Model.from_config(fuzz.model_config(server.config.http_port, "deepfm"))
        fuzzer = fuzz.Fuzzer(server.config.http_port, server.config.grpc_port, model)
        assert fuzzer.healthy() is None
        yield server, fuzzer
        fuzzer.close()


def _get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_binary_and_json_requests_through_nginx_get_the_eager_answer(target):
    server, fuzzer = target
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.config.http_port}")
    try:
        arrays = example("deepfm", 3, seed=11)
        assert_served(infer(client, "deepfm", arrays), "deepfm", arrays)  # binary tensors
    finally:
        client.close()
    assert fuzzer.healthy() is None  # a JSON request over HTTP and one over gRPC, same answer


def test_a_chunk_size_beyond_64_bits_is_refused_by_nginx(target):
    case = fuzz.Case("chunked", "chunk size overflow", http=_json(_deepfm([1, 13], [0.5] * 13), how="chunked-overflow"))
    assert survives(target, case) == "400"


def test_metrics_on_the_http_port_report_the_launchers_restarts(target):
    server, _ = target
    status, body = _get(server.config.http_port, "/metrics")
    assert status == 200 and b"# TYPE opara_server_restarts_total counter" in body, body
    server.record_restart("server exited")
    try:
        status, body = _get(server.config.http_port, "/metrics")
        assert b'opara_server_restarts_total{reason="server exited"} 1' in body, body
    finally:
        server.restarts.clear()
        server.record_restart(None)


def test_while_tritonserver_is_down_nginx_answers_503_and_stops_gracefully(tmp_path, admin_key):
    repository = make_repository(tmp_path / "models", {"deepfm": "deepfm"})
    server = TritonServer(server_config(repository, exit_timeout_s=5, guard="nginx"), tmp_path / "server.log")
    with server:
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
        status, body = _get(server.config.http_port, "/v2/models/deepfm/ready")
        assert status == 503 and "unavailable" in json.loads(body)["error"], (status, body)
        nginx = server.guard
    assert nginx.returncode == 0, nginx.returncode  # SIGQUIT: nginx's graceful stop
    assert not server.nginx.directory.exists()


def test_an_unknown_guard_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="python, nginx, none"):
        ServerConfig(tmp_path, guard="apache")



def test_the_written_config_passes_nginxs_own_check(tmp_path):
    guard = NginxGuard(tmp_path / "nginx", ("0.0.0.0", 8000), ("127.0.0.1", 18999), workers=2)
    guard.write()
    done = subprocess.run([*guard.command(), "-t"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "syntax is ok" in done.stderr, done.stderr
