"""Shared fixtures: the real tritonserver on free ports, and clients for it."""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from opara_core.serving.launcher import ADMIN_KEY_ENV, DEFAULT_MODEL_REPOSITORY, ServerConfig, TritonServer, free_ports


def interpreted_worst_error(code: str, *args: str) -> float:
    """Run `code` (a script that prints a kernel's worst error last) in a new
    process under Triton's interpreter, which runs the kernel's Python on the
    CPU: the same index arithmetic and masks the GPU runs. Its exit must be 0."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.strip().splitlines()[-1])


def load_script(name: str, folder: str = "scripts"):
    """<folder>/<name>.py (scripts/ or dev/) as a module, registered under its name (dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def server_config(model_repository: Path = DEFAULT_MODEL_REPOSITORY, **overrides) -> ServerConfig:
    """A config on three free loopback ports."""
    http_port, grpc_port, metrics_port = free_ports(3)
    return ServerConfig(model_repository=model_repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, **overrides)


@pytest.fixture(scope="session")
def admin_key() -> str:
    """A known key for the servers' restricted APIs (shared memory, repository
    index), set in the environment so that the servers started from here, the
    client package and its subprocesses all use it."""
    key = f"opara-test-{secrets.token_hex(16)}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ADMIN_KEY_ENV, key)
        yield key


@pytest.fixture(scope="session")
def server(tmp_path_factory, admin_key) -> TritonServer:
    """The repository's model_repository served by a real tritonserver."""
    log_path = tmp_path_factory.mktemp("server") / "tritonserver.log"
    with TritonServer(server_config(), log_path) as running:
        yield running


@pytest.fixture(scope="session")
def http_client(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_client(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture
def strict_fp32():
    """Plain fp32 convolutions and matmuls for comparisons with eager: with TF32
    (cuDNN's default) two runs that pick different algorithms, or folded
    weights, differ by ~1e-2 relative after 60 layers, which would hide real
    errors."""
    import torch

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def pytest_collection_modifyitems(config, items):
    """Each test file is one group for pytest-xdist's `--dist loadgroup` (its
    module fixtures, such as a file's own server, are made once), except that
    every file with a test of the session's `server` is in one group, so that
    one worker starts it. GPU tests skip cleanly where torch sees no CUDA
    device (CI, laptops)."""
    import torch

    shared = {item.path for item in items if "server" in item.fixturenames}
    for item in items:
        item.add_marker(pytest.mark.xdist_group("session-server" if item.path in shared else item.path.name))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
