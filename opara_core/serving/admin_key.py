"""Where the server's admin key lives, for the launcher that writes it and the
clients that read it.

The key guards Triton's restricted APIs (shared memory, repository index,
logging, trace). It comes from OPARA_ADMIN_KEY; when that is unset, the
launcher writes the key it generated to `admin_key_path()` (mode 0600), so a
client on the same machine, as the same user, can use it without copying it
by hand. Standard library only: the client imports this without torch.
"""

from __future__ import annotations

import os
from pathlib import Path

ADMIN_KEY_ENV = "OPARA_ADMIN_KEY"


def admin_key_path(env: dict[str, str] | None = None) -> Path:
    """$XDG_RUNTIME_DIR/opara/admin-key (a per-user tmpfs that goes at logout),
    else ~/.cache/opara/admin-key."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "opara" / "admin-key"


def read_admin_key(env: dict[str, str] | None = None) -> str | None:
    """OPARA_ADMIN_KEY if set, else the key file's first line if the file is
    there and only its owner can read it, else None."""
    env = os.environ if env is None else env
    if env.get(ADMIN_KEY_ENV):
        return env[ADMIN_KEY_ENV]
    path = admin_key_path(env)
    try:
        if path.stat().st_mode & 0o077:  # readable by others: not a key we trust
            return None
        key = path.read_text().strip()
    except OSError:
        return None
    return key or None


def write_admin_key(key: str, env: dict[str, str] | None = None) -> Path:
    """Write `key` to `admin_key_path()`, created with mode 0600 (never
    readable by others, not even for a moment); returns the path."""
    path = admin_key_path(env)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older file may have had other bits
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)
    return path
