"""scripts/cudnn_first_call.py on the CPU: what it refuses before a GPU is
needed, and its table of what the measuring processes returned (the
measurement itself needs a GPU)."""

from __future__ import annotations

import json

from conftest import load_script
from torch import nn


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


def test_planning_refuses_an_unknown_model_before_the_gpu_is_needed(capsys):
    assert _script().main(["--planning", "--models", "nasnet,nasnet5000"]) == 2
    assert "nasnet5000" in capsys.readouterr().err


def test_convolutions_are_told_apart_by_groups_kernel_and_stride():
    kind = _script().kind
    assert kind(nn.Conv2d(8, 8, 5, stride=2, groups=8)) == "depthwise k5 s2"
    assert kind(nn.Conv2d(8, 16, 3, groups=8)) == "grouped k3 s1"  # two filters per channel
    assert kind(nn.Conv2d(8, 8, 3, groups=4)) == "grouped k3 s1"
    assert kind(nn.Conv2d(8, 4, 1)) == "dense k1 s1"


def test_the_planning_table_has_a_line_per_way_with_the_depthwise_seconds_where_timed():
    script = _script()
    # as a measuring process prints it: batch sizes become JSON object keys (strings)
    timed = json.loads(json.dumps({"first_calls_s": 26.73, "first_call_s": {1: 7.5}, "by_kind_s": {"depthwise k5 s2": 4.4, "depthwise k3 s1": 3.9, "dense k1 s1": 0.4}, "graph_ms": {1: 7.339, 8: 16.411, 32: 50.234}}))
    threads = json.loads(json.dumps({"first_calls_s": 24.53, "first_call_s": {1: 23.9}, "by_kind_s": {}, "graph_ms": {}}))
    rows = [{"model": "nasnet", "way": "one thread", "result": timed}, {"model": "nasnet", "way": "a thread per bucket", "result": threads}]
    lines = script.planning_table(rows).splitlines()
    assert len(lines) == 2 + 2
    assert lines[2] == "| nasnet | one thread | 26.7 | 8.3 | 7.339 / 16.411 / 50.234 |"
    assert lines[3] == "| nasnet | a thread per bucket | 24.5 | - | - |"
