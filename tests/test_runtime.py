"""Runners: eager on the CPU, CUDA graphs per bucket on a GPU; the eager model is the oracle."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from opara_core import zoo
from opara_core.engine import runtime
from opara_core.engine.capture import capture_module
from opara_core.engine.compare import max_relative_error

MODEL = "googlenet"


@pytest.fixture(scope="module")
def entry() -> zoo.ZooModel:
    return zoo.get(MODEL)


@pytest.fixture(scope="module")
def module(entry) -> torch.nn.Module:
    return entry.build()


def run(runner, batch: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    return [out.numpy().copy() for out in runner.run(batch)]


def test_eager_runner_equals_the_module(entry, module):
    runner = runtime.EagerRunner(module, entry.inputs, entry.outputs, torch.device("cpu"), max_batch=4)
    batch = entry.example_inputs(3, seed=7)
    (out,) = run(runner, batch)
    with torch.inference_mode():
        expected = module(*batch).numpy()
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert runner.info.kind == "eager"


def test_batches_outside_the_staging_buffers_are_refused(entry, module):
    runner = runtime.EagerRunner(module, entry.inputs, entry.outputs, torch.device("cpu"), max_batch=2)
    with pytest.raises(ValueError, match="outside 1..2"):
        runner.run(entry.example_inputs(3))
    with pytest.raises(ValueError):
        runner.run([x[:0] for x in entry.example_inputs(1)])


def test_row_blocks_of_several_requests_run_as_one_batch(entry, module):
    runner = runtime.EagerRunner(module, entry.inputs, entry.outputs, torch.device("cpu"), max_batch=4)
    (x,) = entry.example_inputs(3, seed=5)
    (out,) = runner.run([[x[:1], x[1:]]])
    with torch.inference_mode():
        expected = module(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert runner.batches == {3: 1}


def test_small_host_blocks_are_gathered_on_the_host_and_large_ones_sent_as_they_lie():
    rows = [torch.zeros(1, 13) for _ in range(9)]  # DeepFM's dense input from 9 requests: 52 bytes each
    image = [torch.zeros(1, 3, 224, 224) for _ in range(9)]  # 588 KiB each
    assert not runtime.direct_pays([rows, image])
    assert runtime.direct_pays([image])
    assert runtime.direct_pays([rows[0], [rows[1]]])  # one block per input: one transfer either way


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", [False, True])
def test_many_small_host_blocks_go_through_the_staging_and_answer_as_eager(pinned, strict_fp32):
    """DeepFM's rows from nine requests (52 and 208 bytes each): gathered on the
    host and sent once per input (`direct_pays`), pinned or not."""
    device = torch.device("cuda")
    deepfm = zoo.get("deepfm")
    gpu_module = deepfm.build().to(device)
    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        graphs = {b: capture_module(gpu_module, [x.to(device) for x in deepfm.example_inputs(b, seed=b)], pool) for b in (1, 2, 4, 8, 16)}
    runner = runtime.GraphRunner(graphs, deepfm.inputs, deepfm.outputs, device, max_batch=16)
    inputs = deepfm.example_inputs(9, seed=21)
    blocks = [[(x[i : i + 1].pin_memory() if pinned else x[i : i + 1]) for i in range(9)] for x in inputs]
    assert not runtime.direct_pays(blocks)
    (out,) = runner.run(blocks)
    with torch.inference_mode():
        expected = gpu_module(*(x.to(device) for x in inputs)).cpu()
    assert max_relative_error(out.cpu(), expected) <= 1e-4
    assert runner.batches == {16: 1}


@pytest.fixture(scope="module")
def gpu_graphs(entry):
    """The module captured on one stream at buckets 1, 2, 4 and 8, in one pool,
    in plain fp32 like the eager runs it is compared with (the convolution
    algorithms are fixed at capture)."""
    device = torch.device("cuda")
    gpu_module = zoo.get(MODEL).build().to(device)
    pool = torch.cuda.graph_pool_handle()
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.inference_mode():
            graphs = {b: capture_module(gpu_module, [s.random(b).to(device) for s in entry.inputs], pool) for b in (1, 2, 4, 8)}
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    return gpu_module, graphs


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("where", ["host", "pinned", "gpu"])
@pytest.mark.parametrize("outputs_on_device", [False, True])
def test_graph_runner_equals_eager_on_every_bucket_and_chunks(entry, gpu_graphs, rows, where, outputs_on_device, strict_fp32):
    """11 rows with buckets up to 8 runs as a chunk of 8 and a chunk of 3;
    inputs from the host (through the pinned staging, or straight up from
    page-locked memory) or already on the GPU (copied device to device), in
    two request blocks."""
    device = torch.device("cuda")
    gpu_module, graphs = gpu_graphs
    runner = runtime.GraphRunner(graphs, entry.inputs, entry.outputs, device, max_batch=16)
    assert runner.bucket_for(3) == 4 and runner.bucket_for(11) == 8
    (x,) = entry.example_inputs(rows, seed=rows)
    x = {"host": x, "pinned": x.pin_memory(), "gpu": x.to(device)}[where]
    (out,) = runner.run([[x[: rows // 2], x[rows // 2 :]]], outputs_on_device=outputs_on_device)
    assert out.device.type == ("cuda" if outputs_on_device and rows <= 8 else "cpu")
    with torch.inference_mode():
        expected = gpu_module(x.to(device)).cpu()
    assert max_relative_error(out.cpu(), expected) <= 1e-4


@pytest.mark.gpu
def test_one_runner_answers_each_batch_in_turn_and_refills_its_staging_only_after_the_gpu_read_it(entry, gpu_graphs, strict_fp32):
    """Batches of different sizes through one runner (each size's slices of the
    graphs and staging made once), host and GPU inputs, outputs on the device or
    the host; a run that returns on the device leaves its copy from the staging
    queued behind a long kernel, and the next run must not refill the staging
    before that copy has read it."""
    device = torch.device("cuda")
    gpu_module, graphs = gpu_graphs
    runner = runtime.GraphRunner(graphs, entry.inputs, entry.outputs, device, max_batch=8)
    answers = []
    for rows, where, on_device in ((3, "host", True), (1, "host", False), (2, "gpu", True), (3, "host", False), (8, "pinned", True), (4, "host", True)):
        (x,) = entry.example_inputs(rows, seed=10 + rows)
        x = {"host": x, "pinned": x.pin_memory(), "gpu": x.to(device)}[where]
        torch.cuda._sleep(50_000_000)  # what this run queues waits behind it
        (out,) = runner.run([x], outputs_on_device=on_device)
        answers.append((x, out.clone()))  # a device output's clone is queued after its replay
    for x, out in answers:
        with torch.inference_mode():
            expected = gpu_module(x.to(device)).cpu()
        assert max_relative_error(out.cpu(), expected) <= 1e-4, tuple(x.shape)
    assert runner.batches == {4: 3, 1: 1, 2: 1, 8: 1} and runner.padded_rows == 2


@pytest.mark.gpu
def test_a_run_that_returns_on_the_device_waits_for_its_input_copies_but_not_for_the_replay():
    """Page-locked host inputs, outputs left on the device: run returns once the
    copies have read the caller's memory, while a long graph still runs."""
    device = torch.device("cuda")
    spec = [zoo.TensorSpec("x", torch.float32, (4,))]

    def slow_double(x):
        torch.cuda._sleep(200_000_000)  # about 0.1 s at 2 GHz
        return x * 2

    graphs = {1: capture_module(slow_double, [torch.zeros(1, 4, device=device)], None, warmup=1)}
    runner = runtime.GraphRunner(graphs, spec, spec, device, max_batch=1)
    x = torch.arange(4.0).view(1, 4).pin_memory()
    (out,) = runner.run([x], outputs_on_device=True)
    assert not torch.cuda.current_stream().query(), "run waited for the replay"
    assert torch.equal(out.cpu(), x * 2)


def test_packed_inputs_need_one_dtype():
    ids = zoo.TensorSpec("ids", torch.int64, (4,))
    assert runtime.PackedInputs.fits([ids, zoo.TensorSpec("mask", torch.int64, (4,))])
    assert not runtime.PackedInputs.fits([ids, zoo.TensorSpec("dense", torch.float32, (4,))])
    with pytest.raises(ValueError, match="one dtype"):
        runtime.PackedInputs([ids, zoo.TensorSpec("dense", torch.float32, (4,))], 2, torch.device("cpu"))


@pytest.mark.gpu
def test_packed_inputs_are_copied_up_by_the_graph_and_refilled_only_after_it_read_them():
    """Rows written into the host views reach the captured graph (inputs of
    different shapes, one buffer, the copy captured as its prologue); a refill
    waits for the replay that reads them, even while a long kernel delays it."""
    device = torch.device("cuda")
    specs = [zoo.TensorSpec("ids", torch.int64, (5,)), zoo.TensorSpec("mask", torch.int64, (5,)), zoo.TensorSpec("decoder", torch.int64, (3,))]
    packed = runtime.PackedInputs(specs, 2, device)
    assert [tuple(v.shape) for v in packed.host_inputs] == [(2, 5), (2, 5), (2, 3)]
    assert all(v.is_pinned() for v in packed.host_inputs)

    def model(ids, mask, decoder):
        return ids * mask, decoder + 1

    captured = capture_module(lambda *x: (packed.copy_up(), model(*x))[1], packed.device_inputs, None, warmup=1)
    first = [torch.arange(10).view(2, 5), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), torch.arange(6).view(2, 3) + 7]
    for view, rows in zip(packed.refill(), first):
        view.copy_(rows)
    torch.cuda._sleep(50_000_000)  # the replay queues behind this
    captured.replay()
    packed.replayed()
    second = packed.refill()  # waits for that replay, then zeroes
    assert all(int(v.abs().sum()) == 0 for v in second)
    ids_times_mask, decoder = (out.cpu() for out in captured.outputs)
    assert torch.equal(ids_times_mask, first[0] * first[1]) and torch.equal(decoder, first[2] + 1)
    second[2][1, :2] = torch.tensor([4, 9])
    captured.replay()
    assert captured.outputs[1].cpu().tolist() == [[1, 1, 1], [5, 10, 1]]
    assert int(captured.outputs[0].abs().sum()) == 0


@pytest.mark.gpu
def test_graph_runner_fills_host_inputs_of_a_graph_that_copies_them_up():
    """GraphRunner.run on such a graph (what the guard does): each batch's own
    answer, with outputs kept on the device between runs."""
    device = torch.device("cuda")
    specs = [zoo.TensorSpec("ids", torch.int64, (4,)), zoo.TensorSpec("mask", torch.int64, (4,))]
    outputs = [zoo.TensorSpec("out", torch.int64, (4,))]
    graphs = {}
    for bucket in (1, 4):
        packed = runtime.PackedInputs(specs, bucket, device)
        captured = capture_module(lambda *x, p=packed: (p.copy_up(), x[0] * x[1] + 1)[1], packed.device_inputs, None, warmup=1)
        graphs[bucket] = replace(captured, inputs=tuple(packed.host_inputs))
    runner = runtime.GraphRunner(graphs, specs, outputs, device, max_batch=8)
    for rows in (1, 3, 4, 7):
        ids, mask = torch.randint(0, 100, (rows, 4)), torch.randint(0, 2, (rows, 4))
        torch.cuda._sleep(10_000_000)
        (out,) = runner.run([ids, mask], outputs_on_device=rows != 7)
        assert torch.equal(out.cpu(), ids * mask + 1), rows
