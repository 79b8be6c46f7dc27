"""config.pbtxt as Triton's ModelConfig message, through protobuf's text format.

The one place that reads and writes a model's config: `add-model` writes one,
`model_dir` reads one as Triton would hand it to `initialize`, and the
benchmarks copy the shipped ones with a field or a parameter changed. The
message class is tritonclient's (`model_config_pb2`), the schema Triton
itself parses the file with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """A config.pbtxt that does not parse, or no ModelConfig class to parse it with."""


def _modules():
    try:
        from google.protobuf import json_format, text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as error:
        raise ModelConfigError(f"config.pbtxt is read with tritonclient's ModelConfig ({error}): pip install '.[client]'") from None
    return model_config_pb2, text_format, json_format


def new(**fields: Any):
    """An empty ModelConfig message, or one with `fields` set."""
    pb, _, _ = _modules()
    return pb.ModelConfig(**fields)


def data_type(name: str) -> int:
    """The DataType enum value of a Triton type name ("TYPE_FP32")."""
    pb, _, _ = _modules()
    return pb.DataType.Value(name)


def parse(text: str, where: str = "config.pbtxt"):
    """The message `text` holds; a parse error names `where` and the line."""
    _, text_format, _ = _modules()
    try:
        return text_format.Parse(text, new())
    except text_format.ParseError as error:
        raise ModelConfigError(f"{where}: {error}") from None


def read(path: Path):
    """The message in the file at `path`."""
    return parse(Path(path).read_text(), str(path))


def text(message) -> str:
    """The message in protobuf's text format, as config.pbtxt holds it."""
    _, text_format, _ = _modules()
    return text_format.MessageToString(message)


def write(path: Path, message) -> None:
    Path(path).write_text(text(message))


def as_json(message) -> dict:
    """The message as the JSON object Triton passes to a Python model's `initialize`."""
    _, _, json_format = _modules()
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def parameters(message) -> dict[str, str]:
    """The config's parameters, key to string value."""
    return {key: value.string_value for key, value in message.parameters.items()}
