"""Serving: the Triton Python-backend adapter, model weights and the tritonserver launcher."""
