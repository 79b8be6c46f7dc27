"""t5 served through opara_core; all logic lives in opara_core.triton."""

from opara_core.triton import OparaModel


class TritonPythonModel(OparaModel):
    zoo_name = "t5"
