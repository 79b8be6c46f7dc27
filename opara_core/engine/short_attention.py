"""Attention over a few tokens as one small Triton kernel: the custom op
`opara::short_attention`, and the Inductor post-grad pass that routes the
memory-efficient SDPA kernel's calls to it.

Why: at fp32 SDPA runs the memory-efficient CUTLASS kernel, which costs about
9 us a call however short the sequence (BERT's 16-token cell: 12 calls, 108 of
its 588 us; docs/benchmarks.md, variable lengths run 9). A program per (batch,
head) that holds the whole problem in registers (`short_attention_kernels`)
takes 3.3 us at 16 tokens and 5.0 at 32, but 15.7 at 64 against the efficient
kernel's 10.1 (the probe `scripts/short_attention.py`, since removed, H100, 2026-11-27): so up to
MAX_TOKENS queries and keys.

The op decides per call, so one graph with dynamic sizes serves every cell:
the kernel where the call qualifies (`takes_kernel`), the efficient kernel as
the graph ran before elsewhere (on a CPU, which has no efficient kernel, SDPA's
own math: only tests run it there). Whichever runs, the output is laid out as
the efficient kernel lays it out ([B, L, H, D] in memory, viewed as [B, H, L,
D]): the code Inductor generated around the call was planned for that layout.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node
from torch.fx.operator_schemas import normalize_function

log = logging.getLogger(__name__)

aten = torch.ops.aten

MAX_TOKENS = 32  # queries and keys where the op runs the kernel; at 64 the efficient kernel wins (module docstring)
TILE_TOKENS = 64  # the most the kernel takes (its tiles hold every query and key in registers)
HEAD_SIZES = (16, 32, 64, 128)  # the kernel's tile spans the head whole: a power of two, at least tl.dot's 16


@functools.cache
def _kernels():
    from opara_core.engine import short_attention_kernels

    return short_attention_kernels


def takes_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel computes this call: fp32 4-D tensors on a GPU, at most
    MAX_TOKENS queries and keys, one head size of HEAD_SIZES for q, k and v."""
    tensors = (q, k, v) if bias is None else (q, k, v, bias)
    if not all(t.is_cuda and t.dtype == torch.float32 and t.dim() == 4 for t in tensors):
        return False
    return q.shape[2] <= MAX_TOKENS and k.shape[2] <= MAX_TOKENS and q.shape[3] == k.shape[3] == v.shape[3] in HEAD_SIZES


def efficient_layout(batch: int, heads: int, length: int, head_size: int, like: torch.Tensor) -> torch.Tensor:
    """An empty [B, H, L, D] output laid out as [B, L, H, D], as the efficient kernel writes it."""
    return like.new_empty((batch, length, heads, head_size)).transpose(1, 2)


def efficient_strides(batch: int, heads: int, length: int, head_size: int) -> tuple[int, int, int, int]:
    """The strides of `efficient_layout`'s tensor, without allocating one."""
    return (length * heads * head_size, head_size, heads * head_size, 1)


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with the kernel: q [B, H, Lq, D], k and v
    [B, H, Lk, D], bias broadcastable to [B, H, Lq, Lk]; any strides; lengths up
    to TILE_TOKENS."""
    (batch, heads, lq, size), lk = q.shape, k.shape[2]
    if max(lq, lk) > TILE_TOKENS or size not in HEAD_SIZES:
        raise ValueError(f"short attention: {lq} queries and {lk} keys of head size {size}; the kernel takes up to {TILE_TOKENS} tokens and head sizes {HEAD_SIZES}")
    out = efficient_layout(batch, heads, lq, size, q)
    bias_strides = bias.expand(batch, heads, lq, lk).stride() if bias is not None else (0, 0, 0, 0)  # broadcast: stride 0
    _kernels().short_attention[(batch * heads,)](
        q, k, v, q if bias is None else bias, out, lq, lk, heads, 1 / math.sqrt(size) if scale is None else scale,
        *q.stride(), *k.stride(), *v.stride(), *bias_strides, *out.stride(),
        HAS_BIAS=bias is not None, BLOCK_Q=max(16, 1 << (lq - 1).bit_length()), BLOCK_K=max(16, 1 << (lk - 1).bit_length()), BLOCK_D=size,
    )  # fmt: skip
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """The op's body: the kernel where `takes_kernel`, else the efficient kernel
    (on a GPU) or SDPA's math (on a CPU), laid out as the efficient kernel's."""
    if takes_kernel(q, k, v, bias):
        return kernel_attention(q, k, v, bias, scale)
    if q.is_cuda:
        result = aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, scale=scale)[0]
    else:
        result = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    sizes = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    return result if result.stride() == efficient_strides(*sizes) else efficient_layout(*sizes, q).copy_(result)


@functools.cache
def short_attention_op():
    """`torch.ops.opara.short_attention` (registered on first use: no side
    effects at import): `attention` as a custom op, which Inductor calls as one
    opaque kernel, with a fake implementation for shapes and strides."""

    @torch.library.custom_op("opara::short_attention", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        return attention(q, k, v, bias, scale)

    @op.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        return efficient_layout(q.shape[0], q.shape[1], q.shape[2], v.shape[3], q)

    return torch.ops.opara.short_attention.default


# ---- the post-grad pass ------------------------------------------------------------------


class ShortAttentionPass(CustomGraphPass):
    """For Inductor's post-grad custom pass (`engine.whole_model`). Its uuid (this
    file's and the kernel's source, the devices) keys Inductor's FX graph cache.
    `devices`: where calls are rewritten (the CPU only for tests: the efficient
    kernel is CUDA's); `rewritten` counts the calls of every graph it saw."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",)):
        self.devices = devices
        self.rewritten = 0

    def __call__(self, graph: Graph) -> None:
        count = rewrite_efficient_attention(graph, self.devices)
        self.rewritten += count
        log.debug("%d efficient-attention calls through opara::short_attention", count)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, str(Path(__file__).with_name("short_attention_kernels.py"))), extra=",".join(self.devices))


def rewrite_efficient_attention(graph: Graph, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Route every inference call of the efficient SDPA kernel on one of
    `devices` (no log-sum-exp, dropout or causal mask; only its output read)
    through the op; the number rewritten."""
    count = 0
    for node in list(graph.nodes):
        call = _inference_call(node, devices)
        if call is None:
            continue
        reads = list(node.users)
        with graph.inserting_before(node):
            result = graph.call_function(short_attention_op(), (call["query"], call["key"], call["value"], call["attn_bias"]), {"scale": call["scale"]})
        result.meta["val"] = reads[0].meta["val"]
        for read in reads:
            read.replace_all_uses_with(result)
            graph.erase_node(read)
        graph.erase_node(node)
        count += 1
    return count


def _inference_call(node: Node, devices: tuple[str, ...]) -> dict | None:
    """The arguments of an efficient-attention call the op can take (by name), or None."""
    if node.op != "call_function" or node.target is not aten._scaled_dot_product_efficient_attention.default:
        return None
    call = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    if call["compute_log_sumexp"] or call["dropout_p"] != 0.0 or call["is_causal"]:
        return None
    if not node.users or not all(read.target is operator.getitem and read.args[1] == 0 for read in node.users):
        return None  # the log-sum-exp or the seeds are read: leave it
    query = call["query"].meta.get("val") if isinstance(call["query"], Node) else None
    if not isinstance(query, torch.Tensor) or query.device.type not in devices or query.dtype != torch.float32:
        return None
    return call
