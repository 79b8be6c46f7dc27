"""serving.model_dir: a model directory's description and module outside
Triton, as serving it builds them (what `bench --model-dir` times)."""

from __future__ import annotations

import pytest
import torch
from test_user_models import TwoBranches, exported

from opara_core import bench, zoo
from opara_core.serving import id_guard, model_dir
from opara_core.serving.add_model import add_model
from opara_core.serving.launcher import DEFAULT_MODEL_REPOSITORY


def test_a_shipped_zoo_directory_gives_the_zoo_models_description_and_module():
    spec, module = model_dir.load(DEFAULT_MODEL_REPOSITORY / "deepfm")
    entry = zoo.get("deepfm")
    # what serving builds: DeepFM's ids checked in the graph, whose verdict is one more output
    assert (spec.inputs, spec.outputs[:-1], spec.outputs[-1].name) == (entry.inputs, entry.outputs, id_guard.OUT_OF_RANGE)
    inputs = entry.example_inputs(4, seed=3)
    with torch.inference_mode():
        logits, clamped = module(*inputs)
        torch.testing.assert_close(logits, entry.build()(*inputs))
    assert clamped.tolist() == [0, 0, 0, 0]


def test_a_users_directories_give_what_add_model_read_from_the_program_and_the_module(tmp_path):
    torch.manual_seed(0)
    program = exported(TwoBranches(), (torch.randn(2, 6), torch.randn(2, 3, 4)), tmp_path / "two.pt2")
    add_model("two", tmp_path / "repo", export=program)
    spec, module = model_dir.load(tmp_path / "repo" / "two")
    assert [(t.name, t.shape) for t in spec.inputs] == [("x", (6,)), ("y", (3, 4))]
    assert [(t.name, t.shape) for t in spec.outputs] == [("output", (5,))]
    x, y = torch.randn(3, 6), torch.randn(3, 3, 4)
    expected = torch.export.load(str(program)).module()(x, y)
    torch.testing.assert_close(module(x, y), expected)
    add_model("squeeze", tmp_path / "repo", module="torchvision.models:squeezenet1_1", inputs=("image:fp32:3x64x64",))
    spec, module = model_dir.load(tmp_path / "repo" / "squeeze")
    assert type(module).__name__ == "SqueezeNet" and spec.outputs[0].shape == (1000,)
    entry = bench.model_for(str(tmp_path / "repo" / "squeeze"))
    assert entry.name == "squeeze" and bench.ref_of(entry) == str((tmp_path / "repo" / "squeeze").resolve())
    image = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():  # built again from the directory: the weights add-model saved
        torch.testing.assert_close(entry.build()(image), module(image))


@pytest.mark.parametrize("layout, message", [
    ("nothing", "holds no config.pbtxt"),
    ("no_version", "has no version directory with a model.py"),
    ("bad_config", "config.pbtxt"),
])
def test_what_is_no_model_directory_is_one_clear_error(tmp_path, layout, message):
    directory = tmp_path / "m"
    directory.mkdir()
    if layout != "nothing":
        (directory / "config.pbtxt").write_text('name: "m"\nmax_batch_size: 4\n' if layout == "no_version" else "name: [")
        (directory / "1").mkdir()
        if layout == "bad_config":
            (directory / "1" / "model.py").write_text("")
    with pytest.raises(model_dir.ModelDirError, match=message):
        model_dir.load(directory)


def test_the_bench_takes_a_model_directory_and_says_what_is_wrong_with_a_bad_one(tmp_path, capsys, monkeypatch):
    assert bench.main(["--model-dir", str(tmp_path / "missing"), "--batch", "1"]) == 2
    assert "holds no config.pbtxt" in capsys.readouterr().err
    add_model("squeeze", tmp_path / "repo", module="torchvision.models:squeezenet1_1", inputs=("image:fp32:3x64x64",))
    assert bench.main(["--model-dir", str(tmp_path / "repo" / "squeeze"), "--fused-lanes-autotune", "googlenet"]) == 2
    assert "not among the models timed (squeeze)" in capsys.readouterr().err
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)  # on a GPU machine too: stop before timing
    assert bench.main(["--model-dir", str(tmp_path / "repo" / "squeeze"), "--batch", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
