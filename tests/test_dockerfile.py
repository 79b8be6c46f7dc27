"""The Dockerfile, read with Docker's own parser (no Docker engine runs here),
and the installs it and a client-only user make, resolved by pip for the
Python and platform they run on."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tomllib

import dockerfile
import pytest
from packaging.specifiers import SpecifierSet

from opara_core.serving.launcher import ADMIN_KEY_ENV, REPO_ROOT, RESTRICTED_APIS, ServerConfig, container_command

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from requirements import requirements  # noqa: E402 - scripts/ is not a package

BASE_IMAGE = "nvcr.io/nvidia/tritonserver:26.05-py3"
# What the base image runs: Ubuntu 24.04 (glibc 2.39) with Python 3.12, x86-64
# (Triton 2.69.0's build installs into it from NVIDIA's ubuntu2404 repository and
# its QA preloads the system's libpython3.12; CUDA 13.2.1 per the 26.05 release notes).
IMAGE_PYTHON = "3.12"
IMAGE_GLIBC_MINOR = 39
SOURCE = ("opara_core", "client")
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def commands():
    return dockerfile.parse_file(str(REPO_ROOT / "Dockerfile"))


def by_cmd() -> dict[str, list]:
    found: dict[str, list] = {}
    for c in commands():
        found.setdefault(c.cmd.upper(), []).append(c)
    return found


def installed_extras() -> list[str]:
    """The extras the image installs: `scripts/requirements.py EXTRA...`."""
    runs = [" ".join(c.value) for c in by_cmd()["RUN"]]
    found = [re.search(r"scripts/requirements\.py ([\w ,-]+?)\s*>", run) for run in runs]
    (match,) = [m for m in found if m]
    return match.group(1).split()


def test_base_image_has_the_python_the_pins_need():
    first = commands()[0]
    assert first.cmd.upper() == "FROM" and first.value[0] == BASE_IMAGE
    assert IMAGE_PYTHON in SpecifierSet(PYPROJECT["requires-python"])


def test_requires_python_admits_the_python_that_make_setup_resolved_with():
    """`make setup` installed the pins into this Python, so it is a real floor."""
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert running in SpecifierSet(PYPROJECT["requires-python"])


def test_dependencies_come_in_a_layer_before_the_source():
    order = [(c.cmd.upper(), " ".join(c.value)) for c in commands()]
    install_deps = next(i for i, (cmd, v) in enumerate(order) if cmd == "RUN" and "-r requirements.txt" in v)
    copies_before = [v for cmd, v in order[:install_deps] if cmd == "COPY"]
    assert copies_before and all(not any(s in v for s in SOURCE) for v in copies_before), copies_before
    copy_source = [i for i, (cmd, v) in enumerate(order) if cmd == "COPY" and any(v.startswith(s) for s in SOURCE)]
    assert copy_source and min(copy_source) > install_deps
    (project_install,) = [v for cmd, v in order if cmd == "RUN" and re.search(r"pip install .*--no-deps \.$", v)]
    assert project_install, "the source goes in without touching the dependencies"


def test_installs_only_what_the_server_needs_from_pyproject():
    extras = installed_extras()
    assert set(extras) <= set(PYPROJECT["optional-dependencies"])
    wanted = requirements(extras)
    assert any(r.startswith("torch==") for r in wanted)
    names = {re.split(r"[\[=<>!~ ]", r)[0] for r in wanted}
    assert not names & {"tritonclient", "matplotlib", "pytest", "hypothesis", "nvidia-pytriton"}, names


def test_makefile_installs_the_same_project():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"pip install .*'\.\[[\w,-]+\]'", makefile)


def test_runs_as_a_user_and_checks_readiness():
    found = by_cmd()
    (user,) = found["USER"]
    assert user.value[0] not in ("root", "0")
    (health,) = found["HEALTHCHECK"]
    assert health.value[0] == "CMD" and "/v2/health/ready" in health.value[1]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or a parent wins."""
    parts = path.split("/")
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        bare = pattern.lstrip("!").removeprefix("**/")
        if any(fnmatch.fnmatch("/".join(parts[:n]), bare) or fnmatch.fnmatch(parts[n - 1], bare)
               for n in range(1, len(parts) + 1)):  # fmt: skip
            result = not negate
    return result


def test_dockerignore_sends_only_what_the_image_copies():
    patterns = [
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for c in by_cmd()["COPY"]:
        for source in c.value[:-1]:
            assert not ignored(source, patterns), f"{source} is copied but ignored"
    for path in (".venv", ".git", "tests", "out/perf/x.csv", "opara_core/__pycache__/x.pyc", ".triton"):
        assert ignored(path, patterns), f"{path} would go into the build context"


def test_serves_the_model_repository_with_model_control_none():
    found = by_cmd()
    assert ("model_repository", "/models") in [c.value for c in found["COPY"]]
    (cmd,) = found["CMD"]
    assert list(cmd.value) == ["python3", "-m", "opara_core.serving.launcher", "container", "--model-repository", "/models"]
    assert {"8000", "8001", "8002"} <= set(found["EXPOSE"][0].value)


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


def test_the_image_installs_nginx_for_the_containers_guard():
    """`launcher container` puts nginx in front of the image's tritonserver by default."""
    order = [(c.cmd.upper(), " ".join(c.value)) for c in commands()]
    installs = [i for i, (cmd, v) in enumerate(order) if cmd == "RUN" and re.search(r"apt-get install [^&]*\bnginx\b", v)]
    user = next(i for i, (cmd, _) in enumerate(order) if cmd == "USER")
    assert installs and installs[0] < user, order


# --- the installs resolve (pip's resolver, no download of the wheels themselves) ---------

NETWORK_TROUBLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution", "ConnectTimeout", "Network is unreachable")


def resolve(wanted: list[str], tmp_path, python: str | None = None, glibc_minor: int | None = None) -> list[str]:
    """The distributions pip would install for `wanted` (binary wheels only),
    for another Python and manylinux platform where given; skips when the
    package index cannot be reached."""
    (tmp_path / "requirements.txt").write_text("\n".join(wanted) + "\n")
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--only-binary=:all:",
               "--timeout=20", "--retries=1", "--report", str(tmp_path / "report.json"), "-r", str(tmp_path / "requirements.txt")]  # fmt: skip
    if python is not None:
        # manylinux wheels of any glibc up to the image's (pip takes the listed tags literally)
        platforms = [f"manylinux_2_{m}_x86_64" for m in range(glibc_minor, 16, -1)] + ["manylinux2014_x86_64"]
        command += ["--python-version", python, "--target", str(tmp_path / "target")]
        command += [f"--platform={p}" for p in platforms]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and any(t in done.stderr for t in NETWORK_TROUBLE):
        pytest.skip(f"the package index is unreachable: {done.stderr.strip().splitlines()[-1]}")
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert done.returncode == 0, "\n".join(errors) or done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    return sorted(item["metadata"]["name"].lower() for item in report["install"])


def test_the_images_install_resolves_for_its_python_and_platform(tmp_path):
    """What `docker build` installs, resolved for Python 3.12 on glibc 2.39:
    the check that the 24.10 image (Python 3.10) failed."""
    names = resolve(requirements(installed_extras()), tmp_path, IMAGE_PYTHON, IMAGE_GLIBC_MINOR)
    assert {"torch", "transformers", "networkx", "numpy"} <= set(names)


def test_a_client_only_install_pulls_no_torch(tmp_path):
    names = resolve(requirements(["client"]), tmp_path)
    assert {"tritonclient", "cuda-python"} <= set(names), names  # cuda-python: `--shared-memory cuda`
    assert not {"torch", "torchvision", "transformers", "timm"} & set(names), names
