# Production image: Triton 2.51 (the release the nvidia-pytriton 0.7.0 binary
# comes from) with the project installed from the pins in pyproject.toml.
# The steps mirror `make setup`: install the project with pip, then serve
# model_repository/ through the project's launcher, as `make serve` does.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/opara
COPY pyproject.toml README.md ./
COPY opara_core ./opara_core
COPY client ./client
# torch 2.14.1 from PyPI is a CUDA build; numpy<2 is pinned for the 24.10 stub.
RUN python3 -m pip install --no-cache-dir '.[client]'
COPY model_repository /models

EXPOSE 8000 8001 8002
# tritonserver with model control none and the model-repository, shared-memory,
# logging and trace APIs behind OPARA_ADMIN_KEY (closed to everyone when unset);
# it binds 0.0.0.0 inside the container: `docker run -p 127.0.0.1:8000:8000 ...`
# keeps it on the host's loopback.
CMD ["python3", "-m", "opara_core.serving.launcher", "container", "--model-repository", "/models"]
