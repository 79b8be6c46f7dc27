"""engine.skinny_pass: Inductor's frozen-weight GEMMs routed through
`opara::skinny_mm`, on the CPU (the op is `torch.mm` there) and, on a GPU, the
whole-model graph that variable-length serving captures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from opara_core.engine import skinny_gemm
from opara_core.engine.skinny_pass import SkinnyGemmPass
from opara_core.models.hf import BertLastHiddenState

LAYERS = 2
LINEARS_PER_LAYER = 6  # query, key, value, attention output, intermediate, output


def tiny_bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    return BertLastHiddenState(transformers.BertModel(config, add_pooling_layer=False)).eval()


def bert_inputs(batch: int, length: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    ids = torch.randint(0, 100, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length // 2 :] = 0
    return ids.to(device), mask.to(device)


def spy(monkeypatch, owner, name: str) -> dict:
    """Count the calls of `owner.name` (it still computes): {"n": calls}."""
    counted = {"n": 0}
    real = getattr(owner, name)

    def counting(*args):
        counted["n"] += 1
        return real(*args)

    monkeypatch.setattr(owner, name, counting)
    return counted


@pytest.fixture
def calls(monkeypatch):
    """How often the op's implementation ran."""
    return spy(monkeypatch, skinny_gemm, "linear_mm")


def replay_against_eager(captured, module: torch.nn.Module, batch: int, length: int) -> None:
    """Replay a captured cell of the tiny BERT on fresh ids and compare with eager."""
    fresh = bert_inputs(batch, length, "cuda")
    fresh[0].random_(0, 100)
    for static, value in zip(captured.inputs, fresh):
        static.copy_(value)
    captured.replay()
    torch.cuda.synchronize()
    with torch.inference_mode():
        torch.testing.assert_close(captured.outputs[0], module(*fresh), rtol=1e-4, atol=1e-4)


def compiled_with(module: torch.nn.Module, graph_pass: SkinnyGemmPass):
    """`module` as the whole-model path compiles it, with `graph_pass` (on the
    CPU without Inductor's prepacked mkldnn weights, so GEMMs stay GEMMs)."""
    torch._dynamo.reset()
    compiled = torch.compile(module, dynamic=True)
    patch = torch._inductor.config.patch(
        {"freezing": True, "post_grad_custom_post_pass": graph_pass, "cpp.weight_prepack": False, "force_disable_caches": True}
    )
    return compiled, patch


def test_every_linear_layer_runs_through_the_op_and_answers_as_eager(calls):
    module = tiny_bert()
    graph_pass = SkinnyGemmPass(devices=("cpu",))
    skinny_gemm.skinny_mm_op()
    compiled, patch = compiled_with(module, graph_pass)
    with patch, torch.inference_mode():
        compiled(*bert_inputs(2, 16))
        assert graph_pass.rewritten == LAYERS * LINEARS_PER_LAYER
        assert calls["n"] == LAYERS * LINEARS_PER_LAYER
        for batch, length in [(2, 16), (3, 37)]:  # dynamic sizes: the same graph, other rows
            x = bert_inputs(batch, length)
            got = compiled(*x)
            torch.testing.assert_close(got, module(*x), rtol=1e-5, atol=1e-5)


def test_only_constant_fp32_weights_on_the_named_devices_are_rewritten(calls):
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)
            self.wide = torch.nn.Linear(8, 8).to(torch.float64)

        def forward(self, x, y):
            # x @ y: both operands inputs (no constant weight); the float64 layer: not fp32
            return self.layer(x) + (x @ y) + self.wide(x.double()).float()

    module = Mixed().eval()
    x, y = torch.randn(4, 8), torch.randn(8, 8)
    for devices, expected in [(("cpu",), 1), (("cuda",), 0)]:
        graph_pass = SkinnyGemmPass(devices=devices)
        compiled, patch = compiled_with(module, graph_pass)
        with patch, torch.inference_mode():
            torch.testing.assert_close(compiled(x, y), module(x, y))
        assert graph_pass.rewritten == expected


# one start of a process: the tiny BERT compiled with the pass and Inductor's
# caches in the directory given, run once
ONE_START = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_skinny_pass import tiny_bert, bert_inputs
    from torch._dynamo.utils import counters
    from opara_core.engine import skinny_gemm
    from opara_core.engine.skinny_pass import SkinnyGemmPass
    calls = []
    real = skinny_gemm.linear_mm
    skinny_gemm.linear_mm = lambda *args: calls.append(1) or real(*args)
    skinny_gemm.skinny_mm_op()
    module = tiny_bert()
    graph_pass = SkinnyGemmPass(devices=("cpu",))
    config = {"freezing": True, "post_grad_custom_post_pass": graph_pass, "cpp.weight_prepack": False}
    with torch._inductor.config.patch(config), torch.inference_mode():
        x = bert_inputs(2, 16)
        error = float((torch.compile(module, dynamic=True)(*x) - module(*x)).abs().max())
    hits = counters["inductor"]["fxgraph_cache_hit"]
    print(json.dumps({"error": error, "rewritten": graph_pass.rewritten, "calls": len(calls), "hits": hits}))
    """
)


def test_a_later_start_loads_the_rewritten_graph_from_inductors_cache(tmp_path):
    # the pass adds constants (the transposed weights) after the cache key is taken:
    # a cache hit must still find them, and still call the op
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    starts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", ONE_START, str(Path(__file__).parent)], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        starts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, later = starts
    assert first["hits"] == 0 and first["rewritten"] == LAYERS * LINEARS_PER_LAYER
    assert later["hits"] == 1 and later["rewritten"] == 0  # compiled code from the cache: no pass ran
    assert later["calls"] == first["calls"] == LAYERS * LINEARS_PER_LAYER
    assert later["error"] <= 1e-5


def test_the_cache_key_follows_the_devices():
    assert SkinnyGemmPass().uuid() == SkinnyGemmPass().uuid()
    assert SkinnyGemmPass(devices=("cpu",)).uuid() != SkinnyGemmPass().uuid()


@pytest.mark.gpu
def test_the_served_whole_model_graph_takes_the_kernel_and_answers_as_eager(tmp_path, monkeypatch, calls):
    from opara_core.engine.whole_model import WholeModelInductor

    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    # a fresh Inductor cache: code compiled by an earlier run would load without the pass
    # running (`rewritten` 0), as it did on a device machine that had run this test before
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(skinny_gemm, "_choices", {})
    torch._dynamo.reset()
    module = tiny_bert().cuda()
    whole = WholeModelInductor(module)
    pool = torch.cuda.graph_pool_handle()
    for batch, length in [(1, 16), (2, 16), (4, 64)]:  # 16, 32 and 256 rows
        captured = whole.capture([t.clone() for t in bert_inputs(batch, length, "cuda")], pool)
        replay_against_eager(captured, module, batch, length)
    assert whole.skinny_pass.rewritten > 0 and calls["n"] > 0
    # every row count the cells met was timed outside the captures, and kept
    known = skinny_gemm.choices_for(torch.device("cuda")).known
    # 256 rows too: above MAX_ROWS the choice is between the two cuBLAS layouts, timed as well
    assert {int(shape.split(",")[0]) for shape in known} == {16, 32, 256}
