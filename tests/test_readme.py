"""The README's commands run as written against a real server.

Every ```bash block of README.md is run by bash from the repository root
against the session's server (the shipped model_repository on free ports):
the only change is the port, `localhost:8000` / `localhost:8001` becoming the
test server's HTTP and gRPC ports. The blocks that start things of their own
are left out, each with the test that covers it: `make serve` / `make test`
(tests/test_launcher.py starts `make serve`; CI runs `make test`) and Docker
(no Docker engine here; tests/test_dockerfile.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from opara_core.serving.launcher import REPO_ROOT

pytestmark = pytest.mark.server

README = REPO_ROOT / "README.md"
# first words of the commands a block may hold that this test does not run
ELSEWHERE = ("make serve", "make test", "docker ")


def bash_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, body) of every ```bash block."""
    blocks, start, body = [], None, []
    for number, line in enumerate(text.splitlines(), 1):
        if start is None and line.strip() == "```bash":
            start, body = number, []
        elif start is not None and line.strip() == "```":
            blocks.append((start, "\n".join(body)))
            start = None
        elif start is not None:
            body.append(line)
    return blocks


BLOCKS = bash_blocks(README.read_text())


def runnable(body: str) -> bool:
    """Not a block of the commands run elsewhere."""
    return not any(line.strip().startswith(ELSEWHERE) for line in body.splitlines())


def test_the_readme_has_command_blocks_and_starts_with_the_two_commands():
    assert BLOCKS, "no ```bash block in README.md"
    first = BLOCKS[0][1]
    assert first.splitlines()[0].startswith("make serve") and "make test" in first
    assert BLOCKS[0][0] <= 40, "the two commands come within the first 40 lines"


@pytest.mark.parametrize("line, body", [b for b in BLOCKS if runnable(b[1])], ids=lambda value: f"line{value}" if isinstance(value, int) else "")
def test_a_readme_block_runs_as_written(server, line, body, tmp_path):
    http, grpc = server.http_url.rsplit(":", 1)[1], server.grpc_url.rsplit(":", 1)[1]
    script = re.sub(r"localhost:8000\b", f"127.0.0.1:{http}", body)
    script = re.sub(r"localhost:8001\b", f"127.0.0.1:{grpc}", script)
    env = {**os.environ, "PERF_URL": f"127.0.0.1:{grpc}", "PATH": f"{Path(REPO_ROOT, '.venv', 'bin')}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-e", "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"README.md line {line}:\n{script}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    said = done.stdout + done.stderr
    assert "Traceback" not in said and '{"error"' not in said, said[-3000:]
