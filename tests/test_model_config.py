"""opara_core.serving.model_config: config.pbtxt through Triton's ModelConfig message."""

from __future__ import annotations

import pytest

from opara_core.serving import model_config
from opara_core.serving.launcher import DEFAULT_MODEL_REPOSITORY


@pytest.mark.parametrize("model", sorted(p.parent.name for p in DEFAULT_MODEL_REPOSITORY.glob("*/config.pbtxt")))
def test_every_shipped_config_survives_a_write_and_a_read(tmp_path, model):
    config = model_config.read(DEFAULT_MODEL_REPOSITORY / model / "config.pbtxt")
    assert config.name == model and config.input and config.output
    model_config.write(tmp_path / "config.pbtxt", config)
    assert model_config.read(tmp_path / "config.pbtxt") == config


def test_an_edited_parameter_replaces_the_old_one_and_reaches_the_json():
    config = model_config.read(DEFAULT_MODEL_REPOSITORY / "googlenet" / "config.pbtxt")
    config.parameters["precision"].string_value = "fp16"
    again = model_config.parse(model_config.text(config))
    assert model_config.parameters(again)["precision"] == "fp16"
    assert model_config.as_json(again)["parameters"]["precision"] == {"string_value": "fp16"}


def test_a_config_that_does_not_parse_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('name: "m"\nmax_batch_size: eight\n')
    with pytest.raises(model_config.ModelConfigError, match=r"config.pbtxt: 2:"):
        model_config.read(path)
    with pytest.raises(model_config.ModelConfigError, match="unknown_field"):
        model_config.parse("unknown_field: 1")
