"""scripts/warm_build_diag.py's comparisons, on Triton cache folders laid out as Triton writes them (CPU)."""

from __future__ import annotations

import json
import os
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
    assert diag.read_jit_log(log) == [{"name": "skinny_mm", "repr": "skinny_mm[num_warps=4]", "specialization": "{}", "where": [], "env": {**{k: v for k, v in os.environ.items() if k.startswith("TRITON_")}, "TRITON_PTXAS_PATH": "/opt/ptxas"}}]


def test_the_default_triton_cache_is_listed_by_kernel_name(tmp_path):
    assert diag.default_cache_kernels(tmp_path) == {}
    folder = tmp_path / ".triton" / "cache" / "HASH"
    folder.mkdir(parents=True)
    (folder / "skinny_mm.json").write_text("{}")
    (folder / "__grp__skinny_mm.json").write_text("{}")
    (folder / "skinny_mm.cubin").write_bytes(b"")
    assert diag.default_cache_kernels(tmp_path) == {"HASH": ["skinny_mm"]}
