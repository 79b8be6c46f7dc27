"""scripts/cudnn_first_call.py on the CPU: what it refuses before a GPU is
needed, and its table of what the measuring processes returned (the
measurement itself needs a GPU)."""

from __future__ import annotations

import json

from conftest import load_script


def _script():
    return load_script("cudnn_first_call")


def test_an_unknown_model_is_refused_before_the_gpu_is_needed(capsys):
    assert _script().main(["--models", "resnet50,resnet5000"]) == 2
    assert "resnet5000" in capsys.readouterr().err


def test_the_table_has_a_line_per_model_and_configuration_from_the_processes_json():
    script = _script()
    # as a measuring process prints it: its batch sizes become JSON object keys (strings)
    result = json.loads(json.dumps({"first_call_s": {1: 2.0}, "first_calls_s": 12.34, "graph_ms": {b: b / 10 for b in script.TIMED}}))
    rows = [{"api": "v8", "benchmark": True, "models": {"nasnet": result}}, {"api": "v7", "benchmark": False, "models": {"nasnet": result}}]
    lines = script.table(rows).splitlines()
    assert len(lines) == 2 + 2
    assert lines[2] == "| nasnet | v8 | on | 12.3 | 0.100 / 0.800 / 3.200 |"
    assert lines[3].startswith("| nasnet | v7 | off |")
