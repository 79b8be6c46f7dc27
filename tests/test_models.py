"""Every model of the repository, served by the real server, against the eager oracle."""

from __future__ import annotations

import re

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serving import assert_close, eager, example, infer
from test_server import readme_models
from tritonclient.utils import InferenceServerException

from opara_core import zoo
from opara_core.server import DEFAULT_MODEL_REPOSITORY

pytestmark = pytest.mark.server

MODELS = zoo.names()


def test_the_repository_readme_and_zoo_list_the_same_models():
    served = sorted(p.name for p in DEFAULT_MODEL_REPOSITORY.iterdir() if (p / "config.pbtxt").exists())
    assert served == sorted(MODELS) == sorted(readme_models())


@pytest.mark.parametrize("model", MODELS)
def test_metadata_matches_the_readme(http_client, model):
    documented = readme_models()[model]
    metadata = http_client.get_model_metadata(model)
    for kind in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"], t["shape"][1:]) for t in metadata[kind]] == documented[kind]


@pytest.mark.parametrize("model", MODELS)
def test_both_protocols_answer_with_the_eager_output(http_client, grpc_client, model):
    arrays = example(model, batch=1, seed=21)
    expected = eager(model, arrays)
    assert_close(infer(http_client, model, arrays), expected)
    assert_close(infer(grpc_client, model, arrays), expected)


@pytest.mark.parametrize("model", MODELS)
def test_a_batch_equals_its_rows_sent_alone(http_client, grpc_client, model):
    arrays = example(model, batch=3, seed=22)
    batched = infer(grpc_client, model, arrays)
    singles = np.concatenate([infer(http_client, model, [a[i : i + 1] for a in arrays]) for i in range(3)])
    assert_close(batched, singles)


def infer_or_error(client, model: str, arrays: list[np.ndarray]):
    """The output, or the error the server answered with."""
    try:
        return infer(client, model, arrays)
    except InferenceServerException as error:
        return error


def _with_bad_id(model: str, position: int, value: int, seed: int) -> list[np.ndarray]:
    """Valid inputs except one id in the first integer input."""
    arrays = example(model, batch=1, seed=seed)
    index = next(i for i, spec in enumerate(zoo.get(model).inputs) if not spec.dtype.is_floating_point)
    arrays[index] = arrays[index].copy()
    arrays[index][0, position] = value
    return arrays


@pytest.mark.parametrize(
    ("model", "position", "value", "problem"),
    [
        ("deepfm", 8, 3, "position 8"),  # field 8 has a vocabulary of 3
        ("deepfm", 0, -1, "position 0"),
        ("bert", 5, 30522, "position 5"),
        ("t5", 0, 10**9, "position 0"),
    ],
)
def test_out_of_range_ids_are_rejected_per_request_while_others_succeed(grpc_client, server, model, position, value, problem):
    """Bad and good requests in flight together: the bad ones get INVALID_ARGUMENT
    naming the input and the position, the good ones their answers, and the
    model stays ready (a bad id inside a CUDA graph would kill the instance)."""
    bad = _with_bad_id(model, position, value, seed=23)
    goods = [example(model, batch=1, seed=30 + i) for i in range(4)]

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda a: infer_or_error(grpc_client, model, a), [goods[0], bad, goods[1], bad, goods[2], goods[3]]))
    errors = [results[1], results[3]]
    for error in errors:
        assert isinstance(error, InferenceServerException)
        assert error.status() == "StatusCode.INVALID_ARGUMENT"
        name = zoo.get(model).inputs[[s.dtype.is_floating_point for s in zoo.get(model).inputs].index(False)].name
        assert name in error.message() and problem in error.message() and "Traceback" not in error.message()
    for arrays, result in zip(goods, [results[0], results[2], results[4], results[5]]):
        assert_close(result, eager(model, arrays))
    assert grpc_client.is_model_ready(model)
    assert server.returncode is None


def test_an_error_for_one_request_in_a_batch_leaves_the_batch_intact(grpc_client):
    """Two requests in one gRPC call cannot be sent, so this drives the batcher:
    many concurrent requests, every third one bad, all answered correctly."""
    model = "deepfm"
    requests = [_with_bad_id(model, 3, 100000, seed=40 + i) if i % 3 == 0 else example(model, 1, seed=40 + i) for i in range(24)]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda a: infer_or_error(grpc_client, model, a), requests))
    for i, (arrays, result) in enumerate(zip(requests, results)):
        if i % 3 == 0:
            assert isinstance(result, InferenceServerException) and "position 3" in result.message()
        else:
            assert_close(result, eager(model, arrays))



def test_custom_metrics_count_batches_next_to_tritons_own(server, http_client):
    """opara_batches_total sits on the metrics port with Triton's metrics; counts
    are pushed at most every half second, so a later request flushes them."""
    import time
    import urllib.request

    for seed in range(3):
        infer(http_client, "resnet50", example("resnet50", 1, seed=seed))
    time.sleep(0.6)
    infer(http_client, "resnet50", example("resnet50", 1, seed=9))
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    assert "nv_inference_request_success" in text
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("opara_batches_total{") and 'model="resnet50"' in line
    ]
    assert counts and sum(counts) >= 4, [line for line in text.splitlines() if "opara" in line]
    assert "opara_padded_rows_total" in text
    seconds = dict(re.findall(r'^opara_execute_seconds_total\{model="resnet50",stage="(\w+)"\} (\S+)$', text, re.M))
    assert set(seconds) == {"validate", "stage", "run", "respond"}
    assert float(seconds["run"]) > 0 and float(seconds["run"]) > float(seconds["validate"])
    requests = re.search(r'^opara_requests_total\{model="resnet50"\} (\S+)$', text, re.M)
    assert requests and float(requests.group(1)) >= 4
