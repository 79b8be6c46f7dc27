"""Where each server's admin key is kept: the launcher writes it, the clients read it."""

from __future__ import annotations

import stat

from opara_core.serving.admin_key import ADMIN_KEY_ENV, admin_key_path, read_admin_key, remove_admin_key, write_admin_key


def test_the_path_is_under_the_runtime_directory_else_the_cache(tmp_path):
    assert admin_key_path(8001, {"XDG_RUNTIME_DIR": str(tmp_path), "HOME": "/h"}) == tmp_path / "opara" / "admin-keys" / "8001"
    assert admin_key_path(8000, {"HOME": str(tmp_path)}) == tmp_path / ".cache" / "opara" / "admin-keys" / "8000"


def test_a_written_key_is_private_and_read_back_by_either_port(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    paths = write_admin_key("k" * 32, (8000, 8001), env)
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_admin_key("localhost:8000", env) == read_admin_key("http://127.0.0.1:8001/v2", env) == "k" * 32


def test_two_servers_keep_their_own_keys(tmp_path):
    """A second `make serve` on other ports never overwrites the first one's key."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    write_admin_key("a" * 32, (8000, 8001), env)
    write_admin_key("b" * 32, (9000, 9001), env)
    assert read_admin_key("localhost:8001", env) == "a" * 32
    assert read_admin_key("localhost:9001", env) == "b" * 32
    assert read_admin_key("localhost:7001", env) is None  # no server of ours there


def test_a_stopped_server_removes_only_the_key_files_that_are_still_its_own(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    write_admin_key("a" * 32, (8000, 8001), env)
    write_admin_key("c" * 32, (8001,), env)  # a later server took the gRPC port
    remove_admin_key("a" * 32, (8000, 8001), env)
    assert read_admin_key("localhost:8000", env) is None
    assert read_admin_key("localhost:8001", env) == "c" * 32


def test_a_remote_server_gets_no_local_key(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    write_admin_key("k" * 32, (8001,), env)
    assert read_admin_key("gpu-host.example:8001", env) is None
    assert read_admin_key(None, env) is None


def test_the_environment_wins_over_the_file(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    write_admin_key("k" * 32, (8001,), env)
    assert read_admin_key("localhost:8001", {**env, ADMIN_KEY_ENV: "e" * 20}) == "e" * 20


def test_no_key_and_a_key_others_can_read_give_none(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    assert read_admin_key("localhost:8001", env) is None
    write_admin_key("k" * 32, (8001,), env)[0].chmod(0o644)
    assert read_admin_key("localhost:8001", env) is None


def test_the_module_imports_no_torch_and_no_tritonclient():
    import subprocess
    import sys

    code = "import sys, opara_core.serving.admin_key; assert not {'torch', 'tritonclient'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
