# Production image: the project's models served by the NGC image's tritonserver.
#
# Base: tritonserver 25.10, whose Ubuntu 24.04 brings Python 3.12 and CUDA 13.0.
# The pins need Python >= 3.11 (networkx 3.6.1, transformers 5.23.0), and the
# pinned torch 2.14.1 from PyPI is a CUDA 13.0 build: 24.10 (Triton 2.51, the
# release of the nvidia-pytriton binary that `make serve` runs) has Python 3.10
# and CUDA 12.6, and `pip install` of the pins fails there. Older pins would
# have fitted 24.10 but changed the engine everywhere for the image's sake.
# tests/test_dockerfile.py resolves these requirements for the image's Python
# and platform (pip --dry-run), since no Docker engine runs in CI.
FROM nvcr.io/nvidia/tritonserver:25.10-py3

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
