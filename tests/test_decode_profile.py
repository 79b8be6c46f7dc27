"""scripts/decode_profile.py on the CPU: bad arguments are named before any
GPU work (the profile itself needs a GPU: run on the GPU machine)."""

from __future__ import annotations

import pytest
from conftest import load_script


def _script():
    return load_script("decode_profile")


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--rows", "0,4"], "--rows"),
        (["--rows", "40", "--slots", "32"], "--rows"),
        (["--context", "512"], "--context"),
        (["--steps", "2"], "--steps"),
        (["--streams", "40", "--slots", "32"], "--streams"),
    ],
)
def test_bad_arguments_are_named(argv, problem, capsys):
    assert _script().main(argv) == 2
    assert problem in capsys.readouterr().err


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _script().main(["--rows", "1,2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_step_traced_for_the_engine_computes_the_served_tokens_and_plans_validly():
    """--streams' trace of a decoding step (a small GPT-2, on the CPU): the
    traced graph gives the step's own tokens and writes the same cache, and
    every policy's plan of its kernel DAG respects every edge."""
    import torch

    from opara_core.engine.interpreter import plan_graph
    from opara_core.models.gpt2 import SlotDecoder
    from opara_core.planning import policies
    from opara_core.planning.plan import violations
    from opara_core.serving.generation import small_gpt2

    decoder = SlotDecoder(small_gpt2({"n_layer": 2, "n_embd": 64, "n_head": 4}).lm, 4, 64, torch.device("cpu"), buckets=(4,), spans=(32,))
    graph, bucket = _script().step_graph(decoder, 3, 20)
    assert bucket.shape == (4, 32)
    inputs = bucket.inputs
    with torch.no_grad():
        expected = decoder._step(inputs[0], inputs[1], inputs[2], 32, by_slot=True)
        cache = decoder.keys.clone(), decoder.values.clone()
        decoder.keys.zero_(), decoder.values.zero_()
        got = graph.module(inputs)
    assert torch.equal(got, expected)
    assert torch.equal(decoder.keys[:, :4, :, 20], cache[0][:, :4, :, 20]) and torch.equal(decoder.values[:, :4, :, 20], cache[1][:, :4, :, 20])
    for policy in policies.names():
        assert not violations(graph.dag, plan_graph(graph, policy, 4)), policy
