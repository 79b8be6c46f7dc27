"""Runners: eager on the CPU, CUDA graphs per bucket on a GPU; the eager model is the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opara_core import zoo
from opara_core.engine import runtime

MODEL = "googlenet"


@pytest.fixture(scope="module")
def entry() -> zoo.ZooModel:
    return zoo.get(MODEL)


@pytest.fixture(scope="module")
def module(entry) -> torch.nn.Module:
    return entry.build()


def run(runner, batch: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    n = batch[0].shape[0]
    for buffer, x in zip(runner.host_inputs(n), batch):
        buffer[...] = x.numpy()
    return [out.copy() for out in runner.run(n)]


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
        runner.host_inputs(3)
    with pytest.raises(ValueError):
        runner.host_inputs(0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_graph_runner_equals_eager_on_every_bucket_and_chunks(entry, module, rows, strict_fp32):
    """11 rows with buckets up to 8 runs as a chunk of 8 and a chunk of 3."""
    device = torch.device("cuda")
    gpu_module = zoo.get(MODEL).build().to(device)
    with torch.inference_mode():
        runner = runtime.GraphRunner(
            runtime.capture_sequential(gpu_module), entry.inputs, entry.outputs, device, max_batch=16, buckets=(1, 2, 4, 8)
        )
        assert runner.bucket_for(3) == 4 and runner.bucket_for(11) == 8
        batch = entry.example_inputs(rows, seed=rows)
        (out,) = run(runner, batch)
        expected = gpu_module(*(x.to(device) for x in batch)).cpu().numpy()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(out, expected, atol=1e-4 * scale, rtol=1e-4)
