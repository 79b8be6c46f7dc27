"""The HTTP guard's checks, without a server: what it refuses, in which words,
and that every good request passes. The guard in front of the real server is
exercised by test_fuzz.py, test_bad_input.py and test_security.py."""

from __future__ import annotations

import gzip
import json

import pytest

from opara_core.serving.http_guard import (
    HEADER_LIMIT,
    ModelLimits,
    Refused,
    _check_nesting,
    _decode,
    _model_of,
    check_inference,
    metrics_text,
)

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
    state.refused["invalid"] += 2
    (tmp_path / "status.json").write_text(json.dumps({"restarts": {"server exited": 3}}))
    text = metrics_text(state)
    assert 'opara_guard_refused_total{reason="invalid"} 2' in text
    assert 'opara_server_restarts_total{reason="server exited"} 3' in text


def test_every_json_body_is_refused_when_nested_too_deeply():
    """generate, the repository and settings APIs: Triton's parser overflows
    its stack on deep nesting wherever it reads JSON."""
    with pytest.raises(Refused, match="nested too deeply"):
        _check_nesting(b"[" * 300_000 + b"]" * 300_000)
    _check_nesting(b'{"text_input": "hello", "parameters": {"a": [1, [2]]}}')
    _check_nesting(b"not json: Triton's to refuse")
