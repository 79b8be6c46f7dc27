"""How many CPU cores this process may use. Torch-free, so that the GPU
machine's job queue (dev/gpu_queue.py) shares it with the engine."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: a container's or a
    job's cpuset), not all of the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1
