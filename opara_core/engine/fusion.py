"""Graph passes before planning: fewer, cheaper kernels with the same outputs.

On an H100 the time of GoogLeNet's multi-stream graph sits in the convolutions
and ReLUs on the critical path and in the waits between lanes; folding
BatchNorm alone did not move it (0.46 -> 0.47 ms). So besides folding, the
passes here fuse critical-path kernels (cuDNN's conv + bias + ReLU), merge
parallel convolutions that read one tensor into one kernel (IOS's merge, which
also removes lanes and waits), and drop work that is done twice or not at all.

Every pass rewrites the ATen-level GraphModule that `graph.trace` gives
(torch.export + run_decompositions) in place, returns how many rewrites it
made, and keeps `node.meta["val"]` (a fake tensor) on every node it creates, so
`graph.from_graph_module` can rebuild the kernel DAG. Folded and merged weights
become new buffers of the GraphModule; the ones no node reads any more are
deleted by `fuse`. The cuDNN passes only rewrite nodes whose values live on a
CUDA device: the fused ops have no CPU (or meta) kernel.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_leaves, tree_map

from opara_core.engine import cache as caches
from opara_core.engine import depthwise_conv, skinny_gemm
from opara_core.engine import trace as graphs
from opara_core.engine.compare import max_relative_error, no_cudnn_autotuning
from opara_core.engine.shape_choices import ShapeChoices
from opara_core.engine.trace import OpGraph

log = logging.getLogger(__name__)

aten = torch.ops.aten
CONV = aten.convolution.default
BATCH_NORM = aten._native_batch_norm_legit_no_training.default
RELU = aten.relu.default
ADD = aten.add.Tensor
SLICE = aten.slice.Tensor
CONV_RELU = aten.cudnn_convolution_relu.default
CONV_ADD_RELU = aten.cudnn_convolution_add_relu.default

# dtypes cuDNN's fused convolutions take
_CUDNN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PROBE_TOLERANCE = 1e-4  # a fused convolution's relative error against conv + ReLU in strict fp32 (half precision: twice the plain kernels')


@dataclass(frozen=True)
class FusionReport:
    """What `fuse` did: rewrites per pass (in the order run) and kernels before/after.

    `note` says why fewer passes than asked for were kept (see `fuse_graph`).
    """

    device: str
    rewrites: Mapping[str, int] = field(default_factory=dict)
    kernels_before: int = 0
    kernels_after: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rewrites", MappingProxyType(dict(self.rewrites)))

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "rewrites": dict(self.rewrites),
            "kernels_before": self.kernels_before,
            "kernels_after": self.kernels_after,
            "note": self.note,
        }

    def __str__(self) -> str:
        passes = ", ".join(f"{name} {count}" for name, count in self.rewrites.items()) or "no passes"
        text = f"{self.kernels_before} -> {self.kernels_after} kernels ({passes})"
        return f"{text}; {self.note}" if self.note else text


# ---- helpers -------------------------------------------------------------------------


def _fake_mode(gm: GraphModule) -> FakeTensorMode:
    """The fake mode the graph's values were traced under (new values must share it)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    raise ValueError("the graph has no fake values in node.meta['val']; trace it with torch.export")


def _fake(mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake tensor like `tensor` (a constant: static shape). A fake factory call
    is ~10x cheaper than `mode.from_tensor`, which matters for hundreds of weights."""
    if isinstance(tensor, FakeTensor) and tensor.fake_mode is mode:
        return tensor
    with mode:
        return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device=tensor.device)


def _infer(mode: FakeTensorMode, target: Any, args: tuple, kwargs: dict | None = None) -> Any:
    """The fake value of `target(*args)` computed from the inputs' fake values."""
    fake_args, fake_kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a, (args, kwargs or {}))
    with mode:
        return target(*fake_args, **fake_kwargs)


def _call(gm: GraphModule, target: Any, args: tuple, kwargs: dict | None = None, *, val: Any = None, like: Node | None = None) -> Node:
    """A new call_function node (inserted at the graph's current insert point) with its fake value."""
    node = gm.graph.call_function(target, args, kwargs or {})
    node.meta["val"] = _infer(_fake_mode(gm), target, args, kwargs) if val is None else val
    if like is not None and "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    return node


def _constant(gm: GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a get_attr node reads (None for anything else)."""
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    value = functools.reduce(getattr, node.target.split("."), gm)
    return value if isinstance(value, torch.Tensor) else None


def _add_constant(gm: GraphModule, tensor: torch.Tensor, hint: str) -> Node:
    """Register `tensor` as a new buffer (buffers follow .to() and are not trained) and read it."""
    index = 0
    while hasattr(gm, f"_opara_{hint}_{index}"):
        index += 1
    name = f"_opara_{hint}_{index}"
    gm.register_buffer(name, tensor.detach())
    node = gm.graph.get_attr(name)
    node.meta["val"] = _fake(_fake_mode(gm), tensor)
    return node


def _shape(node: Node) -> tuple[str, ...]:
    """The shape of a node's value as strings, so symbolic sizes compare without guards."""
    return tuple(str(d) for d in node.meta["val"].shape)


def _has_writes(gm: GraphModule) -> bool:
    return any(graphs._written_inputs(n) for n in gm.graph.nodes)


def _eliminate_dead_code(gm: GraphModule) -> None:
    """Erase pure call_function and get_attr nodes that nothing reads.

    Not `Graph.eliminate_dead_code`: that may also drop call_module nodes such
    as export's input guard (`_guards_fn`), which reads but returns nothing.
    """
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("call_function", "get_attr") and not node.users and not node.is_impure():
            gm.graph.erase_node(node)


def _delete_attributes(gm: GraphModule, targets: set[str]) -> None:
    """Delete the attributes (dotted paths) of `targets`, so their memory can be freed."""
    for target in sorted(targets):
        *path, name = target.split(".")
        owner = functools.reduce(getattr, path, gm)
        if hasattr(owner, name):
            delattr(owner, name)


def count_kernels(gm: GraphModule) -> int:
    """Nodes that launch a kernel (see `graph.is_free`)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and not graphs.is_free(n))


# ---- drop identities -----------------------------------------------------------------

def _number(value: Any, wanted: int) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == wanted


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _identity_source(node: Node) -> Node | None:
    """The input that `node` returns unchanged (same values, dtype, shape and device), if any."""
    if node.op != "call_function" or not node.args:
        return None
    target, kwargs = node.target, node.kwargs
    first, second = node.args[0], _arg(node, 1, "other")
    source = None
    if target is aten.alias.default:
        source = first
    elif target is aten.clone.default:
        source = first if kwargs.get("memory_format") in (None, torch.preserve_format) else None
    elif target is aten._to_copy.default:
        val = first.meta.get("val") if isinstance(first, Node) else None
        device = kwargs.get("device")
        same = (
            isinstance(val, torch.Tensor)
            and (device is None or torch.device(device) == val.device)
            and kwargs.get("layout") in (None, val.layout)
            and kwargs.get("memory_format") in (None, torch.preserve_format)
            and not kwargs.get("pin_memory")
        )  # the dtype is checked below for every op
        source = first if same else None
    elif target is aten.dropout.default:
        source = first if not _arg(node, 2, "train") or _arg(node, 1, "p") == 0 else None
    elif target in (aten.mul.Tensor, aten.mul.Scalar):  # x * 1, 1 * x
        source = first if _number(second, 1) else second if _number(first, 1) else None
    elif target in (aten.div.Tensor, aten.div.Scalar):  # x / 1
        source = first if _number(second, 1) and "rounding_mode" not in kwargs else None
    elif target in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):  # x + a*0, 0 + x
        if _number(second, 0):
            source = first
        elif target in (aten.add.Tensor, aten.add.Scalar) and _number(first, 0) and kwargs.get("alpha", 1) == 1:
            source = second
    if not isinstance(source, Node):
        return None
    out, src = node.meta.get("val"), source.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
        return None
    if out.dtype != src.dtype or out.device != src.device or _shape(node) != _shape(source):
        return None
    # same layout too: a copy of a strided view is dense, and a later `view` may need that
    if [str(s) for s in out.stride()] != [str(s) for s in src.stride()]:
        return None
    return source


def drop_identities(gm: GraphModule) -> int:
    """Replace ops that return their input unchanged in eval by that input.

    clone and _to_copy that change nothing, alias, dropout in eval, x * 1, x / 1,
    x + 0, x - 0. Skipped when the graph writes in place (a copy may then be
    needed) and where dropping would return a graph input or weight itself as
    an output (outputs would alias inputs).
    """
    if _has_writes(gm):
        return 0
    count = 0
    for node in list(gm.graph.nodes):
        source = _identity_source(node)
        if source is None:
            continue
        if source.op in ("placeholder", "get_attr") and any(u.op == "output" for u in node.users):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        count += 1
    _eliminate_dead_code(gm)
    return count


# ---- common subexpressions -----------------------------------------------------------


def _key(value: Any) -> Any:
    """A hashable key for an argument: containers by content, scalars with their type
    (so that 1, 1.0 and True stay apart), nodes by identity."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, float) and math.isnan(value):
        raise TypeError("NaN never equals itself")
    hash(value)
    return (type(value).__name__, value)


def eliminate_common_subexpressions(gm: GraphModule) -> int:
    """Compute each pure op on the same inputs once.

    NASNet's separable branches each start with their own ReLU of the same
    tensor (58 duplicated ReLUs, 18 average pools, 4 paddings); one kernel does.
    Random ops and anything impure are left alone; graphs that write in place
    are skipped.
    """
    if _has_writes(gm):
        return 0
    seen: dict[Any, Node] = {}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.is_impure():
            continue
        target = node.target
        if target is not operator.getitem:
            if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
                continue
        try:
            key = (target, _key(node.args), _key(node.kwargs))
            hash(key)
        except TypeError:
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            count += 1
    return count


# ---- BatchNorm folding ---------------------------------------------------------------


def _plain_conv(node: Any) -> bool:
    """A forward (not transposed) convolution node, arguments positional as export writes them."""
    return (
        isinstance(node, Node)
        and node.op == "call_function"
        and node.target is CONV
        and len(node.args) == 9
        and not node.kwargs
        and not node.args[6]
    )


def fold_batchnorm(gm: GraphModule) -> int:
    """Fold eval-mode BatchNorm into the convolution before it.

    w' = w * g / sqrt(var + eps), b' = (b - mean) * g / sqrt(var + eps) + beta,
    computed in float64 and stored in the weight's dtype. Only where the
    convolution's output has no other reader and every parameter is a constant.
    """
    count = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target is not BATCH_NORM or len(bn.args) != 7 or bn.kwargs:
            continue
        conv = bn.args[0]
        if not _plain_conv(conv) or len(conv.users) != 1:
            continue
        if not all(u.target is operator.getitem and u.args[1] == 0 for u in bn.users):
            continue
        weight, bias = _constant(gm, conv.args[1]), _constant(gm, conv.args[2])
        gamma, beta, mean, var = (_constant(gm, a) for a in bn.args[1:5])
        eps = bn.args[6]
        if weight is None or (conv.args[2] is not None and bias is None) or mean is None or var is None:
            continue
        if (bn.args[1] is not None and gamma is None) or (bn.args[2] is not None and beta is None):
            continue
        with torch.no_grad():
            scale = torch.rsqrt(var.double() + eps) * (gamma.double() if gamma is not None else 1.0)
            new_weight = weight.double() * scale.reshape(-1, *([1] * (weight.dim() - 1)))
            new_bias = ((bias.double() if bias is not None else 0.0) - mean.double()) * scale
            if beta is not None:
                new_bias = new_bias + beta.double()
        with gm.graph.inserting_before(conv):
            w_node = _add_constant(gm, new_weight.to(weight.dtype), "folded_weight")
            b_node = _add_constant(gm, new_bias.to(weight.dtype), "folded_bias")
        conv.args = (conv.args[0], w_node, b_node, *conv.args[3:])
        for user in list(bn.users):
            user.replace_all_uses_with(conv)
            gm.graph.erase_node(user)
        gm.graph.erase_node(bn)
        count += 1
    _eliminate_dead_code(gm)
    return count


# ---- merging parallel convolutions ---------------------------------------------------


def _merge_key(gm: GraphModule, conv: Node) -> tuple | None:
    """Convolutions with equal keys read the same tensor the same way and can be merged."""
    if not _plain_conv(conv) or conv.args[8] != 1:
        return None
    weight = _constant(gm, conv.args[1])
    if weight is None or (conv.args[2] is not None and _constant(gm, conv.args[2]) is None):
        return None
    x, _, _, stride, padding, dilation = conv.args[:6]
    return (x, tuple(weight.shape[1:]), weight.dtype, weight.device, tuple(stride), tuple(padding), tuple(dilation))


def merge_parallel_convs(gm: GraphModule) -> int:
    """Merge convolutions that read the same tensor with the same geometry into one.

    IOS's merge: one convolution with the output channels concatenated, then a
    slice (a view, no kernel) per original consumer. When every merged
    convolution feeds only a ReLU, one ReLU follows the merged convolution
    instead, so that the conv + ReLU fusion still applies. Run after BatchNorm
    folding, so the merged convolution carries the folded biases. Returns the
    number of convolutions removed.
    """
    groups: dict[tuple, list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        key = _merge_key(gm, node) if node.op == "call_function" and node.target is CONV else None
        if key is not None:
            groups[key].append(node)
    count = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        weights = [_constant(gm, c.args[1]) for c in members]
        sizes = [int(w.shape[0]) for w in weights]
        biased = any(c.args[2] is not None for c in members)
        first = members[0]
        with gm.graph.inserting_before(first):
            with torch.no_grad():
                w_node = _add_constant(gm, torch.cat(weights), "merged_weight")
                b_node = None
                if biased:
                    parts = [
                        _constant(gm, c.args[2]) if c.args[2] is not None else torch.zeros(n, dtype=w.dtype, device=w.device)
                        for c, w, n in zip(members, weights, sizes)
                    ]
                    b_node = _add_constant(gm, torch.cat(parts), "merged_bias")
            merged = _call(gm, CONV, (first.args[0], w_node, b_node, *first.args[3:]), like=first)
            relus = [next(iter(c.users)) for c in members if len(c.users) == 1]
            if len(relus) == len(members) and all(r.target is RELU for r in relus):
                source, replaced = _call(gm, RELU, (merged,), like=relus[0]), relus
            else:
                source, replaced = merged, members
            start = 0
            for node, size in zip(replaced, sizes):
                view = _call(gm, SLICE, (source, 1, start, start + size), like=node)
                node.replace_all_uses_with(view)
                start += size
        for node in replaced:
            gm.graph.erase_node(node)
        if replaced is not members:
            for conv in members:
                gm.graph.erase_node(conv)
        count += len(members) - 1
    _eliminate_dead_code(gm)
    return count


# ---- merging parallel linear layers ---------------------------------------------------

ADDMM = aten.addmm.default
MM = aten.mm.default
PERMUTE = aten.permute.default
VIEW = aten.view.default


def _linear_weight(gm: GraphModule, node: Node) -> torch.Tensor | None:
    """W of `x @ W.t()` (+ b), the exported form of nn.Linear: an addmm or mm whose
    right operand is a constant 2-D weight permuted [1, 0], and (addmm) a constant
    bias with the default alpha and beta."""
    if node.kwargs or len(node.args) != (3 if node.target is ADDMM else 2):
        return None
    right = node.args[-1]
    if not isinstance(right, Node) or right.target is not PERMUTE or list(right.args[1]) != [1, 0]:
        return None
    weight = _constant(gm, right.args[0])
    if weight is None or weight.dim() != 2:
        return None
    bias = _constant(gm, node.args[0]) if node.target is ADDMM else None
    if node.target is ADDMM and (bias is None or tuple(bias.shape) != (weight.shape[0],)):
        return None
    return weight


def _linear_input(node: Node) -> tuple:
    """What the left operand reads: views of one tensor to one shape are one input."""
    left = node.args[-2]
    if isinstance(left, Node) and left.target is VIEW:
        return (left.args[0], _key(left.args[1]))
    return (left,)


# ops whose result shares its input's memory: they follow the input's strides, and a view may then be impossible
VIEW_OPS = frozenset({
    VIEW, PERMUTE, SLICE, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.select.int, aten.transpose.int, aten.t.default, aten.alias.default, aten._unsafe_view.default,
})
# ops that return views of their input's parts (read through operator.getitem)
SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int})


def _restrided(node: Node, val: torch.Tensor, mode: FakeTensorMode) -> dict[Node, torch.Tensor] | None:
    """The fake values of `node` and of the views that read it (transitively) if
    `node`'s value became `val`; None if one of those views is then impossible."""
    values = {node: val}
    todo = [node]
    while todo:
        for user in todo.pop().users:
            if user.op != "call_function" or user.target not in VIEW_OPS or user in values:
                continue
            args = tree_map(lambda a: values.get(a, a.meta.get("val")) if isinstance(a, Node) else a, user.args)
            try:
                with mode:
                    values[user] = user.target(*args, **user.kwargs)
            except (RuntimeError, ValueError):  # ValueError: the fake kernels' "cannot view"
                return None
            todo.append(user)
    return values


def _mergeable(members: list[Node], mode: FakeTensorMode) -> tuple[list[Node], list[int], list[dict[Node, torch.Tensor]]]:
    """The members whose results can become column slices of one contiguous result
    (every view of them still possible), their widths, and the new fake values of those views.
    A member that cannot keeps its own GEMM; the width, and so the strides, change
    without it, so the rest is checked again."""
    while len(members) >= 2:
        val = members[0].meta["val"]
        widths = [int(m.meta["val"].shape[1]) for m in members]
        with mode:
            merged = torch.empty((val.shape[0], sum(widths)), dtype=val.dtype, device=val.device)
        parts, start = [], 0
        for node, width in zip(members, widths):
            with mode:
                parts.append(_restrided(node, merged[:, start : start + width], mode))
            start += width
        if all(p is not None for p in parts):
            return members, widths, parts
        members = [m for m, p in zip(members, parts) if p is not None]
    return members, [], []


def merge_parallel_linears(gm: GraphModule) -> int:
    """Merge linear layers that read the same tensor into one matrix multiply.

    BERT's query, key and value projections, and the key and value projections
    of every T5 decoder layer over the encoder's output, each read one tensor:
    one GEMM with the weights concatenated (and the biases) gives their outputs
    as column slices (views, no kernel). Three small GEMMs at batch 1 make
    cuBLAS pick split-K kernels with a memset, a scaling and a bias epilogue
    each (an H100 profile of BERT, docs/benchmarks.md); one wide GEMM is one
    kernel, as torch.compile's freezing does it. Returns the number of GEMMs
    removed.
    """
    groups: dict[tuple, list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (ADDMM, MM):
            weight = _linear_weight(gm, node)
            if weight is not None:
                groups[(node.target, _linear_input(node), int(weight.shape[1]), weight.dtype, weight.device)].append(node)
    mode = _fake_mode(gm) if groups else None
    count = 0
    for (target, *_), members in groups.items():
        members, sizes, parts = _mergeable(members, mode)
        if len(members) < 2:
            continue
        weights = [_linear_weight(gm, m) for m in members]
        first = members[0]
        left = first.args[-2]
        with gm.graph.inserting_before(first), torch.no_grad():
            w_node = _add_constant(gm, torch.cat(weights), "merged_linear_weight")
            right = _call(gm, PERMUTE, (w_node, [1, 0]), like=first.args[-1])
            if target is ADDMM:
                b_node = _add_constant(gm, torch.cat([_constant(gm, m.args[0]) for m in members]), "merged_linear_bias")
                merged = _call(gm, ADDMM, (b_node, left, right), like=first)
            else:
                merged = _call(gm, MM, (left, right), like=first)
            start = 0
            for node, size, values in zip(members, sizes, parts):
                column = _call(gm, SLICE, (merged, 1, start, start + size), like=node)
                node.replace_all_uses_with(column)
                for view, val in values.items():
                    if view is not node:
                        view.meta["val"] = val
                start += size
        for node in members:
            gm.graph.erase_node(node)
        count += len(members) - 1
    _eliminate_dead_code(gm)
    return count


def single_column_linears(gm: GraphModule) -> int:
    """Turn a linear layer with one output (`x @ w.t() + b`, w of one row) into a
    product and a row sum, for Inductor to generate and fuse with its neighbours.

    As a GEMM it is a library call: on an H100 cuBLAS took 10.7 us for DeepFM's
    400 -> 1 at batch 1 (the probe `scripts/skinny_gemm.py`, since removed, 2026-11-26), a seventh of
    the model's whole graph; as a reduction it joins the kernel that makes `x`
    or the one that reads the result. Returns the number of layers rewritten.
    """

    def row_sum(node: Node, weight: torch.Tensor, bias: Node | None) -> Node:
        product = _call(gm, aten.mul.Tensor, (node.args[-2], node.args[-1].args[0]), like=node)
        return _plus(gm, _call(gm, aten.sum.dim_IntList, (product, [1], True), like=node), bias, node)

    return _rewrite_linears(gm, lambda weight: weight.shape[0] == 1, row_sum)


def skinny_linears(gm: GraphModule) -> int:
    """Run fp32 linear layers through `opara::skinny_mm` (engine.skinny_gemm):
    `x @ w.t()` as the op, given `w` and a transposed copy (the kernel's
    layout). For CUDA graphs (on a CPU the op is `torch.mm`, so it only costs
    there).

    The op runs the split-K kernel where its first call at that number of rows
    measured it faster than cuBLAS, and elsewhere cuBLAS's `mm` on whichever
    weight layout measured faster there (the weight as stored, what the graph
    ran, or the transposed copy). The bias goes where Inductor would put it
    (`addmm` or `mm` plus an add): an add after the op where pointwise work
    reads the result anyway, so that the add fuses into that generated kernel;
    else into the op, which adds it as it writes. An add after the op there
    costs a kernel of its own: BERT's query/key/value GEMM feeds attention
    through views only, and its add made a copy of each of q, k and v per layer
    (36 kernels at batch 8, H200 2026-11-27, where torch.compile's addmm feeds
    attention strided views). Measured on an H100 (fused sequential graphs,
    2026-11-26, one machine, the bias always after the op): BERT 1.411 -> 1.328
    ms at batch 1 and 17.440 -> 17.742 at batch 32, T5 1.137 -> 0.995 at batch
    1. Returns the number of layers rewritten.
    """

    def through_the_op(node: Node, weight: torch.Tensor, bias: Node | None) -> Node:
        transposed = _add_constant(gm, weight.t().contiguous(), "transposed_linear_weight")
        operands = (node.args[-2], node.args[-1].args[0], transposed)
        if bias is None or _feeds_pointwise(node):
            return _plus(gm, _call(gm, skinny_gemm.skinny_mm_op(), operands, like=node), bias, node)
        return _call(gm, skinny_gemm.skinny_mm_op(), (*operands, bias), like=node)

    return _rewrite_linears(gm, lambda weight: weight.dtype == torch.float32, through_the_op)


def _rewrite_linears(gm: GraphModule, wanted: Callable[[torch.Tensor], bool], product: Callable[[Node, torch.Tensor, Node | None], Node]) -> int:
    """Replace each linear layer (`_linear_weight`) whose weight is `wanted` by
    `product(node, weight, bias)`: the new nodes for `x @ w.t()` plus `bias`
    (the addmm's bias, None for an mm)."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (ADDMM, MM):
            continue
        weight = _linear_weight(gm, node)
        if weight is None or not wanted(weight):
            continue
        with gm.graph.inserting_before(node), torch.no_grad():
            result = product(node, weight, node.args[0] if node.target is ADDMM else None)
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        count += 1
    _eliminate_dead_code(gm)
    return count


def _plus(gm: GraphModule, result: Node, bias: Node | None, like: Node) -> Node:
    return result if bias is None else _call(gm, ADD, (result, bias), like=like)


def _feeds_pointwise(node: Node) -> bool:
    """Whether a pointwise op reads `node`'s result, directly or through views
    of it (a kernel that Inductor can fuse an add into)."""
    todo, seen = [node], set()
    while todo:
        for user in todo.pop().users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user.target in VIEW_OPS or user.target in SPLITS or user.target is operator.getitem:
                todo.append(user)
            elif isinstance(user.target, torch._ops.OpOverload) and torch.Tag.pointwise in user.target.tags:
                return True
    return False


# ---- cuDNN fused convolutions (CUDA only) --------------------------------------------


def _cudnn_conv(conv: Any) -> bool:
    """A 2-d forward ungrouped convolution on a CUDA device in a dtype cuDNN fuses,
    read by one node. Grouped (depthwise) convolutions are left alone: whether
    cuDNN's runtime fusion takes them varies by version, and no zoo model's
    grouped convolution feeds a ReLU directly."""
    if not _plain_conv(conv) or len(conv.users) != 1 or conv.args[8] != 1:
        return False
    val, weight = conv.meta.get("val"), conv.args[1].meta.get("val") if isinstance(conv.args[1], Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return False
    return val.device.type == "cuda" and val.dtype in _CUDNN_DTYPES and weight.dim() == 4 and weight.dtype == val.dtype


def _bias_node(gm: GraphModule, conv: Node) -> Node:
    """The conv's bias, or a zero bias: without one the fused op fills zeros on every call."""
    if conv.args[2] is not None:
        return conv.args[2]
    weight = conv.args[1].meta["val"]
    zeros = torch.zeros(int(weight.shape[0]), dtype=weight.dtype, device=weight.device)
    return _add_constant(gm, zeros, "zero_bias")


def _register_fused_flops() -> None:
    """Count the fused convolutions' FLOPs as their convolution's in the static cost
    model (torch's flop registry knows only aten.convolution)."""
    from torch.utils.flop_counter import flop_registry

    conv = flop_registry[aten.convolution]

    def fused(x, w, *args, out_val=None, **kwargs):
        return conv(x, w, None, None, None, None, False, out_val=out_val)

    for packet in (aten.cudnn_convolution_relu, aten.cudnn_convolution_add_relu):
        flop_registry.setdefault(packet, fused)


def _concrete_shape(val: torch.Tensor) -> list[int]:
    """A concrete shape for a fake value: symbolic sizes (the batch) taken as 1."""
    shape = []
    for d in val.shape:
        if isinstance(d, int):
            shape.append(d)
            continue
        expr = sympy.sympify(d.node.expr)
        value = expr.subs({symbol: 1 for symbol in expr.free_symbols})
        shape.append(int(value) if value.is_number and int(value) > 0 else 1)
    return shape


def _cudnn_probe(gm: GraphModule, conv: Node, z: Node | None, alpha: Any, known: ShapeChoices | None = None) -> bool:
    """Whether cuDNN runs this fused convolution and matches conv (+ z) + ReLU.

    cuDNN's runtime fusion does not take every shape (pytorch#62926), and a
    failure inside a captured graph would cost the whole multi-stream graph, so
    each distinct configuration is run once on random data, and the answer kept
    (`known`, by default on disk per GPU and software: `fused_convolutions`; the
    probes took 0.6 s of each NASNet build on an H200, run 36). Only with a real
    CUDA device and real weights; otherwise (tests of the graph structure) True.
    """
    weight = _constant(gm, conv.args[1])
    if not torch.cuda.is_available() or weight is None or isinstance(weight, FakeTensor):
        return True
    x_val, out_val = conv.args[0].meta["val"], conv.meta["val"]
    _, _, _, stride, padding, dilation, _, _, groups = conv.args
    x_shape = _concrete_shape(x_val)

    def probe() -> str:
        generator = torch.Generator(device=weight.device).manual_seed(0)
        x = torch.randn(x_shape, dtype=weight.dtype, device=weight.device, generator=generator)
        bias = torch.randn(weight.shape[0], dtype=weight.dtype, device=weight.device, generator=generator)
        zz = None if z is None else torch.randn(_concrete_shape(out_val), dtype=weight.dtype, device=weight.device, generator=generator)

        def unfused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, zz: torch.Tensor | None) -> torch.Tensor:
            out = CONV(x, weight, bias, stride, padding, dilation, False, [0] * len(stride), groups)
            return torch.relu(out if zz is None else out + alpha * zz)

        try:
            with torch.no_grad(), _strict_fp32():
                if zz is None:
                    got = CONV_RELU(x, weight, bias, stride, padding, dilation, groups)
                else:
                    got = CONV_ADD_RELU(x, weight, zz, alpha, bias, stride, padding, dilation, groups)
                # against fp32: in half precision the fused kernel rounds otherwise than the plain
                # one (its epilogue in fp32), so it may err up to twice what the plain kernels do
                want = unfused(*(t if t is None else t.float() for t in (x, weight, bias, zz)))
                plain = unfused(x, weight, bias, zz)
                bound = max(PROBE_TOLERANCE, 2 * max_relative_error(plain.float(), want))
                accepted = max_relative_error(got.float(), want) <= bound
        except RuntimeError as error:
            log.info("cuDNN does not fuse %s: %s", conv.name, str(error).splitlines()[0])
            accepted = False
        if not accepted:
            log.info("fusion: %s stays a plain convolution (cuDNN's fused kernel refused it)", conv.name)
        return "fused" if accepted else "plain"

    shape = json.dumps([x_shape, list(weight.shape), str(weight.dtype), list(stride), list(padding), list(dilation), groups, "add" if z is not None else "", alpha])
    known = known if known is not None else fused_convolutions(weight.device)
    return known.choose(shape, probe) == "fused"


def fused_convolutions(device: torch.device) -> ShapeChoices:
    """What `_cudnn_probe` found per configuration on this GPU, kept under the cache directory."""
    return _fused_convolutions(str(device), str(caches.root()))


@functools.cache
def _fused_convolutions(device: str, root: str) -> ShapeChoices:
    return ShapeChoices("cudnn_fusion", [PROBE_TOLERANCE, "against fp32"], str, "plain", software=("gpu", "torch", "cudnn"), device=device)


def fuse_conv_relu(gm: GraphModule) -> int:
    """relu(convolution(x, w, b)) -> cudnn_convolution_relu(x, w, b): one cuDNN kernel.

    Only for CUDA values (the op has no CPU kernel), ungrouped 2-d forward
    convolutions in float32/16 or bfloat16, and only where the ReLU is the
    convolution's only reader.
    """
    count = 0
    for relu in list(gm.graph.nodes):
        if relu.op != "call_function" or relu.target is not RELU or not _cudnn_conv(relu.args[0]):
            continue
        conv = relu.args[0]
        if not _cudnn_probe(gm, conv, None, None):
            continue
        x, w, _, stride, padding, dilation, _, _, groups = conv.args
        with gm.graph.inserting_before(relu):
            bias = _bias_node(gm, conv)
            fused = _call(gm, CONV_RELU, (x, w, bias, stride, padding, dilation, groups), val=relu.meta["val"], like=conv)
        relu.replace_all_uses_with(fused)
        gm.graph.erase_node(relu)
        gm.graph.erase_node(conv)
        count += 1
    if count:
        _register_fused_flops()
    return count


def fuse_conv_add_relu(gm: GraphModule) -> int:
    """relu(convolution(x, w, b) + z) -> cudnn_convolution_add_relu(x, w, z, 1, b): ResNet's
    residual join in one cuDNN kernel. CUDA only, same conditions as `fuse_conv_relu`;
    `z` must have the convolution's shape, dtype and device (no broadcasting)."""
    count = 0
    for relu in list(gm.graph.nodes):
        if relu.op != "call_function" or relu.target is not RELU:
            continue
        add = relu.args[0]
        if not isinstance(add, Node) or add.target is not ADD or len(add.users) != 1 or len(add.args) != 2:
            continue
        a, b = add.args
        alpha = add.kwargs.get("alpha", 1)
        if _cudnn_conv(a) and isinstance(b, Node) and b is not a:
            conv, z = a, b
        elif _cudnn_conv(b) and isinstance(a, Node) and a is not b and alpha == 1:
            conv, z = b, a
        else:
            continue
        cval, zval = conv.meta["val"], z.meta.get("val")
        if not isinstance(zval, torch.Tensor) or zval.dtype != cval.dtype or zval.device != cval.device or _shape(z) != _shape(conv):
            continue
        if not _cudnn_probe(gm, conv, z, alpha):
            continue
        x, w, _, stride, padding, dilation, _, _, groups = conv.args
        with gm.graph.inserting_before(relu):
            bias = _bias_node(gm, conv)
            fused = _call(gm, CONV_ADD_RELU, (x, w, z, alpha, bias, stride, padding, dilation, groups), val=relu.meta["val"], like=conv)
        relu.replace_all_uses_with(fused)
        for node in (relu, add, conv):
            gm.graph.erase_node(node)
        count += 1
    if count:
        _register_fused_flops()
    return count


def depthwise_convs(gm: GraphModule) -> int:
    """Run depthwise convolutions (one filter per channel, weight [C, 1, KH, KW]) in
    fp32, bf16 or fp16 on CUDA values through `opara::depthwise_conv2d` (engine.depthwise_conv): for a
    channels-last input (fused lanes' layout) the Triton kernel where its first call
    at that shape measured it faster than cuDNN, else cuDNN. In the fused-lanes
    graphs' passes (build.INDUCTOR_PASSES), not the ATen graphs'."""
    count = 0
    for conv in list(gm.graph.nodes):
        if not _plain_conv(conv):
            continue
        x, w, bias, stride, padding, dilation, _, _, groups = conv.args
        val, weight = conv.meta.get("val"), w.meta.get("val") if isinstance(w, Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(weight, torch.Tensor) or val.device.type != "cuda" or val.dtype not in depthwise_conv.ACCURACY:
            continue
        if val.dim() != 4 or weight.dim() != 4 or weight.shape[1] != 1 or groups != weight.shape[0] or len(stride) != 2:
            continue
        x_val = x.meta.get("val") if isinstance(x, Node) else None
        same = val if isinstance(x_val, torch.Tensor) and depthwise_conv.fake_output_matches(val, x_val) else None
        with gm.graph.inserting_before(conv):
            fused = _call(gm, depthwise_conv.depthwise_conv_op(), (x, w, bias, list(stride), list(padding), list(dilation)), val=same, like=conv)
        conv.replace_all_uses_with(fused)
        gm.graph.erase_node(conv)
        count += 1
    return count


# ---- driver --------------------------------------------------------------------------

Pass = Callable[[GraphModule], int]

# Every pass in the order `fuse` runs them: identities first (they hide duplicates),
# folding before merging (so merged convolutions carry the folded biases), merging
# before the cuDNN fusions (so a merged convolution's ReLU fuses too).
PASSES: dict[str, Pass] = {
    "drop_identities": drop_identities,
    "cse": eliminate_common_subexpressions,
    "fold_batchnorm": fold_batchnorm,
    "merge_convs": merge_parallel_convs,
    "merge_linears": merge_parallel_linears,
    "single_column_linears": single_column_linears,
    "skinny_linears": skinny_linears,
    "conv_add_relu": fuse_conv_add_relu,
    "conv_relu": fuse_conv_relu,
    "depthwise_convs": depthwise_convs,
}
CUDA_ONLY = frozenset({"conv_add_relu", "conv_relu", "skinny_linears", "depthwise_convs"})
# conv_add_relu is left out of the ATen graphs (unmeasured there: cuDNN's runtime-fused
# kernels are not always faster than a convolution plus an elementwise kernel); the
# fused-lanes graph `inductor-cudnn` has it (build.INDUCTOR_CUDNN_PASSES, where measured).
DEFAULT_PASSES = ("drop_identities", "cse", "fold_batchnorm", "merge_convs", "merge_linears", "conv_relu")


def _selected(passes: Sequence[str] | None, device: torch.device) -> list[str]:
    wanted = DEFAULT_PASSES if passes is None else tuple(passes)
    unknown = sorted(set(wanted) - set(PASSES))
    if unknown:
        raise ValueError(f"unknown fusion passes {unknown}; known: {', '.join(PASSES)}")
    return [p for p in PASSES if p in wanted and (device.type == "cuda" or p not in CUDA_ONLY)]


def fuse(gm: GraphModule, device: torch.device | str, passes: Sequence[str] | None = None) -> FusionReport:
    """Run `passes` (default DEFAULT_PASSES; the CUDA-only ones only for a CUDA device)
    on `gm` in place, delete the weights no node reads any more, and recompile."""
    device = torch.device(device)
    before = count_kernels(gm)
    attributes = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    rewrites = {}
    for name in _selected(passes, device):
        rewrites[name] = PASSES[name](gm)
        log.debug("fusion pass %s: %d rewrites", name, rewrites[name])
    gm.graph.lint()
    _delete_attributes(gm, attributes - {n.target for n in gm.graph.nodes if n.op == "get_attr"})
    gm.recompile()
    report = FusionReport(device=str(device), rewrites=rewrites, kernels_before=before, kernels_after=count_kernels(gm))
    log.info("fusion: %s", report)
    return report


def fuse_graph(
    graph: OpGraph,
    device: torch.device | str,
    *,
    passes: Sequence[str] | None = None,
    check_inputs: Sequence[Sequence[torch.Tensor]] = (),
    tolerance: float = 1e-4,
    sizes: Mapping[sympy.Symbol, int] | None = None,
    cache: Path | None = None,
) -> tuple[OpGraph, FusionReport]:
    """A fused copy of `graph` (the input graph is left as it is) and what was done.

    With `check_inputs` (tuples of model inputs on the graph's device) the fused
    module must match the unfused one on each within `tolerance` (relative to
    the largest output magnitude, TF32 off, so only the rewrite is judged). If
    it fails or raises, the CUDA-only passes are dropped and it is tried again;
    if that fails too, `graph` itself comes back. The report's note says why.
    `sizes` binds symbolic sizes for the static costs, as in `graph.trace`
    (unbound symbols, e.g. the batch, count as 1). With a `cache` directory a
    check that passed is remembered there (`_passed_marker`), and a later call
    with the same graph, weights, passes and inputs' shapes on the same GPU and
    software skips it: each check runs the model eagerly twice per input, and a
    warm build fuses up to three graphs.
    """
    device = torch.device(device)
    selected = _selected(passes, device)
    attempts = [selected]
    if any(p in CUDA_ONLY for p in selected):
        attempts.append([p for p in selected if p not in CUDA_ONLY])
    notes = []
    for attempt in attempts:
        try:
            gm = _copy_sharing_tensors(graph.module)
            report = fuse(gm, device, attempt)
            marker = _passed_marker(cache, graph, attempt, check_inputs, tolerance, device) if cache is not None and check_inputs else None
            problem = None if marker is not None and marker.exists() else _compare(graph.module, gm, check_inputs, tolerance)
            if problem is None and marker is not None:
                _remember(marker)
            if problem is None:
                fused = graphs.from_graph_module(gm, sizes=sizes, name=graph.name, salt=f"{graph.fingerprint} fused {attempt}")
                return fused, replace(report, note="; ".join(notes))
        except Exception as error:  # noqa: BLE001 - a failing pass only costs its speed-up
            log.warning("fusion with %s failed", attempt, exc_info=True)
            problem = f"{type(error).__name__}: {error}"
        notes.append(f"passes {'+'.join(attempt)} rejected: {problem}")
        log.warning("fusion: %s", notes[-1])
    kernels = len(graph.dag)
    return graph, FusionReport(device=str(device), kernels_before=kernels, kernels_after=kernels, note="; ".join(notes))


def _copy_sharing_tensors(gm: GraphModule) -> GraphModule:
    """A copy of `gm` (its graph and module tree) that reads the same weight
    tensors: the passes add new constants and delete attributes, never write
    into a tensor, so the unfused graph keeps its own. Copying the weights too
    held a second copy of every weight in GPU memory per fused graph (NASNet:
    three, ~350 MB each) and took 0.8-1.4 s against 0.3 for NASNet on the
    2-core CPU (its whole fusion 2.6-3.3 s either way there: noisy)."""
    tensors = [*gm.parameters(), *gm.buffers()]
    tensors += [t for n in gm.graph.nodes if n.op == "get_attr" and isinstance(t := operator.attrgetter(n.target)(gm), torch.Tensor)]
    return copy.deepcopy(gm, {id(t): t for t in tensors})


def _remember(marker: Path) -> None:
    """Leave a passed check's marker; a cache that cannot be written only costs the next build the check."""
    try:
        caches.write_bytes(marker, b"")
    except OSError as error:
        log.warning("fusion check not remembered in %s: %s", marker.parent, error)


@functools.cache
def _source_digest() -> str:
    """This module's code: a pass changed is checked again."""
    return caches.digest(Path(__file__).read_bytes())[:16]


def _passed_marker(directory: Path, graph: OpGraph, passes: Sequence[str], inputs_list: Sequence[Sequence[torch.Tensor]], tolerance: float, device: torch.device) -> Path:
    """Where a passed check of these passes on this graph is remembered: keyed
    (engine.cache) by the graph's fingerprint (its code and DAG), a digest of
    its constants' values (one float64 sum per tensor, read back in one
    synchronisation), the passes, the check inputs' shapes (their values come
    from fixed seeds), the tolerance, the GPU and the software: torch, cuDNN
    and this module's code (the checks run with TF32 off and without cuDNN
    benchmarking, whatever the switches say)."""
    constants = [operator.attrgetter(n.target)(graph.module) for n in graph.module.graph.nodes if n.op == "get_attr"]
    tensors = [t.detach() for t in constants if isinstance(t, torch.Tensor) and t.is_floating_point()]
    sums = torch.stack([t.double().sum() for t in tensors]).tolist() if tensors else []
    key = caches.key(
        {
            "graph": graph.fingerprint,
            "constants": [[list(t.shape), f"{value:.17g}"] for t, value in zip(tensors, sums)],
            "passes": list(passes),
            "inputs": [[[list(x.shape), str(x.dtype)] for x in inputs if isinstance(x, torch.Tensor)] for inputs in inputs_list],
            "tolerance": tolerance,
            "code": _source_digest(),
        },
        ("gpu", "torch", "cudnn"),
        device,
    )
    return directory / f"{key}.passed"


def _compare(reference: GraphModule, fused: GraphModule, inputs_list: Sequence[Sequence[torch.Tensor]], tolerance: float) -> str | None:
    """None if `fused` matches `reference` on every input set, else what differs
    (cuDNN's heuristics: only values matter here, and strict-fp32 algorithms
    benchmarked at the largest bucket are never replayed)."""
    if not inputs_list:
        return None
    with torch.no_grad(), _strict_fp32(), no_cudnn_autotuning():
        for inputs in inputs_list:
            expected, actual = tree_leaves(reference(*inputs)), tree_leaves(fused(*inputs))
            if len(expected) != len(actual):
                return f"{len(actual)} outputs instead of {len(expected)}"
            for want, got in zip(expected, actual):
                if not isinstance(want, torch.Tensor):
                    continue
                if got.shape != want.shape or got.dtype != want.dtype:
                    return f"output {tuple(got.shape)} {got.dtype} instead of {tuple(want.shape)} {want.dtype}"
                if not want.is_floating_point():
                    if not torch.equal(got, want):
                        return "integer outputs differ"
                    continue
                error = max_relative_error(got, want)
                if not error <= tolerance:
                    return f"outputs differ by {error:.2e} (relative), tolerance {tolerance:.0e}"
    return None


class _strict_fp32:
    """TF32 off for cuDNN and cuBLAS inside the block, restored after."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc: Any) -> None:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved
