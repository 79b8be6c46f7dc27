"""engine.cache: the root and a directory per kind, keys from the inputs (and the
software parts asked for), atomic writes that never leave half a file, and reads
that take a missing or unreadable file for a miss."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opara_core.engine import cache


def test_the_root_is_opara_cache_dir_else_the_users_cache(tmp_path, monkeypatch):
    assert cache.root({"OPARA_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert cache.root({}) == cache.root({"OPARA_CACHE_DIR": ""}) == Path.home() / ".cache" / "opara"
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    assert cache.root() == tmp_path  # read at each call, not at import
    assert cache.directory("profiles") == tmp_path / "profiles" and not (tmp_path / "profiles").exists()
    assert cache.directory("traces", {}) == Path.home() / ".cache" / "opara" / "traces"
    for bad in ("", ".", "..", "a/b", "/abs"):
        with pytest.raises(ValueError, match="plain name"):
            cache.directory(bad)


def test_importing_it_touches_nothing(tmp_path):
    """No import-time side effects: no directory made, torch not even imported."""
    env = {**os.environ, "OPARA_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path / "home")}
    code = "import sys, opara_core.engine.cache as c; c.root(); c.directory('profiles'); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False" and list(tmp_path.iterdir()) == []


def test_the_key_is_stable_under_order_and_follows_each_input():
    inputs = {"graph": "sha256:aaa", "shapes": [[1, 3, 8, 8]], "settings": {"lanes": 8, "policy": "opara"}, "format": 1}
    key = cache.key(inputs)
    assert len(key) == 64 and key == cache.key(dict(reversed(inputs.items())))
    assert key == cache.key({**inputs, "settings": {"policy": "opara", "lanes": 8}})  # nested mappings too
    for name, other in (("graph", "sha256:bbb"), ("shapes", [[2, 3, 8, 8]]), ("settings", {"lanes": 4, "policy": "opara"}), ("format", 2)):
        assert cache.key({**inputs, name: other}) != key, name
    assert cache.key({**inputs, "extra": None}) != key
    with pytest.raises(TypeError):  # no object's address in a key
        cache.key({"module": object()})


@contextlib.contextmanager
def switched(owner, name, value):
    """`owner.name = value` inside the block (torch's switch modules defeat monkeypatch's undo)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def test_the_software_part_is_opt_in_and_follows_each_part(monkeypatch):
    inputs = {"graph": "sha256:aaa"}
    plain = cache.key(inputs)
    with_software = cache.key(inputs, cache.KERNELS, "cpu")
    assert with_software != plain and with_software == cache.key(inputs, cache.KERNELS, torch.device("cpu"))
    assert cache.software(("gpu", "torch"), "cpu") == {"gpu": "cpu", "torch": torch.__version__}
    assert cache.key(inputs, ("torch",)) != cache.key(inputs, ("torch", "triton"))
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):  # a CUDA device is named (never touched here: the name is patched)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert cache.software(("gpu",), "cuda:0") == {"gpu": name}
    assert cache.key(inputs, ("gpu",), "cuda") != plain and cache.key(inputs, ("gpu",), "cuda") != cache.key(inputs, ("gpu",), "cpu")
    monkeypatch.undo()
    changes = {
        "torch": (torch, "__version__", "0.0.1"),
        "cudnn": (torch.backends.cudnn, "version", lambda: 1),
        "tf32": (torch.backends.cuda.matmul, "allow_tf32", not torch.backends.cuda.matmul.allow_tf32),
        "cudnn_benchmark": (torch.backends.cudnn, "benchmark", not torch.backends.cudnn.benchmark),
    }
    for part, (owner, name, value) in changes.items():
        others = [p for p in cache.KERNELS if p != part]
        without = cache.key(inputs, others, "cpu")
        with switched(owner, name, value):
            assert cache.key(inputs, cache.KERNELS, "cpu") != with_software, part
            assert cache.key(inputs, others, "cpu") == without, part  # a part not asked for does not count
    assert cache.key(inputs, cache.KERNELS, "cpu") == with_software  # all switched back
    with pytest.raises(ValueError, match="needs the device"):
        cache.key(inputs, ("gpu",))
    with pytest.raises(ValueError, match="unknown software part"):
        cache.key(inputs, ("cuda",))


def test_writes_replace_the_file_whole(tmp_path):
    path = tmp_path / "new" / "table.json"
    assert cache.write_json(path, {"a": [1, 2]}, indent=1) == path
    assert path.read_text() == '{\n "a": [\n  1,\n  2\n ]\n}'
    assert cache.write_bytes(tmp_path / "b.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    assert cache.write_text(tmp_path / "why.wrong", "IndexError").read_text() == "IndexError"
    cache.write_torch(tmp_path / "t.pt", {"x": torch.arange(3)})
    assert torch.equal(torch.load(tmp_path / "t.pt", weights_only=True)["x"], torch.arange(3))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["b.bin", "new", "t.pt", "table.json", "why.wrong"]


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    cache.write_json(path, {"old": 1})
    with pytest.raises(TypeError, match="not JSON serializable"):
        cache.write_json(path, {"a": list(range(10000)), "b": object()})  # half of it written when it raises
    assert json.loads(path.read_text()) == {"old": 1} and [p.name for p in tmp_path.iterdir()] == ["table.json"]

    def full_disk(obj, handle, *args, **kwargs):
        handle.write(b"partial")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(RuntimeError, match="file write failed"):
        cache.write_torch(path, {"x": torch.zeros(3)})
    assert json.loads(path.read_text()) == {"old": 1} and [p.name for p in tmp_path.iterdir()] == ["table.json"]
    with pytest.raises(KeyboardInterrupt), cache.atomic(path) as partial:  # a writer that takes a path
        partial.write_bytes(b"half")
        raise KeyboardInterrupt
    assert json.loads(path.read_text()) == {"old": 1} and [p.name for p in tmp_path.iterdir()] == ["table.json"]


def test_a_reader_during_a_write_sees_the_old_file_or_the_new_one(tmp_path):
    path = tmp_path / "table.json"
    cache.write_json(path, {"n": 0})
    with cache.atomic(path) as partial:
        partial.write_text('{"n": ')  # half written: the reader still sees the old file
        assert cache.read_json(path) == {"n": 0}
        partial.write_text('{"n": 1}')
    assert cache.read_json(path) == {"n": 1}


def test_new_files_get_the_usual_permissions_not_the_owners_only(tmp_path):
    """A cache filled for a container image is read by another user."""
    umask = os.umask(0o022)
    try:
        mode = cache.write_json(tmp_path / "a.json", {}).stat().st_mode & 0o777
    finally:
        os.umask(umask)
    assert mode == 0o644


def test_a_missing_file_is_a_miss_and_an_unreadable_one_a_miss_logged_once(tmp_path, caplog):
    assert cache.read_json(tmp_path / "missing.json") is None
    assert cache.read(tmp_path / "missing.pt", lambda p: torch.load(p, weights_only=True)) is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=cache.__name__):
        assert cache.read_json(bad, what="cost table") is None
        assert cache.read_json(bad, what="cost table") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "unreadable cost table" in warnings[0], warnings
    # what the reader makes of the data counts too: a file of the wrong shape is a miss
    shape = tmp_path / "shape.json"
    shape.write_text('{"choices": []}')
    assert cache.read_json(shape, lambda data: {int(k): v for k, v in data["choices"].items()}) is None
    assert cache.read_json(bad.with_name("good.json")) is None
    cache.write_json(bad, {"a": 1})
    assert cache.read_json(bad, lambda data: data["a"]) == 1


def test_digest_is_sha256_of_its_parts_in_order():
    assert cache.digest("ab", b"c") == cache.digest("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert cache.digest("a", "bc") == cache.digest("abc") != cache.digest("cba")
