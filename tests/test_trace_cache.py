"""The trace cache: a warm start reads its exported graph instead of exporting again."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from opara_core import zoo
from opara_core.engine import trace_cache
from opara_core.engine.trace import trace_model
from opara_core.engine.trace_cache import module_fingerprint


def outputs(module, inputs):
    with torch.inference_mode():
        return tree_leaves(module(*inputs))


def test_a_cached_graph_reads_the_live_weights_and_answers_as_eager(tmp_path):
    """BERT: non-persistent buffers (position ids) and an attention mask built
    in the graph. The second trace reads the file the first one wrote, and its
    graph computes with the module it was given, not with saved weights."""
    entry = zoo.get("bert").at((12,))
    first = trace_model(entry, entry.build(), "cpu", cache=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    other = entry.build(seed=5)  # same structure, other weights: the same cache entry
    second = trace_model(entry, other, "cpu", cache=tmp_path)
    assert second.module.code == first.module.code and second.fingerprint == first.fingerprint
    live = {t.data_ptr() for _, t in trace_cache.named_tensors(other)}
    assert all(p.data_ptr() in live for p in second.module.parameters())
    x = entry.example_inputs(3, seed=11)
    for got, want in zip(outputs(second.module, x), outputs(other, x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_key_follows_the_inputs_and_the_modules_settings():
    entry = zoo.get("deepfm")
    module = entry.build()
    dims = entry.dynamic_shapes()
    key = trace_cache.export_key(module, entry.example_inputs(2), dims)
    assert key == trace_cache.export_key(entry.build(seed=3), entry.example_inputs(2, seed=9), dims)  # values do not count
    assert key != trace_cache.export_key(module, entry.example_inputs(4), dims)
    assert key != trace_cache.export_key(module, entry.example_inputs(2), None)
    relu = next(m for m in module.modules() if isinstance(m, torch.nn.ReLU))
    relu.inplace = True  # a plain setting the graph may depend on
    assert key != trace_cache.export_key(module, entry.example_inputs(2), dims)


def test_a_damaged_entry_is_exported_again_and_replaced(tmp_path):
    entry = zoo.get("deepfm")
    module = entry.build()
    trace_model(entry, module, "cpu", cache=tmp_path)
    (path,) = tmp_path.glob("*.pt")
    path.write_bytes(b"not a saved graph")
    graph = trace_model(entry, module, "cpu", cache=tmp_path)
    x = entry.example_inputs(2, seed=4)
    for got, want in zip(outputs(graph.module, x), outputs(module, x)):
        torch.testing.assert_close(got, want)
    assert trace_cache.load(path, module).code == graph.module.code  # rewritten whole


def test_no_directory_no_files(tmp_path, monkeypatch):
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    entry = zoo.get("deepfm")
    trace_model(entry, entry.build())
    assert not list(tmp_path.rglob("*.pt"))


def test_programs_of_the_same_tensors_but_other_operators_are_other_modules():
    # a torch.export program's module class has no source to read: its code tells them apart
    def program(activation):
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(4, 4)

            def forward(self, x):
                return activation(self.linear(x))

        return torch.export.export(Net().eval(), (torch.randn(2, 4),)).module()

    assert module_fingerprint(program(torch.relu)) != module_fingerprint(program(torch.tanh))


class Varargs(torch.nn.Module):
    """A forward of `*inputs` (engine.precision.AtPrecision is one)."""

    def forward(self, *inputs):
        return inputs[0] * 2 + inputs[1].sum(1, keepdim=True)


def test_a_forward_of_varargs_exports_with_a_dynamic_batch(tmp_path):
    batch = torch.export.Dim("batch", min=1, max=16)
    inputs = (torch.randn(3, 4), torch.randn(3, 5))
    gm = trace_cache.exported_module(Varargs(), inputs, ({0: batch}, {0: batch}), tmp_path)
    other = (torch.randn(7, 4), torch.randn(7, 5))
    torch.testing.assert_close(gm(*other), Varargs()(*other))


def test_reading_a_cached_graph_asks_for_each_schema_classs_type_hints_once(tmp_path, monkeypatch):
    """torch.export's deserialiser asked typing.get_type_hints for every object
    it read (pytorch/pytorch#196452): a quarter of NASNet's warm trace."""
    import typing

    from torch._export.serde import serialize

    asked: list[object] = []
    real = typing.get_type_hints

    def counting(obj, *args, **kwargs):
        asked.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(serialize, "typing", typing)  # as torch has it, before any read
    monkeypatch.setattr(typing, "get_type_hints", counting)
    entry = zoo.get("deepfm")
    module = entry.build()
    first = trace_model(entry, module, "cpu", cache=tmp_path)
    asked.clear()
    for _ in range(2):
        second = trace_model(entry, module, "cpu", cache=tmp_path)
        assert second.module.code == first.module.code
    assert asked and len(asked) == len(set(asked)), f"{len(asked)} questions about {len(set(asked))} classes"
