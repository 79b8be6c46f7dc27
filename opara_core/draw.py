"""A picture of a plan: the DAG laid out by depth, each operator marked by its
stream (`python -m opara_core plan --draw FILE.png|FILE.svg`).

Colours repeat after 20 streams, so the marker shape changes with every 20;
cross-stream waits are red. Operators are labelled with their kind (the traced
node's name without its number: `convolution`, `relu`, `cat`). An SVG carries a
tooltip per operator (name, kind, cost, stream) for graphs too large to label.
matplotlib's object API only: no pyplot state, no display.
"""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from opara_core.planning.dag import Dag
from opara_core.planning.plan import Plan

PALETTE = 20  # colours of matplotlib's tab20
MARKERS = "osD^v<>ph*"  # one shape per 20 streams
SVG_NS = "http://www.w3.org/2000/svg"


# ATen names shortened for labels
SHORT = {
    "native_batch_norm_legit_no_training": "batch_norm",
    "native_layer_norm": "layer_norm",
    "max_pool2d_with_indices": "max_pool",
    "convolution": "conv",
    "scaled_dot_product_efficient_attention": "sdpa",
    "scaled_dot_product_flash_attention_for_cpu": "sdpa",
}


def op_kind(name: str) -> str:
    """`convolution_12` -> `conv`: what the operator is, for a label."""
    kind = re.sub(r"_\d+$", "", name).lstrip("_")
    return SHORT.get(kind, kind)


def lane_style(lane: int, cmap) -> tuple[str, tuple]:
    """(marker, colour) of a stream: tab20's colours, a new shape every 20 streams."""
    return MARKERS[(lane // PALETTE) % len(MARKERS)], cmap(lane % PALETTE)


def depths(dag: Dag) -> list[int]:
    """Operators between each node and the nearest input, on the longest path."""
    depth = [0] * len(dag)
    for v, preds in enumerate(dag.preds):
        depth[v] = max((depth[p] + 1 for p in preds), default=0)
    return depth


def draw(dag: Dag, plan: Plan, path: str | Path) -> Path:
    """Save the picture; the format follows the suffix (.png, .svg, .pdf)."""
    try:
        import networkx as nx
        from matplotlib import colormaps
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as error:
        raise ValueError(f"--draw needs matplotlib ({error}); install the client extra: pip install '.[client]'") from None
    path = Path(path)
    depth = depths(dag)
    # Each depth lists its nodes by stream, so that a stream keeps to one band.
    layers: dict[int, list[str]] = {}
    for v in sorted(range(len(dag)), key=lambda v: (depth[v], plan.stream[dag.names[v]], v)):
        layers.setdefault(depth[v], []).append(dag.names[v])
    graph = dag.to_networkx()
    pos = nx.multipartite_layout(graph, subset_key=layers)
    width = max((len(nodes) for nodes in layers.values()), default=1)
    fig = Figure(figsize=(min(60, max(8, len(layers) * 0.4)), min(30, max(5, width * 1.5))), layout="constrained")
    ax = fig.subplots()
    waits = set(plan.waits)
    plain = [e for e in dag.edges if e not in waits]
    nx.draw_networkx_edges(graph, pos, edgelist=plain, ax=ax, edge_color="#999999", width=0.5, arrowsize=5)
    nx.draw_networkx_edges(graph, pos, edgelist=list(plan.waits), ax=ax, edge_color="#d62728", width=0.8, arrowsize=6)
    cmap = colormaps["tab20"]
    size = 40 if len(dag) > 60 else 300
    tooltips = {}
    for v, name in enumerate(dag.names):
        lane = plan.stream[name]
        x, y = pos[name]
        marker, color = lane_style(lane, cmap)
        (mark,) = ax.plot(
            [x], [y], linestyle="none", marker=marker, markersize=size**0.5,
            markerfacecolor=color, markeredgecolor="#333333", markeredgewidth=0.4, zorder=3,
        )  # fmt: skip
        mark.set_gid(f"op{v}")
        node = dag.nodes[v]
        tooltips[f"op{v}"] = f"{name} ({node.kind}, {node.cost:.3g} µs) on stream {lane}"
    small = len(dag) > 60  # then kinds, written downwards, so that neighbours do not overlap
    for name in dag.names:
        ax.annotate(
            op_kind(name) if small else name, pos[name], xytext=(0, -5 if small else -12), textcoords="offset points",
            ha="center", va="top", rotation=90 if small else 0, fontsize=5 if small else 7, color="#222222", zorder=4,
        )  # fmt: skip
    handles = []
    for lane in range(plan.num_streams):
        marker, color = lane_style(lane, cmap)
        handles.append(Line2D([], [], linestyle="none", marker=marker, markersize=7, markerfacecolor=color,
                              markeredgecolor="#333333", label=f"stream {lane}"))  # fmt: skip
    handles.append(Line2D([], [], color="#d62728", label="wait (cross-stream event)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=max(1, len(handles) // 25 + 1))
    ax.set_title(f"{plan.policy}: {len(dag)} ops, {plan.num_streams} streams, {len(plan.waits)} waits (red)")
    ax.set_xlabel("depth (operators on the longest path from an input)")
    ax.set_ylabel("operators at the same depth, grouped by stream")
    ax.tick_params(axis="x", bottom=True, labelbottom=True)  # networkx turns the ticks off
    ax.margins(x=0.02, y=0.12)  # room for the labels under the lowest row
    ax.set_yticks([])
    ticks = sorted(layers)[:: max(1, len(layers) // 20)]
    ax.set_xticks([pos[layers[d][0]][0] for d in ticks], [str(d) for d in ticks])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if path.suffix.lower() == ".svg":
        buffer = io.BytesIO()
        fig.savefig(buffer, format="svg")
        path.write_bytes(_with_tooltips(buffer.getvalue(), tooltips))
    else:
        fig.savefig(path, dpi=100)
    return path


def _with_tooltips(svg: bytes, tooltips: dict[str, str]) -> bytes:
    """The SVG with a <title> (a browser's tooltip) in each element whose id has one."""
    ET.register_namespace("", SVG_NS)
    ET.register_namespace("xlink", "http://www.w3.org/1999/xlink")
    root = ET.fromstring(svg)
    for element in root.iter(f"{{{SVG_NS}}}g"):
        text = tooltips.get(element.get("id", ""))
        if text:
            title = ET.Element(f"{{{SVG_NS}}}title")
            title.text = text
            element.insert(0, title)
    return ET.tostring(root, xml_declaration=True, encoding="utf-8")
