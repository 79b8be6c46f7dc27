"""The project's on-disk caches: one root, a directory per kind, keys, atomic writes, reads.

Every cache lies under $OPARA_CACHE_DIR (else ~/.cache/opara), one directory
per kind (`directory("profiles")`; docs/design.md, "Caches", lists them). A
file is named by `key`: the sha256 of the inputs that decide what it holds (a
JSON mapping, keys sorted), plus, where they decide it, the named parts of the
software (`SOFTWARE`: the GPU, torch, cuDNN, Triton, the TF32 and cuDNN
benchmark switches), read here the same way for every cache. A cache's
`format`, among its inputs, is bumped when its key or its file changes shape,
so that old files are missed (one cold rebuild), never misread.

Writes go to a temporary file beside the target, renamed over it at the end
(`os.replace`): a reader, in this process or another one, sees the old file or
the whole new one, and a write that fails leaves the old file as it was and no
temporary behind. A read treats a missing file as a miss, and an unreadable
one too (logged once per file, named). Nothing happens at import: the root is
read at each call, and nothing is created until something is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

ENV = "OPARA_CACHE_DIR"
# what decides which kernels run and how fast they are (auto's choices, profiles)
KERNELS = ("gpu", "torch", "cudnn", "tf32", "cudnn_benchmark")
SOFTWARE = (*KERNELS, "triton")  # every part `software` knows

T = TypeVar("T")

_warned: set[str] = set()  # unreadable files already logged
_warned_lock = threading.Lock()


def root(env: Mapping[str, str] = os.environ) -> Path:
    """The project's cache directory: $OPARA_CACHE_DIR, else ~/.cache/opara."""
    value = env.get(ENV)
    return Path(value) if value else Path.home() / ".cache" / "opara"


def directory(kind: str, env: Mapping[str, str] = os.environ) -> Path:
    """The directory of one kind of cache (`profiles`, `traces`, ...), under `root`; not created here."""
    if not kind or Path(kind).name != kind or kind in (".", ".."):
        raise ValueError(f"a cache kind is one plain name, not {kind!r}")
    return root(env) / kind


def software(parts: Iterable[str] = KERNELS, device: Any = None) -> dict[str, Any]:
    """The named parts of the software, as `key` hashes them: `gpu` (the
    device's name on CUDA, else its type: needs `device`), `torch`, `cudnn`
    (its version, None without it), `triton` (None without it), `tf32` (cuDNN's
    and cuBLAS's TF32 switches, float32 matmul precision), `cudnn_benchmark`."""
    import torch

    found: dict[str, Any] = {}
    for part in parts:
        if part == "gpu":
            if device is None:
                raise ValueError("the `gpu` part needs the device")
            device = torch.device(device)
            found[part] = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        elif part == "torch":
            found[part] = torch.__version__
        elif part == "cudnn":
            found[part] = torch.backends.cudnn.version()
        elif part == "tf32":
            found[part] = [torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()]
        elif part == "cudnn_benchmark":
            found[part] = torch.backends.cudnn.benchmark
        elif part == "triton":
            try:
                import triton
            except ImportError:
                found[part] = None
            else:
                found[part] = triton.__version__
        else:
            raise ValueError(f"unknown software part {part!r}; known: {', '.join(SOFTWARE)}")
    return found


_software = software  # for `key`, whose argument of that name it is


def key(inputs: Mapping[str, Any], software: Iterable[str] = (), device: Any = None) -> str:
    """sha256 (hex) of `inputs` (JSON-able: a value JSON cannot write raises
    TypeError, so that no key hides an object's address) with mapping keys
    sorted, plus the parts of the software named in `software` (none unless
    asked; `gpu` needs `device`)."""
    text = json.dumps({"inputs": dict(inputs), "software": _software(tuple(software), device)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def digest(*parts: str | bytes) -> str:
    """sha256 (hex) of `parts` in order (text as UTF-8): a file's or some code's
    fingerprint, to go among a key's inputs."""
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(part.encode() if isinstance(part, str) else part)
    return hashed.hexdigest()


# ---- writing ------------------------------------------------------------------------


@contextlib.contextmanager
def atomic(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` (its directory made) for the block to
    write; renamed over `path` when the block ends, removed if it raises. For
    writers that take a path (Inductor's `CompiledArtifact.save`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = _created_beside(path)
    try:
        yield Path(name)
        os.replace(name, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)  # only there if the block raised (or the rename failed)


def _created_beside(path: Path) -> str:
    """A new empty file of a name no one else has, beside `path`, with the
    permissions any new file gets (the umask's: `tempfile`'s are the owner's
    only, and a cache filled for a container image is read by another user)."""
    for _ in range(100):
        name = str(path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"))
        try:
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            continue
        return name
    raise FileExistsError(f"no free temporary name beside {path}")


def write_bytes(path: Path, data: bytes) -> Path:
    with atomic(path) as partial:
        partial.write_bytes(data)
    return Path(path)


def write_text(path: Path, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: Path, data: Any, **dump_options: Any) -> Path:
    """`json.dump(data, ..., **dump_options)`, atomically."""
    with atomic(path) as partial, open(partial, "w") as handle:
        json.dump(data, handle, **dump_options)
    return Path(path)


def write_torch(path: Path, obj: Any) -> Path:
    """`torch.save(obj, ...)`, atomically."""
    import torch

    with atomic(path) as partial, open(partial, "wb") as handle:
        torch.save(obj, handle)
    return Path(path)


# ---- reading ------------------------------------------------------------------------


def read(path: Path, parse: Callable[[Path], T], what: str = "cache file") -> T | None:
    """`parse(path)`; None where the file is missing, and where it cannot be
    read or parsed (any error `parse` raises: the file is then treated as
    missing, and the first time in this process a warning names it)."""
    try:
        return parse(Path(path))
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - whatever a damaged or foreign file makes the parser raise
        with _warned_lock:
            first = str(path) not in _warned
            _warned.add(str(path))
        if first:
            log.warning("ignoring unreadable %s %s (%s: %s): not read, as if missing", what, path, type(error).__name__, error)
        return None


def read_json(path: Path, convert: Callable[[Any], T] = lambda data: data, what: str = "cache file") -> T | None:
    """`convert(json.load(...))` (see `read`: None if missing or unreadable)."""
    return read(path, lambda p: convert(json.loads(p.read_bytes())), what)
