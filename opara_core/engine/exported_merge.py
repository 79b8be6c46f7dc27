"""Linear layers that read one tensor, merged into one GEMM in an exported
graph whose weights are its inputs (`whole_model.WholeModelSaved`).

Why: a saved Inductor artifact cannot be frozen, and without freezing Inductor
merges no linear layers; BERT's query, key and value projections stayed three
small GEMMs, each with a bias add of its own (nothing else takes the add: the
attention op is opaque). H100, 2026-11-27, the 16-token cell
(the since removed `scripts/varlen_cell_profile.py --parts saved,dynamic`): 0.687 ms with 72 GEMMs
and 36 bias kernels, against the frozen graph's 0.523 ms with 48 and none.

The graph's `opara::skinny_mm` calls (`skinny_gemm.SkinnyLinear`'s, after the
export) that read the same tensor become one call whose weights are new graph
inputs, the members' concatenated (the weight along rows, its stored transpose
along columns, the biases, which the op then adds as it writes); each member's
output is a column slice of it (a view). The caller makes the new inputs from
the module's tensors when it binds the graph's inputs (`MergedInput`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from opara_core.engine import skinny_gemm

aten = torch.ops.aten
RESHAPES = (aten.reshape.default, aten.view.default)
MERGE_VERSION = 2  # part of a saved artifact's key: bump when what the merge makes changes


@dataclass(frozen=True)
class MergedInput:
    """A graph input added by the merge: the concatenation along `dim` of the
    inputs named `parts` (placeholder names), in that order."""

    parts: tuple[str, ...]
    dim: int


@dataclass(frozen=True)
class _Member:
    mm: Node  # opara::skinny_mm(x, weight, weight_t)
    out: Node  # its output reshaped back to the layer's shape
    add: Node | None  # out + bias, where the layer has a bias
    bias: Node | None

    @property
    def weight(self) -> Node:
        return self.mm.args[1]

    @property
    def weight_t(self) -> Node:
        return self.mm.args[2]

    @property
    def last(self) -> Node:
        """The node whose users read the layer's output."""
        return self.add if self.add is not None else self.out


def merge_linears(gm: GraphModule) -> list[MergedInput]:
    """Merge, in place, the linear layers of `gm` that read one tensor; the
    graph inputs added (after the existing ones, in this order). The members'
    own weight inputs that nothing reads any more are removed from the graph."""
    groups: dict[tuple, list[_Member]] = defaultdict(list)
    for node in gm.graph.nodes:
        member = _member(node)
        if member is not None:
            groups[_source(member.mm.args[0])].append(member)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake = detect_fake_mode([n.meta.get("val") for n in placeholders])
    if fake is None:  # not an exported graph (no fake values to derive the new nodes' from)
        return []
    added: list[MergedInput] = []
    last = placeholders[-1]
    for members in groups.values():
        if len(members) < 2 or len({m.bias is None for m in members}) > 1:
            continue
        inputs = []
        parts_of = [[m.weight for m in members], [m.weight_t for m in members]] + ([[m.bias for m in members]] if members[0].bias is not None else [])
        for parts, dim in zip(parts_of, (0, 1, 0)):
            with gm.graph.inserting_after(last):
                last = gm.graph.placeholder(f"merged_{len(added)}")
            with fake:
                last.meta["val"] = torch.cat([p.meta["val"] for p in parts], dim)
            inputs.append(last)
            added.append(MergedInput(tuple(p.name for p in parts), dim))
        first = members[0]
        with gm.graph.inserting_before(first.mm):
            merged = _call(gm, fake, first.mm.target, (first.mm.args[0], *inputs))
        start = 0
        for member in members:
            width = member.weight.meta["val"].shape[0]
            with gm.graph.inserting_before(member.out):
                column = _call(gm, fake, aten.slice.Tensor, (merged, 1, start, start + width))
                output = _call(gm, fake, member.out.target, (column, *member.out.args[1:]))
            member.last.replace_all_uses_with(output)
            reshaped = member.mm.args[0]
            for node in (member.add, member.out, member.mm):
                if node is not None:
                    gm.graph.erase_node(node)
            if reshaped is not first.mm.args[0] and reshaped.op == "call_function" and not reshaped.users:
                gm.graph.erase_node(reshaped)
            start += width
        for part in (p for parts in parts_of for p in parts):
            if not part.users:  # a member's own weight, read by nothing now: no longer a graph input
                gm.graph.erase_node(part)
    if added:
        gm.graph.lint()
        gm.recompile()
    return added


def _member(node: Node) -> _Member | None:
    """`node` as a linear layer the merge can take: the op with a weight and its
    transpose that are graph inputs and no bias of its own, its output
    reshaped, then (optionally) a bias that is a graph input added."""
    if node.op != "call_function" or node.target is not skinny_gemm.skinny_mm_op() or len(node.args) != 3 or node.kwargs:
        return None
    if not all(isinstance(a, Node) and a.op == "placeholder" for a in node.args[1:]) or len(node.users) != 1:
        return None
    (out,) = node.users
    if out.target not in RESHAPES or out.args[0] is not node:
        return None
    add = next(iter(out.users)) if len(out.users) == 1 else None
    if add is not None and add.target is aten.add.Tensor and len(add.args) == 2 and add.args[0] is out and not add.kwargs:
        bias = add.args[1]
        if isinstance(bias, Node) and bias.op == "placeholder" and tuple(bias.meta["val"].shape) == (node.args[1].meta["val"].shape[0],):
            return _Member(node, out, add, bias)
    return _Member(node, out, None, None)


def _source(x: Node) -> tuple:
    """What a layer reads, one key for every reshape of one tensor to one shape."""
    if x.op == "call_function" and x.target in RESHAPES:
        return (x.args[0], repr(x.args[1:]))
    return (x,)


def _call(gm: GraphModule, fake, target, args: tuple) -> Node:
    """A new call of `target`, its output's fake value computed from its arguments'."""
    node = gm.graph.call_function(target, args)
    with fake:
        node.meta["val"] = target(*map_arg(args, lambda n: n.meta["val"]))
    return node
