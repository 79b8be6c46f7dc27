"""Where Inductor keeps fused lanes' compiled code (reuse across processes:
tests/test_segment_compiler.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opara_core.engine.inductor_cache import INDUCTOR_ENV, TRITON_ENV, inductor_cache_dir, use_inductor_cache

def test_the_parameter_wins_then_torchs_variable_then_the_projects_cache(tmp_path):
    env = {INDUCTOR_ENV: "/from/torch", "OPARA_CACHE_DIR": "/from/opara"}
    assert inductor_cache_dir("/from/config", env) == Path("/from/config")
    assert inductor_cache_dir("", env) == Path("/from/torch")
    assert inductor_cache_dir("", {"OPARA_CACHE_DIR": "/from/opara"}) == Path("/from/opara/inductor")
    assert inductor_cache_dir("", {}) == Path.home() / ".cache" / "opara" / "inductor"


def test_inductors_own_default_in_the_variable_is_no_choice_of_the_user():
    """Inductor writes its default (/tmp/torchinductor_<user>) into the variable the first time it looks."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    saved = os.environ.pop(INDUCTOR_ENV, None)
    try:
        torchs = cache_dir()
        assert os.environ[INDUCTOR_ENV] == torchs
        assert inductor_cache_dir("", {INDUCTOR_ENV: torchs}) == Path.home() / ".cache" / "opara" / "inductor"
    finally:
        os.environ.pop(INDUCTOR_ENV, None)
        if saved is not None:
            os.environ[INDUCTOR_ENV] = saved


def test_a_directory_that_cannot_be_made_is_named(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.delenv(INDUCTOR_ENV, raising=False)
    with pytest.raises(ValueError, match="a-file/inductor"):
        use_inductor_cache(str(blocker / "inductor"))
    assert INDUCTOR_ENV not in os.environ


def test_triton_compiles_into_the_cache_unless_the_user_chose_its_directory(tmp_path, monkeypatch):
    """The engine's own Triton kernels (skinny_gemm, depthwise_conv) compile before
    Inductor first runs: their binaries must land in the cache `make warm` fills."""
    monkeypatch.delenv(INDUCTOR_ENV, raising=False)
    monkeypatch.delenv(TRITON_ENV, raising=False)
    first = use_inductor_cache(str(tmp_path / "first"))
    assert os.environ[TRITON_ENV] == str(first / "triton" / "0")
    # a second model's build in the same process (the bench) moves both, Inductor's default under the first too
    second = use_inductor_cache(str(tmp_path / "second"))
    assert os.environ[TRITON_ENV] == str(second / "triton" / "0")
    monkeypatch.setenv(TRITON_ENV, str(second / "triton" / "7"))  # as Inductor names it on another device
    third = use_inductor_cache(str(tmp_path / "third"))
    assert os.environ[TRITON_ENV] == str(third / "triton" / "0")
    monkeypatch.setenv(TRITON_ENV, "/users/own/triton")
    use_inductor_cache(str(tmp_path / "fourth"))
    assert os.environ[TRITON_ENV] == "/users/own/triton"
    monkeypatch.setenv(TRITON_ENV, str(tmp_path / "fourth" / "kernels"))  # the user's, inside the same cache
    use_inductor_cache(str(tmp_path / "fourth"))
    assert os.environ[TRITON_ENV] == str(tmp_path / "fourth" / "kernels")


_KERNEL_AFTER = """
import json, os, sys
import torch
from opara_core.engine.inductor_cache import use_inductor_cache
from opara_core.engine.skinny_gemm import SkinnyConfig, skinny_mm
use_inductor_cache(sys.argv[1])
if sys.argv[2] == "inductor-first":  # a warm build: Inductor loads its segments before the engine's kernels run
    torch._inductor.config.compile_threads = 1
    torch.compile(lambda t: (t * 2).relu())(torch.randn(8, device="cuda"))
ptxas = os.environ.get("TRITON_PTXAS_PATH")
skinny_mm(torch.randn(4, 256, device="cuda"), torch.randn(256, 128, device="cuda"), SkinnyConfig(32, 64, 2))
torch.cuda.synchronize()
print(json.dumps({"ptxas": ptxas}))
"""


def _kernel_after(cache: Path, order: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (INDUCTOR_ENV, TRITON_ENV, "TRITON_PTXAS_PATH")}
    done = subprocess.run([sys.executable, "-c", _KERNEL_AFTER, str(cache), order], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_an_engine_kernel_compiled_before_inductor_ran_is_found_in_a_process_where_it_ran_first(tmp_path):
    """Inductor sets Triton's ptxas at its first compile in a process, and Triton
    keys its cache by the ptxas: a cold build compiles the skinny kernels before
    Inductor runs, a warm build after (T5's first warm build compiled 9 of them
    again, run 33)."""
    cold = _kernel_after(tmp_path, "engine-first")
    kernels = tmp_path / "triton"
    before = {p for p in kernels.rglob("*") if p.is_file()}
    assert any(p.suffix == ".cubin" for p in before), "the kernel was not compiled into the cache"
    warm = _kernel_after(tmp_path, "inductor-first")
    assert cold["ptxas"] == warm["ptxas"], (cold, warm)
    written = sorted(p.name for p in {p for p in kernels.rglob("*") if p.is_file()} - before if "skinny" in p.name)
    assert not written, f"the second process compiled the engine's kernel again: {written}"
