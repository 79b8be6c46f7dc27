"""The Dockerfile, read with Docker's own parser: no Docker engine runs here."""

from __future__ import annotations

import re
import shlex
import tomllib

import dockerfile

from opara_core.server import REPO_ROOT

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
    assert cmd[0] == "tritonserver" and "--model-repository=/models" in cmd and "--model-control-mode=none" in cmd
    assert {"8000", "8001", "8002"} <= set(by_cmd["EXPOSE"][0])
