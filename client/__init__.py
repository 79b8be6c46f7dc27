"""gRPC and HTTP clients for the Triton server, and latency tooling.

api (one interface over tritonclient), inputs (requests built from model
metadata), bench (the load generator), plots, perf (perf_analyzer), and the
CLI in __main__ (`python -m client infer|bench`).
"""
