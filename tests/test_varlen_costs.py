"""serving.varlen_costs: a measured cost table kept on disk for first-use starts."""

import logging

import torch

from opara_core import zoo
from opara_core.serving import varlen_costs


def test_a_stored_table_loads_as_it_was_kept(tmp_path):
    seconds = {((16,), 1): 0.5e-3, ((16,), 2): 0.61e-3, ((512,), 32): 69.2e-3}
    two_axes = {((16, 128), 4): 2.5e-3, ((512, 16), 1): 1.25e-3}
    varlen_costs.store("a", seconds, tmp_path)
    varlen_costs.store("b", two_axes, tmp_path)
    assert varlen_costs.load("a", tmp_path) == seconds
    assert varlen_costs.load("b", tmp_path) == two_axes
    assert varlen_costs.load("missing", tmp_path) == {}
    assert [p.name for p in tmp_path.iterdir() if p.suffix != ".json"] == []  # no partial files left


def test_an_unreadable_table_is_ignored_with_a_warning(tmp_path, caplog):
    (tmp_path / "bad.json").write_text('{"seconds": {"16": {"one": 1}}}')
    with caplog.at_level(logging.WARNING):
        assert varlen_costs.load("bad", tmp_path) == {}
    assert "unreadable cost table" in caplog.text


def test_the_key_follows_what_the_timings_depend_on():
    entry = zoo.get("bert")
    module = entry.build()
    cpu = torch.device("cpu")
    key = varlen_costs.costs_key("bert", module, "saved", ((16, 512),), (1, 2), cpu)
    other_weights = entry.build()
    with torch.no_grad():
        next(other_weights.parameters()).add_(1.0)
    assert key == varlen_costs.costs_key("bert", other_weights, "saved", ((16, 512),), (2, 1), cpu)
    others = [
        varlen_costs.costs_key("bert", module, "inductor", ((16, 512),), (1, 2), cpu),
        varlen_costs.costs_key("bert", module, "saved", ((16, 32, 512),), (1, 2), cpu),
        varlen_costs.costs_key("bert", module, "saved", ((16, 512),), (1, 2, 4), cpu),
        varlen_costs.costs_key("t5", module, "saved", ((16, 512),), (1, 2), cpu),
    ]
    assert key not in others and len(set(others)) == len(others)
