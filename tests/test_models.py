"""Every model of the repository, served by the real server, against the eager oracle."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serving import assert_close, assert_served, eager, example, infer, served_tolerance
from test_launcher import readme_models
from tritonclient.utils import InferenceServerException

from opara_core import zoo
from opara_core.serving.launcher import DEFAULT_MODEL_REPOSITORY, REPO_ROOT, find_server, free_ports, stub_processes

pytestmark = pytest.mark.server

MODELS = zoo.names()


def test_the_repository_readme_and_zoo_list_the_same_models():
    served = sorted(p.name for p in DEFAULT_MODEL_REPOSITORY.iterdir() if (p / "config.pbtxt").exists())
    assert served == sorted(zoo.names(None)) == sorted(readme_models())


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
    assert_close(infer(http_client, model, arrays), expected, served_tolerance(model))
    assert_close(infer(grpc_client, model, arrays), expected, served_tolerance(model))


@pytest.mark.parametrize("model", MODELS)
def test_a_batch_equals_its_rows_sent_alone(http_client, grpc_client, model):
    arrays = example(model, batch=3, seed=22)
    batched = infer(grpc_client, model, arrays)
    singles = np.concatenate([infer(http_client, model, [a[i : i + 1] for a in arrays]) for i in range(3)])
    assert_close(batched, singles, served_tolerance(model))


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
        assert_served(result, model, arrays)
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
            assert_served(result, model, arrays)



def test_custom_metrics_count_batches_next_to_tritons_own(server, http_client):
    """opara_batches_total sits on the metrics port with Triton's metrics. Counts
    are pushed at most every half second, by execute or by the model's timer: a
    scrape soon after a burst sees all of it with no later request (before the
    timer, the burst's tail waited for the next request)."""
    import time
    import urllib.request

    def scrape() -> tuple[str, float, float]:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = response.read().decode()
        success = re.search(r'^nv_inference_request_success\{model="resnet50",version="1"\} (\S+)$', text, re.M)
        requests = re.search(r'^opara_requests_total\{model="resnet50"\} (\S+)$', text, re.M)
        return text, float(success.group(1)) if success else 0.0, float(requests.group(1)) if requests else 0.0

    for seed in range(3):
        infer(http_client, "resnet50", example("resnet50", 1, seed=seed))
    deadline = time.monotonic() + 10
    text, success, requests = scrape()
    while requests < success and time.monotonic() < deadline:
        time.sleep(0.1)  # polling for the pushed counts
        text, success, requests = scrape()
    assert success >= 3 and requests >= success, (success, requests)
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("opara_batches_total{") and 'model="resnet50"' in line
    ]
    assert counts and sum(counts) >= 3, [line for line in text.splitlines() if "opara" in line]
    assert "opara_padded_rows_total" in text
    seconds = dict(re.findall(r'^opara_execute_seconds_total\{model="resnet50",stage="(\w+)"\} (\S+)$', text, re.M))
    assert set(seconds) == {"validate", "stage", "run", "respond"}
    assert float(seconds["run"]) > 0 and float(seconds["run"]) > float(seconds["validate"])


# --- the stub's numpy ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def numpy2_python(tmp_path_factory) -> Path:
    """A Python whose numpy is 2: this one where it already is (the GPU machine),
    else a venv with numpy 2, then this venv's packages (torch, the Triton
    wheel, ...) behind it. A server launched with it gets stubs that adopt it:
    the r24.10 stub's embedded interpreter takes its environment from PATH and
    ignores PYTHONPATH, so that is how a machine whose Python has numpy 2 runs
    the models. Where neither can be had (numpy 1 here and no package index to
    install numpy 2 from), the test skips and says why."""
    if int(np.__version__.split(".")[0]) >= 2:
        return Path(sys.executable)
    venv = tmp_path_factory.mktemp("numpy2") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "numpy>=2,<3"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if install.returncode != 0:
        last = (install.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"this Python has numpy {np.__version__} and numpy 2 could not be installed: {last}")
    site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    Path(site, "zz_project_venv.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return python


def numpy_directory(python: Path) -> str:
    """Where `python` imports numpy from."""
    return subprocess.check_output([python, "-c", "import os, numpy; print(os.path.realpath(os.path.dirname(numpy.__file__)))"], text=True).strip()


def stub_numpy_paths(server_pid: int) -> set[str]:
    """Where the numpy extension loaded by each Python stub of a server lives."""
    return {
        line.split()[-1]
        for pid in stub_processes(server_pid).values()
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if "_multiarray_umath" in line
    }


def test_a_stub_with_numpy_2_answers_in_full(numpy2_python, tmp_path):
    """With numpy 2 in the stub, Triton 24.10's numpy bridge sends outputs of the
    right shape and zero bytes (found on the GPU machine); the adapter's DLPack
    path must give full, correct answers over both protocols."""
    shutil.copytree(DEFAULT_MODEL_REPOSITORY / "deepfm", tmp_path / "models" / "deepfm")
    ports = dict(zip(("HTTP_PORT", "GRPC_PORT", "METRICS_PORT"), free_ports(3)))
    env = {**os.environ, **{k: str(v) for k, v in ports.items()}}
    with open(tmp_path / "server.log", "w") as log:
        launcher = subprocess.Popen(
            [numpy2_python, "-m", "opara_core.serving.launcher", "serve", "--model-repository", tmp_path / "models", "--workdir", tmp_path / "work"],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP_PORT']}")
        deadline = time.monotonic() + 300
        while not _ready(http):
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(1)
        loaded = stub_numpy_paths(find_server(ports["HTTP_PORT"]))
        assert loaded and all(path.startswith(numpy_directory(numpy2_python) + os.sep) for path in loaded), loaded
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['GRPC_PORT']}")
        arrays = example("deepfm", batch=3, seed=51)
        for client in (http, grpc):
            assert_served(infer(client, "deepfm", arrays), "deepfm", arrays)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(60)


def _ready(client) -> bool:
    try:
        return client.is_server_ready()
    except Exception:  # noqa: BLE001 - not listening yet
        return False
