"""Variable-length BERT and T5 through the real server: requests of mixed lengths
sent at once batch together, and each answer equals the eager model run on that
request alone, unpadded; bad lengths get INVALID_ARG. Plus the adapter's
config and request checks, without a server.

Short lengths and few requests: BERT on this CPU takes about a second per batch.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from client import bench
from conftest import server_config
from serving import assert_close, assert_served, eager, served_tolerance
from test_faults import make_repository, wait_for
from test_triton_backend import config_of
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from opara_core import zoo
from opara_core.parameters import VARLEN, parse, strings
from opara_core.planning import batching
from opara_core.serving.launcher import TritonServer
from opara_core.serving.triton_backend import RequestError
from opara_core.serving.varlen import check_config, check_request, on_host, varlen_settings

# long enough that every request of a burst joins one batch
QUEUE_DELAY_US = 500_000


def request(model: str, lengths: tuple[int, ...], rows: int, seed: int) -> list[np.ndarray]:
    """Random valid inputs at `lengths` (one per variable axis), the last mask position 0."""
    arrays = [t.numpy() for t in zoo.get(model).at(lengths).example_inputs(rows, seed)]
    mask = arrays[1]
    mask[:] = 1
    if mask.shape[1] > 1:
        mask[:, -1] = 0  # padding the client did itself: must stay hidden as in eager
    return arrays


def send(client, model: str, arrays: list[np.ndarray], scheduler: str | None = None) -> np.ndarray:
    module = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    tensors = []
    for spec, array in zip(zoo.get(model).inputs, arrays):
        tensor = module.InferInput(spec.name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    parameters = {"scheduler": scheduler} if scheduler else None
    return client.infer(model, tensors, parameters=parameters).as_numpy("last_hidden_state")


@pytest.fixture(scope="module")
def varlen_server(tmp_path_factory, admin_key):
    root = make_repository(tmp_path_factory.mktemp("varlen"), {"bert": "bert", "t5": "t5"})
    for config in root.glob("*/config.pbtxt"):
        text = config.read_text()
        config.write_text(text.replace("max_queue_delay_microseconds: 100", f"max_queue_delay_microseconds: {QUEUE_DELAY_US}"))
    with TritonServer(server_config(root), tmp_path_factory.mktemp("varlen-log") / "tritonserver.log") as running:
        http = httpclient.InferenceServerClient(running.http_url)
        grpc = grpcclient.InferenceServerClient(running.grpc_url)
        yield http, grpc, running
        http.close()
        grpc.close()


def executions(client, model: str) -> tuple[int, int]:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def executions_since(client, model: str, before: tuple[int, int], inferences: int) -> tuple[int, int]:
    """Inferences and executions since `before`, once the statistics count
    `inferences` (Triton counts an execution after its responses are sent: on
    a loaded CI machine a client had its answer before the count moved)."""
    deadline = time.monotonic() + 10
    while True:
        now = tuple(a - b for a, b in zip(executions(client, model), before))
        if now[0] >= inferences or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@pytest.mark.server
@pytest.mark.parametrize(
    ("model", "shapes"),
    [
        # (lengths, rows) per request; HTTP and gRPC alternate
        ("bert", [((3,), 1), ((9,), 1), ((17,), 2), ((30,), 1)]),
        ("t5", [((5, 2), 1), ((20, 9), 1), ((40, 17), 1)]),
    ],
)
def test_mixed_lengths_batch_together_and_each_answer_is_its_own_eager_run(varlen_server, model, shapes):
    http, grpc, running = varlen_server
    sent = [request(model, lengths, rows, seed=50 + i) for i, (lengths, rows) in enumerate(shapes)]
    before = executions(grpc, model)
    barrier = threading.Barrier(len(sent))

    def one(i: int) -> np.ndarray:
        if i % 2:
            barrier.wait()
            return send(grpc, model, sent[i])
        # an HTTP client belongs to the thread that made it (gevent)
        with httpclient.InferenceServerClient(running.http_url) as own:
            barrier.wait()
            return send(own, model, sent[i])

    with ThreadPoolExecutor(len(sent)) as pool:
        answers = list(pool.map(one, range(len(sent))))
    inferences, runs = executions_since(grpc, model, before, sum(rows for _, rows in shapes))
    assert inferences == sum(rows for _, rows in shapes)
    assert runs < len(sent), "the requests were not batched together"
    for arrays, answer in zip(sent, answers):
        expected = eager(model, arrays)
        assert answer.shape == expected.shape  # the request's own length, not a bucket's
        assert_close(answer, expected, served_tolerance(model))


@pytest.mark.server
@pytest.mark.parametrize("scheduler", ["greedy", "single", "padded"])
def test_every_scheduler_answers_each_request_as_eager(varlen_server, scheduler):
    http, grpc, running = varlen_server
    arrays = request("t5", (33, 12), 1, seed=60)
    assert_served(send(http if scheduler == "greedy" else grpc, "t5", arrays, scheduler), "t5", arrays)
    # the request's parameter chose the shape it ran at: padded runs at the largest
    shape = "512,128" if scheduler == "padded" else "64,16"
    wait_for(lambda: f'bucket="{shape}x1"' in scrape_t5_batches(running), 10, f"a t5 batch at {shape} in the metrics")


def scrape_t5_batches(running) -> str:
    with urllib.request.urlopen(running.metrics_url, timeout=10) as response:
        return "\n".join(line for line in response.read().decode().splitlines() if line.startswith("opara_batches_total{") and 't5' in line)


@pytest.mark.server
@pytest.mark.parametrize(
    ("model", "lengths", "problem"),
    [
        ("bert", (513,), "input 'input_ids' has length 513; the model takes 1 to 512 tokens"),
        ("t5", (8, 129), "input 'decoder_input_ids' has length 129; the model takes 1 to 128 tokens"),
    ],
)
def test_a_request_above_the_limit_is_refused_naming_input_length_and_limit(varlen_server, model, lengths, problem):
    arrays = [np.zeros((1, zoo.get(model).at(lengths).inputs[k].shape[0]), np.int64) for k in range(len(zoo.get(model).inputs))]
    for client in varlen_server[:2]:
        with pytest.raises(InferenceServerException) as raised:
            send(client, model, arrays)
        assert problem in raised.value.message(), raised.value.message()
        assert "Traceback" not in raised.value.message()


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bench_sends_seeded_lengths_with_a_scheduler_parameter(varlen_server, protocol):
    _, grpc, running = varlen_server
    before = executions(grpc, "bert")
    config = bench.BenchConfig(
        model="bert",
        url=running.http_url if protocol == "http" else running.grpc_url,
        protocol=protocol,
        concurrency=(2,),
        requests=4,
        warmup=0,
        lengths="lognormal:mean=6,cap=24,seed=1",
        parameters=(("scheduler", "greedy"),),
        progress=False,
    )
    result = bench.run(config)
    assert result.errors == 0 and result.rows[0].requests == 4
    assert executions_since(grpc, "bert", before, 4)[0] == 4


@pytest.mark.server
def test_an_unknown_scheduler_parameter_is_refused(varlen_server):
    _, grpc, _ = varlen_server
    with pytest.raises(InferenceServerException, match="parameter 'scheduler' is 'fastest'"):
        send(grpc, "bert", request("bert", (4,), 1, 1), scheduler="fastest")


def test_inputs_of_one_axis_must_have_one_length():
    tensors = {"input_ids": torch.zeros(1, 8, dtype=torch.int64), "attention_mask": torch.ones(1, 9, dtype=torch.int64)}
    with pytest.raises(RequestError, match=r"different lengths \[8, 9\]"):
        check_request(zoo.get("bert"), tensors, "dp")


def test_an_empty_sequence_is_refused():
    tensors = {"input_ids": torch.zeros(1, 0, dtype=torch.int64), "attention_mask": torch.zeros(1, 0, dtype=torch.int64)}
    with pytest.raises(RequestError, match="has length 0; the model takes 1 to 512"):
        check_request(zoo.get("bert"), tensors, "dp")


@pytest.mark.parametrize("model", ["bert", "t5"])
def test_the_repository_configs_declare_variable_lengths(model):
    config = config_of(model)
    check_config(zoo.get(model), config)
    assert all(t.get("allow_ragged_batch") for t in config["input"])
    settings = varlen_settings(zoo.get(model), parse(VARLEN, strings(config)))
    assert settings.axes[0] == (16, 32, 64, 128, 256, 512)
    assert settings.compiler == "saved"


def test_the_capture_environment_variable_overrides_every_config(monkeypatch):
    """OPARA_CAPTURE (what `launcher warm` sets) replaces the config's `capture`;
    a bad value names the variable."""
    config = config_of("t5")
    assert varlen_settings(zoo.get("t5"), parse(VARLEN, strings(config))).capture == "first_use"
    monkeypatch.setenv("OPARA_CAPTURE", "load")
    assert varlen_settings(zoo.get("t5"), parse(VARLEN, strings(config))).capture == "load"
    monkeypatch.setenv("OPARA_CAPTURE", "always")
    with pytest.raises(ValueError, match=re.escape("parameter capture (from the environment variable OPARA_CAPTURE) is 'always'; allowed: load, first_use")):
        parse(VARLEN, strings(config))


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("length_buckets.sequence", "16,64,256", "must ascend from 1 or more to the axis's limit 512"),
        ("length_buckets.sequence", "16,x", "parameter length_buckets.sequence is '16,x'; allowed: comma-separated integers >= 1"),
        ("max_length.input_ids", "128", "max_length.input_ids is '128', the model's is '512'"),
        ("scheduler", "fastest", "parameter scheduler is 'fastest'; allowed: dp, greedy, padded, single"),
        ("capture", "never", "parameter capture is 'never'; allowed: load, first_use"),
        ("compiler", "tensorrt", "parameter compiler is 'tensorrt'; allowed: saved, engine"),
        ("compiler", "aot", "parameter compiler is 'aot', which was removed (AOTInductor's loader died of SIGSEGV"),
        ("compiler", "inductor", "parameter compiler is 'inductor', which was removed (torch.compile at every start"),
        ("length_buckets.tokens", "16,512", "length_buckets.tokens names no variable axis of the model; its axes: sequence"),
        ("max_length.token_type_ids", "512", "max_length.token_type_ids names no variable-length input"),
    ],
)
def test_bad_varlen_parameters_fail_at_load(key, value, problem):
    config = config_of("bert")
    config["parameters"][key] = {"string_value": value}
    with pytest.raises(ValueError, match=re.escape(problem)):
        varlen_settings(zoo.get("bert"), parse(VARLEN, strings(config)))


def test_a_fixed_length_config_is_refused():
    config = config_of("bert")
    config["input"][0]["dims"] = [128]
    with pytest.raises(ValueError, match=r"'input_ids' is TYPE_INT64 \[128\], the model needs TYPE_INT64 \[-1\]"):
        check_config(zoo.get("bert"), config)


def test_a_sub_batch_runs_on_a_cheaper_longer_shape_and_answers_as_eager():
    """Where the cost table says a longer shape is cheaper (an H100 timed BERT's
    16-token batch-1 graph slower than its 32-token one), the rows run there,
    padded further, and each answer still equals its own eager run."""
    from opara_core.engine.build import EngineSettings
    from opara_core.planning.batching import CostTable
    from opara_core.serving.varlen import VarLenRunners, VarLenSettings

    entry = zoo.get("bert")
    module = entry.build()
    axes = ((16, 64, 512),)
    runners = VarLenRunners(module, entry, torch.device("cpu"), EngineSettings(buckets=(1, 2)), VarLenSettings(axes))
    seconds = {((s,), b): float(s * b) for s in axes[0] for b in (1, 2)}
    seconds[((16,), 1)] = seconds[((16,), 2)] = 1000.0  # two rows at 64 together (100) beat two alone (2 x 64)
    seconds[((64,), 2)] = 100.0
    runners.costs = CostTable(axes, (1, 2), seconds)
    requests = [check_request(entry, dict(zip((s.name for s in entry.inputs), entry.at((n,)).example_inputs(1, seed=n))), "dp") for n in (5, 12)]
    with torch.inference_mode():
        expected = [module(*request.tensors) for request in requests]
        answers = runners.run(requests)
    assert dict(runners.batches) == {"64x2": 1}
    for answer, reference in zip(answers, expected):
        assert answer[0].shape == reference.shape
        assert_close(answer[0].numpy(), reference.numpy())


def test_the_build_takes_the_gpu_turn_once_its_whole_model_is_loaded_and_before_its_shapes(tmp_path, monkeypatch):
    """A server's model holds its GPU turn lazily (engine.gpu_turn): a variable-length
    build casts its module and loads (or compiles, aside) its saved artifact without
    the turn, and takes it before it captures and times its first shape: on an H100's
    warm start (2026-12-07) BERT and T5 held it 10 and 6.5 s, 4 and 2.8 s of it loading."""
    from opara_core.engine import gpu_turn
    from opara_core.engine.build import EngineSettings
    from opara_core.serving.varlen import VarLenRunners, VarLenSettings

    seen = []
    monkeypatch.setattr(VarLenRunners, "_whole_model", lambda self, module, compiler: seen.append(("whole model", gpu_turn.holding())))
    build = VarLenRunners._build
    monkeypatch.setattr(VarLenRunners, "_build", lambda self, shape: seen.append((shape, gpu_turn.holding())) or build(self, shape))
    entry = zoo.get("bert")
    with gpu_turn.held(tmp_path / "turn.lock", lazily=True):
        VarLenRunners(entry.build(), entry, torch.device("cpu"), EngineSettings(buckets=(1,)), VarLenSettings(((16, 32),), capture="load"))
    assert seen == [("whole model", False), ((32,), True), ((16,), True)], seen


def test_each_request_is_answered_once_with_its_rows_as_their_eager_runs():
    """Requests of one and of several rows and mixed lengths, through every
    scheduler: `run` hands each request over to `answered` exactly once, with the
    outputs it returns, and each row equals the eager model on that row alone."""
    from opara_core.engine.build import EngineSettings
    from opara_core.serving.varlen import VarLenRunners, VarLenSettings

    entry = zoo.get("bert")
    module = entry.build()
    runners = VarLenRunners(module, entry, torch.device("cpu"), EngineSettings(buckets=(1, 2, 4)), VarLenSettings(((16, 64),)))
    names = [s.name for s in entry.inputs]
    requests = [check_request(entry, dict(zip(names, entry.at((n,)).example_inputs(rows, seed=n))), "dp") for n, rows in ((5, 1), (40, 3), (12, 2), (16, 1))]
    with torch.inference_mode():
        expected = [[module(*(t[r : r + 1] for t in request.tensors)) for r in range(request.rows)] for request in requests]
        for scheduler in batching.SCHEDULERS:
            for request in requests:
                request.scheduler = scheduler
            handed = []
            answers = runners.run(requests, answered=lambda k, outputs: handed.append((k, outputs)))
            assert sorted(k for k, _ in handed) == list(range(len(requests))), scheduler
            assert all(outputs is answers[k] for k, outputs in handed)
            for answer, rows in zip(answers, expected):
                assert answer[0].shape == (len(rows), *rows[0].shape[1:])
                for r, reference in enumerate(rows):
                    assert_close(answer[0][r : r + 1].numpy(), reference.numpy())


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "compiler"), [("bert", "engine"), ("bert", "saved"), ("t5", "saved")])
def test_on_a_gpu_every_scheduler_answers_each_row_as_eager_with_measured_costs(model, compiler, strict_fp32):
    """The CUDA graphs of a few shapes (a short grid, first use for T5's), mixed
    lengths through every scheduler, each row against its own eager run; with
    the compiler "saved" every shape runs the saved whole-model Inductor
    artifact, which a second build loads instead of compiling;
    every built shape's cells (also those built on first use) are timed."""
    from opara_core.engine.build import EngineSettings
    from opara_core.engine.whole_model import WholeModelSaved
    from opara_core.serving.varlen import VarLenRunners, VarLenSettings

    entry = zoo.get(model)
    device = torch.device("cuda")
    module = entry.build().to(device)
    axes = ((16, 64, 512),) if model == "bert" else ((16, 512), (16, 128))
    capture = "load" if model == "bert" else "first_use"
    varlen = VarLenSettings(axes, capture=capture, compiler=compiler)
    runners = VarLenRunners(module, entry, device, EngineSettings(policy="opara", buckets=(1, 2, 4), fused_lanes=False), varlen)
    assert runners.info.kind == "cuda-graph"
    # at load: every shape, or (first use) the smallest, which compiles the model
    assert runners.report.measured == (set(batching.grid(axes)) if capture == "load" else {batching.grid(axes)[0]})
    shapes = [(3,), (40,), (17,), (300,), (9,)] if model == "bert" else [(3, 2), (40, 100), (17, 9), (300, 5), (9, 1)]
    requests = [check_request(entry, dict(zip((s.name for s in entry.inputs), entry.at(n).example_inputs(1, seed=k))), "dp") for k, n in enumerate(shapes)]
    requests.append(check_request(entry, dict(zip((s.name for s in entry.inputs), entry.at(shapes[1]).example_inputs(2, seed=9))), "dp"))  # two rows
    for request in requests:
        request.tensors[1][:] = 1  # attention masks without padding of their own
    cpu_module = entry.build()
    with torch.inference_mode():
        expected = [cpu_module(*r.tensors) for r in requests]
    for scheduler in ("dp", "greedy", "padded", "single"):
        for request in requests:
            request.scheduler = scheduler
        answers = runners.run(requests)
        for answer, reference in zip(answers, expected):
            assert answer[0].shape == reference.shape
            assert_close(answer[0].numpy(), reference.numpy(), zoo.oracle_tolerance())
    # a shape built on first use plans with its own replay timings from then on
    assert runners.report.measured == set(runners.runners) == set(runners.report.shapes)
    built = {shape: report.runner for shape, report in runners.report.shapes.items()}
    expected = WholeModelSaved.label if compiler == "saved" else None
    assert built and all(runner == expected if expected else "whole-model" not in runner for runner in built.values()), (built, runners.report.fallbacks)
    if compiler == "saved":  # a second start finds the artifact and loads it
        again = VarLenRunners(module, entry, device, EngineSettings(policy="opara", buckets=(1, 2, 4), fused_lanes=False), varlen)
        assert " loaded in " in again.report.whole_model and set(again.report.choices.values()) == {expected}, again.report.summary()
    if capture == "load" and compiler == "saved":  # a first-use start plans with the last full start's timings
        later = VarLenRunners(module, entry, device, EngineSettings(policy="opara", buckets=(1, 2, 4), fused_lanes=False), dataclasses.replace(varlen, capture="first_use"))
        unbuilt = set(batching.grid(axes)[1:])
        assert later.report.stored == unbuilt and later.report.measured == {batching.grid(axes)[0]}
        assert {c: t for c, t in later.costs.seconds.items() if c[0] in unbuilt} == {c: t for c, t in again._measured.items() if c[0] in unbuilt}


def test_an_untimed_shape_never_looks_cheaper_than_a_timed_one_it_holds():
    """First use: only shape 16 is built and timed. The token-count model, scaled
    to its timings, would price the unbuilt 32-token cells below them (as on an
    H100); a 10-token request must still run on the built shape, not build another."""
    from opara_core.engine.build import EngineSettings
    from opara_core.serving.varlen import VarLenRunners, VarLenSettings, modelled_seconds

    entry = zoo.get("bert")
    module = entry.build()
    axes = ((16, 32, 512),)
    runners = VarLenRunners(module, entry, torch.device("cpu"), EngineSettings(buckets=(1, 2)), VarLenSettings(axes, capture="first_use"))
    assert list(runners.runners) == [(16,)]
    runners._measured = {((16,), 1): 3 * modelled_seconds((16,), 1), ((16,), 2): modelled_seconds((16,), 2)}
    runners._set_costs()
    costs = runners.costs.seconds
    assert costs[((32,), 1)] >= costs[((16,), 1)] and costs[((512,), 1)] >= costs[((16,), 1)]
    assert costs[((32,), 2)] > costs[((16,), 2)]  # the model's own ordering where it already held
    request = check_request(entry, dict(zip((s.name for s in entry.inputs), entry.at((10,)).example_inputs(1, seed=4))), "dp")
    with torch.inference_mode():
        runners.run([request])
    assert dict(runners.batches) == {"16x1": 1} and list(runners.runners) == [(16,)]


# an earlier start's timings of BERT's cells (sequence buckets 16, 32, 512; batches 1, 2), the
# 32-token cells cheaper than the 16-token ones: the token-count model would never say so
KEPT = {((16,), 1): 2e-3, ((16,), 2): 3e-3, ((32,), 1): 1e-3, ((32,), 2): 1.5e-3, ((512,), 1): 9e-3, ((512,), 2): 17e-3}


def first_use_runners_with_kept_table(cache, monkeypatch):
    """(module, runners): BERT's runners on the CPU, `capture` first_use, after a start
    that kept KEPT in the cache directory `cache` (written here: on a CPU nothing is timed)."""
    from opara_core.engine.build import EngineSettings
    from opara_core.serving import varlen_costs
    from opara_core.serving.varlen import VarLenRunners, VarLenSettings

    monkeypatch.setenv("OPARA_CACHE_DIR", str(cache))
    entry = zoo.get("bert")
    module = entry.build()
    axes, batches, cpu = ((16, 32, 512),), (1, 2), torch.device("cpu")
    varlen_costs.store(varlen_costs.costs_key("bert", module, "saved", axes, batches, cpu), KEPT)
    return module, VarLenRunners(module, entry, cpu, EngineSettings(buckets=batches), VarLenSettings(axes, capture="first_use"))


def test_a_first_use_start_plans_with_the_timings_an_earlier_start_kept(tmp_path, monkeypatch):
    """Shapes not built yet are costed by the stored table of an earlier start
    that timed every cell, not by the token-count model; the report marks them."""
    from opara_core.engine.build import EngineSettings
    from opara_core.serving.varlen import VarLenRunners, VarLenSettings

    module, runners = first_use_runners_with_kept_table(tmp_path, monkeypatch)
    entry, batches, cpu = zoo.get("bert"), (1, 2), torch.device("cpu")
    assert dict(runners.costs.seconds) == KEPT
    assert runners.report.stored == {(16,), (32,), (512,)} and runners.report.measured == set()
    assert " 16 s    2.000    3.000" in runners.report.summary()
    request = check_request(entry, dict(zip((s.name for s in entry.inputs), entry.at((10,)).example_inputs(1, seed=4))), "dp")
    with torch.inference_mode():
        runners.run([request])
    assert dict(runners.batches) == {"32x1": 1}  # the cheaper cell, built on first use
    assert list(runners.runners) == [(16,), (512,), (32,)]  # after the largest, as at load (the pool's blocks)
    # another grid is another key: the model's costs again
    other = VarLenRunners(module, entry, cpu, EngineSettings(buckets=batches), VarLenSettings(((16, 512),), capture="first_use"))
    assert other.report.stored == set() and other.costs.seconds[((16,), 1)] < other.costs.seconds[((512,), 1)]


def test_a_cpu_instance_in_bf16_says_so_and_what_its_guard_measured():
    """The ready line's details come from VarLenReport.summary: eager shapes (no
    choices, no fallbacks) printed nothing of their precision, so a bf16 BERT on
    a CPU looked like an fp32 one."""
    from opara_core.engine import precision
    from opara_core.engine.build import EngineSettings
    from opara_core.serving.varlen import VarLenRunners, VarLenSettings

    if precision.on_device("bf16", torch.device("cpu"))[0] != "bf16":
        pytest.skip("this CPU has no native bf16")
    entry = zoo.get("bert")
    runners = VarLenRunners(entry.build(), entry, torch.device("cpu"), EngineSettings(buckets=(1, 2), precision="bf16"), VarLenSettings(((16, 32),)))
    lines = [line for line in runners.report.summary().splitlines() if line.startswith("precision")]
    assert len(lines) == 1 and lines[0].startswith("precision bf16: max relative error against the fp32 module"), lines
    assert lines[0].endswith(f"over {len(runners.report.precision_error)} graphs") and len(runners.report.precision_error) >= 2


@pytest.mark.gpu
def test_an_executes_gpu_inputs_come_to_the_host_with_one_wait():
    """Ids from CUDA shared memory: every input of three requests queued to the
    host, then one wait for them all (`.cpu()` per input waits six times, a wait
    per request three), the values intact and each request's own."""
    entry = zoo.get("bert")
    arrived = [{spec.name: tensor.cuda() for spec, tensor in zip(entry.inputs, entry.at((n,)).example_inputs(rows, seed=n))} for n, rows in ((7, 1), (30, 3), (12, 2))]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            host = on_host(arrived)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    waits = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(waits) == 1, waits
    assert len(host) == len(arrived)
    for got, sent in zip(host, arrived):
        assert all(got[name].device.type == "cpu" and torch.equal(got[name], tensor.cpu()) for name, tensor in sent.items())


def test_host_inputs_stay_as_they_are():
    arrived = [dict(zip(("input_ids", "attention_mask"), zoo.get("bert").example_inputs(2, seed=k))) for k in range(2)]
    host = on_host(arrived)
    assert all(host[k][name] is tensor for k, inputs in enumerate(arrived) for name, tensor in inputs.items())
