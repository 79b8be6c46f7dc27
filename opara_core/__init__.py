"""opara_core: trace, plan, capture and serve multi-stream CUDA graphs of PyTorch models."""

__version__ = "0.1.0"
