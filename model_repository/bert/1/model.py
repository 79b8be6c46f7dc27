"""bert served through opara_core with variable lengths; the logic lives in opara_core.serving.varlen."""

from opara_core.serving.varlen import VarLenModel


class TritonPythonModel(VarLenModel):
    zoo_name = "bert"
