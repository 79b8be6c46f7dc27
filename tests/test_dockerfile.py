"""The Dockerfile, read with Docker's own parser: no Docker engine runs here."""

from __future__ import annotations

import re
import shlex
import tomllib

import dockerfile

from opara_core.serving.launcher import ADMIN_KEY_ENV, REPO_ROOT, RESTRICTED_APIS, ServerConfig, container_command

BASE_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"


def commands():
    return dockerfile.parse_file(str(REPO_ROOT / "Dockerfile"))


def pip_installs(run_line: str) -> list[list[str]]:
    """The package arguments of every `pip install` in a shell line."""
    installs = []
    for part in re.split(r"&&|;", run_line):
        words = shlex.split(part)
        if "pip" in words and "install" in words:
            args = words[words.index("install") + 1 :]
            installs.append([a for a in args if not a.startswith("-")])
    return installs


def test_base_image_is_the_triton_release_of_the_pytriton_binary():
    first = commands()[0]
    assert first.cmd.upper() == "FROM" and first.value[0] == BASE_IMAGE


def test_installs_only_the_project_so_pins_come_from_pyproject():
    extras = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    installs = [args for c in commands() if c.cmd.upper() == "RUN" for args in pip_installs(" ".join(c.value))]
    assert installs, "the Dockerfile installs nothing with pip"
    for args in installs:
        for arg in args:
            match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
            assert match, f"{arg!r} is installed outside pyproject.toml's pins"
            assert set((match.group(1) or "").split(",")) - {""} <= extras


def test_makefile_installs_the_same_project():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"pip install .*'\.\[[\w,-]+\]'", makefile)


def test_serves_the_model_repository_with_model_control_none():
    by_cmd = {}
    for c in commands():
        by_cmd.setdefault(c.cmd.upper(), []).append(c.value)
    assert ("model_repository", "/models") in by_cmd["COPY"]
    (cmd,) = by_cmd["CMD"]
    assert list(cmd) == ["python3", "-m", "opara_core.serving.launcher", "container", "--model-repository", "/models"]
    assert {"8000", "8001", "8002"} <= set(by_cmd["EXPOSE"][0])


def test_the_containers_server_has_the_safe_flags(monkeypatch, tmp_path):
    """What the CMD runs: the image's tritonserver, model control none, the
    restricted APIs behind the admin key, all interfaces inside the container."""
    monkeypatch.setenv(ADMIN_KEY_ENV, "container-admin-key-0123")
    config = ServerConfig.from_env(model_repository=tmp_path, address="0.0.0.0")
    command = container_command(config)
    assert command[0].endswith("tritonserver")
    assert f"--model-repository={tmp_path}" in command and "--model-control-mode=none" in command
    assert "--http-address=0.0.0.0" in command and "--grpc-address=0.0.0.0" in command
    for api in RESTRICTED_APIS:
        assert any(f.startswith("--http-restricted-api=") and api in f and f.endswith("=container-admin-key-0123") for f in command)
        assert any(f.startswith("--grpc-restricted-protocol=") and api in f and f.endswith("=container-admin-key-0123") for f in command)
    assert not any(f.startswith("--backend-directory") for f in command), "the image's own backends are used"
