"""The HTTP guard's checks, without a server: what it refuses, in which words,
and that every good request passes; its workers on one port. The guard in front of the real server is
exercised by test_fuzz.py, test_bad_input.py and test_security.py."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from opara_core.serving.http_guard import (
    HEADER_LIMIT,
    ModelLimits,
    Refusals,
    Refused,
    _check_nesting,
    _decode,
    _model_of,
    check_inference,
    guard_metrics_text,
)
from opara_core.serving.launcher import free_ports

# Triton's JSON model config, as /v2/models/deepfm/config returns it (int64 dims as strings)
DEEPFM = ModelLimits.from_config(
    {"name": "deepfm", "max_batch_size": 32, "input": [
        {"name": "dense", "data_type": "TYPE_FP32", "dims": ["13"]},
        {"name": "sparse", "data_type": "TYPE_INT64", "dims": ["26"]},
    ]}
)  # fmt: skip


def json_body(dense_shape=(1, 13), dense_data=None, **extra) -> bytes:
    rows = min(dense_shape[0], 64) if dense_shape else 1
    dense = {"name": "dense", "shape": list(dense_shape), "datatype": "FP32", "data": dense_data if dense_data is not None else [0.5] * (13 * rows)}
    sparse = {"name": "sparse", "shape": [rows, 26], "datatype": "INT64", "data": [[0] * 26] * rows}
    return json.dumps({"inputs": [dense, sparse], **extra}).encode()


def binary_body(rows=1, dense_size=None, extra=b"") -> tuple[bytes, int]:
    header = json.dumps({"inputs": [
        {"name": "dense", "shape": [rows, 13], "datatype": "FP32", "parameters": {"binary_data_size": 52 * rows if dense_size is None else dense_size}},
        {"name": "sparse", "shape": [rows, 26], "datatype": "INT64", "parameters": {"binary_data_size": 208 * rows}},
    ]}).encode()  # fmt: skip
    return header + bytes(52 * rows + 208 * rows) + extra, len(header)


def refused(body: bytes, header_length: int | None = None, limits=DEEPFM) -> str:
    with pytest.raises(Refused) as error:
        check_inference(body, header_length, limits)
    assert error.value.status == 400
    return str(error.value)


def test_good_requests_pass():
    for rows in (1, 7, 32):
        check_inference(json_body((rows, 13)), None, DEEPFM)
        check_inference(*binary_body(rows), DEEPFM)
    check_inference(json_body(outputs=[{"name": "probability", "parameters": {"binary_data": True}}]), None, DEEPFM)
    shm = json.dumps({"inputs": [{"name": "dense", "shape": [4, 13], "datatype": "FP32", "parameters": {"shared_memory_region": "r"}}]})
    check_inference(shm.encode(), None, DEEPFM)
    check_inference(json_body(), None, None)  # an unknown model: the data checks alone


@pytest.mark.parametrize("shape", [[1, 13, 2**40], [33, 4294967297], [4294967297, 13], [1, 2**31]])
def test_a_declared_shape_beyond_the_config_is_refused_before_triton_allocates_it(shape):
    assert "dense" in refused(json_body(shape, [0.5] * 13))


def test_without_a_config_the_data_must_still_match_the_shape():
    assert "needs 1099511627776 values, its data has 13" in refused(json_body([1, 2**40], [0.5] * 13), limits=None)


def test_triton_words_for_batch_and_shape():
    assert "batch-size 33 must be <= 32" in refused(json_body((33, 13)))
    assert "unexpected shape for input 'dense'" in refused(json_body((1, 14), [0.0] * 14))
    assert "negative" in refused(json_body((-1, 13)))


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"inputs": [', "failed to parse"),
        (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
        (b"[1, 2]", "'inputs'"),
        (json_body(dense_data=[0.5] * 12), "needs 13 values, its data has 12"),
        (json_body(dense_data=[[[0.5]]] * 13), None),
        (json_body(dense_data=[{"a": 1}] * 13), "object"),
        (json.dumps({"inputs": [{"name": "dense", "shape": ["1", 13], "datatype": "FP32", "data": []}]}).encode(), "list of integers"),
        (json.dumps({"inputs": [{"name": "dense", "shape": [1, 13], "datatype": "FOO", "data": []}]}).encode(), "unknown datatype"),
        (json.dumps({"inputs": [{"name": "dense", "shape": [1, 13], "datatype": "FP32"}]}).encode(), "no data"),
        (json.dumps({"inputs": [{"name": f"x{i}", "shape": [1], "datatype": "FP32", "data": [0]} for i in range(300)]}).encode(), "300 inputs"),
        (json_body(outputs=[{"name": "probability", "parameters": {"classification": 2**40}}]), "classification"),
    ],
    ids=["truncated", "deep nesting", "not an object", "short data", "nested data", "object in data", "string dim",
         "unknown datatype", "no data", "many inputs", "huge classification"],
)  # fmt: skip
def test_malformed_json_is_refused_with_a_clear_message(body, says):
    if says is None:
        check_inference(body, None, DEEPFM)  # nesting that still holds 13 values is Triton's to judge
    else:
        assert says in refused(body)


def test_binary_sizes_must_match_the_shapes_and_the_body():
    body, header_length = binary_body(dense_size=2**40)
    assert "needs 52 bytes, binary_data_size is 1099511627776" in refused(body, header_length)
    body, header_length = binary_body(extra=b"\0" * 8)
    assert "the body carries 268" in refused(body, header_length)
    body, header_length = binary_body()
    assert "header size" in refused(body, len(body) + 1)
    assert "header size" in refused(body, 0)


def test_the_body_limits_follow_the_config():
    assert DEEPFM.body_limit(binary=True) == HEADER_LIMIT + 32 * (13 * 4 + 26 * 8)
    assert DEEPFM.body_limit(binary=False) > DEEPFM.body_limit(binary=True)


def test_a_compressed_body_is_inflated_only_up_to_the_limit():
    assert _decode(gzip.compress(b"x" * 1000), "gzip", 1000) == b"x" * 1000
    with pytest.raises(Refused) as bomb:
        _decode(gzip.compress(b"0" * (1 << 22)), "gzip", 1 << 20)
    assert bomb.value.status == 413
    with pytest.raises(Refused, match="cannot be decoded"):
        _decode(b"not gzip", "gzip", 1000)
    with pytest.raises(Refused, match="unsupported"):
        _decode(b"", "br", 1000)


def test_inference_paths():
    assert _model_of("/v2/models/deepfm/infer") == ("deepfm", "infer")
    assert _model_of("/v2/models/deepfm/versions/1/infer") == ("deepfm", "infer")
    assert _model_of("/v2/models/deepfm/ready") == ("deepfm", "ready")
    assert _model_of("/v2/health/ready") is None


def test_metrics_report_refusals_and_the_launchers_restarts(tmp_path):
    from opara_core.serving.http_guard import GuardState

    state = GuardState("127.0.0.1:1", tmp_path / "status.json")
    state.refused.add("invalid")
    state.refused.add("invalid")
    (tmp_path / "status.json").write_text(json.dumps({"restarts": {"server exited": 3}}))
    text = guard_metrics_text(state)
    assert 'opara_guard_refused_total{reason="invalid"} 2' in text
    assert 'opara_server_restarts_total{reason="server exited"} 3' in text


def test_every_json_body_is_refused_when_nested_too_deeply():
    """generate, the repository and settings APIs: Triton's parser overflows
    its stack on deep nesting wherever it reads JSON."""
    with pytest.raises(Refused, match="nested too deeply"):
        _check_nesting(b"[" * 300_000 + b"]" * 300_000)
    _check_nesting(b'{"text_input": "hello", "parameters": {"a": [1, [2]]}}')
    _check_nesting(b"not json: Triton's to refuse")


def test_refusals_counted_in_one_worker_are_seen_by_the_others():
    refused = Refusals()
    child = os.fork()
    if child == 0:  # a worker forked from the guard's first process, as `main` forks them
        refused.add("json")
        refused.add("size")
        os._exit(0)
    os.waitpid(child, 0)
    refused.add("json")
    assert refused.items() == [("json", 2), ("size", 1)]
    with pytest.raises(ValueError, match="unknown refusal reason"):
        Refused("no", reason="teapot")


class Guard:
    """The guard as the launcher starts it, here with no server behind it: what it
    refuses itself (JSON nested too deeply) never needs one."""

    def __init__(self, workers: int):
        self.port, upstream = free_ports(2)
        command = [sys.executable, "-m", "opara_core.serving.http_guard", f"--listen=127.0.0.1:{self.port}",
                   f"--upstream=127.0.0.1:{upstream}", f"--workers={workers}"]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.forked = []
        deadline = time.monotonic() + 30
        while len(self.forked) < workers - 1 or not self._answers():
            assert self.process.poll() is None and time.monotonic() < deadline, "the guard did not start"
            self.forked = psutil.Process(self.process.pid).children()
            time.sleep(0.05)

    def _answers(self) -> bool:
        with contextlib.suppress(OSError):
            return self.request("GET", "/metrics")[0] == 200
        return False

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)  # a new connection each time
        try:
            connection.request(method, path, body=body)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


@pytest.fixture
def guard():
    started = Guard(workers=3)
    yield started
    started.process.kill()
    for process in started.forked:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    started.process.wait(10)


def test_the_workers_share_one_port_and_report_the_same_refusal_totals(guard):
    assert len(guard.forked) == 2
    deep = b"[" * 300_000 + b"]" * 300_000
    for _ in range(30):  # 30 connections spread over 3 workers by SO_REUSEPORT
        status, body = guard.request("POST", "/v2/repository/index", deep)
        assert status == 400 and b"nested too deeply" in body
    for _ in range(10):  # whichever worker answers, it reports the guard's total
        status, body = guard.request("GET", "/metrics")
        assert status == 200 and 'opara_guard_refused_total{reason="json"} 30' in body.decode()


def test_sigterm_stops_every_worker_and_the_guard_exits_0(guard):
    guard.process.send_signal(signal.SIGTERM)
    assert guard.process.wait(30) == 0
    gone, alive = psutil.wait_procs(guard.forked, timeout=10)
    assert not alive


def test_a_worker_that_dies_stops_the_guard_with_exit_code_1(guard):
    """The launcher restarts a guard that exits, not one missing a worker."""
    first, second = guard.forked
    first.kill()
    assert guard.process.wait(30) == 1
    gone, alive = psutil.wait_procs([second], timeout=10)
    assert not alive
