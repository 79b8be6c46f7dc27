"""Start the real `tritonserver` on this machine, with no Docker engine.

The `nvidia-pytriton` wheel ships the Triton 2.51 server binary, the Python
backend and one backend stub per Python version. This module turns that wheel
into a runnable server: it lays out a backend directory with the stub for the
running Python, builds the environment the server and its stubs need, and starts
the server bound to loopback. `make serve` and the integration tests both go
through here, so what the tests start is what a user starts.

CLI: `python -m opara_core.server prepare` lays out the backend directory;
`python -m opara_core.server serve [--model-repository DIR]` runs the server in
the foreground (ports from HTTP_PORT, GRPC_PORT, METRICS_PORT).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_WORKDIR = REPO_ROOT / ".triton"
LOOPBACK = "127.0.0.1"


def pytriton_root() -> Path:
    """The installed `pytriton` package directory (found without importing it)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed; run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def prepare_backends(workdir: Path = DEFAULT_WORKDIR) -> Path:
    """Copy the wheel's Python backend to `workdir/backends` and add the stub
    for the running Python. Idempotent: a complete layout is left alone.

    Returns the backend directory to pass as `--backend-directory`.
    """
    source = pytriton_root() / "tritonserver"
    backends = workdir / "backends"
    stub = backends / "python" / "triton_python_backend_stub"
    marker = backends / ".prepared-for"
    wanted = f"{source} python{python_tag()}"
    if stub.exists() and marker.exists() and marker.read_text() == wanted:
        return backends
    if backends.exists():
        shutil.rmtree(backends)
    shutil.copytree(source / "backends", backends)
    stub_source = source / "python_backend_stubs" / python_tag() / "triton_python_backend_stub"
    if not stub_source.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {python_tag()}")
    shutil.copy2(stub_source, stub)
    marker.write_text(wanted)
    log.info("prepared Triton backends in %s", backends)
    return backends


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for tritonserver and the Python stubs it spawns.

    The stubs inherit it: PATH decides which Python environment the embedded
    interpreter adopts (this venv, with torch and numpy<2), PYTHONPATH adds the
    venv's site-packages and the repository, LD_LIBRARY_PATH finds the wheel's
    bundled libraries and this Python's libpython.
    """
    env = dict(os.environ if base is None else base)
    site_packages = sysconfig.get_paths()["purelib"]
    libs = [
        str(pytriton_root().parent / "nvidia_pytriton.libs"),
        sysconfig.get_config_var("LIBDIR") or "",
    ]
    env["LD_LIBRARY_PATH"] = _join_paths(libs, env.get("LD_LIBRARY_PATH"))
    env["PATH"] = _join_paths([str(Path(sys.executable).parent)], env.get("PATH"))
    # a PYTHONPATH the caller set comes first, so it can override a package of
    # the venv for the server alone (e.g. numpy<2 beside a numpy 2 venv)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), site_packages, str(REPO_ROOT)) if p)
    return env


def _join_paths(first: list[str], rest: str | None) -> str:
    parts = [p for p in first if p] + ([rest] if rest else [])
    return os.pathsep.join(parts)


@dataclass(frozen=True)
class ServerConfig:
    """How to start one server. `server_id` is reported by the server's
    metadata endpoint, which lets a caller prove it talks to its own process."""

    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = LOOPBACK
    server_id: str = field(default_factory=lambda: f"opara-{uuid.uuid4().hex[:12]}")
    log_verbose: int = 0
    exit_timeout_s: int = 30
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "ServerConfig":
        """Ports from HTTP_PORT, GRPC_PORT and METRICS_PORT (defaults 8000-8002)."""
        env = os.environ if env is None else env
        ports = {}
        for key, var in (("http_port", "HTTP_PORT"), ("grpc_port", "GRPC_PORT"), ("metrics_port", "METRICS_PORT")):
            if env.get(var):
                try:
                    ports[key] = int(env[var])
                except ValueError:
                    raise ValueError(f"{var} must be a port number, got {env[var]!r}") from None
        return cls(**{**ports, **overrides})


def server_command(config: ServerConfig, backends: Path) -> list[str]:
    """The tritonserver command line: loopback only, model control `none`."""
    binary = pytriton_root() / "tritonserver" / "bin" / "tritonserver"
    return [
        str(binary),
        f"--id={config.server_id}",
        f"--model-repository={Path(config.model_repository).resolve()}",
        "--model-control-mode=none",
        f"--backend-directory={backends}",
        f"--cache-directory={pytriton_root() / 'tritonserver' / 'caches'}",
        f"--http-address={config.address}",
        f"--http-port={config.http_port}",
        f"--grpc-address={config.address}",
        f"--grpc-port={config.grpc_port}",
        f"--metrics-address={config.address}",
        f"--metrics-port={config.metrics_port}",
        "--allow-gpu-metrics=false",
        f"--exit-timeout-secs={config.exit_timeout_s}",
        # a unique shared-memory prefix per server, so parallel servers and
        # leftovers of a crashed one never collide
        f"--backend-config=python,shm-region-prefix-name=opara_{config.server_id}_",
        f"--log-verbose={config.log_verbose}",
        *config.extra_args,
    ]


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server did not come up; the message carries the tail of its log."""


class TritonServer:
    """A tritonserver child process: start, wait until ready, stop.

    Readiness means: the process is alive, `/v2/health/ready` answers 200 and
    the metadata's name is this server's id (so another server that happens to
    hold the port cannot fool us).
    """

    def __init__(self, config: ServerConfig, log_path: Path, workdir: Path = DEFAULT_WORKDIR):
        self.config = config
        self.log_path = Path(log_path)
        self.workdir = workdir
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.config.address}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.config.address}:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.config.address}:{self.config.metrics_port}/metrics"

    def start(self) -> "TritonServer":
        backends = prepare_backends(self.workdir)
        command = server_command(self.config, backends)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(
                command,
                env=server_env(),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        log.info("started tritonserver pid %d (%s)", self.process.pid, self.config.server_id)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise ServerError(f"tritonserver exited early (code {self.returncode}):\n{self.log_tail()}")
            if self._answers_as_self():
                return
            time.sleep(0.25)
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _answers_as_self(self) -> bool:
        base = f"http://{self.http_url}"
        try:
            with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=2) as response:
                if response.status != 200:
                    return False
            with urllib.request.urlopen(f"{base}/v2", timeout=2) as response:
                return json.load(response).get("name") == self.config.server_id
        except (urllib.error.URLError, OSError, ValueError):
            return False

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (Triton finishes in-flight requests and unloads), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return self.returncode
        timeout_s = self.config.exit_timeout_s + 10 if timeout_s is None else timeout_s
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("tritonserver did not stop in %.0f s; killing it", timeout_s)
            self.process.kill()
            self.process.wait()
        return self.process.returncode

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so a killed
    `make serve` or test run never leaves an orphaned server holding ports."""
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass


def serve(config: ServerConfig, workdir: Path = DEFAULT_WORKDIR) -> None:
    """Replace this process with tritonserver in the foreground.

    exec keeps Ctrl-C and SIGTERM going straight to the server, which then
    shuts down cleanly; the parent-death signal covers a killed `make`.
    """
    backends = prepare_backends(workdir)
    command = server_command(config, backends)
    print(
        f"tritonserver: HTTP {config.address}:{config.http_port}, gRPC {config.address}:{config.grpc_port}, "
        f"metrics {config.address}:{config.metrics_port}, models from {config.model_repository}",
        flush=True,
    )
    _die_with_parent()
    os.execve(command[0], command, server_env())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opara_core.server", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare", help="lay out the Triton backend directory")
    prepare.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    run = sub.add_parser("serve", help="run tritonserver in the foreground")
    run.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    run.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    run.add_argument("--log-verbose", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "prepare":
            print(prepare_backends(args.workdir))
            return 0
        if not args.model_repository.is_dir():
            raise ValueError(f"model repository {args.model_repository} is not a directory")
        serve(ServerConfig.from_env(model_repository=args.model_repository, log_verbose=args.log_verbose), args.workdir)
    except (RuntimeError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
