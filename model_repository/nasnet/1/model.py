"""nasnet served through opara_core; all logic lives in opara_core.serving.triton_backend."""

from opara_core.serving.triton_backend import OparaModel


class TritonPythonModel(OparaModel):
    zoo_name = "nasnet"
