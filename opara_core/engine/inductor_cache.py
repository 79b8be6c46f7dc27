"""Where Inductor keeps the code it compiles for fused lanes.

Inductor caches compiled graphs and Triton kernels on disk under
TORCHINDUCTOR_CACHE_DIR, by default a per-user directory under /tmp that a
reboot or a fresh container loses. Fused-lanes builds compile every segment,
so the project points Inductor at a directory that lasts: the `inductor_cache`
config parameter, else TORCHINDUCTOR_CACHE_DIR if the user set it, else
$OPARA_CACHE_DIR/inductor, else ~/.cache/opara/inductor (engine.cache). Never inside the package.
The compiled segments themselves are saved in its `segments` subdirectory
(engine.segment_compiler), which a later build loads without compiling.
Triton's compiled kernels go to its `triton/0` subdirectory, where Inductor
puts its own once it runs: also the engine's hand-written kernels
(skinny_gemm, depthwise_conv, short_attention), which otherwise compile into
~/.triton before Inductor first runs in the process, outside the cache that
`make warm` fills for a container image. A TRITON_CACHE_DIR the user set is kept.
Triton's ptxas is pinned to the one Inductor picks, for the same reason
(`pin_triton_ptxas`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from opara_core.engine import cache

log = logging.getLogger(__name__)

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"


def inductor_cache_dir(configured: str = "", env: Mapping[str, str] = os.environ) -> Path:
    """The directory Inductor should use (see the module docstring for the order).

    Inductor writes its own default into TORCHINDUCTOR_CACHE_DIR the first
    time it looks (once anything in the process compiled): that value is not
    the user's choice and does not count."""
    if configured:
        return Path(configured).expanduser()
    if env.get(INDUCTOR_ENV) and env[INDUCTOR_ENV] != _torch_default():
        return Path(env[INDUCTOR_ENV])
    return cache.directory("inductor", env)


def _torch_default() -> str | None:
    """Inductor's default cache directory (/tmp/torchinductor_<user>), where this torch says."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        try:
            from torch._inductor.runtime.runtime_utils import default_cache_dir
        except ImportError:
            return None
    return os.path.abspath(default_cache_dir())


def use_inductor_cache(configured: str = "") -> Path:
    """Point this process's Inductor at its cache directory (created if missing).

    Inductor reads the variable whenever it looks for its cache, so this must
    run before the first compilation of the process; a directory that cannot be
    created is a configuration error, named here rather than deep in a compile."""
    directory = inductor_cache_dir(configured)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"inductor cache directory {directory} cannot be created: {error.strerror}") from None
    previous = os.environ.get(INDUCTOR_ENV)
    moved = previous != str(directory)
    if moved:
        os.environ[INDUCTOR_ENV] = str(directory)
        log.info("Inductor's cache: %s", directory)
    triton = os.environ.get(TRITON_ENV)
    # unset, or Inductor's default under the directory this process used before: not the user's
    if triton is None or (moved and previous and Path(triton).is_relative_to(previous)):
        os.environ[TRITON_ENV] = str(directory / "triton" / "0")  # where Inductor puts it (device 0 as the process sees it)
    pin_triton_ptxas()
    return directory


def pin_triton_ptxas() -> None:
    """Give every Triton compile of this process the ptxas Inductor gives its own.

    Where the torch wheel ships a ptxas (torch/bin/ptxas), Inductor points
    TRITON_PTXAS_PATH at it at its first compile in a process. Triton keys its
    cache by the ptxas, so an engine kernel compiled before that moment (a cold
    build's skinny-GEMM timing) was not found by a process where Inductor ran
    first (a warm build): T5's first warm build compiled 27 kernels again, the
    engine's 9 and 18 of Inductor's (docs/benchmarks.md run 33). Inductor's
    own function, so the choice stays Inductor's; it keeps a path the user set."""
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # a torch without it does not set the path either
        return
    _set_triton_ptxas_path()
