"""engine.gemm_layout (the layout answer, kept on disk) and scripts/gemm_layout.py
on the CPU: the GEMM shapes it would time are the ones the model runs (the
timing itself needs a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from opara_core.engine import gemm_layout

REPO_ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("gemm_layout", REPO_ROOT / "scripts" / "gemm_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bert_shapes_are_its_layers_at_128_tokens_per_row_and_the_merged_projections():
    shapes = {(s["M"], s["K"], s["N"]): s["uses"] for s in _script().linear_shapes("bert", 2, "cpu")}
    # BERT-base: 12 layers; query, key and value read one tensor, so they also appear merged
    assert shapes[(256, 768, 768)] == 12 * 4  # query, key, value, attention output
    assert shapes[(256, 768, 3072)] == 12 and shapes[(256, 3072, 768)] == 12
    assert shapes[(256, 768, 2304)] == 12


def test_an_unknown_model_is_refused_before_the_gpu_is_needed(capsys):
    assert _script().main(["--models", "bert,gpt5"]) == 2
    assert "gpt5" in capsys.readouterr().err


@pytest.fixture
def timings(monkeypatch):
    """Scripted (stored, transposed) microseconds per row count instead of a GPU."""
    script: dict[int, tuple[float, float]] = {}
    measured: list[int] = []

    def time_layouts(bias, m, k, n, dtype, device):
        measured.append(m)
        return script[m]

    monkeypatch.setattr(gemm_layout, "time_layouts", time_layouts)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    return script, measured


def test_the_layout_is_measured_once_per_shape_and_kept(tmp_path, timings):
    script, measured = timings
    script.update({128: (10.0, 8.0), 4096: (100.0, 95.0)})  # 20% and 5% faster transposed
    assert gemm_layout.transposed_is_faster(True, [128, 4096], 768, 768, torch.float32, "cuda", tmp_path)
    assert measured == [128, 4096] and len(list(tmp_path.glob("*.json"))) == 1
    script.clear()  # another measurement would fail: the answer comes from disk
    assert gemm_layout.transposed_is_faster(True, [4096, 128], 768, 768, torch.float32, "cuda", tmp_path)
    script.update({128: (10.0, 8.0), 4096: (100.0, 95.0)})
    assert gemm_layout.transposed_is_faster(False, [128, 4096], 768, 768, torch.float32, "cuda", tmp_path)
    assert measured == [128, 4096, 128, 4096]  # mm is another shape than addmm


def test_one_row_count_much_slower_transposed_keeps_the_stored_layout(tmp_path, timings):
    script, _ = timings
    script.update({128: (25.5, 29.8), 4096: (131.6, 131.9)})  # H100, BERT's 768x768 at batch 1 and 32
    assert not gemm_layout.transposed_is_faster(True, [128, 4096], 768, 768, torch.float32, "cuda", tmp_path)
    script.update({1024: (100.0, 98.0)})  # 2% is within the noise: as stored
    assert not gemm_layout.transposed_is_faster(True, [1024], 768, 768, torch.float32, "cuda", tmp_path)


def test_an_unreadable_answer_is_measured_again(tmp_path, timings):
    script, measured = timings
    script.update({128: (10.0, 8.0)})
    assert gemm_layout.transposed_is_faster(True, [128], 64, 64, torch.float32, "cuda", tmp_path)
    (answer,) = tmp_path.glob("*.json")
    answer.write_text("{not json")
    assert gemm_layout.transposed_is_faster(True, [128], 64, 64, torch.float32, "cuda", tmp_path)
    assert measured == [128, 128]
