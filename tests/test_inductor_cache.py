"""Where Inductor keeps fused lanes' compiled code, and that a build reuses it:
across batch sizes (with dynamic shapes, the batch dimension compiled once as a
symbol) and across processes (a warm cache compiles nothing anew)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opara_core.engine.inductor_cache import INDUCTOR_ENV, cache_root, inductor_cache_dir, use_inductor_cache

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_the_parameter_wins_then_torchs_variable_then_the_projects_cache(tmp_path):
    env = {INDUCTOR_ENV: "/from/torch", "OPARA_CACHE_DIR": "/from/opara"}
    assert inductor_cache_dir("/from/config", env) == Path("/from/config")
    assert inductor_cache_dir("", env) == Path("/from/torch")
    assert inductor_cache_dir("", {"OPARA_CACHE_DIR": "/from/opara"}) == Path("/from/opara/inductor")
    assert inductor_cache_dir("", {}) == Path.home() / ".cache" / "opara" / "inductor"
    assert cache_root({}) == Path.home() / ".cache" / "opara"


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


# One build's compilations, in a fresh process: fused lanes (dynamic shapes) of
# a branchy module run at batch 1, 2, 4 and 8; prints the segment count, the graphs Dynamo
# compiled and Inductor's FX graph cache hits and misses.
WORKER = """
import json, sys, torch
from opara_core.engine.fused_lanes import fused_lanes
from opara_core.engine.inductor_cache import CacheCount, use_inductor_cache
from opara_core.engine.interpreter import plan_graph, run_plan
from opara_core.engine.trace import trace

class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.left = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        self.right = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Sigmoid())
    def forward(self, x):
        return torch.cat([self.left(x), self.right(x)], dim=1).softmax(-1)

use_inductor_cache(sys.argv[1])
# on the CPU, freezing packs weights into mkldnn tensors, which Inductor's cache
# cannot pickle (it bypasses them); GPU weights are never packed
torch._inductor.config.cpp.weight_prepack = False
torch.manual_seed(0)
module = Branches().eval()
graph = trace(module, (torch.randn(2, 16),))
fused, plan = fused_lanes(graph, plan_graph(graph, "opara", 4), shapes="dynamic")
before = CacheCount.now()
error = 0.0
with torch.inference_mode(), torch._inductor.config.patch(freezing=True):
    for batch in (1, 2, 4, 8):
        x = torch.randn(batch, 16)
        error = max(error, (run_plan(fused, plan, x) - module(x)).abs().max().item())
count = CacheCount.now() - before
print(json.dumps({"segments": len(plan.order), "lanes": plan.num_streams, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                  "hits": count.hits, "misses": count.misses, "error": error}))
"""


def _build(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_ENV}
    done = subprocess.run([sys.executable, "-c", WORKER, str(cache)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_dynamic_batch_sizes_share_code_and_a_second_process_compiles_nothing_anew(tmp_path):
    cold = _build(tmp_path / "cache")
    assert cold["lanes"] > 1 and cold["segments"] > 1, cold
    assert cold["error"] < 1e-5, cold
    # batch 1 static, batch 2 with the batch dimension as a symbol, 4 and 8 reuse it
    assert cold["graphs"] == 2 * cold["segments"], cold
    assert cold["misses"] > 0, cold
    warm = _build(tmp_path / "cache")
    assert warm["error"] < 1e-5, warm
    assert warm["misses"] == 0 and warm["hits"] == cold["misses"], (cold, warm)
