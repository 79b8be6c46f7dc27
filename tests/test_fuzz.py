"""No single request takes the server down: a short seeded fuzz run over HTTP and
gRPC (scripts/fuzz.py), and one named regression test per crash class the
longer runs found (docs/reliability.md, "Requests that crashed Triton"): JSON
data shorter than its declared shape (plain and chunked) and deeply nested JSON
(to infer and to the other endpoints that read JSON).

Each regression test sends the request that killed tritonserver 2.51 when it
listened on the public HTTP port itself, then checks that the server is live
and a good request still gets its answer on both protocols. They run on a
deepfm-only server of their own, so a crash here never takes the session's
server with it.
"""

from __future__ import annotations

import json

import pytest
from conftest import load_script, server_config
from test_faults import make_repository

from opara_core.serving.launcher import TritonServer

pytestmark = pytest.mark.server


def _load_fuzz():
    """scripts/fuzz.py as a module (scripts/ is not a package)."""
    return load_script("fuzz")


fuzz = _load_fuzz()


@pytest.fixture(scope="module")
def target(tmp_path_factory, admin_key):
    root = tmp_path_factory.mktemp("fuzz")
    repository = make_repository(root / "models", {"deepfm": "deepfm"})
    with TritonServer(server_config(repository, exit_timeout_s=5), root / "server.log") as server:
        model = fuzz.Model.from_config(fuzz.model_config(server.config.http_port, "deepfm"))
        fuzzer = fuzz.Fuzzer(server.config.http_port, server.config.grpc_port, model)
        assert fuzzer.healthy() is None
        yield server, fuzzer
        fuzzer.close()


def survives(target, case) -> str:
    """Send `case`; the server must be live and answer good requests correctly afterwards."""
    server, fuzzer = target
    outcome = fuzzer.send(case)
    problem = fuzzer.healthy()
    assert problem is None and server.returncode is None, (
        f"{case.cls} ({case.what}) -> {outcome}; then: {problem}; tritonserver: {server.returncode}\n{server.log_tail(15)}"
    )
    return outcome


def _json(inputs: list[dict], path: str = "/v2/models/deepfm/infer", how: str = "plain") -> tuple:
    return ("POST", path, [("Content-Type", "application/json")], json.dumps({"inputs": inputs}).encode(), how)


def _deepfm(dense_shape: list[int], dense_data: list, sparse_shape=(1, 26)) -> list[dict]:
    return [
        {"name": "dense", "shape": dense_shape, "datatype": "FP32", "data": dense_data},
        {"name": "sparse", "shape": list(sparse_shape), "datatype": "INT64", "data": [0] * 26},
    ]


# --- one test per crash class ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [[1, 13, 2**40], [33, 2**32 + 1], [2**40, 13]])
def test_json_data_shorter_than_its_declared_shape(target, shape):
    """Triton allocates the declared shape before it counts the JSON values:
    a few values declaring 2^40 elements ended it with std::bad_alloc (SIGABRT)."""
    outcome = survives(target, fuzz.Case("json shape", f"shape {shape}", http=_json(_deepfm(shape, [0.5] * 13))))
    assert outcome == "400"


def test_json_data_shorter_than_its_declared_shape_in_a_chunked_body(target):
    case = fuzz.Case("chunked", "huge shape", http=_json(_deepfm([1, 2**40], [0.5] * 13), how="chunked"))
    assert survives(target, case) == "400"


@pytest.mark.parametrize("where", ["data", "parameters"])
def test_deeply_nested_json(target, where):
    """A million nested brackets overflowed the stack of Triton's JSON parser
    (SIGSEGV); 300,000 (600 kB, below the body limit) reach the guard's parser."""
    nest = "[" * 300_000 + "0" + "]" * 300_000
    text = json.dumps({"inputs": _deepfm([1, 13], [0.5] * 13)})
    raw = text.replace("[0.5, " + ", ".join(["0.5"] * 12) + "]", nest, 1) if where == "data" else text[:-1] + f', "parameters": {{"p": {nest}}}}}'
    case = fuzz.Case("deep nesting", where, http=("POST", "/v2/models/deepfm/infer", [("Content-Type", "application/json")], raw.encode(), "plain"))
    assert survives(target, case) == "400"


def test_a_chunk_size_beyond_64_bits_is_refused_at_once(target):
    """Not a crash: Triton alone waits for the 2^80 bytes (the fuzzer's 15 s
    timeout); the guard's HTTP parser refuses the chunk size at once."""
    case = fuzz.Case("chunked", "chunk size overflow", http=_json(_deepfm([1, 13], [0.5] * 13), how="chunked-overflow"))
    assert survives(target, case) == "400"


@pytest.mark.parametrize("endpoint", ["/v2/models/deepfm/generate", "/v2/models/deepfm/generate_stream"])
def test_deeply_nested_json_to_other_endpoints(target, endpoint):
    """The same parser reads the generate extension's body (open to everyone,
    like infer): SIGSEGV."""
    raw = ("[" * 300_000 + "]" * 300_000).encode()
    case = fuzz.Case("deep nesting", endpoint, http=("POST", endpoint, [("Content-Type", "application/json")], raw, "plain"))
    assert survives(target, case) == "400"


# --- the seeded run ------------------------------------------------------------------------------


def test_a_short_seeded_fuzz_run_crashes_nothing(target):
    """A bounded run of every class on both protocols (about a minute on the
    CI machine); the long runs are `scripts/fuzz.py`."""
    _, fuzzer = target
    report = fuzz.run(fuzzer, seed=20261123, count=1500, budget_s=45)
    assert not report.crashes, report.crashes
    assert sum(report.sent.values()) >= 50 and len(report.sent) >= 8, report.sent
    assert any(status.startswith("4") for _, status in report.outcomes), report.outcomes
