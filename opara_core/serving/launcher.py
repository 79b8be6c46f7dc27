"""Start the real `tritonserver` on this machine, with no Docker engine.

The `nvidia-pytriton` wheel ships the Triton 2.51 server binary, the Python
backend and one backend stub per Python version. This module turns that wheel
into a runnable server: it lays out a backend directory with the stub for the
running Python, builds the environment the server and its stubs need, and starts
the server bound to loopback. `make serve` and the integration tests both go
through here, so what the tests start is what a user starts.

Safe defaults: every endpoint binds 127.0.0.1, model control is `none`, and
the model-repository, shared-memory, logging and trace APIs need the key in
OPARA_ADMIN_KEY (`serve` without it: a new random key per server, written 0600
to that server's key files (`admin_key`), where the project's client reads it; the
container without it: a random key nobody knows, so those APIs are closed).

The public HTTP port is served by the HTTP guard (`http_guard`), which checks
inference requests before they reach tritonserver's own HTTP port on a free
loopback port: Triton 2.51 crashes on some single requests. The container's
tritonserver (2.69) needs only nginx in front (`nginx_guard`), the faster guard.

CLI: `python -m opara_core.serving.launcher prepare` lays out the backend directory;
`python -m opara_core.serving.launcher serve [--model-repository DIR] [--guard python|nginx|none]`
runs the server and the guard in the foreground (ports from HTTP_PORT, GRPC_PORT,
METRICS_PORT) and restarts the server if it, the guard or a model's backend
process dies; `container` does the same with the image's own tritonserver.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from opara_core.serving.admin_key import ADMIN_KEY_ENV, remove_admin_key, write_admin_key
from opara_core.serving.guard_metrics import metrics_text
from opara_core.serving.nginx_guard import NginxGuard
from opara_core.serving.startup import StartupHandler, StartupLog

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_WORKDIR = REPO_ROOT / ".triton"
LOOPBACK = "127.0.0.1"

# Triton's restricted APIs: a request to one of these must carry the header
# `admin-key: <key>` (HTTP) or the metadata `triton-grpc-protocol-admin-key: <key>` (gRPC).
ADMIN_HEADER = "admin-key"
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
_ADMIN_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/-]{16,}")

# A start has no deadline while it makes progress (TritonServer.wait_ready);
# this many seconds with no output and no CPU time in the model processes is a
# stall (a hung build, a deadlock). A cold build's quiet steps (Inductor
# compiling NASNet's segments prints nothing for minutes) keep their processes
# busy, so they count as progress whatever this is.
START_STALL_ENV = "OPARA_START_STALL_S"
GUARD_WORKERS_ENV = "OPARA_GUARD_WORKERS"
MAX_GUARD_WORKERS = 64  # the HTTP guard's worker processes, at most
GUARDS = ("python", "nginx", "none")  # ServerConfig.guard
DEFAULT_START_STALL_S = 300.0
PROGRESS_CPU_S = 1.0  # CPU time below this over a wait is the stubs' idle housekeeping, not work
WAITING_NOTE_S = 30.0  # how often a start that is still loading says what each model does


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


def server_env(base: dict[str, str] | None = None, workdir: Path = DEFAULT_WORKDIR) -> dict[str, str]:
    """The environment for tritonserver and the Python stubs it spawns.

    The stubs inherit it: PATH decides which Python environment the embedded
    interpreter adopts (this venv's); LD_LIBRARY_PATH finds the wheel's bundled
    libraries and this Python's libpython (`python_library_dir`). PYTHONPATH is
    left as it is: the r24.10 stub's interpreter ignores it (its sys.path: the
    working directory, the standard library, the adopted venv's site-packages,
    the model's directory, the backend's), so a package for the stubs belongs
    in the venv.
    """
    env = dict(os.environ if base is None else base)
    libs = [str(pytriton_root().parent / "nvidia_pytriton.libs"), str(python_library_dir(workdir) or "")]
    env["LD_LIBRARY_PATH"] = _join_paths(libs, env.get("LD_LIBRARY_PATH"))
    env["PATH"] = _join_paths([str(Path(sys.executable).parent)], env.get("PATH"))
    return env


def python_library_dir(workdir: Path = DEFAULT_WORKDIR) -> Path | None:
    """`workdir/pylib`: a directory that holds only a link to this Python's shared
    library, which the Python backend's stub links against; None for a Python
    without one.

    Not Python's LIBDIR itself: for a system Python that is /usr/lib/<arch>, and
    on LD_LIBRARY_PATH everything else there outranks the libraries torch finds
    through its RUNPATH. On the H100 machine (2026-11-26) the stubs so loaded the
    CUDA image's cuDNN 9.14 against torch's 9.19, and every GPU build's kernel
    profile failed with "cuDNN version incompatibility".
    """
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not libdir or not name or not (Path(libdir) / name).exists():
        return None
    directory = workdir / "pylib"
    link, target = directory / name, Path(libdir) / name
    if not (link.is_symlink() and os.readlink(link) == str(target)):
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{name}.{os.getpid()}"
        partial.unlink(missing_ok=True)
        partial.symlink_to(target)
        partial.replace(link)  # atomic: servers starting side by side
    return directory


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
    # what serves http_port in front of tritonserver's own HTTP port (then on a free loopback port):
    # "python", the HTTP guard (opara_core.serving.http_guard); "nginx" (opara_core.serving.nginx_guard,
    # for a tritonserver that parses JSON safely: the container's); "none": tritonserver on http_port
    guard: str = "python"
    # the guard's worker processes (GUARD_WORKERS_ENV); None: its own default (one per four CPUs, at most 4)
    guard_workers: int | None = None
    # more tritonserver flags (TRITON_ARGS, or `serve -- FLAGS`); see passthrough_flags
    extra_args: tuple[str, ...] = ()
    # the key for the restricted APIs; None: a random one per start, so nobody has it
    admin_key: str | None = field(default_factory=lambda: os.environ.get(ADMIN_KEY_ENV) or None, repr=False)
    # the key is in this server's key files (with_admin_key), removed when it stops
    key_files: bool = False
    # seconds without progress after which a start is given up (START_STALL_ENV)
    start_stall_s: float = DEFAULT_START_STALL_S

    def __post_init__(self) -> None:
        passthrough_flags(self.extra_args)  # a flag the launcher owns is refused here, before anything starts
        if self.admin_key is not None and not _ADMIN_KEY_PATTERN.fullmatch(self.admin_key):
            raise ValueError(
                f"{ADMIN_KEY_ENV} must be at least 16 characters from A-Z a-z 0-9 . _ ~ + / - "
                "(e.g. the output of `openssl rand -hex 32`)"
            )
        if not self.start_stall_s > 0:
            raise ValueError(f"{START_STALL_ENV} must be a positive number of seconds, got {self.start_stall_s}")
        if self.guard not in GUARDS:
            raise ValueError(f"the HTTP guard must be one of {', '.join(GUARDS)}, got {self.guard!r}")
        if self.guard_workers is not None and not 1 <= self.guard_workers <= MAX_GUARD_WORKERS:
            raise ValueError(f"{GUARD_WORKERS_ENV} must be 1 to {MAX_GUARD_WORKERS} worker processes, got {self.guard_workers}")

    @property
    def guarded(self) -> bool:
        return self.guard != "none"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "ServerConfig":
        """Ports from HTTP_PORT, GRPC_PORT and METRICS_PORT (defaults 8000-8002),
        the admin key from OPARA_ADMIN_KEY, the stall limit of a start from
        OPARA_START_STALL_S, the HTTP guard's workers from OPARA_GUARD_WORKERS,
        more tritonserver flags from TRITON_ARGS (split as a shell would),
        before any `extra_args` given."""
        env = os.environ if env is None else env
        values: dict = {}
        if env.get(START_STALL_ENV):
            try:
                values["start_stall_s"] = float(env[START_STALL_ENV])
            except ValueError:
                raise ValueError(f"{START_STALL_ENV} must be a number of seconds, got {env[START_STALL_ENV]!r}") from None
        for key, var in (("http_port", "HTTP_PORT"), ("grpc_port", "GRPC_PORT"), ("metrics_port", "METRICS_PORT")):
            if env.get(var):
                try:
                    values[key] = int(env[var])
                except ValueError:
                    raise ValueError(f"{var} must be a port number, got {env[var]!r}") from None
        if env.get(GUARD_WORKERS_ENV):
            try:
                values["guard_workers"] = int(env[GUARD_WORKERS_ENV])
            except ValueError:
                raise ValueError(f"{GUARD_WORKERS_ENV} must be a number of processes, got {env[GUARD_WORKERS_ENV]!r}") from None
        try:
            extra = tuple(shlex.split(env.get(TRITON_ARGS_ENV, "")))
        except ValueError as error:
            raise ValueError(f"{TRITON_ARGS_ENV}: {error}") from None
        extra += tuple(overrides.pop("extra_args", ()))
        return cls(**{**values, "admin_key": env.get(ADMIN_KEY_ENV) or None, "extra_args": extra, **overrides})


def shm_prefix(config: ServerConfig) -> str:
    """The Python backend's /dev/shm region names for this server start with this."""
    return f"opara_{config.server_id}_"


def restricted_api_args(key: str) -> list[str]:
    """Flags that put RESTRICTED_APIS behind `key` on HTTP and gRPC."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={key}", f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={key}"]


def server_command(config: ServerConfig, backends: Path, http: tuple[str, int] | None = None) -> list[str]:
    """The tritonserver command line of the pytriton wheel's server: loopback
    only, model control `none`, administrative APIs behind a key. `http`:
    where tritonserver's own HTTP port listens (default: the config's)."""
    binary = pytriton_root() / "tritonserver" / "bin" / "tritonserver"
    paths = [f"--backend-directory={backends}", f"--cache-directory={pytriton_root() / 'tritonserver' / 'caches'}"]
    return [str(binary), *safe_args(config, paths, http)]


def container_command(config: ServerConfig, http: tuple[str, int] | None = None) -> list[str]:
    """The command line of the NGC image's own tritonserver (on PATH, with its
    own backends), with the same safe flags as `server_command`."""
    binary = shutil.which("tritonserver") or "/opt/tritonserver/bin/tritonserver"
    return [binary, *safe_args(config, [], http)]


def safe_args(config: ServerConfig, paths: list[str], http: tuple[str, int] | None = None) -> list[str]:
    """Flags every server gets: model control `none`, the configured address
    and ports, restricted APIs behind the admin key (a random one if unset),
    GPU metrics where there is a GPU; then the pass-through flags, which
    replace the defaults of the same name."""
    http_address, http_port = http or (config.address, config.http_port)
    given = {name for name, _ in passthrough_flags(config.extra_args)}
    defaults = {
        "--model-control-mode": "none",
        "--allow-gpu-metrics": "true" if gpu_present() else "false",  # on a GPU-less host DCGM and NVML only print errors
        "--log-verbose": config.log_verbose,
        # every model of the repository loads at once (Triton's default: 4 at a time); their builds
        # take turns on each GPU only while they use it (engine.gpu_turn), and compile meanwhile
        "--model-load-thread-count": str(max(4, len(expected_models(config) or ()))),
    }
    return [
        f"--id={config.server_id}",
        f"--model-repository={Path(config.model_repository).resolve()}",
        *paths,
        f"--http-address={http_address}",
        f"--http-port={http_port}",
        f"--grpc-address={config.address}",
        f"--grpc-port={config.grpc_port}",
        f"--metrics-address={config.address}",
        f"--metrics-port={config.metrics_port}",
        f"--exit-timeout-secs={config.exit_timeout_s}",
        # a unique shared-memory prefix per server, so parallel servers and
        # leftovers of a crashed one never collide
        f"--backend-config=python,shm-region-prefix-name={shm_prefix(config)}",
        *restricted_api_args(config.admin_key or secrets.token_urlsafe(32)),
        *(f"{name}={value}" for name, value in defaults.items() if name not in given),
        *config.extra_args,
    ]


TRITON_ARGS_ENV = "TRITON_ARGS"
# tritonserver flags the launcher sets itself, which a pass-through may not
# change, and what to do instead
_PORTS = "the launcher checks and owns the ports"
OWNED_FLAGS = {
    "--id": "the launcher names each server it starts",
    "--model-repository": "use MODEL_REPOSITORY (make serve) or --model-repository",
    "--model-store": "use MODEL_REPOSITORY (make serve) or --model-repository",
    "--http-port": f"use HTTP_PORT; {_PORTS}",
    "--grpc-port": f"use GRPC_PORT; {_PORTS}",
    "--metrics-port": f"use METRICS_PORT; {_PORTS}",
    "--http-address": "make serve binds 127.0.0.1, the container 0.0.0.0: put a proxy in front to serve others",
    "--grpc-address": "make serve binds 127.0.0.1, the container 0.0.0.0: put a proxy in front to serve others",
    "--metrics-address": "make serve binds 127.0.0.1, the container 0.0.0.0: put a proxy in front to serve others",
    "--allow-http": "the launcher's readiness check and the HTTP guard need it",
    "--allow-grpc": "the launcher serves gRPC on GRPC_PORT",
    "--allow-metrics": "the launcher serves metrics on METRICS_PORT",
    "--http-restricted-api": "set OPARA_ADMIN_KEY; the launcher puts the restricted APIs behind it",
    "--grpc-restricted-protocol": "set OPARA_ADMIN_KEY; the launcher puts the restricted APIs behind it",
    "--backend-directory": "the launcher lays out the backends of the pytriton wheel",
    "--cache-directory": "the launcher uses the pytriton wheel's",
    "--exit-timeout-secs": "the launcher waits that long for a clean stop, then kills",
    "--log-file": "the launcher reads tritonserver's output (progress, the reasons for restarts)",
}


def passthrough_flags(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """(name, value) of each flag in `args`, extra tritonserver flags given as
    `--flag=value` or `--flag value`. Raises ValueError naming every flag the
    launcher owns (OWNED_FLAGS; and the Python backend's shm-region-prefix-name,
    which keeps parallel servers apart) and anything that is not a flag."""
    flags: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        name, equals, value = args[i].partition("=")
        if not name.startswith("--"):
            raise ValueError(f"extra tritonserver flags: {args[i]!r} is not a flag (--name=value)")
        if not equals and i + 1 < len(args) and not args[i + 1].startswith("--"):
            i += 1
            value, equals = args[i], "="
        flags.append((name, value if equals else None))
        i += 1
    refused = [f"{name} ({OWNED_FLAGS[name]})" for name, _ in flags if name in OWNED_FLAGS]
    refused += [
        f"{name} {value} (the launcher gives each server its own shared-memory prefix)"
        for name, value in flags
        if name == "--backend-config" and value and "shm-region-prefix-name" in value
    ]
    if refused:
        raise ValueError(f"extra tritonserver flags ({TRITON_ARGS_ENV} or serve -- ...): the launcher sets " + "; ".join(refused))
    return flags


def gpu_present(dev: Path = Path("/dev"), env: Mapping[str, str] | None = None) -> bool:
    """Whether tritonserver will find an NVIDIA GPU, found without torch or
    CUDA: a device node /dev/nvidia<N> (the driver makes one per GPU, and the
    NVIDIA container toolkit passes exactly a container's GPUs), unless
    CUDA_VISIBLE_DEVICES hides every one."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return False
    return any(re.fullmatch(r"nvidia\d+", node.name) for node in dev.glob("nvidia*"))


def model_control_mode(config: ServerConfig) -> str:
    """`none` (the launcher's), or what a pass-through flag chose."""
    return dict(passthrough_flags(config.extra_args)).get("--model-control-mode") or "none"


def instance_model(instance: str) -> str:
    """The model of a model instance as Triton names it (`deepfm_0_0`: the
    model, its instance group, the instance; groups in this repository have
    no names of their own)."""
    return re.sub(r"(_\d+){2}$", "", instance)


def expected_models(config: ServerConfig) -> list[str] | None:
    """The models tritonserver will load at start: every model directory of the
    repository, or with explicit model control those named by --load-model
    (None where that is not known)."""
    repository = Path(config.model_repository)
    every = sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))
    if model_control_mode(config) != "explicit":
        return every
    named = [value for name, value in passthrough_flags(config.extra_args) if name == "--load-model" and value]
    return every if "*" in named else (sorted(named) or None)


def free_port(avoid: Collection[int] = ()) -> int:
    """A TCP port that was free a moment ago (the OS picks it), none of `avoid`:
    ports chosen but not bound yet (a server's public ports, before tritonserver
    opens them) were handed out again for its internal HTTP port, and its gRPC
    service then failed with "already in use" (CI, 2026-11-25)."""
    for _ in range(100):
        port = _unbound_port()
        if port not in avoid:
            return port
    raise OSError(f"the OS offered only ports already chosen ({', '.join(map(str, sorted(avoid)))})")


def free_ports(count: int) -> list[int]:
    """`count` distinct ports from `free_port` (one server's HTTP, gRPC and metrics ports)."""
    ports: list[int] = []
    for _ in range(count):
        ports.append(free_port(avoid=ports))
    return ports


def _unbound_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def busy_ports(config: ServerConfig) -> list[str]:
    """The public ports that something else already listens on, each named with
    its variable: checked before tritonserver starts, which would otherwise load
    every model first and fail only when it opens its ports."""
    busy = []
    for name, var, port in (("HTTP", "HTTP_PORT", config.http_port), ("gRPC", "GRPC_PORT", config.grpc_port), ("metrics", "METRICS_PORT", config.metrics_port)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
            try:
                s.bind((config.address, port))
            except OSError:
                busy.append(f"{name} port {port} ({var}) is in use on {config.address}")
    return busy


class ServerError(RuntimeError):
    """The server did not come up; the message carries the tail of its log."""


class TritonServer:
    """A tritonserver child process, and the HTTP guard in front of it: start,
    wait until ready, stop.

    Readiness means: both processes are alive, `/v2/health/ready` answers 200
    on the public HTTP port and the metadata's name is this server's id (so
    another server that happens to hold the port cannot fool us).
    """

    def __init__(
        self,
        config: ServerConfig,
        log_path: Path | None,
        workdir: Path = DEFAULT_WORKDIR,
        wrapper: tuple[str, ...] = (),
        image: bool = False,
        startup: StartupLog | None = None,
    ):
        self.config = config
        self.log_path = None if log_path is None else Path(log_path)  # None: this process's stdout
        # with log_path None: tritonserver's output goes through this (progress lines, CPU-host noise hidden)
        self.startup = startup
        self.workdir = workdir
        self.wrapper = wrapper  # a command that execs its arguments, e.g. ("prlimit", "--fsize=N", "--")
        self.image = image  # the container's own tritonserver instead of the pytriton wheel's
        self.process: subprocess.Popen | None = None
        self.guard: subprocess.Popen | None = None
        # tritonserver's own HTTP port: behind the guard, loopback only, the same across restarts
        public = (config.http_port, config.grpc_port, config.metrics_port)
        self.upstream = (LOOPBACK, free_port(avoid=public)) if config.guarded else (config.address, config.http_port)
        self.nginx = None
        if config.guard == "nginx":
            directory = Path(tempfile.gettempdir()) / f"{config.server_id}-nginx"  # beside the status file: writable in the container
            self.nginx = NginxGuard(directory, (config.address, config.http_port), self.upstream, config.guard_workers or 1)
        self.status_file = Path(tempfile.gettempdir()) / f"{config.server_id}-status.json"
        self.restarts: dict[str, int] = {}
        self._signalled: set[int] = set()  # pids sent SIGTERM or SIGINT already
        self._stub_pids: set[int] = set()  # every stub seen since the last stop, for `stop`
        self._log_start = 0  # where this run of tritonserver begins in the log

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
        """Start tritonserver, and the guard unless it runs already (it stays up
        across restarts of the server, answering 503 meanwhile)."""
        if self.image:
            command = container_command(self.config, self.upstream)
        else:
            command = [*self.wrapper, *server_command(self.config, prepare_backends(self.workdir), self.upstream)]
        if self.config.guarded and (self.guard is None or self.guard.poll() is not None):
            if self.nginx is not None:
                self.nginx.write()  # before record_restart, which writes the metrics file nginx serves
                guard = self.nginx.command()
                if not self.image:
                    log.warning("nginx guards the HTTP port: tritonserver 2.51's JSON crash classes (a huge JSON shape, deep nesting) stay open; docs/deployment.md")
            else:
                guard = [sys.executable, "-m", "opara_core.serving.http_guard", f"--listen={self.http_url}",
                         f"--upstream={self.upstream[0]}:{self.upstream[1]}", f"--status-file={self.status_file}"]  # fmt: skip
                if self.config.guard_workers is not None:
                    guard.append(f"--workers={self.config.guard_workers}")
            self.record_restart(None)
            if self.log_path is None and self.startup is not None:
                self.guard = self._spawn(guard, subprocess.PIPE)
                threading.Thread(target=self._read_output, args=(self.guard.stdout, False), daemon=True).start()
            else:
                self.guard = self._spawn(guard)
            log.info("started the HTTP guard (%s) pid %d on %s", self.config.guard, self.guard.pid, self.http_url)
        self._log_start = self.log_path.stat().st_size if self.log_path is not None and self.log_path.exists() else 0
        if self.log_path is None and self.startup is not None:
            self.startup.restart()
            self.process = self._spawn(command, subprocess.PIPE)
            threading.Thread(target=self._read_output, args=(self.process.stdout,), daemon=True).start()
        else:
            self.process = self._spawn(command)
        log.info("started tritonserver pid %d (%s)", self.process.pid, self.config.server_id)
        return self

    def _read_output(self, stream, progress: bool = True) -> None:
        """tritonserver's output (its stubs' too; `progress` False: the
        guard's) into the startup log, until the last of them exits."""
        with stream:
            for raw in stream:
                self.startup.feed(raw.decode(errors="replace"), progress)

    def announce_ready(self) -> None:
        """One line for a server that now answers: how long it took, its models, its URLs."""
        guarded = {"python": " (HTTP guard in front)", "nginx": " (HTTP guard: nginx in front)"}.get(self.config.guard, "")
        urls = f"HTTP http://{self.http_url}{guarded}, gRPC {self.grpc_url}, metrics {self.metrics_url}"
        if self.startup is not None:
            self.startup.announce_ready(urls)
        else:
            log.info("ready: %s", urls)

    def _spawn(self, command: list[str], output=None) -> subprocess.Popen:
        """`command` with its output to `output` (subprocess.PIPE), else to the log file, else to ours."""
        env = dict(os.environ) if self.image else server_env(workdir=self.workdir)  # the image's server needs no wheel paths
        if output is not None or self.log_path is None:
            return spawn(command, env, output)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:  # a restart appends
            return spawn(command, env, log_file)

    def record_restart(self, reason: str | None) -> None:
        """Count a restart by `reason` (None: none) in the status file that the
        guard's /metrics reports as opara_server_restarts_total."""
        if reason is not None:
            self.restarts[reason] = self.restarts.get(reason, 0) + 1
        partial = self.status_file.with_suffix(".partial")
        partial.write_text(json.dumps({"restarts": self.restarts}))
        partial.replace(self.status_file)
        if self.nginx is not None:  # what nginx serves at /metrics
            partial = self.nginx.metrics_path.with_suffix(".partial")
            partial.write_text(metrics_text({}, self.restarts))
            partial.replace(self.nginx.metrics_path)

    def failure(self, watched: dict[str, int]) -> tuple[str, str] | None:
        """(reason, what happened) if the server, the guard or a watched stub died.

        With explicit or poll model control, models come and go on purpose:
        `watched` follows them (a stub whose model Triton no longer reports
        ready was unloaded; a new stub, or a new pid under an old name, is a
        load). A stub gone while its model still reports ready died."""
        if self.returncode is not None:
            return "server exited", f"tritonserver {describe_exit(self.returncode)}{self.last_words()}"
        if self.guard is not None and self.guard.poll() is not None:
            return "guard exited", f"the HTTP guard {describe_exit(self.guard.returncode)}" + (f": {self._guard_words()}" if self.nginx else "")
        alive = self.stubs()
        if model_control_mode(self.config) in ("explicit", "poll"):
            for name in [name for name in watched if name not in alive and not self._model_ready(instance_model(name))]:
                del watched[name]
            watched.update(alive)
        dead = sorted(name for name, pid in watched.items() if alive.get(name) != pid)
        if dead:
            return "backend process died", (
                f"the backend process of model instance {', '.join(dead)} died; Triton 2.51 neither restarts it "
                "nor reports the model down"
            )
        return None

    def last_words(self) -> str:
        """The log's last lines that say why a process ended (C++ exceptions, signals)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as log_file:  # this run's part of the log only
                log_file.seek(self._log_start)
                lines = log_file.read().decode(errors="replace").splitlines()[-80:]
        except OSError:
            return ""
        words = [line for line in lines if re.search(r"terminate called|what\(\)|Signal \(|Segmentation", line)]
        return f" ({'; '.join(w.strip() for w in words[-2:])})" if words else ""

    def stubs(self) -> dict[str, int]:
        """This server's Python-backend stub processes: instance name -> pid."""
        found = {} if self.process is None else stub_processes(self.process.pid)
        self._stub_pids.update(found.values())
        return found

    def _is_our_stub(self, pid: int) -> bool:
        """`pid` runs, and is a stub of this server (its shared-memory region is
        named with our prefix), not a process that reused the pid."""
        try:
            return alive(pid) and shm_prefix(self.config).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    def _model_ready(self, model: str) -> bool:
        """Whether tritonserver (its own HTTP port) reports `model` ready."""
        url = f"http://{self.upstream[0]}:{self.upstream[1]}/v2/models/{model}/ready"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status == 200
        except urllib.error.HTTPError:
            return False
        except (urllib.error.URLError, OSError):
            return True  # no answer: not a sign of an unload

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the server answers as itself. No deadline while it makes
        progress: a cold GPU build of a large model takes minutes, and
        tritonserver opens no port before every model is loaded. Progress is
        new output or CPU time spent by the model processes (the backend stubs
        and the compile workers they start); `config.start_stall_s` seconds
        without either is a stall, which names the models still loading and
        what each last said. `timeout_s`: an overall limit besides (tests)."""
        started = last_progress = last_note = time.monotonic()
        marker = self._progress_marker()
        while True:
            if self.process is None or self.process.poll() is not None:
                raise ServerError(f"tritonserver exited early (code {self.returncode}):\n{self.log_tail()}")
            if self.guard is not None and self.guard.poll() is not None:
                raise ServerError(f"the HTTP guard exited early (code {self.guard.returncode}):\n{self._guard_words() or self.log_tail()}")
            if self._answers_as_self():
                self.stubs()  # remembered, so that `stop` can end any a killed server leaves behind
                return
            now = time.monotonic()
            if timeout_s is not None and now - started > timeout_s:
                raise ServerError(f"tritonserver not ready after {timeout_s:.0f} s{self._loading()}:\n{self.log_tail()}")
            seen = self._progress_marker()
            if seen[0] != marker[0] or abs(seen[1] - marker[1]) >= PROGRESS_CPU_S:
                marker, last_progress = seen, now
            elif now - last_progress > self.config.start_stall_s:
                raise ServerError(
                    f"tritonserver made no progress for {now - last_progress:.0f} s (no output, and its model processes "
                    f"spent no CPU time){self._loading()}; if a model needs longer, raise {START_STALL_ENV} "
                    f"(now {self.config.start_stall_s:.0f} s):\n{self.log_tail()}"
                )
            if self.startup is not None and now - last_note >= WAITING_NOTE_S:
                self.startup.announce_waiting()
                last_note = now
            time.sleep(0.25)

    def _progress_marker(self) -> tuple[float, float]:
        """(when output last came, CPU seconds of the model processes): either
        moving is progress."""
        if self.startup is not None:
            output = self.startup.last_output
        else:
            try:
                output = float(self.log_path.stat().st_size) if self.log_path is not None else 0.0
            except OSError:
                output = 0.0
        return output, models_cpu_seconds(self.process.pid) if self.process is not None else 0.0

    def _loading(self) -> str:
        """`; still loading: nasnet: profiling (290 s ago); t5: queued`, where the startup log knows."""
        pending = self.startup.pending() if self.startup is not None else []
        return f"; still loading: {'; '.join(pending)}" if pending else ""

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

    def interrupt(self, signum: int = signal.SIGTERM) -> None:
        """Begin a clean stop: `signum` to the front process (the guard, which
        closes its port at once and lets its requests in flight finish; else
        tritonserver). `stop` does the rest."""
        front = self.guard if self.guard is not None and self.guard.poll() is None else self.process
        if front is not None and front.poll() is None:
            front.send_signal(self._stop_signal(front, signum))
            self._signalled.add(front.pid)

    def _guard_words(self, lines: int = 5) -> str:
        """The end of nginx's error log (the Python guard writes into the server's output)."""
        if self.nginx is None:
            return ""
        try:
            return "\n".join(self.nginx.error_log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _stop_signal(self, process: subprocess.Popen, signum: int = signal.SIGTERM) -> int:
        """nginx ends at once on SIGTERM and SIGINT, dropping its requests in
        flight; SIGQUIT is its graceful stop."""
        return signal.SIGQUIT if self.nginx is not None and process is self.guard else signum

    def stop(self, timeout_s: float | None = None, keep_guard: bool = False) -> int | None:
        """SIGTERM to the guard, which closes its port at once and waits for its
        requests in flight (tritonserver still serves them); then SIGTERM to
        tritonserver (it finishes its own and unloads); SIGKILL for either that
        outlasts `timeout_s`. Then remove the shared-memory regions a dead stub
        left behind. `keep_guard`: stop only tritonserver (a restart)."""
        timeout_s = self.config.exit_timeout_s + 10 if timeout_s is None else timeout_s
        order = ([] if keep_guard else [("the HTTP guard", self.guard)]) + [("tritonserver", self.process)]
        for name, process in order:
            if process is None:
                continue
            if process.poll() is None and process.pid not in self._signalled:  # once: a second one may cut a drain short
                process.send_signal(self._stop_signal(process))
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", name, timeout_s)
                process.kill()
                process.wait()
        if not keep_guard:
            self.status_file.unlink(missing_ok=True)
            if self.nginx is not None:
                shutil.rmtree(self.nginx.directory, ignore_errors=True)
        # a stub outliving its server: a SIGKILLed server's stub exits within a
        # second by itself, but one was seen hung for minutes in a futex wait
        # (a lock the dead server held), holding its model's memory
        deadline = time.monotonic() + 2
        while (left := [pid for pid in self._stub_pids if self._is_our_stub(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            with contextlib.suppress(OSError):  # gone meanwhile
                os.kill(pid, signal.SIGKILL)
                log.warning("killed backend process %d, left behind by its server", pid)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in left) and time.monotonic() < deadline:  # exiting takes a moment
            time.sleep(0.05)
        self._stub_pids.clear()
        for region in Path("/dev/shm").glob(f"{shm_prefix(self.config)}*"):  # the server is gone: all ours
            region.unlink(missing_ok=True)
        return None if self.process is None else self.process.returncode

    def log_tail(self, lines: int = 60) -> str:
        if self.log_path is None:
            full = self.startup.full_log if self.startup is not None else None
            return f"(the whole log: {full.name})" if full is not None else "(the log is on the terminal)"
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


def models_cpu_seconds(server_pid: int) -> float:
    """CPU seconds spent so far by the processes tritonserver started (its
    models' backend stubs) and theirs (e.g. Inductor's compile workers),
    finished children included; 0 where the server is gone."""
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for child in children:
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            times = child.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie (an orphan's reaper may be slow or absent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def describe_exit(code: int) -> str:
    """`exited with code 1`, `was killed by SIGKILL` (a negative Popen code)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stub_processes(server_pid: int) -> dict[str, int]:
    """The Python-backend stubs of a tritonserver process: instance name -> pid.

    Each model instance is a child process whose command line (Triton 2.51) is
    `triton_python_backend_stub <model.py> <shm region> <shm sizes x2> <server
    pid> <backend dir> <ipc handle> <instance name> <kind>`.
    """
    stubs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            args = (entry / "cmdline").read_bytes().split(b"\0") if parent == server_pid else []
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if len(args) > 8 and args[0].endswith(b"triton_python_backend_stub"):
            stubs[args[8].decode()] = int(entry.name)
    return stubs


def find_server(port: int) -> int | None:
    """The pid of the tritonserver on this machine listening on `port`
    (matched on its --http-port / --grpc-port argument, or behind the HTTP
    guard listening there)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if args and args[0].endswith("tritonserver") and any(a in (f"--http-port={port}", f"--grpc-port={port}") for a in args):
            return int(entry.name)
        if "opara_core.serving.http_guard" in args and any(a.startswith("--listen=") and a.endswith(f":{port}") for a in args):
            upstream = [a.rsplit(":", 1)[1] for a in args if a.startswith("--upstream=")]
            return find_server(int(upstream[0])) if upstream else None
    return None


def spawn(command: list[str], env: dict[str, str], log_file=None) -> subprocess.Popen:
    """Start `command` as a child that dies with its parent (see
    `_parent_death_wrapper`), its output to `log_file` (an open file or
    subprocess.PIPE; None: ours).

    No preexec_fn: with one, Python starts the child with fork(), which runs
    every loaded library's at-fork handlers and then Python code in the child.
    Beside live gRPC clients that killed children before exec with gRPC's
    "epoll_wait error: Bad file descriptor" (seen in CI; 264 of 2,000 spawns of
    /bin/true here). Without one, Python uses vfork() and runs neither.
    """
    output = {} if log_file is None else {"stdout": log_file, "stderr": subprocess.STDOUT}
    return subprocess.Popen([*_parent_death_wrapper(), *command], env=env, stdin=subprocess.DEVNULL, **output)


def _parent_death_wrapper() -> tuple[str, ...]:
    """util-linux's setpriv, which asks Linux to SIGTERM the server when the
    thread that started it dies (the setting survives exec), so a killed
    `make serve` or test run never leaves an orphaned server holding ports."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        log.warning("setpriv (util-linux) not found: tritonserver will outlive a killed parent")
        return ()
    return (setpriv, "--pdeathsig", "TERM", "--")


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies."""
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass


def supervise(
    server: TritonServer,
    stop: threading.Event,
    poll_s: float = 1.0,
    max_restarts: int = 5,
    serving: threading.Event | None = None,
    window_s: float = 600.0,
    backoff_s: float = 1.0,
) -> int:
    """Run `server` until `stop` is set (0), or until it keeps failing (1);
    `serving`, if given, is set while the server is ready and watched.

    Restarts the server when tritonserver dies (a crash in Triton's own code,
    an out-of-memory kill, SIGKILL), when the HTTP guard dies, and when a
    Python-backend stub dies: Triton 2.51 neither restarts a dead stub nor
    reports its model down (the model stays ready and every request to it
    fails with "Stub process '<instance>' is not healthy"), so only a new
    server brings the model back. Each restart waits `backoff_s`, doubled
    for each restart in the last `window_s` seconds; after `max_restarts` in
    that window the supervisor gives up. The reason goes to the log and to
    opara_server_restarts_total on the guard's /metrics. A server that does
    not come up at the first start is not retried (a broken repository).
    """
    recent: list[float] = []
    started_once = False
    while not stop.is_set():
        try:
            server.start()
            server.wait_ready()
        except ServerError as error:
            server.stop(keep_guard=started_once)
            if stop.is_set():
                break
            if not started_once:
                log.error("%s", error)
                server.stop()
                return 1
            failure = ("server did not come back", str(error).splitlines()[0])
        else:
            started_once = True
            watched = server.stubs()
            log.info("watching the backend processes of %s", ", ".join(sorted(watched)) or "no Python model")
            server.announce_ready()
            if serving is not None:
                serving.set()
            failure = None
            while failure is None and not stop.wait(poll_s):
                failure = server.failure(watched)
            if serving is not None:
                serving.clear()
            if failure is None:
                break
        now = time.monotonic()
        recent = [t for t in recent if now - t < window_s]
        if len(recent) >= max_restarts:
            log.error("%s; the server stops after %d restarts in %.0f s", failure[1], len(recent), window_s)
            server.stop()
            return 1
        delay = backoff_s * 2 ** len(recent)
        log.error(
            "%s; the server restarts in %.0f s (restart %d of at most %d in %.0f s)",
            failure[1], delay, len(recent) + 1, max_restarts, window_s,
        )  # fmt: skip
        server.stop(keep_guard=True)
        recent.append(now)
        server.record_restart(failure[0])
        if stop.wait(delay):
            break
    server.stop()
    return 0


def with_admin_key(config: ServerConfig, env: dict[str, str] | None = None) -> tuple[ServerConfig, str]:
    """`make serve`'s admin key: OPARA_ADMIN_KEY, else a new random key for
    this server, written (mode 0600) to the key files of its HTTP and gRPC
    ports, where the project's client finds it (admin_key). Returns the config
    with its key and a line that says where the key is."""
    if config.admin_key:
        return config, f"admin key: from {ADMIN_KEY_ENV}"
    key = secrets.token_urlsafe(32)
    paths = write_admin_key(key, server_ports(config), env)
    return replace(config, admin_key=key, key_files=True), (
        f"admin key: new for this server, in {' and '.join(map(str, paths))} (mode 0600; the client reads the one "
        f"of the port it talks to; set {ADMIN_KEY_ENV} to choose one)"
    )


def server_ports(config: ServerConfig) -> tuple[int, int]:
    """The ports a client names: HTTP and gRPC."""
    return config.http_port, config.grpc_port


def serve(config: ServerConfig, workdir: Path = DEFAULT_WORKDIR, image: bool = False) -> int:
    """Run tritonserver (`image`: the container's own) and the HTTP guard in
    the foreground under `supervise`. `make serve`'s terminal gets the lines a
    person reads (a line per model, progress while loading, warnings and
    errors, the ready line) and the whole output goes to a log file; verbose,
    or in the container (whose log collector wants everything), the whole
    output goes to the terminal. SIGINT and SIGTERM stop both: requests in
    flight finish, Triton unloads; the parent-death signal covers a killed `make`."""
    verbose = config.log_verbose > 0 or "--log-verbose" in dict(passthrough_flags(config.extra_args))
    models = expected_models(config)
    full_log = None if verbose or image else open_server_log(workdir, config)
    startup = StartupLog(sys.stdout, models, hide_no_gpu_noise=not verbose and not gpu_present(), full_log=full_log)
    server = TritonServer(config, log_path=None, workdir=workdir, image=image, startup=startup)
    behind = f" (guarded by {config.guard}; tritonserver's own HTTP on {server.upstream[0]}:{server.upstream[1]})" if config.guarded else ""
    loading = f"{len(models)} model{'s' * (len(models) != 1)} ({', '.join(models)})" if models is not None else "models"
    print(
        f"tritonserver: HTTP {config.address}:{config.http_port}{behind}, gRPC {config.address}:{config.grpc_port}, "
        f"metrics {config.address}:{config.metrics_port}; loading {loading} from {config.model_repository}"
        + (f"; extra flags: {shlex.join(config.extra_args)}" if config.extra_args else "")
        + (f"; full log: {full_log.name}" if full_log is not None else ""),
        flush=True,
    )
    if full_log is not None:  # the launcher's own lines are sorted like the server's
        logging.getLogger().handlers = [StartupHandler(startup)]
    die_with_parent()
    stop = threading.Event()

    def forward(signum, frame) -> None:
        stop.set()
        server.interrupt(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        return supervise(server, stop)
    finally:
        if config.key_files:
            remove_admin_key(config.admin_key, server_ports(config))
        if full_log is not None:
            full_log.close()


def open_server_log(workdir: Path, config: ServerConfig):
    """The file that keeps a server's whole output: `<workdir>/logs/server-<HTTP
    port>.log`, begun anew by each launcher (a restart of its server appends)."""
    path = Path(workdir) / "logs" / f"server-{config.http_port}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w", encoding="utf-8", errors="replace")


def warm(config: ServerConfig, workdir: Path = DEFAULT_WORKDIR) -> int:
    """Load every model of the repository once, as `serve` does, then stop.

    The builds fill the on-disk caches (Inductor's compiled code for fused
    lanes, see engine.inductor_cache; the profiles, traced graphs and seeded
    weights; every shape of a variable-length model, whatever its `capture`),
    so the next start of the same models on the same GPU and software builds
    from them: run it when building a container image, with the cache
    directory inside the image. No deadline while the builds make progress
    (TritonServer.wait_ready). Exit code 1 if a model failed to load or the
    server never became ready."""
    models = expected_models(config)
    full_log = open_server_log(workdir, config)
    startup = StartupLog(sys.stdout, models, hide_no_gpu_noise=not gpu_present(), full_log=full_log)
    # variable-length models build every shape (serving.varlen.CAPTURE_ENV), not only those
    # their `capture` "first_use" would build at load, so that later starts find all of them
    # (unless the caller chose otherwise, e.g. to time a first-use start)
    os.environ.setdefault("OPARA_CAPTURE", "load")
    server = TritonServer(config, log_path=None, workdir=workdir, startup=startup)
    logging.getLogger().handlers = [StartupHandler(startup)]
    print(
        f"warming: loading {', '.join(models) if models else 'the models'} from {config.model_repository}, then stopping; "
        f"full log: {full_log.name}",
        flush=True,
    )
    die_with_parent()
    problem = None
    try:
        server.start().wait_ready()
        startup.announce_ready("stopping")
    except ServerError as error:
        problem = str(error)
    finally:
        server.stop()
        full_log.close()
    if startup.failed:  # why: in its `failed to load` line above
        problem = f"failed to load: {', '.join(startup.failed)} (the reason is in its line above)"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problem else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opara_core.serving.launcher", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare", help="lay out the Triton backend directory")
    prepare.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    run = sub.add_parser("serve", help="run tritonserver in the foreground")
    run.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    run.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    run.add_argument("--log-verbose", type=int, default=0)
    run.add_argument("--guard", choices=GUARDS, default="python", help="what serves HTTP_PORT in front of tritonserver: "
                     "the Python HTTP guard (default: it refuses every request class known to end tritonserver 2.51), nginx "
                     "(faster; for a tritonserver that parses JSON safely, 2.69 and later), or none (tritonserver's own port)")
    warming = sub.add_parser("warm", help="load every model once and stop: fills the build caches (e.g. for a container image)")
    warming.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    warming.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    container = sub.add_parser(
        "container",
        help="run the image's own tritonserver with the safe flags, behind the HTTP guard, supervised (the "
        "Dockerfile's CMD); binds 0.0.0.0 inside the container: publish with -p 127.0.0.1:8000:8000 to keep it local",
    )
    container.add_argument("--model-repository", type=Path, default=Path("/models"))
    container.add_argument("--log-verbose", type=int, default=0)
    container.add_argument("--guard", choices=GUARDS, default="nginx", help="what serves HTTP_PORT in front of the image's "
                           "tritonserver 2.69 (default nginx; python: the Python HTTP guard; none)")
    for command in (run, container):
        command.epilog = (
            f"Extra tritonserver flags: after `--`, or in {TRITON_ARGS_ENV} (split as a shell would; "
            f"those come first); a flag the launcher owns (ports, addresses, model repository, "
            f"restricted APIs) is refused."
        )
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "prepare":
            print(prepare_backends(args.workdir))
            return 0
        if not args.model_repository.is_dir():
            raise ValueError(f"model repository {args.model_repository} is not a directory")
        if args.command == "warm":  # free ports: a running server is no obstacle
            ports = dict(zip(("HTTP_PORT", "GRPC_PORT", "METRICS_PORT"), map(str, free_ports(3))))
            config = ServerConfig.from_env({**os.environ, **ports}, model_repository=args.model_repository, guard="none")
            return warm(config, args.workdir)
        if args.command == "container":
            config = ServerConfig.from_env(
                model_repository=args.model_repository, log_verbose=args.log_verbose, address="0.0.0.0", extra_args=extra,
                guard=args.guard,
            )
            _refuse_busy_ports(config)
            if not config.admin_key:
                print(f"note: {ADMIN_KEY_ENV} is unset: the {', '.join(RESTRICTED_APIS)} APIs are closed to everyone", flush=True)
            return serve(config, image=True)
        config = ServerConfig.from_env(
            model_repository=args.model_repository, log_verbose=args.log_verbose, guard=args.guard, extra_args=extra
        )
        _refuse_busy_ports(config)
        config, where = with_admin_key(config)
        print(where, flush=True)
        return serve(config, args.workdir)
    except (RuntimeError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _refuse_busy_ports(config: ServerConfig) -> None:
    busy = busy_ports(config)
    if busy:
        raise ValueError("; ".join(busy) + ": stop what holds it, or choose other ports with HTTP_PORT, GRPC_PORT and METRICS_PORT")


if __name__ == "__main__":
    sys.exit(main())
