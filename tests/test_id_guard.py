"""serving.id_guard: a batch model's id ranges checked inside the graph it serves."""

from __future__ import annotations

import pytest
import torch

from opara_core import zoo
from opara_core.engine.build import EngineSettings, build_runner
from opara_core.engine.compare import max_relative_error
from opara_core.engine.trace import trace_model
from opara_core.serving import id_guard
from opara_core.spec import ModelSpec, TensorSpec


class Looks(torch.nn.Module):
    """Returns what it was given, so a test sees the ids the served module reads."""

    def forward(self, ids: torch.Tensor, x: torch.Tensor):
        return ids * 1, x * 2


def test_deepfm_answers_good_rows_as_before_and_flags_each_row_with_a_bad_id():
    entry = zoo.get("deepfm")
    module, graph_entry = id_guard.in_graph(entry.build().eval(), entry)
    assert graph_entry.outputs == (*entry.outputs, id_guard.OUT_OF_RANGE_SPEC) and graph_entry.inputs == entry.inputs
    inputs = entry.example_inputs(6, seed=1)
    ranged = next(k for k, spec in enumerate(entry.inputs) if spec.limits() is not None)
    _, high = entry.inputs[ranged].limits()
    inputs[ranged][1, 3] = int(high[3])  # one past its field's table
    inputs[ranged][4, 0] = -1
    with torch.inference_mode():
        logits, clamped = module(*inputs)
        alone = entry.build().eval()
        expected = alone(*(t[[0, 2, 3, 5]] for t in inputs))
    assert clamped.dtype == torch.int32 and clamped.tolist() == [0, 1, 0, 0, 1, 0]
    torch.testing.assert_close(logits[[0, 2, 3, 5]], expected)


def test_the_ids_the_module_reads_lie_in_their_tables_and_keep_their_dtype():
    spec = TensorSpec("ids", torch.int32, (3,), value_range=(0, 100), upper_bounds=(10, 20, 100))
    entry = ModelSpec("looks", (spec, TensorSpec("x", torch.float32, (2,))), (TensorSpec("ids", torch.int32, (3,)), TensorSpec("x", torch.float32, (2,))))
    module, _ = id_guard.in_graph(Looks(), entry)
    ids = torch.tensor([[9, 19, 99], [10, 5, 5], [-3, 0, 100]], dtype=torch.int32)
    seen, doubled, clamped = module(ids, torch.ones(3, 2))
    assert seen.dtype == torch.int32 and seen.tolist() == [[9, 19, 99], [9, 5, 5], [0, 0, 99]]
    assert clamped.tolist() == [0, 1, 1] and doubled.tolist() == [[2.0, 2.0]] * 3


def test_a_model_without_ranged_inputs_is_built_as_it_is():
    entry = zoo.get("googlenet")
    module = torch.nn.Identity()
    assert id_guard.in_graph(module, entry) == (module, entry)
    assert not id_guard.guarded(entry)


def test_the_engine_traces_the_guarded_module_with_a_dynamic_batch():
    entry = zoo.get("deepfm")
    module, graph_entry = id_guard.in_graph(entry.build().eval(), entry)
    assert id_guard.guarded(graph_entry)
    graph = trace_model(graph_entry, module, "cpu", batch=4)
    assert any("clamp" in str(node.target) for node in graph.module.graph.nodes)


@pytest.mark.gpu
def test_a_served_deepfm_graph_answers_good_rows_and_flags_bad_ones_without_a_device_assert():
    """The build a GPU instance makes (fused lanes among the candidates, bf16 as
    shipped), run on a batch with ids past their tables, from the GPU (CUDA shared
    memory) and from the host: the graph reads clamped ids, flags those rows, and
    the other rows answer as the module does alone."""
    entry = zoo.get("deepfm")
    module, graph_entry = id_guard.in_graph(entry.build().eval(), entry)
    settings = EngineSettings(buckets=(1, 8), precision="bf16", remember_choices=False)
    runner, report = build_runner(module, graph_entry, torch.device("cuda"), 8, settings)
    assert report.runner != "eager", report.fallbacks
    inputs = entry.example_inputs(6, seed=2)
    ranged = next(k for k, spec in enumerate(entry.inputs) if spec.limits() is not None)
    inputs[ranged][2, 5] = 10**9
    inputs[ranged][5, 0] = -7
    good = [0, 1, 3, 4]
    with torch.inference_mode():
        expected = entry.build().eval()(*(t[good] for t in inputs))
    for where in ("cuda", "cpu"):
        *outputs, clamped = runner.run([t.to(where) for t in inputs])
        assert clamped.tolist() == [0, 0, 1, 0, 0, 1], where
        assert max_relative_error(outputs[0][good].cpu(), expected) < 2e-2, where
    torch.cuda.synchronize()  # a device-side assert would surface here
