"""Where a server's admin key lives, for the launcher that writes it and the
clients that read it.

The key guards Triton's restricted APIs (shared memory, repository index,
logging, trace). It comes from OPARA_ADMIN_KEY; when that is unset, the
launcher makes a key for each server it starts and writes it (mode 0600) to
one file per port that server listens on (`admin_key_path(port)`), so a
client on the same machine, as the same user, finds the key of the very
server it talks to: a second server on other ports writes files of its own
and never overwrites the first one's. The launcher removes its files when
the server stops. Standard library only: the client imports this without torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

ADMIN_KEY_ENV = "OPARA_ADMIN_KEY"
# a key file is only trusted for a server on this machine
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0")


def admin_key_dir(env: dict[str, str] | None = None) -> Path:
    """$XDG_RUNTIME_DIR/opara/admin-keys (a per-user tmpfs that goes at logout),
    else ~/.cache/opara/admin-keys."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "opara" / "admin-keys"


def admin_key_path(port: int, env: dict[str, str] | None = None) -> Path:
    """The key file of the server listening on `port` (HTTP or gRPC)."""
    return admin_key_dir(env) / str(int(port))


def split_url(url: str) -> tuple[str, int | None]:
    """(host, port) of `host:port` or `scheme://host:port/...`; port None if absent."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return rest, None
    return host, int(port)


def read_admin_key(url: str | None = None, env: dict[str, str] | None = None) -> str | None:
    """OPARA_ADMIN_KEY if set; else, for a server on this machine at `url`,
    the key file of its port if only its owner can read it; else None."""
    env = os.environ if env is None else env
    if env.get(ADMIN_KEY_ENV):
        return env[ADMIN_KEY_ENV]
    if url is None:
        return None
    host, port = split_url(url)
    if port is None or host not in LOCAL_HOSTS:
        return None
    path = admin_key_path(port, env)
    try:
        if path.stat().st_mode & 0o077:  # readable by others: not a key we trust
            return None
        key = path.read_text().strip()
    except OSError:
        return None
    return key or None


def write_admin_key(key: str, ports: Iterable[int], env: dict[str, str] | None = None) -> list[Path]:
    """Write `key` to the key file of each port, each created with mode 0600
    (never readable by others, not even for a moment); returns the paths."""
    paths = []
    for port in ports:
        path = admin_key_path(port, env)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # an older file may have had other bits
            os.write(fd, (key + "\n").encode())
        finally:
            os.close(fd)
        paths.append(path)
    return paths


def remove_admin_key(key: str, ports: Iterable[int], env: dict[str, str] | None = None) -> None:
    """Remove the key files of `ports` that still hold `key` (a later server
    on the same port has written its own: that one stays)."""
    for port in ports:
        path = admin_key_path(port, env)
        with contextlib.suppress(OSError):
            if path.read_text().strip() == key:
                path.unlink()
