"""scripts/gemm_layout.py on the CPU: the GEMM shapes it would time are the ones
the model runs (the timing itself needs a GPU)."""

from __future__ import annotations

from conftest import load_script


def _script():
    return load_script("gemm_layout")


def test_bert_shapes_are_its_layers_at_128_tokens_per_row_and_the_merged_projections():
    shapes = {(s["M"], s["K"], s["N"]): s["uses"] for s in _script().linear_shapes("bert", 2, "cpu")}
    # BERT-base: 12 layers; query, key and value read one tensor, so they also appear merged
    assert shapes[(256, 768, 768)] == 12 * 4  # query, key, value, attention output
    assert shapes[(256, 768, 3072)] == 12 and shapes[(256, 3072, 768)] == 12
    assert shapes[(256, 768, 2304)] == 12


def test_an_unknown_model_is_refused_before_the_gpu_is_needed(capsys):
    assert _script().main(["--models", "bert,gpt5"]) == 2
    assert "gpt5" in capsys.readouterr().err
