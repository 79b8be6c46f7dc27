"""Runners: eager on the CPU, CUDA graphs per bucket on a GPU; the eager model is the oracle."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def gpu_graphs(entry):
    """The module captured on one stream at buckets 1, 2, 4 and 8, in one pool."""
    device = torch.device("cuda")
    gpu_module = zoo.get(MODEL).build().to(device)
    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        graphs = {b: capture_module(gpu_module, [s.random(b).to(device) for s in entry.inputs], pool) for b in (1, 2, 4, 8)}
    return gpu_module, graphs


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("where", ["host", "gpu"])
@pytest.mark.parametrize("outputs_on_device", [False, True])
def test_graph_runner_equals_eager_on_every_bucket_and_chunks(entry, gpu_graphs, rows, where, outputs_on_device, strict_fp32):
    """11 rows with buckets up to 8 runs as a chunk of 8 and a chunk of 3;
    inputs from the host or already on the GPU (copied device to device), in
    two request blocks."""
    device = torch.device("cuda")
    gpu_module, graphs = gpu_graphs
    runner = runtime.GraphRunner(graphs, entry.inputs, entry.outputs, device, max_batch=16)
    assert runner.bucket_for(3) == 4 and runner.bucket_for(11) == 8
    (x,) = entry.example_inputs(rows, seed=rows)
    x = x if where == "host" else x.to(device)
    (out,) = runner.run([[x[: rows // 2], x[rows // 2 :]]], outputs_on_device=outputs_on_device)
    assert out.device.type == ("cuda" if outputs_on_device and rows <= 8 else "cpu")
    with torch.inference_mode():
        expected = gpu_module(x.to(device)).cpu()
    assert max_relative_error(out.cpu(), expected) <= 1e-4
