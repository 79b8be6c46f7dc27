"""engine.short_attention: the kernel's arithmetic (on the CPU through Triton's
interpreter), the op and the post-grad rewrite on the CPU, and on a GPU the
kernel against float64 and the whole-model graph that variable-length serving
captures."""

from __future__ import annotations

import operator
import textwrap
from pathlib import Path

import pytest
from conftest import interpreted_worst_error
import torch
from hypothesis import given
from hypothesis import strategies as st

from opara_core.engine import short_attention
from opara_core.engine.short_attention import ShortAttentionPass, rewrite_efficient_attention

ROOT = Path(__file__).resolve().parents[1]
efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default


def projections(batch: int, lq: int, lk: int, heads: int = 2, size: int = 16, seed: int = 0, device: str = "cpu"):
    """q [B, H, Lq, D] and k, v [B, H, Lk, D] as BERT's graph holds them: views of
    one projection, permuted (strided, not contiguous)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, lq, heads * size, generator=generator).view(batch, lq, heads, size).permute(0, 2, 1, 3)
    kv = torch.randn(batch, lk, 2 * heads * size, generator=generator)
    k, v = (t.view(batch, lk, heads, size).permute(0, 2, 1, 3) for t in kv.split(heads * size, dim=-1))
    return q.to(device), k.to(device), v.to(device)


def mask_bias(batch: int, lq: int, lk: int, heads: int, device: str = "cpu") -> torch.Tensor:
    """BERT's mask as HF builds it: 0 or float32's lowest per key, [B, 1, 1, Lk]
    expanded over heads and queries (stride 0), its rows padded to a multiple of
    8 as SDPA pads them (the efficient kernel's alignment); row b pads its last b keys."""
    keep = torch.ones(batch, -(-lk // 8) * 8)
    for row in range(1, batch):
        keep[row, lk - min(row, lk - 1) : lk] = 0
    bias = ((1 - keep) * torch.finfo(torch.float32).min).to(device)
    return bias.view(batch, 1, 1, -1)[..., :lk].expand(batch, heads, lq, lk)


def exact(q, k, v, bias=None, scale=None) -> torch.Tensor:
    """float64 attention, the oracle."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias.double()
    return scores.softmax(-1) @ v.double()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


# (batch, queries, keys): one token, ragged lengths below a tile, queries unlike keys (T5's cross-attention), the op's limit, the tile's
SHAPES = [(1, 1, 1), (2, 7, 7), (3, 16, 16), (2, 5, 29), (1, 32, 32), (2, 32, 9), (1, 64, 40)]

INTERPRETED = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_short_attention import SHAPES, projections, mask_bias, exact, relative_error
    from opara_core.engine.short_attention import kernel_attention
    worst = 0.0
    for batch, lq, lk in SHAPES:
        q, k, v = projections(batch, lq, lk)
        full = torch.randn(batch, 2, lq, lk, generator=torch.Generator().manual_seed(lq))  # T5's position bias: a value per head
        for bias, scale in ((None, None), (mask_bias(batch, lq, lk, 2), None), (full, 1.0), (full[:1], 0.3)):
            got = kernel_attention(q, k, v, bias, scale)
            assert got.shape == (batch, 2, lq, 16) and got.transpose(1, 2).is_contiguous()
            worst = max(worst, relative_error(got, exact(q, k, v, bias, scale)))
    print(worst)
    """
)


def test_the_kernel_computes_attention_for_every_length_and_bias():
    # Triton's interpreter runs the kernel's Python on the CPU: the same index
    # arithmetic, masks and softmax the GPU runs
    assert interpreted_worst_error(INTERPRETED, str(ROOT / "tests")) <= 1e-6


def test_the_kernel_refuses_what_its_tile_cannot_hold():
    q, k, v = projections(1, 65, 65)
    with pytest.raises(ValueError, match="65 queries and 65 keys"):
        short_attention.kernel_attention(q, k, v)
    q, k, v = projections(1, 8, 8, size=24)
    with pytest.raises(ValueError, match="head size 24"):
        short_attention.kernel_attention(q, k, v)


def test_on_the_cpu_the_op_is_sdpa_laid_out_as_the_efficient_kernel():
    op = short_attention.short_attention_op()
    q, k, v = projections(2, 9, 9)
    bias = mask_bias(2, 9, 9, 2)
    got = op(q, k, v, bias, scale=0.5)
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.5))
    assert got.transpose(1, 2).is_contiguous()  # [B, L, H, D] in memory


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 40), st.sampled_from(short_attention.HEAD_SIZES))
def test_the_layout_is_known_without_allocating(batch, heads, length, size):
    # the op returns the efficient kernel's own output as it is where these strides match
    like = torch.empty(0)
    assert short_attention.efficient_layout(batch, heads, length, size, like).stride() == short_attention.efficient_strides(batch, heads, length, size)


# ---- the rewrite, on a hand-built post-grad graph (CPU SDPA has no efficient kernel to trace) ----


def efficient_graph(q, k, v, bias, *, read=(0,), **call) -> torch.fx.GraphModule:
    """A graph calling the efficient kernel on placeholders q, k, v, bias and returning the results at `read`."""
    graph = torch.fx.Graph()
    inputs = []
    for name, value in zip("qkvb", (q, k, v, bias)):
        node = graph.placeholder(name)
        node.meta["val"] = value
        inputs.append(node)
    node = graph.call_function(efficient, (*inputs, False), call)
    outputs = [graph.call_function(operator.getitem, (node, i)) for i in read]
    for out in outputs:
        out.meta["val"] = exact(q, k, v, bias).float().transpose(1, 2).contiguous().transpose(1, 2)
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def calls_of(gm: torch.fx.GraphModule, target) -> int:
    return sum(node.target is target for node in gm.graph.nodes)


def test_the_rewrite_routes_an_inference_call_through_the_op_and_keeps_its_answer():
    q, k, v = projections(2, 12, 12)
    bias = mask_bias(2, 12, 12, 2)
    for call in ({}, {"scale": 0.25}):
        gm = efficient_graph(q, k, v, bias, **call)
        assert rewrite_efficient_attention(gm.graph, devices=("cpu",)) == 1
        gm.recompile()
        assert calls_of(gm, efficient) == 0 and calls_of(gm, short_attention.short_attention_op()) == 1
        (got,) = gm(q, k, v, bias)
        assert relative_error(got, exact(q, k, v, bias, call.get("scale"))) <= 1e-6


@pytest.mark.parametrize(
    "why, call, read, devices",
    [
        ("causal", {"is_causal": True}, (0,), ("cpu",)),
        ("dropout", {"dropout_p": 0.1}, (0,), ("cpu",)),
        ("the log-sum-exp is read", {}, (0, 1), ("cpu",)),
        ("another device", {}, (0,), ("cuda",)),
    ],
)
def test_the_rewrite_leaves_calls_the_op_does_not_compute(why, call, read, devices):
    q, k, v = projections(1, 8, 8)
    gm = efficient_graph(q, k, v, mask_bias(1, 8, 8, 2), read=read, **call)
    assert rewrite_efficient_attention(gm.graph, devices=devices) == 0, why
    assert calls_of(gm, efficient) == 1


def test_the_cache_key_follows_the_devices():
    assert ShortAttentionPass().uuid() == ShortAttentionPass().uuid()
    assert ShortAttentionPass(devices=("cpu",)).uuid() != ShortAttentionPass().uuid()


# ---- on a GPU ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch, lq, lk", [*SHAPES, (8, 16, 16), (4, 32, 32)])
def test_the_kernel_equals_float64_on_the_gpu_as_closely_as_the_efficient_kernel(batch, lq, lk):
    q, k, v = projections(batch, lq, lk, heads=12, size=64, device="cuda")
    # a bias of a value per head, its rows padded to a multiple of 8 as SDPA pads them (the efficient kernel's alignment)
    per_head = torch.randn(batch, 12, lq, -(-lk // 8) * 8, device="cuda")[..., :lk]
    for bias in (None, mask_bias(batch, lq, lk, 12, "cuda"), per_head):
        want = exact(q, k, v, bias)
        mine = short_attention.kernel_attention(q, k, v, bias)
        theirs = efficient(q, k, v, bias, False)[0]
        assert mine.stride() == theirs.stride()
        assert relative_error(mine, want) <= max(2 * relative_error(theirs, want), 2e-6)


def tiny_bert() -> torch.nn.Module:
    import transformers

    from opara_core.models.hf import BertLastHiddenState

    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    return BertLastHiddenState(transformers.BertModel(config, add_pooling_layer=False)).eval()


def bert_inputs(batch: int, length: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    ids = torch.randint(0, 100, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length // 2 :] = 0
    return ids.to(device), mask.to(device)


@pytest.mark.gpu
def test_the_served_whole_model_graph_takes_the_kernel_and_answers_as_eager(tmp_path, monkeypatch):
    """The saved whole-model artifact (compiler "saved") of a tiny BERT: its
    attention runs the kernel at 16 and 32 tokens, the efficient kernel at 64;
    each captured cell answers as eager."""
    from opara_core.engine.whole_model import WholeModelSaved

    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    ran = {"n": 0}
    real = short_attention.kernel_attention

    def counting(*args):
        ran["n"] += 1
        return real(*args)

    monkeypatch.setattr(short_attention, "kernel_attention", counting)
    module = tiny_bert().cuda()
    dims = [{0: ("batch", 1, 4), 1: ("tokens", 1, 64)}] * 2
    whole = WholeModelSaved(module, bert_inputs(3, 24, "cuda"), dims, tmp_path / "saved")
    pool = torch.cuda.graph_pool_handle()
    for batch, length in [(1, 16), (2, 32), (2, 64)]:
        before = ran["n"]
        captured = whole.capture([t.clone() for t in bert_inputs(batch, length, "cuda")], pool)
        assert (ran["n"] > before) == (length <= short_attention.MAX_TOKENS)
        fresh = bert_inputs(batch, length, "cuda")
        fresh[0].random_(0, 100)
        for static, value in zip(captured.inputs, fresh):
            static.copy_(value)
        captured.replay()
        torch.cuda.synchronize()
        with torch.inference_mode():
            torch.testing.assert_close(captured.outputs[0], module(*fresh), rtol=1e-4, atol=1e-4)
