"""`plan --draw`: labels, marks that stay distinct beyond 20 streams, SVG tooltips."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from matplotlib import colormaps

from opara_core.draw import PALETTE, draw, lane_style, op_kind
from opara_core.planning.dag import Dag
from opara_core.planning.plan import make_plan


def fan_out(width: int) -> Dag:
    """One source, `width` independent operators, one sink: `width` streams under opara."""
    names = ["x"] + [f"convolution_{i}" for i in range(width)] + ["cat"]
    edges = [["x", n] for n in names[1:-1]] + [[n, "cat"] for n in names[1:-1]]
    return Dag.from_json({"nodes": [{"name": n, "kind": "compute"} for n in names], "edges": edges})


def test_labels_name_the_operator_kind():
    assert op_kind("convolution_12") == "conv"
    assert op_kind("_native_batch_norm_legit_no_training_3") == "batch_norm"
    assert op_kind("cat") == "cat" and op_kind("relu_1") == "relu"


def test_every_stream_has_its_own_mark_beyond_the_palette():
    cmap = colormaps["tab20"]
    styles = [lane_style(lane, cmap) for lane in range(3 * PALETTE)]
    assert len(set(styles)) == len(styles)


def test_svg_has_a_tooltip_per_operator(tmp_path):
    dag = fan_out(24)
    plan = make_plan(dag, "opara")
    assert plan.num_streams > PALETTE
    path = draw(dag, plan, tmp_path / "plan.svg")
    titles = [t.text for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}title")]
    ops = [t for t in titles if " on stream " in t]
    assert len(ops) == len(dag) and any(t.startswith("convolution_23 (compute") for t in ops)


def test_png_is_written(tmp_path):
    dag = fan_out(3)
    path = draw(dag, make_plan(dag, "opara"), tmp_path / "plan.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
