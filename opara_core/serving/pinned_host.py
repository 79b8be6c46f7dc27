"""Page-lock the shared memory where Triton's Python backend puts a request's host inputs.

A host input (tensors in the message, or system shared memory) reaches
`execute` inside the stub's shared-memory region, ordinary pageable memory.
Copying it to the GPU then takes two steps: into the runner's pinned staging
(a CPU copy) and from there to the graph's inputs. Registered once with
`cudaHostRegister`, the region is page-locked where it is: the runner copies a
request's rows straight to the GPU in one asynchronous transfer
(`engine.runtime.GraphRunner`: blocks whose memory is pinned skip the staging).

The backend never unmaps a region while its stub lives: growing the pool maps
the file again at a new address and keeps the old mapping
(python_backend's `SharedMemoryManager::GrowIfNeeded`), so each mapping is
registered the first time an input lands in it and stays registered until
`close`. Memory outside `/dev/shm` (a test's own tensors) is left as it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAPS = Path("/proc/self/maps")


@dataclass(frozen=True)
class Mapping:
    """One mapped range of this process (a line of /proc/self/maps)."""

    start: int
    end: int
    path: str

    def holds(self, address: int) -> bool:
        return self.start <= address < self.end


def shared_memory_mappings(maps: str) -> list[Mapping]:
    """The writable mappings of files under /dev/shm in `maps` (the text of /proc/self/maps)."""
    found = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/dev/shm/") and fields[1].startswith("rw"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append(Mapping(start, end, fields[5]))
    return found


class SharedMemoryPinner:
    """Registers, once each, the shared-memory mappings that hold a GPU
    instance's host inputs. A failure, or an input outside shared memory,
    turns it off for good: the inputs then take the staging copy, as before."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self.pinned: list[Mapping] = []

    def pin(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory is (now) page-locked by this pinner."""
        if not self.enabled or tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        address = tensor.data_ptr()
        if any(m.holds(address) for m in self.pinned):
            return True
        mapping = next((m for m in shared_memory_mappings(MAPS.read_text()) if m.holds(address)), None)
        if mapping is None:  # not the backend's region (outside a stub): not worth a look at every request
            self.enabled = False
            log.info("host inputs outside shared memory: they take the staging copy")
            return False
        error = int(torch.cuda.cudart().cudaHostRegister(mapping.start, mapping.end - mapping.start, 0))
        if error != 0:
            self.enabled = False
            log.warning("page-locking the shared memory of %s failed (cudaError %d): host inputs take the staging copy", mapping.path, error)
            return False
        self.pinned.append(mapping)
        log.info("page-locked %s (%.1f MiB): host inputs go to the GPU in one copy", mapping.path, (mapping.end - mapping.start) / 2**20)
        return True

    def close(self) -> None:
        """Unregister every mapping (the model's `finalize`)."""
        for mapping in self.pinned:
            torch.cuda.cudart().cudaHostUnregister(mapping.start)
        self.pinned.clear()
