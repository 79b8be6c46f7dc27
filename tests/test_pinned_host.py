"""Page-locking the Python backend's shared memory (serving.pinned_host)."""

from __future__ import annotations

from multiprocessing import shared_memory

import pytest
import torch

from opara_core.serving.pinned_host import MAPS, SharedMemoryPinner, shared_memory_mappings


@pytest.fixture
def block():
    """A tensor in a fresh /dev/shm file, as Triton's Python backend hands a host input to `execute`."""
    region = shared_memory.SharedMemory(create=True, size=1 << 20)
    tensor = torch.frombuffer(region.buf, dtype=torch.float32)
    yield tensor, region.name
    del tensor
    region.close()
    region.unlink()


def test_the_mapping_of_a_shared_memory_block_is_found_and_no_other_memory_is(block):
    tensor, name = block
    mappings = shared_memory_mappings(MAPS.read_text())
    holding = [m for m in mappings if m.holds(tensor.data_ptr())]
    assert [m.path for m in holding] == [f"/dev/shm/{name}"] and holding[0].end - holding[0].start >= 1 << 20
    assert not any(m.holds(torch.zeros(1 << 16).data_ptr()) for m in mappings)


def test_only_writable_mappings_of_shared_memory_files_are_taken():
    maps = "\n".join([
        "7f0000000000-7f0000100000 rw-s 00000000 00:1a 12 /dev/shm/triton_python_backend_shm_region_1",
        "7f0000100000-7f0000200000 r--s 00000000 00:1a 13 /dev/shm/read_only",
        "7f0000200000-7f0000300000 rw-p 00000000 08:01 14 /usr/lib/libc.so.6",
        "7f0000300000-7f0000400000 rw-p 00000000 00:00 0 ",
    ])  # fmt: skip
    (found,) = shared_memory_mappings(maps)
    assert (found.start, found.end, found.path) == (0x7F0000000000, 0x7F0000100000, "/dev/shm/triton_python_backend_shm_region_1")


def test_a_cpu_instance_pins_nothing(block):
    tensor, _ = block
    pinner = SharedMemoryPinner(torch.device("cpu"))
    assert not pinner.pin(tensor) and not pinner.pinned


@pytest.mark.gpu
def test_a_gpu_instance_pins_each_mapping_once_and_gives_it_back(block):
    tensor, _ = block
    pinner = SharedMemoryPinner(torch.device("cuda"))
    assert pinner.pin(tensor[:1000]) and pinner.pin(tensor[5000:]) and len(pinner.pinned) == 1
    assert tensor.is_pinned()  # what the runner asks before it copies straight to the GPU
    up = tensor[:1000].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(up.cpu(), tensor[:1000])
    pinner.close()
    assert not tensor.is_pinned() and not pinner.pinned


@pytest.mark.gpu
def test_an_input_outside_shared_memory_turns_the_pinner_off():
    pinner = SharedMemoryPinner(torch.device("cuda"))
    assert not pinner.pin(torch.zeros(1 << 16)) and not pinner.enabled
