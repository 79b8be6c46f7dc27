"""Kernel profiles: attribution of a chrome trace to node ranges (a hand-written trace,
no GPU), the disk cache, applying a profile to the DAG, and a real profile on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from opara_core import zoo
from opara_core.engine import profile
from opara_core.planning import order
from opara_core.engine.trace import trace
from opara_core.engine.interpreter import plan_graph
from opara_core.engine.profile import KernelCost, Profile, apply_profile, parse_trace


def annotation(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": {}}


def launch(ts, correlation, name="cudaLaunchKernel", cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": 2, "args": {"correlation": correlation}}


def kernel(correlation, dur, ts=1000.0, cat="kernel", **args):
    keys = {
        "registers": "registers per thread",
        "smem": "shared memory",
        "occupancy": "est. achieved occupancy %",
        "old_occupancy": "est. achieved occupancy",
    }
    return {
        "ph": "X",
        "cat": cat,
        "name": f"kernel_{correlation}",
        "pid": 0,
        "tid": 7,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": correlation, "stream": 7, **{keys.get(k, k): v for k, v in args.items()}},
    }


CONV = {"grid": [8, 2, 1], "block": [256, 1, 1], "registers": 64, "smem": 16384, "occupancy": 25}


def synthetic_trace() -> dict:
    """Two iterations of conv (three kernels: launched by cudaLaunchKernel, by
    cuLaunchKernelEx, and by cudaLaunchKernelExC whose nested cuLaunchKernelEx shares
    its correlation id), relu (one kernel), view (nothing) and zeros (a memset); plus
    work no node owns: a kernel launched between ranges, one without a launch event,
    and one whose correlation id shows up in two nodes' ranges. One relu kernel has
    no launch event but names its host op (External id)."""
    events = []
    for it, base in enumerate((100.0, 300.0)):
        c = 10 * it
        events += [
            annotation("opara::conv", base, 50),
            launch(base + 10, c + 1),
            launch(base + 20, c + 2, "cuLaunchKernelEx", "cuda_driver"),
            launch(base + 30, c + 3, "cudaLaunchKernelExC"),
            launch(base + 31, c + 3, "cuLaunchKernelEx", "cuda_driver"),
            annotation("opara::relu", base + 60, 20),
            launch(base + 65, c + 4),
            annotation("opara::view", base + 90, 5),
            annotation("opara::zeros", base + 100, 10),
            launch(base + 102, c + 5, "cudaMemsetAsync"),
        ]
    events += [
        kernel(1, 10, grid=[4, 1, 1], block=[128, 1, 1], registers=32, smem=0, occupancy=50),
        kernel(2, 30, **CONV),
        kernel(3, 5),  # no resources in the trace at all
        kernel(4, 3, grid=[10, 1, 1]),
        kernel(5, 1, cat="gpu_memset"),
        kernel(11, 12, grid=[4, 1, 1], block=[128, 1, 1], registers=32, smem=0, occupancy=50),
        kernel(12, 34, **CONV),  # the longest conv kernel: its resources are the node's
        kernel(13, 5),
        kernel(14, 5, grid=[10, 1, 1], block=[512, 1, 1], registers=16, smem=0, old_occupancy=0.75),
        kernel(15, 2, cat="gpu_memset"),
        launch(250, 20),  # between ranges
        kernel(20, 100),
        kernel(21, 7),  # no launch event, no host op
        {"ph": "X", "cat": "cpu_op", "name": "aten::relu", "pid": 1, "tid": 1, "ts": 366, "dur": 4, "args": {"External id": 77}},
        kernel(23, 2, **{"External id": 77}),  # launch not recorded: found through its host op (relu)
        launch(165, 22),  # in relu's range ...
        launch(305, 22),  # ... and in conv's
        kernel(22, 9),
        # noise the parser must skip
        {"ph": "X", "cat": "gpu_user_annotation", "name": "opara::conv", "pid": 0, "tid": 7, "ts": 100, "dur": 999, "args": {}},
        annotation("ProfilerStep#1", 0, 1000),
        {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 120, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::convolution", "pid": 1, "tid": 1, "ts": 105, "dur": 40, "args": {}},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
    ]
    return {"traceEvents": events}


def test_kernels_are_attributed_to_node_ranges_by_correlation():
    prof = parse_trace(synthetic_trace())
    assert set(prof) == {"conv", "relu", "view", "zeros"}
    assert prof.iterations == 2
    assert prof.unattributed == 3
    conv = prof["conv"]
    assert conv.duration_us == pytest.approx((45 + 51) / 2)  # median of the two runs
    assert conv.kernels == 3
    assert (conv.grid, conv.block, conv.threads) == ((8, 2, 1), (256, 1, 1), 256)
    assert (conv.registers_per_thread, conv.shared_memory, conv.occupancy) == (64, 16384, 25.0)


def test_missing_trace_keys_give_none_and_memsets_count_time_only():
    prof = parse_trace(synthetic_trace())
    relu = prof["relu"]
    assert relu.duration_us == pytest.approx((3 + 7) / 2) and relu.kernels == 1  # median_low of [1, 2]
    assert relu.block == (512, 1, 1) and relu.occupancy == pytest.approx(75.0)  # old fraction key
    assert prof["view"] == KernelCost(duration_us=0.0, kernels=0)
    zeros = prof["zeros"]
    assert zeros.duration_us == pytest.approx(1.5) and zeros.kernels == 1
    assert zeros.block is None and zeros.threads is None and zeros.registers_per_thread is None
    only_bare = parse_trace([annotation("opara::k", 0, 10), launch(1, 7), kernel(7, 4)])
    assert only_bare["k"] == KernelCost(duration_us=4.0, kernels=1)


def test_attribution_does_not_depend_on_event_order():
    events = synthetic_trace()["traceEvents"]
    assert parse_trace(list(reversed(events))) == parse_trace(events)


def test_profiles_round_trip_through_json():
    prof = profile.dataclasses.replace(parse_trace(synthetic_trace()), key="abc", device="NVIDIA H100")
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    assert again == prof and again["conv"].grid == (8, 2, 1)
    with pytest.raises(ValueError, match="format"):
        Profile.from_json({**prof.to_json(), "format": 0})


def test_the_cache_key_covers_gpu_software_graph_and_shapes(monkeypatch):
    shapes = [("torch.float32", (1, 3, 224, 224))]
    key = profile.cache_key("sha256:abcd", shapes, "cpu")
    assert key == profile.cache_key("sha256:abcd", shapes, "cpu") and len(key) == 64
    assert profile.cache_key("sha256:ef01", shapes, "cpu") != key
    assert profile.cache_key("sha256:abcd", [("torch.float32", (2, 3, 224, 224))], "cpu") != key
    assert profile.cache_key("sha256:abcd", [("torch.float16", (1, 3, 224, 224))], "cpu") != key
    # the GPU, torch, cuDNN and the switches: engine.cache's KERNELS (each one: tests/test_cache.py)
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert profile.cache_key("sha256:abcd", shapes, "cpu") != key
    monkeypatch.undo()
    saved = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = not saved
        assert profile.cache_key("sha256:abcd", shapes, "cpu") != key
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    assert profile.cache_key("sha256:abcd", shapes, "cpu") == key


def test_profiles_are_cached_on_disk_outside_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    assert profile.cache_dir() == tmp_path / "profiles"
    monkeypatch.delenv("OPARA_CACHE_DIR")
    assert profile.cache_dir() == profile.Path.home() / ".cache" / "opara" / "profiles"
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    prof = profile.dataclasses.replace(parse_trace(synthetic_trace()), key="k1", device="gpu")
    assert profile.load("k1") is None
    path = profile.store(prof)
    assert path == tmp_path / "profiles" / "k1.json" and not list(path.parent.glob("*.tmp"))
    assert profile.load("k1") == prof
    path.write_text("{not json")
    assert profile.load("k1") is None


def test_profiling_needs_cuda():
    graph = trace(nn.Linear(3, 2).eval(), (torch.randn(2, 3),))
    with pytest.raises(ValueError, match="CUDA"):
        profile.profile_graph(graph, (torch.randn(2, 3),), "cpu")


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return torch.relu(self.a(x)) + torch.sigmoid(self.b(x))


@pytest.fixture(scope="module")
def small():
    return trace(Small().eval(), (torch.randn(2, 3, 8, 8),))


def test_every_node_gets_a_named_range(small):
    """The CPU profiler sees the same ranges as on a GPU; with no device, no kernels."""
    prof = profile.measure(small, (torch.randn(2, 3, 8, 8),), iterations=3, warmup=1)
    calls = {n.name for n in small.module.graph.nodes if n.op == "call_function"}
    assert calls <= set(prof) and set(small.dag.names) <= set(prof)
    assert prof.iterations == 3 and prof.unattributed == 0
    assert all(cost.kernels == 0 and cost.duration_us == 0 for cost in prof.values())


def test_apply_profile_puts_measurements_on_the_dag(small):
    names = small.dag.names
    measured = {
        name: KernelCost(duration_us=10.0 * (i + 1), kernels=1, grid=(4, 1, 1), block=(64, 2, 1), registers_per_thread=40, shared_memory=1024)
        for i, name in enumerate(names[:-1])
    }  # the last node is left out: it keeps its static cost
    graph = apply_profile(small, measured)
    assert graph.module is small.module and graph.dag.edges == small.dag.edges
    assert graph.fingerprint != small.fingerprint
    for i, (before, after) in enumerate(zip(small.dag.nodes, graph.dag.nodes)):
        if before.name in measured:
            assert (after.cost, after.threads, after.registers, after.shared_memory) == (10.0 * (i + 1), 128, 40, 1024)
            assert order.resource_demand(after) > 0
        else:
            assert after == before
    assert graph.dag.critical_path_us != small.dag.critical_path_us
    plan = plan_graph(graph, "opara")
    assert plan.critical_path_us == graph.dag.critical_path_us
    assert any(n.meta.get("opara_kernel_cost") == measured[n.name] for n in graph.module.graph.nodes if n.name in measured)


# ---- on the GPU ----------------------------------------------------------------------


@pytest.mark.gpu
def test_profile_of_googlenet_on_the_gpu(tmp_path, monkeypatch):
    from opara_core.engine.trace import trace_model
    from opara_core.engine.fusion import fuse_graph

    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    device = torch.device("cuda")
    entry = zoo.get("googlenet")
    module = entry.build().to(device)
    graph = trace_model(entry, module, device)
    inputs = tuple(x.to(device) for x in entry.example_inputs(1, seed=5))
    prof = profile.profile_graph(graph, inputs, device)
    assert prof.key and prof.device == torch.cuda.get_device_name(device) and prof.iterations == 5
    convs = [n.name for n in graph.module.graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert len(convs) == 57
    for name in convs:
        cost = prof[name]
        assert cost.kernels >= 1 and cost.duration_us > 0, (name, cost)
        assert cost.grid is not None and cost.block is not None and cost.threads > 0, (name, cost)
        assert cost.registers_per_thread is not None and cost.shared_memory is not None, (name, cost)
    assert all(name in prof for name in graph.dag.names)
    # nearly all device work belongs to some node
    assert prof.unattributed <= 0.05 * sum(c.kernels for c in prof.values()) * prof.iterations
    measured = apply_profile(graph, prof)
    assert measured.dag.costs != graph.dag.costs
    assert measured.dag.critical_path_us < sum(measured.dag.costs)
    assert sum(n.threads is not None for n in measured.dag.nodes) >= 57
    # the second call comes from the cache
    assert list(tmp_path.glob("profiles/*.json")) and profile.profile_graph(graph, inputs, device) == prof
    # fused kernels are found too
    fused, _ = fuse_graph(graph, device)
    fused_prof = profile.profile_graph(fused, inputs, device)
    cudnn = [n.name for n in fused.module.graph.nodes if n.target is torch.ops.aten.cudnn_convolution_relu.default]
    assert cudnn and all(fused_prof[name].kernels >= 1 and fused_prof[name].duration_us > 0 for name in cudnn)
    print(
        f"googlenet critical path {measured.dag.critical_path_us:.0f} us of {sum(measured.dag.costs):.0f} us; "
        f"fused {apply_profile(fused, fused_prof).dag.critical_path_us:.0f} us"
    )
