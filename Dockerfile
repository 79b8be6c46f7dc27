# Production image: the project's models served by the NGC image's tritonserver.
#
# Base: tritonserver 26.05 (Triton 2.69.0): Ubuntu 24.04 with Python 3.12
# (glibc 2.39), CUDA 13.2.1. Why this release: its HTTP front end fixes two of
# the request classes that ended tritonserver 2.51 (`make serve`'s binary) and
# that the HTTP guard refuses: a JSON shape far larger than its data (fixed in
# 2.59) and JSON nested about a million levels deep (fixed in 2.69; 25.10,
# Triton 2.62, still parses it recursively). No upstream fix was found for a
# chunk size beyond 64 bits, so a guard still runs here: nginx, which refuses it
# (the Python guard in `make serve` checks 2.51's JSON classes too);
# docs/deployment.md has the table. Not 26.06-26.08: they parse Inference-Header-Content-Length
# with std::stoi and end on a value above 2^31-1 (fixed after 26.08 branched,
# server PR #8925).
# The pins need Python >= 3.11 (networkx 3.6.1, transformers 5.23.0): 24.10
# (Triton 2.51) has Python 3.10 and CUDA 12.6, and `pip install` of the pins
# fails there (older pins would have fitted 24.10 but changed the engine
# everywhere for the image's sake). The pinned torch 2.14.1 from PyPI is a
# CUDA 13.0 build that brings its own CUDA 13.0 libraries as wheels
# (nvidia-cuda-runtime 13.0.96 and the rest), so it needs a driver for CUDA 13
# (580 or newer, NVIDIA's minor version compatibility), not the image's CUDA
# 13.2 toolkit.
# tests/test_dockerfile.py resolves these requirements for the image's Python
# and platform (pip --dry-run), since no Docker engine runs in CI.
FROM nvcr.io/nvidia/tritonserver:26.05-py3

# Ubuntu 24.04 marks its Python as externally managed; this image is the
# server's alone, so the project installs into it (the image's Python backend
# stub adopts that environment).
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /opt/opara
# Dependencies first, in a layer of their own: a code change reuses it instead
# of reinstalling gigabytes. Only what the server needs: the base pins and the
# `engine` extra (torch and the model zoo), no client, no test tools.
COPY pyproject.toml ./
COPY scripts/requirements.py ./scripts/
RUN python3 scripts/requirements.py engine > requirements.txt \
    && python3 -m pip install -r requirements.txt

# Then the source, installed without touching the dependencies.
COPY README.md ./
COPY opara_core ./opara_core
COPY client ./client
RUN python3 -m pip install --no-deps .
COPY model_repository /models

# nginx in front of tritonserver's HTTP port (the launcher's `container` guard):
# it refuses the one request class 2.69 has no fix for, a chunk size beyond 64
# bits, at a fraction of the Python guard's cost (docs/reliability.md).
RUN apt-get update && apt-get install -y --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/*

# Not root: the server needs no privilege (its ports are above 1024).
RUN useradd --system --create-home --uid 10001 --user-group opara
USER opara

EXPOSE 8000 8001 8002
# Ready once every model has loaded (built its graphs, on a GPU); a model whose
# backend process died reports not ready, and so does the container.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD python3 -c "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ.get(\"HTTP_PORT\", 8000)}/v2/health/ready', timeout=4)"
# tritonserver with model control none and the model-repository, shared-memory,
# logging and trace APIs behind OPARA_ADMIN_KEY (closed to everyone when unset);
# it binds 0.0.0.0 inside the container: `docker run -p 127.0.0.1:8000:8000 ...`
# keeps it on the host's loopback. GPU metrics are on when the container has GPUs
# (/dev/nvidia<N>); `-e TRITON_ARGS="..."` passes more tritonserver flags.
CMD ["python3", "-m", "opara_core.serving.launcher", "container", "--model-repository", "/models"]
