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
