"""Where the admin key is kept: the launcher writes it, the clients read it."""

from __future__ import annotations

import stat

from opara_core.serving.admin_key import ADMIN_KEY_ENV, admin_key_path, read_admin_key, write_admin_key


def test_the_path_is_under_the_runtime_directory_else_the_cache(tmp_path):
    assert admin_key_path({"XDG_RUNTIME_DIR": str(tmp_path), "HOME": "/h"}) == tmp_path / "opara" / "admin-key"
    assert admin_key_path({"HOME": str(tmp_path)}) == tmp_path / ".cache" / "opara" / "admin-key"


def test_a_written_key_is_private_and_read_back(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    path = write_admin_key("k" * 32, env)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_admin_key(env) == "k" * 32
    write_admin_key("m" * 32, env)  # a new start replaces the old key
    assert read_admin_key(env) == "m" * 32


def test_the_environment_wins_over_the_file(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    write_admin_key("k" * 32, env)
    assert read_admin_key({**env, ADMIN_KEY_ENV: "e" * 20}) == "e" * 20


def test_no_key_and_a_key_others_can_read_give_none(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    assert read_admin_key(env) is None
    write_admin_key("k" * 32, env).chmod(0o644)
    assert read_admin_key(env) is None


def test_the_module_imports_no_torch_and_no_tritonclient():
    import subprocess
    import sys

    code = "import sys, opara_core.serving.admin_key; assert not {'torch', 'tritonclient'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
