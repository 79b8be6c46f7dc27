"""engine.whole_model's saved Inductor artifact on the CPU: one answers every
size its dynamic dimensions allow as the eager module does; a later start loads
it without compiling; it reads the live weights, so other weights share it.
(Capturing it into CUDA graphs is a GPU test in tests/test_varlen.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from serving import assert_close

from opara_core.engine import whole_model
from opara_core.engine.whole_model import WholeModelSaved

DIMS = ({0: ("batch", 1, 4), 1: ("tokens", 1, 16)}, {0: ("batch", 1, 4), 1: ("tokens", 1, 16)})


class TinyAttention(torch.nn.Module):
    """Ids and a mask of one variable length, as BERT takes them."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(50, 8)
        self.project = torch.nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * mask.unsqueeze(-1)
        scores = self.project(x) @ x.transpose(1, 2) + (mask[:, None, :] - 1) * 1e4
        return torch.softmax(scores, -1) @ x


def inputs(batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 100 + tokens)
    mask = torch.ones(batch, tokens, dtype=torch.int64)
    mask[:, tokens // 2 + 1 :] = 0
    return torch.randint(0, 50, (batch, tokens), generator=generator), mask


def test_one_artifact_answers_every_size_as_eager_and_a_later_start_only_loads_it(tmp_path, monkeypatch):
    module = TinyAttention().eval()
    first = WholeModelSaved(module, inputs(3, 7), DIMS, tmp_path)
    assert first.compiled_now and first.path.exists()
    # its linear layer exported as the skinny GEMM op (with its transposed weight); the module itself as it was
    assert ["BUFFER", "project.weight_t"] in json.loads(first.signature_path.read_text())["inputs"]
    assert type(module.project) is torch.nn.Linear and not hasattr(module.project, "weight_t")
    with torch.inference_mode():
        for batch, tokens in [(1, 1), (1, 16), (3, 7), (4, 12)]:  # sizes of 1 too: no specialisation
            example = inputs(batch, tokens)
            assert_close(first.runner(*example).numpy(), module(*example).numpy(), 1e-5)

    def no_compiling(*args, **kwargs):
        raise AssertionError("a later start compiled again")

    monkeypatch.setattr(torch._inductor, "standalone_compile", no_compiling)
    again = WholeModelSaved(TinyAttention().eval(), inputs(2, 5), DIMS, tmp_path)  # same weights, other example sizes
    assert not again.compiled_now and again.path == first.path
    with torch.inference_mode():
        example = inputs(2, 9)
        assert_close(again.runner(*example).numpy(), module(*example).numpy(), 1e-5)
    assert first.path.name in {p.name for p in tmp_path.iterdir()}
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial file left


def test_a_saved_artifact_reads_the_live_weights_and_its_key_follows_the_attention_pass(tmp_path):
    """The artifact holds code, not weights: a module whose weights changed in
    place after the load answers with the new ones; with and without the
    short-attention pass are two artifacts."""
    module = TinyAttention().eval()
    saved = WholeModelSaved(module, inputs(3, 7), DIMS, tmp_path, skinny_gemms=False)  # (a swapped layer keeps its transpose)
    with torch.inference_mode():
        module.project.weight.mul_(2)
        example = inputs(2, 9)
        assert_close(saved.runner(*example).numpy(), module(*example).numpy(), 1e-5)
    plain = WholeModelSaved(TinyAttention().eval(), inputs(3, 7), DIMS, tmp_path, skinny_gemms=False, short_attention=False)
    assert plain.compiled_now and plain.path != saved.path


def test_the_artifact_key_follows_structure_and_allowed_sizes_not_weight_values():
    """A saved artifact holds code, its weights are inputs: other values, one key."""
    module, example = TinyAttention(), inputs(3, 7)
    key = whole_model.artifact_key(module, example, DIMS)
    assert whole_model.artifact_key(TinyAttention(seed=1), inputs(2, 5), DIMS) == key
    wider = TinyAttention()
    wider.project = torch.nn.Linear(8, 8, bias=False)
    assert whole_model.artifact_key(wider, example, DIMS) != key
    longer = ({0: ("batch", 1, 4), 1: ("tokens", 1, 32)}, {0: ("batch", 1, 4), 1: ("tokens", 1, 32)})
    assert whole_model.artifact_key(module, example, longer) != key


def test_a_damaged_artifact_is_compiled_again(tmp_path):
    module = TinyAttention().eval()
    path = WholeModelSaved(module, inputs(3, 7), DIMS, tmp_path).path
    path.write_bytes(b"not an artifact")  # a disk that lost it, say
    again = WholeModelSaved(module, inputs(3, 7), DIMS, tmp_path)
    assert again.compiled_now and again.path == path
    with torch.inference_mode():
        example = inputs(2, 9)
        assert_close(again.runner(*example).numpy(), module(*example).numpy(), 1e-5)


def test_a_failed_compile_leaves_no_artifact(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(torch._inductor, "standalone_compile", broken)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        WholeModelSaved(TinyAttention().eval(), inputs(3, 7), DIMS, tmp_path)
    assert list(tmp_path.iterdir()) == []
