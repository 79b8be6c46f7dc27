"""engine.exported_merge: linear layers that read one tensor become one GEMM in
an exported graph whose weights are inputs; the graph with the merged weights
bound answers as the eager module, and so does a saved artifact built on it."""

from __future__ import annotations

import json

import torch
from serving import assert_close

from opara_core.engine import skinny_gemm
from opara_core.engine.exported_merge import merge_linears
from opara_core.engine.whole_model import WholeModelSaved, export_dynamic

DIMS = ({0: ("batch", 1, 4), 1: ("tokens", 1, 16)},)


class Projections(torch.nn.Module):
    """Three biased projections of one tensor (BERT's query, key, value), two
    without bias of another (T5's cross-attention key and value), one alone."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.query, self.key, self.value = (torch.nn.Linear(8, n) for n in (8, 8, 4))
        self.cross_key, self.cross_value = (torch.nn.Linear(8, 6, bias=False) for _ in range(2))
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        other = torch.tanh(x)
        ck, cv = self.cross_key(other), self.cross_value(other)
        mixed = torch.softmax(q @ k.transpose(1, 2), -1) @ torch.cat([v, ck[..., :4]], -1)
        return self.out(torch.relu(mixed)) + cv.sum(-1, keepdim=True)


def skinny_calls(gm: torch.fx.GraphModule) -> int:
    return sum(node.target is skinny_gemm.skinny_mm_op() for node in gm.graph.nodes)


def test_layers_that_read_one_tensor_become_one_gemm_and_answer_as_eager():
    module = Projections().eval()
    prepared = skinny_gemm.with_skinny_linears(module)
    example = torch.randn(2, 5, 8)
    exported = export_dynamic(prepared, (example,), DIMS)
    gm = exported.graph_module
    assert skinny_calls(gm) == 6
    names = [spec.arg.name for spec in exported.graph_signature.input_specs]
    state = {**dict(prepared.named_parameters()), **dict(prepared.named_buffers())}
    by_name = {spec.arg.name: state.get(spec.target) for spec in exported.graph_signature.input_specs}
    merged = merge_linears(gm)
    assert skinny_calls(gm) == 3  # query+key+value, cross key+value, out
    assert [len(m.parts) for m in merged] == [3, 3, 3, 2, 2]  # weights, transposes, biases; weights, transposes
    # the members' own weights are graph inputs no more (13 of them); the unmerged layer's stay
    left = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
    parts = {part for m in merged for part in m.parts}
    assert len(parts) == 13 and not parts & set(left)
    assert {name for name in names if name in by_name} - parts <= set(left)
    names = [name for name in names if name in left]
    for x in (torch.randn(1, 1, 8), torch.randn(4, 16, 8), torch.randn(3, 7, 8)):
        flat = [x if name not in by_name or by_name[name] is None else by_name[name] for name in names]
        flat += [torch.cat([by_name[part] for part in m.parts], m.dim) for m in merged]
        with torch.inference_mode():
            (actual,) = gm(*flat)
            assert_close(actual.numpy(), module(x).numpy(), 1e-5)


def test_a_saved_artifact_takes_the_merged_weights_from_the_module(tmp_path):
    module = Projections().eval()
    saved = WholeModelSaved(module, (torch.randn(2, 5, 8),), DIMS, tmp_path, short_attention=False)
    inputs = json.loads(saved.signature_path.read_text())["inputs"]
    merged = [name for kind, name in inputs if kind == "MERGED"]
    assert [part.rsplit(".", 1)[0] for part in merged[0]["cat"]] == ["query", "key", "value"]
    # the artifact takes the merged weights, not its members' (their transposed copies are not kept)
    taken = {name for kind, name in inputs if kind != "MERGED"}
    assert "out.weight_t" in taken and not taken & {part for m in merged for part in m["cat"]}
    with torch.inference_mode():
        for x in (torch.randn(1, 1, 8), torch.randn(4, 16, 8)):
            assert_close(saved.runner(x).numpy(), module(x).numpy(), 1e-5)
    again = WholeModelSaved(module, (torch.randn(2, 5, 8),), DIMS, tmp_path, short_attention=False)
    assert not again.compiled_now
    with torch.inference_mode():
        x = torch.randn(3, 9, 8)
        assert_close(again.runner(x).numpy(), module(x).numpy(), 1e-5)
