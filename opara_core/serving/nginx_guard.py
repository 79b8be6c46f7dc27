"""nginx as the HTTP guard, for a tritonserver whose HTTP front end parses JSON
safely (Triton 2.69 and later: the container's 26.05).

Why: of the requests that end tritonserver 2.51, 2.69 still has one class
without an upstream fix, a chunk size beyond 64 bits (docs/deployment.md), and
a C reverse proxy that buffers request bodies refuses it with 400 before it
opens the upstream connection (nginx 1.22, 2026-12-06). The Python guard
(`http_guard`) refuses it too, but every request crosses a Python process:
+31% p50 on a small request at concurrency 1 and 0.75x the throughput at 16
against +10% and no measurable loss through nginx (DeepFM over HTTP, 2-core
CPU, docs/reliability.md), and about 1.9 ms more per 588 KiB image on an H200.
In front of 2.51, nginx would leave its JSON crash classes open: the
launcher says so and keeps the Python guard the default there.

What the Python guard also does, nginx does here: `GET /metrics` on the
public port (the launcher's restarts, from a file the launcher rewrites), 503
with Triton's `{"error": ...}` body while tritonserver restarts, and 413 for a
body above `client_max_body_size`. It does not count its refusals.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

NGINX_CANDIDATES = ("nginx", "/usr/sbin/nginx")
BODY_LIMIT = 1 << 30  # bytes: either guard's limit for an inference whose model sets no bound (http_guard's OPEN_BODY_LIMIT)
UNAVAILABLE = '{"error":"the inference server is unavailable (restarting)"}'


def find_nginx() -> str:
    """The nginx binary, or a clear error naming what to install."""
    for candidate in NGINX_CANDIDATES:
        path = shutil.which(candidate)
        if path:
            return path
    raise RuntimeError("the nginx guard needs nginx on PATH or in /usr/sbin (Debian and Ubuntu: apt-get install nginx)")


@dataclass(frozen=True)
class NginxGuard:
    """One nginx in front of one tritonserver: its files live in `directory`."""

    directory: Path
    listen: tuple[str, int]
    upstream: tuple[str, int]
    workers: int = 1
    body_limit: int = BODY_LIMIT

    @property
    def config_path(self) -> Path:
        return self.directory / "nginx.conf"

    @property
    def metrics_path(self) -> Path:
        """The Prometheus text nginx serves at /metrics (the launcher writes it)."""
        return self.directory / "metrics.prom"

    @property
    def error_log(self) -> Path:
        return self.directory / "error.log"

    def command(self) -> list[str]:
        return [find_nginx(), "-p", str(self.directory), "-c", str(self.config_path), "-e", str(self.error_log)]

    def write(self) -> Path:
        """The directory with nginx.conf and an empty metrics file."""
        for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        if not self.metrics_path.exists():
            self.metrics_path.write_text("")
        self.config_path.write_text(self.config_text())
        return self.directory

    def config_text(self) -> str:
        host, port = self.listen
        listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        up_host, up_port = self.upstream
        d = self.directory
        return f"""# written by opara_core.serving.nginx_guard for one launcher's server
daemon off;
worker_processes {self.workers};
pid {d}/nginx.pid;
error_log {self.error_log} warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    # every temporary directory in ours: as a non-root user (the container's) nginx cannot create its defaults
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    client_max_body_size {self.body_limit};
    client_body_buffer_size 1m;
    upstream triton {{ server {up_host}:{up_port}; keepalive 64; }}
    server {{
        listen {listen} reuseport;
        # the whole body before tritonserver sees any of it: a chunked body is
        # parsed (and one with a chunk size beyond 64 bits refused) here
        proxy_request_buffering on;
        proxy_buffering off;  # responses stream, e.g. generate_stream's events
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_read_timeout 3600s;
        error_page 502 504 = @unavailable;
        location / {{ proxy_pass http://triton; }}
        location = /metrics {{ default_type text/plain; alias {self.metrics_path}; }}
        location @unavailable {{ default_type application/json; return 503 '{UNAVAILABLE}'; }}
    }}
}}
"""
