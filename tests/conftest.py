"""Shared fixtures: the real tritonserver on free ports, and clients for it."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from opara_core.serving.launcher import ADMIN_KEY_ENV, DEFAULT_MODEL_REPOSITORY, ServerConfig, TritonServer, free_ports


def interpreted_output(code: str, *args: str) -> list[str]:
    """The lines `code` prints, run in a new process under Triton's interpreter,
    which runs the kernel's Python on the CPU: the same index arithmetic and
    masks the GPU runs. Its exit must be 0."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


def interpreted_worst_error(code: str, *args: str) -> float:
    """The last line `code` prints under the interpreter (`interpreted_output`): a kernel's worst error."""
    return float(interpreted_output(code, *args)[-1])


def turn_is_free(lock: Path) -> bool:
    """Whether a build could take the GPU turn of `lock` now (engine.gpu_turn),
    by a try that never blocks: a descriptor of its own conflicts with this
    process's flock as another process's would."""
    descriptor = os.open(lock, os.O_RDONLY | os.O_CREAT)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(descriptor)


def load_script(name: str, folder: str = "scripts"):
    """<folder>/<name>.py (scripts/ or dev/) as a module, registered under its name (dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def server_config(model_repository: Path = DEFAULT_MODEL_REPOSITORY, **overrides) -> ServerConfig:
    """A config on three free loopback ports."""
    http_port, grpc_port, metrics_port = free_ports(3)
    return ServerConfig(model_repository=model_repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, **overrides)


@pytest.fixture(scope="session")
def admin_key() -> str:
    """A known key for the servers' restricted APIs (shared memory, repository
    index), set in the environment so that the servers started from here, the
    client package and its subprocesses all use it."""
    key = f"opara-test-{secrets.token_hex(16)}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ADMIN_KEY_ENV, key)
        yield key


@pytest.fixture(scope="session")
def server(request, tmp_path_factory, admin_key) -> TritonServer:
    """The repository's model_repository served by a real tritonserver. It
    stops after the last test of this process that needs it (see
    `pytest_runtest_teardown`), not at the session's end: its eight models'
    processes hold several GiB that the servers of later test files need."""
    log_path = tmp_path_factory.mktemp("server") / "tritonserver.log"
    with TritonServer(server_config(), log_path) as running:
        # what pytest runs at the session's end, run early (pytest 9.2 has no public call for it)
        _shared_server_finish.append(lambda: request._fixturedef.finish(request))
        yield running
    _shared_server_finish.clear()


_shared_server_finish: list = []
_shared_files = pytest.StashKey[set]()  # the files with a test of `server`


@pytest.fixture(scope="session")
def http_client(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_client(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture
def strict_fp32():
    """Plain fp32 convolutions and matmuls for comparisons with eager: with TF32
    (cuDNN's default) two runs that pick different algorithms, or folded
    weights, differ by ~1e-2 relative after 60 layers, which would hide real
    errors."""
    import torch

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def uses_shared_server(item: pytest.Item) -> bool:
    """Whether `item` needs the session's `server` (not a file's own fixture of that name)."""
    definitions = getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.get("server")
    return bool(definitions) and definitions[-1].func.__module__ == __name__


# --- which pytest-xdist worker runs what ---------------------------------------------------
# pytest-xdist 3.8's loadgroup passes a test's group from the worker that collects
# it to the controller that schedules it as a suffix that it writes into the test's
# id; pytest 9.2's structured ids ignore that write (pytest-dev/pytest-xdist#1386),
# so every test was a group of its own: each worker that got a test of a file with
# its own server started that server, and both workers started the session's (CI's
# 24 GiB ran out: OOM-killed workers). Here the workers write the groups into a
# file that `FileGroups`, the controller's scheduler for `--dist loadgroup`, reads.

GROUPS_KEY = "opara_test_groups"
SHARED_GROUP = "session-server"  # the group of every file with a test of the session's `server`
_groups_dir = pytest.StashKey[Path]()


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("dist", "no") == "loadgroup":
        config.stash[_groups_dir] = Path(tempfile.mkdtemp(prefix="opara-test-groups-"))


def pytest_unconfigure(config):
    if _groups_dir in config.stash:
        shutil.rmtree(config.stash[_groups_dir], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(Controller, pytest-xdist) where the worker writes its groups."""
    if _groups_dir in node.config.stash:
        node.workerinput[GROUPS_KEY] = str(node.config.stash[_groups_dir])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if _groups_dir not in config.stash:
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileGroups(LoadGroupScheduling):
        """loadgroup with the groups the workers wrote (all have collected when
        `schedule` first asks for a test's scope); a test they did not name is
        grouped as pytest-xdist would. The session server's group goes first.
        While it runs the other workers take groups that start no server: the
        load test's memory check (tests/test_load.py) is of pages only its
        server maps, and a library's pages become the server's alone when the
        last other tritonserver on the machine stops (16% more, seen). Then the
        groups that start servers, the longest, so that neither worker is left
        with one at the end. Otherwise pytest-xdist's order: most tests first."""

        groups: dict[str, str] | None = None
        servers: set[str] = set()

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = {}
                for written in sorted(config.stash[_groups_dir].glob("*.json")):
                    content = json.loads(written.read_text())
                    self.groups.update(content["groups"])
                    self.servers = self.servers | set(content["servers"])
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            shared_elsewhere = any(
                not all(work.get(SHARED_GROUP, {}).values()) for other, work in self.assigned_work.items() if other is not node
            )
            if SHARED_GROUP in self.workqueue:
                wanted = SHARED_GROUP
            else:
                wanted = next((g for g in self.workqueue if (g in self.servers) != shared_elsewhere), None)
            if wanted is not None:
                self.workqueue.move_to_end(wanted, last=False)
            super()._assign_work_unit(node)

    return FileGroups(config, log)


# tryfirst: for pytest-xdist's own hook of this name (see above), were it to work.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Each test file is one group for pytest-xdist's `--dist loadgroup` (its
    module fixtures, such as a file's own server, are made once), except that
    every file with a test of the session's `server` is in one group, so that
    one worker starts it; a worker writes them down for `FileGroups`. GPU
    tests skip cleanly where torch sees no CUDA device (CI, laptops)."""
    import torch

    shared = config.stash[_shared_files] = {item.path for item in items if uses_shared_server(item)}
    groups = {}
    for item in items:
        groups[item.nodeid] = SHARED_GROUP if item.path in shared else item.path.name
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    worker = getattr(config, "workerinput", {})
    if GROUPS_KEY in worker:
        servers = sorted({groups[item.nodeid] for item in items if item.get_closest_marker("server")})
        Path(worker[GROUPS_KEY], f"{worker['workerid']}.json").write_text(json.dumps({"groups": groups, "servers": servers}))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the session's server after the last test of this process that needs
    it. Under `FileGroups` its files come in one batch (their group), so a next
    test of another file tells; in a single process the rest of the session
    does (other pytest-xdist schedules: the session's end). A test that asked
    for it later would get a new one (pytest sets a finished fixture up again)."""
    shared = item.config.stash.get(_shared_files, set())
    if not _shared_server_finish or item.path not in shared:
        return
    worker = getattr(item.config, "workerinput", None)
    if worker is not None:
        if GROUPS_KEY not in worker or (nextitem is not None and nextitem.path in shared):
            return
    elif any(uses_shared_server(other) for other in item.session.items[item.session.items.index(item) + 1 :]):
        return
    _shared_server_finish.pop()()
