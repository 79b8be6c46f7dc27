"""gpt2 served through opara_core; all logic lives in opara_core.serving.generation."""

from opara_core.serving.generation import GenerationModel


class TritonPythonModel(GenerationModel):
    zoo_name = "gpt2"
