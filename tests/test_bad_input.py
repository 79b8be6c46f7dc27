"""Bad input against the real server, over both protocols, at the wire level.

Requests are built by hand (raw HTTP bodies, gRPC protobufs) because
tritonclient refuses most of them before they leave the client. Triton's core
rejects wrong datatypes, shapes and batch sizes against the config before
model.py runs; model.py rejects what only the model knows (ids out of range,
shapes that slip past the core). Either way the answer is a clear error with no
Python traceback, and the server and every model stay ready.
"""

from __future__ import annotations

import http.client
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from serving import assert_served, eager, example, infer, served_tolerance
from tritonclient.grpc import service_pb2, service_pb2_grpc

from opara_core import zoo

pytestmark = pytest.mark.server

IMAGE = ("image", (3, 224, 224), "FP32")
ROW = 3 * 224 * 224 * 4  # bytes of one googlenet image


@dataclass(frozen=True)
class Tensor:
    """One input as declared on the wire, with the bytes actually sent."""

    name: str
    shape: tuple[int, ...]
    datatype: str
    data: bytes


@dataclass(frozen=True)
class Case:
    """One bad request and what its error must say (lower case substrings)."""

    model: str
    inputs: tuple[Tensor, ...]
    says: tuple[str, ...]
    http_status: int = 400
    grpc_code: str = "INVALID_ARGUMENT"
    version: str = ""
    extra: dict = field(default_factory=dict)


def image(rows: int, shape=None, datatype="FP32", data: bytes | None = None) -> Tensor:
    shape = (rows, 3, 224, 224) if shape is None else shape
    return Tensor("image", tuple(shape), datatype, bytes(rows * ROW) if data is None else data)


def deepfm_inputs(rows: int = 1) -> dict[str, Tensor]:
    dense, sparse = example("deepfm", rows, seed=5)
    return {
        "dense": Tensor("dense", dense.shape, "FP32", dense.tobytes()),
        "sparse": Tensor("sparse", sparse.shape, "INT64", sparse.tobytes()),
    }


def _out_of_range_id() -> Tensor:
    sparse = example("deepfm", 1, seed=6)[1].copy()
    sparse[0, 8] = 3  # field 8 has a vocabulary of 3
    return Tensor("sparse", sparse.shape, "INT64", sparse.tobytes())


CASES = {
    "wrong datatype": Case("googlenet", (image(1, datatype="FP64", data=bytes(2 * ROW)),), ("image", "data-type", "fp64")),
    "wrong integer datatype": Case("deepfm", (deepfm_inputs()["dense"], Tensor("sparse", (1, 26), "INT32", bytes(104))), ("sparse", "int32")),
    "wrong shape": Case("googlenet", (image(1, shape=(1, 3, 224, 225), data=bytes(ROW + 3 * 224 * 4)),), ("image", "shape")),
    "wrong rank": Case("googlenet", (image(1, shape=(3, 224, 224)),), ("image", "shape")),
    "missing input": Case("deepfm", (deepfm_inputs()["dense"],), ("sparse", "missing")),
    "unknown input": Case("googlenet", (image(1), Tensor("mask", (1, 4), "FP32", bytes(16))), ("mask",)),
    "batch above max_batch_size": Case("googlenet", (image(33),), ("batch-size", "32")),
    "empty batch": Case("googlenet", (image(0),), ("image",)),
    "truncated tensor data": Case("googlenet", (image(1, data=bytes(1000)),), ("image", "1000")),
    "extra tensor data": Case("googlenet", (image(1, data=bytes(ROW + 8)),), ("image",)),
    "absurd shape": Case("googlenet", (image(1, shape=(1, 3, 224, 2**40), data=bytes(ROW)),), ("image", "shape")),
    "absurd batch, 64-bit": Case("googlenet", (image(1, shape=(2**62, 3, 224, 224), data=bytes(ROW)),), ("image",)),
    "absurd batch, 32-bit": Case("googlenet", (image(1, shape=(2**32, 3, 224, 224), data=bytes(ROW)),), ("image",)),
    "absurd batch with no data": Case("googlenet", (image(1, shape=(2**40, 3, 224, 224), data=b""),), ("image",)),
    "out-of-range id": Case("deepfm", (deepfm_inputs()["dense"], _out_of_range_id()), ("sparse", "position 8")),
    "unknown model": Case("no_such_model", (image(1),), ("unknown model", "no_such_model"), 404, "NOT_FOUND"),
    "unknown version": Case("googlenet", (image(1),), ("googlenet", "version 7"), 404, "NOT_FOUND", version="7"),
}


# --- the two wires ----------------------------------------------------------------------


def http_post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, str]:
    host, port = server.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        connection.request("POST", path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def http_infer(server, case: Case) -> tuple[int, str]:
    """The binary tensor extension: a JSON header, then each input's bytes."""
    header = json.dumps(
        {
            "inputs": [
                {"name": t.name, "shape": list(t.shape), "datatype": t.datatype, "parameters": {"binary_data_size": len(t.data)}}
                for t in case.inputs
            ],
            **case.extra,
        }
    ).encode()
    version = f"/versions/{case.version}" if case.version else ""
    return http_post(
        server,
        f"/v2/models/{case.model}{version}/infer",
        header + b"".join(t.data for t in case.inputs),
        {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )


@pytest.fixture(scope="module")
def grpc_stub(server):
    channel = grpc.insecure_channel(
        server.grpc_url, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    )
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel), channel
    channel.close()


def grpc_request(case: Case) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=case.model, model_version=case.version)
    for t in case.inputs:
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = t.name, t.datatype
        tensor.shape.extend(t.shape)
        request.raw_input_contents.append(t.data)
    return request


def grpc_infer(grpc_stub, request) -> tuple[str, str]:
    """(status code name, message); "OK" and the output names on success."""
    stub, _ = grpc_stub
    try:
        response = stub.ModelInfer(request, timeout=120)
        return "OK", ",".join(o.name for o in response.outputs)
    except grpc.RpcError as error:
        return error.code().name, error.details() or ""


def assert_no_traceback(message: str) -> None:
    """Neither a Python traceback nor the Python backend's `At: file.py(line)` trace."""
    assert "Traceback" not in message and not re.search(r'\.py\(\d+\)|\.py", line', message), message


# --- one bad request at a time ------------------------------------------------------------


def _ready(server, model: str) -> bool:
    host, port = server.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", f"/v2/models/{model}/ready")
        return connection.getresponse().status == 200
    finally:
        connection.close()


@pytest.mark.parametrize("name", CASES)
def test_a_bad_request_over_http_gets_a_clear_client_error(server, name):
    case = CASES[name]
    status, body = http_infer(server, case)
    message = json.loads(body)["error"].lower()
    assert status == case.http_status, body
    assert all(word in message for word in case.says), body
    assert_no_traceback(body)
    if case.model in zoo.names():
        assert _ready(server, case.model)


@pytest.mark.parametrize("name", CASES)
def test_a_bad_request_over_grpc_gets_a_clear_client_error(server, grpc_stub, name):
    case = CASES[name]
    code, message = grpc_infer(grpc_stub, grpc_request(case))
    assert code == case.grpc_code, message
    assert all(word in message.lower() for word in case.says), message
    assert_no_traceback(message)
    if case.model in zoo.names():
        assert _ready(server, case.model)


# --- malformed messages --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "headers", "says"),
    [
        (b'{"inputs": [', {}, "parse"),
        (b"\x00\x01 not json", {}, "parse"),
        (b"[1, 2, 3]", {}, "inputs"),
        (b'{"inputs": [{"name": "image", "shape": [-1, 3, 224, 224], "datatype": "FP32", "data": []}]}', {}, "shape"),
        (b'{"inputs": [{"name": "image", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": [1, 2]}]}', {}, "data"),
        (b'{"inputs": [{"name": "image", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": [NaN]}]}', {}, "data"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "100000"}, "header size"),
    ],
    ids=["truncated JSON", "not JSON", "JSON not an object", "negative dimension", "too few values", "NaN literal", "header longer than body"],
)
def test_malformed_http_bodies_get_a_clear_error(server, body, headers, says):
    """Triton's HTTP front end parses the body before any model sees it and
    answers a JSON it cannot parse with 500 (its choice, not the project's);
    what matters here is a message that names the problem and a server that
    carries on."""
    status, text = http_post(server, "/v2/models/googlenet/infer", body, headers)
    assert 400 <= status < 600 and says in json.loads(text)["error"].lower(), text
    assert_no_traceback(text)
    assert _ready(server, "googlenet")


def test_a_grpc_message_that_is_not_a_protobuf_is_refused(server, grpc_stub):
    _, channel = grpc_stub
    raw = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    with pytest.raises(grpc.RpcError) as refused:
        raw(b"\xff\xff\xff\xff\x0f garbage", timeout=30)
    assert refused.value.code() == grpc.StatusCode.INTERNAL and "parse" in refused.value.details().lower()
    assert _ready(server, "googlenet")


def test_a_batch_dimension_beyond_32_bits_never_reads_past_the_data_sent(server, grpc_stub):
    """Triton 2.51 keeps the batch dimension in 32 bits: a request that declares
    2**32 + 1 rows is taken as one row. The sizes are checked against the data
    actually sent, so the answer is for that one row (or an error), never a read
    beyond the message."""
    x = example("googlenet", 1, seed=8)[0]
    case = Case("googlenet", (image(1, shape=(2**32 + 1, 3, 224, 224), data=x.tobytes()),), ())
    status, body = http_infer(server, case)
    if status == 200:
        output = json.loads(body)["outputs"][0]
        assert output["shape"] == [1, 1000]
        assert_served(np.asarray(output["data"], np.float32).reshape(1, 1000), "googlenet", [x])
    else:
        assert 400 <= status < 500 and "image" in body
    code, _ = grpc_infer(grpc_stub, grpc_request(case))
    assert code in ("OK", "INVALID_ARGUMENT")


# --- NaN and infinity: served as given --------------------------------------------------------


def assert_same_with_nan(actual: np.ndarray, model: str, arrays: list[np.ndarray]) -> None:
    """assert_served where NaN and ±Inf must sit at the same places."""
    expected, tolerance = eager(model, arrays), served_tolerance(model)
    finite = expected[np.isfinite(expected)]
    scale = max(float(np.abs(finite).max()) if finite.size else 0.0, 1e-12)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance * scale, equal_nan=True)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_nan_and_inf_are_served_as_the_model_computes_them(http_client, grpc_client, protocol):
    """NaN and ±Inf are valid FP32 values: they are not rejected, the model runs
    on them and the answer is what it computes (the eager oracle's, NaN for
    NaN). Rows are independent, so the finite rows keep their own answers."""
    client = http_client if protocol == "http" else grpc_client
    x = example("googlenet", 3, seed=9)[0].copy()
    x[0, 0, 0, 0], x[1, 2, 5, 5] = np.nan, np.inf
    logits = infer(client, "googlenet", [x])
    assert np.isnan(logits[0]).all() and not np.isfinite(logits[1]).all()
    assert_same_with_nan(logits, "googlenet", [x])
    assert_served(logits[2:], "googlenet", [x[2:]])
    dense, sparse = example("deepfm", 3, seed=9)
    dense = dense.copy()
    dense[0, 3], dense[1, 0] = np.nan, -np.inf
    probability = infer(client, "deepfm", [dense, sparse])
    assert np.isnan(probability[0]).all()
    assert_same_with_nan(probability, "deepfm", [dense, sparse])
    assert_served(probability[2:], "deepfm", [dense[2:], sparse[2:]])
    assert client.is_model_ready("googlenet") and client.is_model_ready("deepfm")


# --- everything at once ----------------------------------------------------------------------


def test_good_requests_sent_among_bad_ones_all_succeed(server, grpc_stub, http_client, grpc_client):
    """Every bad request above on both protocols, interleaved with good ones:
    the good ones get their eager answers, and afterwards the server and all
    models are live and ready."""
    goods = [("googlenet", example("googlenet", 1, seed=40 + i)) for i in range(4)]
    goods += [("deepfm", example("deepfm", 1 + i % 3, seed=50 + i)) for i in range(8)]

    def good(item):
        model, arrays = item
        return infer(grpc_client, model, arrays)

    def bad(case: Case):
        status, _ = http_infer(server, case)
        code, _ = grpc_infer(grpc_stub, grpc_request(case))
        return status, code

    with ThreadPoolExecutor(8) as pool:
        good_futures = [pool.submit(good, item) for item in goods]
        bad_futures = [pool.submit(bad, case) for case in CASES.values()]
        answers = [f.result() for f in good_futures]
        outcomes = [f.result() for f in bad_futures]
    for (model, arrays), answer in zip(goods, answers):
        assert_served(answer, model, arrays)
    assert all(status >= 400 and code != "OK" for status, code in outcomes)
    assert http_client.is_server_live() and http_client.is_server_ready() and grpc_client.is_server_ready()
    for model in zoo.names():
        assert http_client.is_model_ready(model) and grpc_client.is_model_ready(model), model
    assert server.returncode is None
