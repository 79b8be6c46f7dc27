"""scripts/warm_build_diag.py's comparisons, on Triton cache folders laid out as Triton writes them (CPU)."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import time
from pathlib import Path

from conftest import load_script

diag = load_script("warm_build_diag")


def _kernel(cache: Path, folder: str, name: str, cubin_bytes: int = 8, ttir: str = "", **meta) -> str:
    path = cache / "inductor" / "triton" / "0" / folder
    path.mkdir(parents=True)
    (path / f"{name}.json").write_text(json.dumps({"name": name, "hash": folder, **meta}))
    (path / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {}}))
    (path / f"{name}.cubin").write_bytes(b"\0" * cubin_bytes)
    if ttir:
        (path / f"{name}.ttir").write_text(f"module {{\n  {ttir} {{\n  }}\n}}\n")
    return f"inductor/triton/0/{folder}"


def test_a_new_kernel_is_compared_field_by_field_with_the_cold_kernels_of_its_name(tmp_path):
    cold = [
        _kernel(tmp_path, "A", "triton_poi_fused_add_0", num_warps=4, debug=False, constants={"XBLOCK": 128}),
        _kernel(tmp_path, "B", "triton_poi_fused_add_0", num_warps=8, debug=True, constants={"XBLOCK": 64}),
        _kernel(tmp_path, "C", "skinny_mm", num_warps=4, ttir="tt.func public @skinny_mm(%x: !tt.ptr<f32> {tt.divisibility = 16 : i32})"),
    ]
    assert sorted(diag.triton_folders(tmp_path)) == sorted(cold)
    new = _kernel(tmp_path, "D", "triton_poi_fused_add_0", num_warps=4, debug=True, constants={"XBLOCK": 128})
    (found,) = diag.compare_new_kernels(tmp_path, [new], cold)
    assert found["kernel"] == "triton_poi_fused_add_0" and found["cold_kernels_of_that_name"] == 2
    # closest first: A differs only in `debug`; the hash never counts
    assert found["closest"][0] == {"cold_folder": cold[0], "differs": {"debug": [True, False]}}
    assert set(found["closest"][1]["differs"]) == {"num_warps", "constants"}
    # the arguments' specialization and the machine code's size count too
    new = _kernel(tmp_path, "E", "skinny_mm", cubin_bytes=16, num_warps=4, ttir="tt.func public @skinny_mm(%x: !tt.ptr<f32>)")
    (found,) = diag.compare_new_kernels(tmp_path, [new], cold)
    assert found["closest"][0]["differs"] == {
        "_cubin_bytes": [16, 8],
        "_ttir_signature": [["tt.func public @skinny_mm(%x: !tt.ptr<f32>) {"], ["tt.func public @skinny_mm(%x: !tt.ptr<f32> {tt.divisibility = 16 : i32}) {"]],
    }


def test_a_kernel_name_the_cold_build_never_compiled_has_nothing_to_compare():
    assert diag.differing_fields({"a": 1, "hash": "x"}, {"a": 1, "hash": "y"}) == {}
    assert diag.differing_fields({"a": 1}, {"b": 2}) == {"a": [1, None], "b": [None, 2]}


def test_new_specializations_are_those_no_earlier_build_asked_for():
    cold = [{"name": "skinny_mm", "specialization": '{"attrs": [16]}'}]
    warm = [{"name": "skinny_mm", "specialization": '{"attrs": [16]}'}, {"name": "skinny_mm", "specialization": '{"attrs": []}'}, {"name": "sum_splits", "specialization": '{"attrs": [16]}'}]
    assert diag.new_specializations(warm, cold) == warm[1:]
    # a Triton without specialization data: the repr (argument types, options) tells them apart
    cold = [{"name": "skinny_mm", "specialization": None, "repr": "skinny_mm[num_warps=4](x: *fp32)"}]
    warm = [*cold, {"name": "skinny_mm", "specialization": None, "repr": "skinny_mm[num_warps=8](x: *fp32)"}]
    assert diag.new_specializations(warm, cold) == warm[1:]


def test_the_jit_log_hook_records_a_request_and_lets_triton_compile(tmp_path, monkeypatch):
    from triton import knobs

    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/ptxas")
    log = tmp_path / "jit.jsonl"
    before = knobs.runtime.jit_cache_hook
    try:
        diag.install_jit_log(str(log))

        class Info:
            name = "skinny_mm"

        skip = knobs.runtime.jit_cache_hook(key=("k",), repr="skinny_mm[num_warps=4]", fn=Info(), compile={"specialization_data": "{}"}, is_manual_warmup=False, already_compiled=False)
        # a call this hook does not understand is reported, never raised into the build
        assert knobs.runtime.jit_cache_hook(key=("k",)) is False
    finally:
        knobs.runtime.jit_cache_hook = before
    assert not skip, "a true answer would make Triton skip the compile"
    assert diag.read_json_lines(log) == [{"name": "skinny_mm", "repr": "skinny_mm[num_warps=4]", "specialization": "{}", "where": [], "env": {**{k: v for k, v in os.environ.items() if k.startswith("TRITON_")}, "TRITON_PTXAS_PATH": "/opt/ptxas"}}]


def test_the_default_triton_cache_is_listed_by_kernel_name(tmp_path):
    assert diag.default_cache_kernels(tmp_path) == {}
    folder = tmp_path / ".triton" / "cache" / "HASH"
    folder.mkdir(parents=True)
    (folder / "skinny_mm.json").write_text("{}")
    (folder / "__grp__skinny_mm.json").write_text("{}")
    (folder / "skinny_mm.cubin").write_bytes(b"")
    assert diag.default_cache_kernels(tmp_path) == {"HASH": ["skinny_mm"]}


class _Autotuner:
    """What `timed_benchmarks` reads of Inductor's CachingAutotuner."""

    def __init__(self, state: str | None = None, save=None):
        self.inductor_meta = {"kernel_name": "triton_per_fused_mean_0"}
        self.autotune_cache_info = {"autotune_cache_state": state} if state else {}
        self.save_cache_hook = save

    def benchmark_all_configs(self, *args):
        return {"config a": 0.01, "config b": 0.02}


class _KeptChoice:
    """What the log reads of Inductor's AutotuneCache: `save` bound to it, its local file and hash."""

    def __init__(self, path):
        self.path, self.configs_hash = path, "abc"
        self.local_cache = (object(), str(path))

    def save(self, *args):
        self.path.write_text(json.dumps({"XBLOCK": 8, "configs_hash": self.configs_hash}))


def _benchmark_and_save(self, *args):
    self.save_cache_hook()
    return {"config a": 0.01, "config b": 0.02}


def test_a_runtime_autotune_is_logged_with_its_kernel_and_the_timings_pass_through(tmp_path):
    log = tmp_path / "autotune.jsonl"
    benchmark = diag.timed_benchmarks(_Autotuner.benchmark_all_configs, str(log))
    assert benchmark(_Autotuner(), 1, 2) == {"config a": 0.01, "config b": 0.02}
    assert benchmark(_Autotuner("miss", save=print)) == {"config a": 0.01, "config b": 0.02}
    first, second = diag.read_json_lines(log)
    assert (first["kernel"], first["configs"], first["cache_state"], first["saved"]) == ("triton_per_fused_mean_0", 2, None, False)
    assert (second["cache_state"], second["saved"]) == ("miss", True) and first["seconds"] >= 0
    # where the choice is kept: the file before and after the call (here the stand-in's save writes it)
    kept = _KeptChoice(tmp_path / "k.best_config")
    assert diag.timed_benchmarks(_benchmark_and_save, str(log))(_Autotuner("miss", save=kept.save)) == {"config a": 0.01, "config b": 0.02}
    third = diag.read_json_lines(log)[2]
    assert (third["kept_in"], third["configs_hash"], third["file_before"]) == (str(kept.path), "abc", None)
    assert third["file_after"] == {"XBLOCK": 8, "configs_hash": "abc"}
    assert first["kept_in"] is None and first["file_after"] is None
    assert diag.best_config_file(object()) is None  # a path of a type Inductor might change to: no error into the build
    # a log it cannot write never reaches the build
    unwritable = diag.timed_benchmarks(_Autotuner.benchmark_all_configs, str(tmp_path / "missing" / "autotune.jsonl"))
    assert unwritable(_Autotuner()) == {"config a": 0.01, "config b": 0.02}


def test_a_sampled_stack_is_summarised_by_inclusive_seconds(tmp_path):
    def slow_part():
        end = time.perf_counter() + 0.15
        while time.perf_counter() < end:
            sum(i * i for i in range(2000))

    def build():
        for _ in range(2):
            slow_part()

    with diag.StackSampler(interval=0.001) as sampler:
        build()
    sampler.write(tmp_path / "build.stacks")
    table = diag.top_functions(tmp_path / "build.stacks", lines=200)  # pytest's frames hold it all too
    rows = {line.split()[-1].rpartition("(")[2].rstrip(")"): float(line.split()[0]) for line in table.splitlines()[1:]}
    # ~0.3 s spent in it, however often sampled; the caller holds its callee's time (equal here: ties in either order)
    assert 0.2 <= rows["slow_part"] <= rows["build"] <= 0.6
    (tmp_path / "empty.stacks").write_text("")  # a build that died before a sample
    assert diag.top_functions(tmp_path / "empty.stacks").startswith("no profile in")
    assert diag.top_functions(tmp_path / "missing.stacks").startswith("no profile in")


def test_garbage_collections_are_counted_and_the_slow_ones_attributed():
    collections = diag.GarbageCollections()
    gc.callbacks.append(collections)
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        gc.callbacks.remove(collections)
    report = collections.report()
    assert report["collections"]["2"] >= 1 and report["collections"]["0"] >= 1
    assert report["seconds"]["2"] > 0
    assert list(report["slow_ones_by_function"]) == ["(outside the engine)"]  # called from a test, not from opara_core
    explicit = report["full"][0]
    assert explicit["line"] == "gc.collect(2)" and "test_warm_build_diag.py" in explicit["where"]
    assert explicit["frozen"] == gc.get_freeze_count() and explicit["threshold"] == gc.get_threshold()[2] and explicit["seconds"] > 0


def test_the_whole_report_from_three_builds_each_logging_as_a_build_process_does(tmp_path, monkeypatch, capsys):
    """main() over three stand-in build processes (the real ones need a GPU): each
    writes what the hooks in a build write, and the bench's report line."""
    import subprocess

    calls = []

    def build_process(command, env, **kwargs):
        build = Path(env[diag.JIT_LOG_ENV]).name.split("_")[1]
        calls.append((build, diag.PROFILE_ENV in env))
        if build != "warm2":  # the cold build and the first warm one compile the kernel
            _kernel(Path(env["OPARA_CACHE_DIR"]), f"F{build}", "skinny_mm", num_warps=4 if build == "cold" else 8)
        Path(env[diag.AUTOTUNE_LOG_ENV]).write_text(json.dumps({"kernel": "triton_red_0", "configs": 3, "seconds": 0.5, "cache_state": "miss", "saved": build == "cold"}) + "\n")
        if diag.PROFILE_ENV in env:
            Path(env[diag.PROFILE_ENV]).write_text("bench.py:1(<module>);build.py:240(make_captures) 1500.0\nbench.py:1(<module>) 500.0\n")
        Path(env[diag.GC_LOG_ENV]).write_text(json.dumps({"collections": {"0": 900, "2": 3}, "seconds": {"0": 0.1, "2": 0.9}, "slow_ones_by_function": {"segment_compiler.prepare": 0.8}, "full": [{"where": "graphs.py:12(__enter__)", "line": "gc.collect()", "frozen": 7, "threshold": 10, "seconds": 0.3}]}))
        report = {"seconds": {"fusion": 1.0}, "inductor": f"{build}: 6 segment calls"}
        return subprocess.CompletedProcess(command, 0, stdout="log line\n" + json.dumps(report) + "\n")

    monkeypatch.setattr(diag.subprocess, "run", build_process)
    monkeypatch.setattr(diag, "default_cache_kernels", lambda: {})
    assert diag.main(["t5", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--profile"]) == 0
    assert calls == [("cold", False), ("warm1", False), ("warm2", True)]  # only the last warm build profiled
    result = json.loads((tmp_path / "out" / "t5_diag.json").read_text())
    assert result["added_by_warm1"]["folders"] == 1 and result["added_by_warm2"]["folders"] == 0
    assert result["added_by_warm1"]["kernels"][0]["closest"][0]["differs"] == {"num_warps": [8, 4]}
    assert [len(result["autotuned_at_first_call"][b]) for b in diag.BUILDS] == [1, 1, 1]
    assert (tmp_path / "out" / "t5_warm2_profile.txt").exists() and not (tmp_path / "out" / "t5_warm1_profile.txt").exists()
    assert "2.000   0.500  bench.py:1(<module>)" in (tmp_path / "out" / "t5_warm2_profile.txt").read_text()
    assert result["garbage_collections"]["cold"]["seconds"]["2"] == 0.9
    printed = capsys.readouterr().out
    assert "warm1: garbage collections per generation {'0': 900, '2': 3}, seconds {'0': 0.1, '2': 0.9}; generations 1-2 in segment_compiler.prepare 0.80" in printed
    assert "  full collection 0.30 s, 7 objects frozen, threshold 10: graphs.py:12(__enter__): gc.collect()" in printed
    assert "warm1: 1 Inductor kernels autotuned at their first call (0.5 s; autotune cache miss 1; 1 whose choice is not saved)" in printed
    assert "warm1: 1 new Triton folders" in printed and "warm2: 0 new Triton folders" in printed


def test_the_autotune_log_wraps_the_method_of_this_torchs_autotuner(tmp_path, monkeypatch):
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    original = CachingAutotuner.benchmark_all_configs
    monkeypatch.setattr(CachingAutotuner, "benchmark_all_configs", original)  # restored after the test
    diag.install_autotune_log(str(tmp_path / "autotune.jsonl"))
    assert CachingAutotuner.benchmark_all_configs is not original and CachingAutotuner.benchmark_all_configs.__name__ == "benchmark"
    # the attributes the log reads are this torch's (a missing one would log None, silently)
    import inspect

    setup = inspect.getsource(CachingAutotuner.__init__)
    assert all(f"self.{name}" in setup for name in ("inductor_meta", "autotune_cache_info", "save_cache_hook")), "CachingAutotuner changed"
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    cache = inspect.getsource(AutotuneCache)
    assert all(f"self.{name}" in cache for name in ("local_cache", "configs_hash")) and "def save(" in cache, "AutotuneCache changed"


def test_with_bytecode_two_more_warm_builds_read_bytecode_compiled_before_them(tmp_path, monkeypatch, capsys):
    """--bytecode: compileall writes torch's bytecode into a folder of its own
    after the three builds, and only the two builds after it read from there."""
    import subprocess

    calls = []

    def process(command, env, **kwargs):
        if command[1:3] == ["-m", "compileall"]:
            calls.append(("compileall", env["PYTHONPYCACHEPREFIX"], command))
            return subprocess.CompletedProcess(command, 0, stdout="")
        build = Path(env[diag.JIT_LOG_ENV]).name.split("_")[1]
        calls.append((build, env.get("PYTHONPYCACHEPREFIX"), None))
        report = {"seconds": {"fusion": 1.0}, "inductor": f"{build}: 6 segment calls"}
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(report) + "\n")

    monkeypatch.setattr(diag.subprocess, "run", process)
    monkeypatch.setattr(diag, "default_cache_kernels", lambda: {})
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    assert diag.main(["t5", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--bytecode"]) == 0
    prefix = str(tmp_path / "cache" / "bytecode")  # beside the cache: --out is what a GPU call brings back
    assert [c[0] for c in calls] == ["cold", "warm1", "warm2", "compileall", "bytecode1", "bytecode2"]
    assert [c[1] for c in calls] == [None, None, None, prefix, prefix, prefix]
    torch_dir = str(Path(importlib.util.find_spec("torch").origin).parent)
    assert torch_dir in calls[3][2]
    assert calls[3][2][calls[3][2].index("-j") + 1] == str(len(os.sched_getaffinity(0)))  # the job's cores, not the machine's (usable_cpus)
    result = json.loads((tmp_path / "out" / "t5_diag.json").read_text())
    assert result["bytecode"]["prefix"] == prefix and torch_dir in result["bytecode"]["folders"]
    assert result["builds"]["bytecode2"]["inductor"] == "bytecode2: 6 segment calls"
    printed = capsys.readouterr().out
    assert f"compiled into {prefix}" in printed and "bytecode1: fusion 1.0" in printed
