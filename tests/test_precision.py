"""engine.precision and the builds in another precision than fp32: casting
inside the module, the guard against the fp32 module, and the fallbacks."""

import pytest
import torch

from opara_core import parameters
from opara_core.engine import precision
from opara_core.engine.build import EngineSettings, build_runner
from opara_core.engine.compare import max_relative_error
from opara_core.spec import ModelSpec, TensorSpec

NATIVE_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Scaled(torch.nn.Module):
    """A float input through two branches that join, and an id input."""

    def __init__(self):
        super().__init__()
        self.left, self.right = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
        self.table = torch.nn.Embedding(10, 16)

    def forward(self, x, ids):
        return torch.relu(self.left(x)) * torch.sigmoid(self.right(x)) + self.table(ids).sum(1), ids * 2


SPEC = ModelSpec(
    "scaled",
    inputs=(TensorSpec("x", torch.float32, (8,)), TensorSpec("ids", torch.int64, (3,), value_range=(0, 10))),
    outputs=(TensorSpec("y", torch.float32, (16,)), TensorSpec("twice", torch.int64, (3,))),
)


def scaled() -> Scaled:
    torch.manual_seed(0)
    return Scaled().eval()


def test_a_half_module_casts_floats_in_and_back_and_leaves_integers_alone():
    module = scaled()
    half = precision.cast(module, SPEC, "bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in module.parameters()} == {torch.float32}, "the fp32 module stays as it was: the guard's reference"
    assert precision.cast(module, SPEC, "bf16") is half, "one half copy per module and precision"
    x, ids = SPEC.example_inputs(4, seed=1)
    with torch.inference_mode():
        y, twice = half(x, ids)
        want_y, want_twice = module(x, ids)
    assert y.dtype == torch.float32 and twice.dtype == torch.int64
    assert torch.equal(twice, want_twice)
    assert 0 < max_relative_error(y, want_y) < 2e-2
    assert precision.cast(module, SPEC, "fp32") is module and precision.cast(module, SPEC, "tf32") is module


def test_the_auto_tolerance_follows_the_eager_error_and_a_number_is_taken_as_given():
    assert precision.tolerance("bf16", "auto", 0.0) == precision.FLOOR["bf16"]
    assert precision.tolerance("bf16", "auto", 0.5) == 0.5 * precision.EAGER_FACTOR
    assert precision.tolerance("fp16", 1e-3, 0.5) == 1e-3


def test_the_parameter_names_its_values():
    values = parameters.parse(parameters.BATCH, {"precision": "bf16", "precision_tolerance": "0.05"})
    assert EngineSettings(**values.settings(parameters.ENGINE)).precision == "bf16"
    with pytest.raises(parameters.ParameterError, match=r"parameter precision is 'int8'; allowed: fp32, tf32, bf16, fp16"):
        parameters.parse(parameters.BATCH, {"precision": "int8"})
    with pytest.raises(parameters.ParameterError, match="precision_tolerance"):
        parameters.parse(parameters.BATCH, {"precision_tolerance": "-1"})


def test_a_cpu_instance_keeps_fp32_where_it_cannot_run_the_precision_natively():
    cpu = torch.device("cpu")
    assert precision.on_device("tf32", cpu)[0] == "fp32"
    assert precision.on_device("bf16", torch.device("cuda")) == ("bf16", "")
    runner, report = build_runner(scaled(), SPEC, cpu, 4, EngineSettings(precision="tf32"))
    assert report.precision == "fp32" and report.fallbacks[0].startswith("precision tf32: ")


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bf16")
def test_a_cpu_build_in_bf16_is_held_to_its_tolerance_against_the_fp32_module():
    module = scaled()
    runner, report = build_runner(module, SPEC, torch.device("cpu"), 4, EngineSettings(precision="bf16"))
    assert report.precision == "bf16" and not report.fallbacks
    (accuracy,) = report.precision_error.values()
    assert 0 < accuracy.error <= accuracy.tolerance
    assert "precision bf16: max relative error against the fp32 module" in report.summary()
    x, ids = SPEC.example_inputs(3, seed=2)
    y, _ = runner.run([x, ids])
    with torch.inference_mode():
        assert 0 < max_relative_error(y, module(x, ids)[0]) <= accuracy.tolerance


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bf16")
def test_a_build_beyond_its_tolerance_runs_fp32_and_says_why():
    module = scaled()
    runner, report = build_runner(module, SPEC, torch.device("cpu"), 4, EngineSettings(precision="bf16", precision_tolerance=1e-9))
    assert report.precision == "fp32"
    assert report.fallbacks and "replay differs from the fp32 module" in report.fallbacks[0] and "runs fp32" in report.fallbacks[0]
    x, ids = SPEC.example_inputs(3, seed=2)
    with torch.inference_mode():
        assert max_relative_error(runner.run([x, ids]), module(x, ids)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["bf16", "fp16", "tf32"])
def test_on_a_gpu_a_build_in_another_precision_has_graphs_within_tolerance(tmp_path, monkeypatch, numerics):
    """Multi-stream graphs (fused lanes among the candidates) in the precision,
    each bucket held against the fp32 module, the answers in the config's datatypes."""
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path / "cache"))
    module = scaled()
    device = torch.device("cuda")
    runner, report = build_runner(module, SPEC, device, 8, EngineSettings(buckets=(1, 8), precision=numerics))
    assert report.runner == "multi-stream graph" and not report.fallbacks, report.summary()
    assert report.precision == numerics and set(report.precision_error) == {1, 8}
    for batch in (1, 5):
        x, ids = SPEC.example_inputs(batch, seed=batch)
        y, twice = runner.run([x, ids])
        with torch.inference_mode():
            want_y, want_twice = module.to(device)(x.to(device), ids.to(device))
        assert y.dtype == torch.float32 and torch.equal(twice.to(device), want_twice)
        assert max_relative_error(y, want_y) <= max(a.tolerance for a in report.precision_error.values())


@pytest.mark.gpu
def test_on_a_gpu_no_graph_within_tolerance_builds_again_in_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path / "cache"))
    runner, report = build_runner(scaled(), SPEC, torch.device("cuda"), 8, EngineSettings(buckets=(1, 8), precision="bf16", precision_tolerance=1e-9))
    assert report.precision == "fp32" and report.runner != "eager", report.summary()
    assert any(reason.startswith("precision bf16: no graph passed its guard") for reason in report.fallbacks), report.fallbacks
