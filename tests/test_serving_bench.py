"""scripts/serving_bench.py's repository and table, and the floor model and the
hand-written peer it serves beside every model (opara_core.serving.floor and
.peer), against the real server."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from conftest import load_script, server_config
from serving import assert_served, eager, example
from test_triton_backend import config_of

from client.api import Client, ClientError, result_arrays
from opara_core import zoo
from opara_core.engine.build import BuildReport, Candidate
from opara_core.parameters import BATCH, parse, strings
from opara_core.parameters import get as get_parameter
from opara_core.serving import model_config
from opara_core.serving.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer
from opara_core.serving.startup import ready_line


def _load_bench():
    """scripts/serving_bench.py as a module (scripts/ is not a package)."""
    return load_script("serving_bench")


serving_bench = _load_bench()
FLOORED = ("googlenet", "deepfm")
VARLEN_FLOORED = ("bert", "t5")
PEERED = ("deepfm", "t5")  # a fixed-shape peer (ids checked by its embedding) and a variable-length one
IO_FLOORED = ("deepfm", "bert")  # two inputs of two dtypes; a variable-length input and output


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    return serving_bench.make_repository(
        list(FLOORED), tmp_path_factory.mktemp("bench"), instances=2, batching="greedy", queue_delay_us=500,
        parameters={"FORCE_CPU_ONLY_INPUT_TENSORS": "yes", "torch_threads": "0"}, io_floors=True,
    )  # fmt: skip


def without_name(path) -> object:
    config = model_config.read(path)
    config.ClearField("name")
    return config


@pytest.mark.parametrize("model", FLOORED)
def test_each_model_gets_a_floor_with_its_own_config(repository, model):
    """Same inputs, outputs, instance group, batching and parameters (GPU inputs
    included): only the name and the model.py differ."""
    config = repository / model / "config.pbtxt"
    floor = model_config.read(repository / f"{model}_floor" / "config.pbtxt")
    assert floor.name == f"{model}_floor"
    assert without_name(repository / f"{model}_floor" / "config.pbtxt") == without_name(config)
    assert [g.count for g in floor.instance_group] == [2]
    assert not floor.dynamic_batching.preferred_batch_size and floor.dynamic_batching.max_queue_delay_microseconds == 500
    parameters = model_config.parameters(floor)
    assert parameters["FORCE_CPU_ONLY_INPUT_TENSORS"] == "yes" and parameters["torch_threads"] == "0"
    shipped = model_config.read(DEFAULT_MODEL_REPOSITORY / model / "config.pbtxt")
    assert {k: v for k, v in parameters.items() if k not in ("FORCE_CPU_ONLY_INPUT_TENSORS", "torch_threads")} == {
        k: v for k, v in model_config.parameters(shipped).items() if k not in ("FORCE_CPU_ONLY_INPUT_TENSORS", "torch_threads")
    }
    assert "FloorModel" in (repository / f"{model}_floor" / "1" / "model.py").read_text()
    assert model_config.read(repository / f"{model}_peer" / "config.pbtxt").name == f"{model}_peer"
    assert without_name(repository / f"{model}_peer" / "config.pbtxt") == without_name(config)
    assert "PeerModel" in (repository / f"{model}_peer" / "1" / "model.py").read_text()
    assert without_name(repository / f"{model}_iofloor" / "config.pbtxt") == without_name(config)
    assert "IOFloorModel" in (repository / f"{model}_iofloor" / "1" / "model.py").read_text()


def test_the_io_floor_is_served_only_when_asked_for(tmp_path):
    assert not (serving_bench.make_repository(["deepfm"], tmp_path) / "deepfm_iofloor").exists()


def test_no_peer_leaves_the_peers_out(tmp_path):
    assert not (serving_bench.make_repository(["deepfm"], tmp_path, peers=False) / "deepfm_peer").exists()


def test_the_peer_pads_the_requests_of_one_execute_to_the_longest_and_cuts_each_answer_back():
    """T5's two axes: the encoder's ids and mask padded together, the decoder's ids alone."""
    from opara_core.serving.peer import PeerModel

    peer = PeerModel()
    peer.axis_inputs = [[0, 1], [2]]
    short = [torch.ones(1, 3, dtype=torch.int64), torch.ones(1, 3, dtype=torch.int64), torch.ones(1, 2, dtype=torch.int64)]
    long = [torch.ones(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.int64), torch.ones(2, 1, dtype=torch.int64)]
    (a, b) = peer._padded([short, long])
    assert [tuple(x.shape) for x in a] == [(1, 5), (1, 5), (1, 2)] and [tuple(x.shape) for x in b] == [(2, 5), (2, 5), (2, 2)]
    assert a[1].tolist() == [[1, 1, 1, 0, 0]] and b[2].tolist() == [[1, 0], [1, 0]]  # masks and ids padded with 0


@pytest.fixture(scope="module")
def floor_server(tmp_path_factory):
    """The floor models and the peers alone (the real ones are not needed to serve them)."""
    root = tmp_path_factory.mktemp("floors") / "models"
    for model in FLOORED + VARLEN_FLOORED:
        (root / model).mkdir(parents=True)
        # an added parameter (the floor honours output_memory): tritonserver must parse the edited config
        config = model_config.read(DEFAULT_MODEL_REPOSITORY / model / "config.pbtxt")
        serving_bench.set_parameter(config, "output_memory", "host")
        model_config.write(root / model / "config.pbtxt", config)
        serving_bench.add_floor_model(root, model)
        if model in IO_FLOORED:
            serving_bench.add_io_floor_model(root, model)
        if model in PEERED:  # each peer is a stub process of about 0.5 GB more in CI's 24 GiB: one per kind
            serving_bench.add_peer_model(root, model)
        (root / model / "config.pbtxt").unlink()
        (root / model).rmdir()
    with TritonServer(server_config(root), root.parent / "server.log") as running:
        yield running


@pytest.mark.server
@pytest.mark.parametrize("model", FLOORED)
def test_the_floor_answers_zeros_of_the_models_output_shapes(floor_server, model):
    entry = zoo.get(model)
    with Client(floor_server.grpc_url) as client:
        arrays = dict(zip((s.name for s in entry.inputs), example(model, batch=3, seed=1)))
        request = client.request(f"{model}_floor", arrays)
        outputs = result_arrays(request, client.infer(request), [s.name for s in entry.outputs])
    for spec in entry.outputs:
        np.testing.assert_array_equal(outputs[spec.name], np.zeros((3, *spec.shape), dtype=np.float32))


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_io_floor_moves_every_request_of_a_batch_and_answers_zeros_at_its_shapes(floor_server, protocol):
    """Requests of several rows and (bert) several lengths at once: each answer has its own
    request's shape (the batch's buffers are cut per request), over gRPC and HTTP."""
    import concurrent.futures

    url = floor_server.grpc_url if protocol == "grpc" else floor_server.http_url
    sizes = {"deepfm": [(3, None), (1, None), (2, None)], "bert": [(2, 7), (1, 19), (3, 4)]}

    def ask(model, rows, length):
        entry = zoo.get(model)
        sized = entry.at((length,)) if length else entry
        arrays = {s.name: t.numpy() for s, t in zip(sized.inputs, sized.example_inputs(rows, seed=rows))}
        with Client(url, protocol=protocol) as client:
            request = client.request(f"{model}_iofloor", arrays)
            return sized, rows, result_arrays(request, client.infer(request), [s.name for s in entry.outputs])

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda job: ask(*job), [(m, r, n) for m, jobs in sizes.items() for r, n in jobs]))
    for sized, rows, outputs in answers:
        for spec in sized.outputs:
            assert outputs[spec.name].shape == (rows, *spec.shape)
            assert not outputs[spec.name].any()


@pytest.mark.server
def test_the_peer_answers_as_the_eager_module_does(floor_server):
    """Over gRPC and HTTP: the zoo's module (its seeded weights, in the precision the model is served in) is the oracle."""
    model = "deepfm"
    entry = zoo.get(model)
    inputs = example(model, batch=3, seed=5)
    for url, protocol in ((floor_server.grpc_url, "grpc"), (floor_server.http_url, "http")):
        with Client(url, protocol=protocol) as client:
            request = client.request(f"{model}_peer", dict(zip((s.name for s in entry.inputs), inputs)))
            got = result_arrays(request, client.infer(request), [entry.outputs[0].name])[entry.outputs[0].name]
        assert_served(got, model, inputs)


@pytest.mark.server
def test_a_variable_length_peer_answers_at_the_requests_lengths_as_the_eager_module_does(floor_server):
    entry = zoo.get("t5")
    sized = entry.at((9, 4))
    inputs = [t.numpy() for t in sized.example_inputs(2, seed=3)]
    assert eager("t5", inputs).shape == (2, 4, 512)
    # lengths the peer has no graph for yet: on a GPU it compiles and captures one in this request (tens of seconds)
    with Client(floor_server.grpc_url, timeout_s=300) as client:
        request = client.request("t5_peer", dict(zip((s.name for s in entry.inputs), inputs)))
        got = result_arrays(request, client.infer(request), ["last_hidden_state"])["last_hidden_state"]
    assert_served(got, "t5", inputs)


@pytest.mark.server
def test_the_peer_refuses_an_id_beyond_its_vocabulary_and_stays_up(floor_server):
    entry = zoo.get("deepfm")
    inputs = dict(zip((s.name for s in entry.inputs), example("deepfm", batch=2, seed=6)))
    ids = next(s for s in entry.inputs if s.value_range is not None)
    inputs[ids.name] = np.full_like(inputs[ids.name], ids.value_range[1] + 10)
    with Client(floor_server.grpc_url) as client:
        with pytest.raises(ClientError, match=rf"input '{ids.name}': value \d+ .* is outside \[0, \d+\)"):
            client.infer(client.request("deepfm_peer", inputs))
        good = dict(zip((s.name for s in entry.inputs), example("deepfm", batch=1, seed=7)))
        request = client.request("deepfm_peer", good)
        assert result_arrays(request, client.infer(request), [entry.outputs[0].name])[entry.outputs[0].name].shape == (1, *entry.outputs[0].shape)


@pytest.mark.server
@pytest.mark.parametrize("model", VARLEN_FLOORED)
def test_a_variable_length_floor_answers_at_the_requests_lengths(floor_server, model):
    """bert and t5 since issue 16: each output at the length of its axis's inputs
    in that request (T5: the decoder's), not the config's -1."""
    entry = zoo.get(model)
    lengths = (7, 3)[: len(entry.lengths)]
    sized = entry.at(lengths)
    with Client(floor_server.grpc_url) as client:
        arrays = {s.name: t.numpy() for s, t in zip(sized.inputs, sized.example_inputs(2, seed=1))}
        request = client.request(f"{model}_floor", arrays)
        outputs = result_arrays(request, client.infer(request), [s.name for s in entry.outputs])
    for spec in sized.outputs:
        assert outputs[spec.name].shape == (2, *spec.shape)
        assert not outputs[spec.name].any()
    assert outputs[entry.outputs[0].name].shape[1] == lengths[-1]  # bert: its one axis; t5: the decoder's


def test_the_table_puts_the_floor_beside_each_row():
    split = {"server_queue_ms": 0.05, "server_compute_input_ms": 0.05, "server_compute_infer_ms": 0.8, "server_compute_output_ms": 0.1}
    floor = {"throughput_rps": 1500.0, "p50_ms": 0.7, "p99_ms": 0.9, **dict.fromkeys(split, 0.1)}
    row = {"model": "googlenet", "shared_memory": "cuda", "concurrency": 1, "throughput_rps": 800.0, "p50_ms": 1.2, "p99_ms": 1.5,
           **split, "mean_batch": 1.0, "execute_ms": {}, "floor": floor}  # fmt: skip
    header, _, line = serving_bench.table([row], {"googlenet": 0.4}).splitlines()
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in line.split("|")]))
    assert cells["outside replay"] == "0.600"  # 1.0 ms in Triton - 0.4 replay
    assert cells["floor p50"] == "0.700" and cells["floor server"] == "0.400"
    assert cells["p50 above floor"] == "0.500" and cells["outside replay above floor"] == "0.200"
    assert cells["peer p50"] == "-" and cells["infer/s / peer"] == "-"  # no peer measured in this row
    row["peer"] = {"throughput_rps": 640.0, "p50_ms": 1.5, "p99_ms": 1.9, **split}
    header, _, line = serving_bench.table([row], {"googlenet": 0.4}).splitlines()
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in line.split("|")]))
    assert cells["peer p50"] == "1.500" and cells["peer infer/s"] == "640" and cells["infer/s / peer"] == "1.25"
    assert cells["I/O floor p50"] == "-" and cells["p50 above I/O floor + replay"] == "-"
    row["io_floor"] = {"throughput_rps": 1200.0, "p50_ms": 0.75, "p99_ms": 1.0, **split}
    header, _, line = serving_bench.table([row], {"googlenet": 0.4}).splitlines()
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in line.split("|")]))
    assert cells["I/O floor p50"] == "0.750" and cells["I/O floor infer/s"] == "1200"
    assert cells["p50 above I/O floor + replay"] == "0.050"  # 1.2 - 0.75 - 0.4




def test_precision_reaches_every_served_config_and_a_bad_one_is_refused(tmp_path, capsys):
    """--precision bf16 (issue 72): the model's config and its floor's say it, once, and
    the config still parses; without --precision the configs keep their own."""
    parser = serving_bench.argument_parser()
    args = parser.parse_args(["--precision", "bf16", "--parameter", "torch_threads=0"])
    repository = serving_bench.make_repository(["googlenet"], tmp_path / "bf16", parameters=serving_bench.served_parameters(args))
    for name in ("googlenet", "googlenet_floor"):
        assert model_config.parameters(model_config.read(repository / name / "config.pbtxt"))["precision"] == "bf16"
    assert parse(BATCH, strings(config_of("googlenet", repository)))["precision"] == "bf16"
    plain = serving_bench.make_repository(["googlenet"], tmp_path / "plain", parameters=serving_bench.served_parameters(parser.parse_args([])))
    assert model_config.read(plain / "googlenet" / "config.pbtxt") == model_config.read(DEFAULT_MODEL_REPOSITORY / "googlenet" / "config.pbtxt")
    with pytest.raises(SystemExit, match="give one"):
        serving_bench.served_parameters(parser.parse_args(["--precision", "bf16", "--parameter", "precision=fp16"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "bf17"])
    error = capsys.readouterr().err
    assert "argument --precision: invalid choice: 'bf17'" in error
    assert all(repr(choice) in error for choice in get_parameter("precision").choices)


def test_the_report_says_the_precision_and_reads_a_json_from_before_it(tmp_path, monkeypatch, capsys):
    for meta, title in (({"precision": "bf16"}, "precision: bf16"), ({}, "precision: the config's own (default fp32)")):
        stored = tmp_path / "serving.json"
        stored.write_text(json.dumps({"meta": {"replay_ms": {}, **meta}, "rows": []}))
        monkeypatch.setattr(sys, "argv", ["serving_bench.py", "--report", str(stored)])
        assert serving_bench.main() == 0
        assert capsys.readouterr().out.splitlines()[0] == title


PERF_SUMMARY = """  Client: 
    Request count: 3388
    Throughput: 1109.51 infer/sec
    p50 latency: 795 usec
    p99 latency: 3821 usec
    Avg gRPC time: 872 usec (marshal 4 usec + response wait 867 usec + unmarshal 1 usec)
  Server: 
    Avg request latency: 613 usec (overhead 2 usec + queue 314 usec + compute input 19 usec + compute infer 166 usec + compute output 111 usec)
"""  # perf_analyzer 2.51's summary of a level (a CPU run of deepfm's floor)


@pytest.mark.parametrize("graph", ["nchw", "inductor", "inductor-cudnn"])
def test_the_bucket_1_replay_is_read_from_the_ready_line_whatever_the_graph(graph):
    """The line as triton_backend logs it, from the build's own report (every
    row of the H200's bf16 run of 2026-12-03 read '-': inductor-cudnn has a '-')."""
    chosen, other = Candidate(graph, "opara", 4), Candidate("inductor", "sequential", 1)
    report = BuildReport(
        runner="multi-stream graph", choices={1: chosen, 2: other}, timings_ms={1: {chosen: 0.202, other: 0.33}, 2: {other: 0.36}}, served_ms={1: 0.25, 2: 0.4}
    )
    details = [line for line in report.summary().splitlines()[1:]]
    log = "INFO [googlenet] opara_core.serving.triton_backend: " + ready_line("googlenet", "cuda:0", 108.9, "multi-stream graph, 2 buckets", details)
    assert serving_bench.replay_medians(log + "\n") == {"googlenet": 0.202}


def test_a_start_that_timed_its_candidates_is_told_from_a_warm_one():
    """From the ready lines as triton_backend writes them (the build's own report):
    a multi-stream build without remembered choices timed its candidates in this start;
    one that remembered them, an eager model and a model not benchmarked do not count,
    and the last start of a restarted server decides."""
    chosen = Candidate("inductor", "sequential", 1)

    def line(model: str, device: str, runner: str, remembered: bool) -> str:
        report = BuildReport(runner=runner, choices={1: chosen} if runner != "eager" else {}, timings_ms={1: {chosen: 0.057}}, remembered=remembered)
        built = report.runner + (f", {len(report.choices)} buckets" if report.choices else "")
        return f"INFO [{model}] opara_core.serving.triton_backend: " + ready_line(model, device, 41.4, built, report.summary().splitlines()[1:]) + "\n"

    cold = line("deepfm", "cuda:0", "multi-stream graph", remembered=False)
    warm = line("deepfm", "cuda:0", "multi-stream graph", remembered=True)
    others = line("googlenet", "cuda:0", "multi-stream graph", remembered=True) + line("resnet50", "cpu", "eager", remembered=False)
    assert serving_bench.timed_in_this_start(cold + others, ["deepfm", "googlenet", "resnet50"]) == ["deepfm"]
    assert serving_bench.timed_in_this_start(cold + warm + others, ["deepfm", "googlenet", "resnet50"]) == []
    assert serving_bench.timed_in_this_start(cold, ["googlenet"]) == []


def test_the_mean_comes_from_perf_analyzers_summary_and_shows_in_the_table():
    """A run stabilised on p50 has no mean in its CSV: the summary's Avg gRPC (or HTTP) time is it."""
    assert serving_bench.mean_latency(PERF_SUMMARY) == 0.872
    assert serving_bench.mean_latency(PERF_SUMMARY.replace("gRPC", "HTTP")) == 0.872
    assert serving_bench.mean_latency("Failed to obtain stable measurement.") is None
    split = {"server_queue_ms": 0.05, "server_compute_input_ms": 0.05, "server_compute_infer_ms": 0.8, "server_compute_output_ms": 0.1}
    row = {"model": "deepfm", "shared_memory": "none", "concurrency": 16, "throughput_rps": 800.0, "p50_ms": 1.2, "p99_ms": 1.5,
           "avg_ms": 3.1, **split}  # fmt: skip
    header, _, line = serving_bench.table([row], {}).splitlines()
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in line.split("|")]))
    assert cells["mean ms"] == "3.100"
