"""Safe defaults: loopback, model control `none`, administrative APIs behind a
key, request sizes bounded, and a README section that says so.

Loopback binding and `--model-control-mode=none` on the command line are
checked in test_launcher.py, weights_only loading in test_weights.py.
"""

from __future__ import annotations

import http.client
import json
import urllib.request
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from client.api import REJECTED, Client, ClientError, admin_headers
from opara_core.serving.launcher import ADMIN_KEY_ENV, REPO_ROOT, RESTRICTED_APIS, ServerConfig, server_command

# --- the command line ------------------------------------------------------------------


def restricted_flags(command: list[str]) -> dict[str, str]:
    """{flag: value} of the restricted-API flags of a tritonserver command."""
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith(("--http-restricted-api", "--grpc-restricted-protocol")))


def test_the_admin_apis_need_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv(ADMIN_KEY_ENV, "k" * 32)
    flags = restricted_flags(server_command(ServerConfig(), Path("/backends")))
    expected = f"{','.join(RESTRICTED_APIS)}:admin-key={'k' * 32}"
    assert flags == {"http-restricted-api": expected, "grpc-restricted-protocol": expected}
    assert set(RESTRICTED_APIS) == {"model-repository", "shared-memory", "logging", "trace"}


def test_without_a_key_the_admin_apis_are_closed_to_everyone(monkeypatch):
    """A random key per start that nobody is told: the APIs exist but no
    request can carry the key."""
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    keys = []
    for _ in range(2):
        flags = restricted_flags(server_command(ServerConfig(), Path("/backends")))
        assert len(flags) == 2 and len(set(flags.values())) == 1
        keys.append(flags["http-restricted-api"].rsplit("admin-key=", 1)[1])
    assert keys[0] != keys[1] and all(len(k) >= 32 for k in keys)


@pytest.mark.parametrize("key", ["short", "has space in it ok?", "comma,separated:value=x"])
def test_a_weak_or_unparsable_key_is_refused(monkeypatch, key):
    monkeypatch.setenv(ADMIN_KEY_ENV, key)
    with pytest.raises(ValueError, match=ADMIN_KEY_ENV):
        ServerConfig()
    with pytest.raises(ValueError, match=ADMIN_KEY_ENV):
        ServerConfig.from_env({ADMIN_KEY_ENV: key})


def test_the_launcher_reads_the_key_from_its_environment():
    assert ServerConfig.from_env({ADMIN_KEY_ENV: "e" * 20}).admin_key == "e" * 20
    assert ServerConfig.from_env({}).admin_key is None


def test_the_key_stays_out_of_the_config_repr():
    assert "secret-key-0123456789" not in repr(ServerConfig(admin_key="secret-key-0123456789"))


def test_the_client_sends_the_key_only_where_it_is_set():
    assert admin_headers("http", "localhost:8000", {ADMIN_KEY_ENV: "abc"}) == {"admin-key": "abc"}
    assert admin_headers("grpc", "localhost:8001", {ADMIN_KEY_ENV: "abc"}) == {"triton-grpc-protocol-admin-key": "abc"}
    no_file = {"HOME": "/nonexistent"}  # and no key file either
    assert admin_headers("grpc", "localhost:8001", no_file) == {}
    assert admin_headers("http", "localhost:8000", {**no_file, ADMIN_KEY_ENV: ""}) == {}


# --- the running server -----------------------------------------------------------------


# (method, path) of one call per restricted HTTP API; none of them changes anything
HTTP_ADMIN_CALLS = {
    "model-repository": ("POST", "/v2/repository/index"),
    "shared-memory": ("GET", "/v2/systemsharedmemory/status"),
    "logging": ("GET", "/v2/logging"),
    "trace": ("GET", "/v2/trace/setting"),
}


def http_call(server, method: str, path: str, headers: dict | None = None, body: bytes | None = None) -> tuple[int, str]:
    host, port = server.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


@pytest.mark.server
@pytest.mark.parametrize("api", RESTRICTED_APIS)
def test_over_http_an_admin_api_answers_only_with_the_key(server, admin_key, api):
    method, path = HTTP_ADMIN_CALLS[api]
    for headers in ({}, {"admin-key": "wrong-key-0123456789abcdef"}, {"Admin-Key": admin_key[:-1]}):
        status, body = http_call(server, method, path, headers)
        assert status == 403 and "restricted" in body, (headers, body)
    status, body = http_call(server, method, path, {"admin-key": admin_key})
    assert status == 200, body


@pytest.mark.server
@pytest.mark.parametrize("api", RESTRICTED_APIS)
def test_over_grpc_an_admin_api_answers_only_with_the_key(server, admin_key, api):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    call = {
        "model-repository": client.get_model_repository_index,
        "shared-memory": client.get_system_shared_memory_status,
        "logging": client.get_log_settings,
        "trace": client.get_trace_settings,
    }[api]
    try:
        for headers in (None, {"admin-key": admin_key}, {"triton-grpc-protocol-admin-key": "wrong-key-0123456789"}):
            with pytest.raises(InferenceServerException, match="restricted"):
                call(headers=headers)
        call(headers={"triton-grpc-protocol-admin-key": admin_key})
    finally:
        client.close()


@pytest.mark.server
def test_inference_health_metadata_and_metrics_need_no_key(server, http_client, grpc_client):
    assert http_client.is_server_ready() and grpc_client.is_server_ready()
    assert http_client.get_model_metadata("deepfm")["name"] == "deepfm"
    assert grpc_client.get_model_config("deepfm").config.max_batch_size == 32
    assert http_client.get_inference_statistics("deepfm")["model_stats"]
    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        assert response.status == 200


@pytest.mark.server
def test_even_with_the_key_models_cannot_be_loaded_or_unloaded(server, admin_key, http_client):
    """Model control mode `none`: the repository API lists models but refuses
    load and unload to everyone, so a client cannot swap the code a model runs."""
    for action in ("unload", "load"):
        status, body = http_call(server, "POST", f"/v2/repository/models/deepfm/{action}", {"admin-key": admin_key})
        assert status >= 400 and "not allowed" in body, body
    assert http_client.is_model_ready("deepfm")


@pytest.mark.server
def test_the_client_uses_the_key_from_the_environment(server, monkeypatch):
    """With OPARA_ADMIN_KEY (set by the session fixture) the client lists shared
    memory; without it the server refuses, and the client says so at once
    instead of retrying as if the server were down."""
    for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
        with Client(url, protocol) as client:
            assert isinstance(client.shm_regions(), list)
    monkeypatch.delenv(ADMIN_KEY_ENV)
    for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
        with Client(url, protocol) as client:
            with pytest.raises(ClientError) as refused:
                client.shm_regions()
            assert refused.value.kind == REJECTED and ADMIN_KEY_ENV in str(refused.value)


# --- request sizes ------------------------------------------------------------------------

BIG = 64 << 20  # bytes: three times the largest valid googlenet request (32 images)


@pytest.mark.server
def test_an_oversized_http_request_is_refused_and_the_server_carries_on(server, http_client):
    """Triton 2.51 has no HTTP body limit below 2 GiB; the HTTP guard refuses a
    body larger than the model can use (max_batch_size rows of its inputs,
    plus 1 MiB of header) before reading it."""
    header = json.dumps(
        {"inputs": [{"name": "image", "shape": [1, 3, 224, 224], "datatype": "FP32", "parameters": {"binary_data_size": BIG}}]}
    ).encode()
    status, body = http_call(
        server, "POST", "/v2/models/googlenet/infer", {"Inference-Header-Content-Length": str(len(header))}, header + bytes(BIG)
    )
    assert status == 413 and "larger than the" in body, body
    assert http_client.is_server_live() and http_client.is_model_ready("googlenet")


@pytest.mark.server
def test_an_oversized_grpc_request_is_refused_and_the_server_carries_on(server, grpc_client):
    """gRPC messages are capped at 2 GiB by Triton; below that the model's own
    shapes bound a request."""
    channel = grpc.insecure_channel(server.grpc_url, options=[("grpc.max_send_message_length", -1)])
    try:
        request = service_pb2.ModelInferRequest(model_name="googlenet")
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = "image", "FP32"
        tensor.shape.extend([32, 3, 224, 224])
        request.raw_input_contents.append(bytes(BIG))
        with pytest.raises(grpc.RpcError) as refused:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=120)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "byte size" in refused.value.details()
    finally:
        channel.close()
    assert grpc_client.is_server_live() and grpc_client.is_model_ready("googlenet")


# --- the README ---------------------------------------------------------------------------


def readme_security() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    assert "\n## Security\n" in text, "README.md has no Security section"
    return text.split("\n## Security\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_security_section_matches_the_defaults():
    section = readme_security()
    command = " ".join(server_command(ServerConfig(admin_key="k" * 16), Path("/b")))
    assert "127.0.0.1" in section and "--http-address=127.0.0.1" in command
    assert "`none`" in section and "--model-control-mode=none" in command
    assert ADMIN_KEY_ENV in section
    for api in RESTRICTED_APIS:
        assert f"`{api}`" in section, api
    assert "weights_only=True" in section
    assert "2 GiB" in section, "the request size limits are documented"
