"""The model configurations as Triton reads them: dynamic-batching defaults."""

from __future__ import annotations

import re

import pytest

from opara_core.serving.launcher import DEFAULT_MODEL_REPOSITORY

# batch models; a decoupled model (gpt2) batches inside itself, with no dynamic batcher
CONFIGS = [c for c in sorted(DEFAULT_MODEL_REPOSITORY.glob("*/config.pbtxt")) if "decoupled: true" not in c.read_text()]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.parent.name)
def test_no_preferred_batch_of_one(config):
    """With 1 preferred, every lone request is a preferred batch: the batcher
    never waits its max_queue_delay for a second request."""
    text = config.read_text()
    assert "dynamic_batching" in text
    for sizes in re.findall(r"preferred_batch_size:\s*\[([^\]]*)\]", text):
        assert 1 not in [int(s) for s in sizes.split(",")], f"{config}: preferred_batch_size [{sizes}]"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.parent.name)
def test_instances_go_to_every_visible_gpu(config):
    """No `kind` and no `gpus` list: Triton makes `count` instances on each GPU it
    sees (a CPU instance where it sees none), so a two-GPU host serves from both,
    each GPU building its graphs under its own lock (triton_backend.gpu_lock_path)."""
    group = re.search(r"^instance_group \[(.*?)\]$", config.read_text(), re.M | re.S).group(1)
    assert "count:" in group and "kind" not in group and "gpus" not in group, group
