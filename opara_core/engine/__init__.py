"""The engine: trace, fuse, profile, interpret, capture, replay (torch and CUDA)."""
