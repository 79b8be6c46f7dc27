"""`python -m opara_core plan`: the DAG-file contract other tools depend on, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_helpers import APPENDIX_EDGES, min_waits_by_brute_force

from opara_core.planning import policies
from opara_core.planning.dag import Dag
from opara_core.planning.plan import Plan, violations

# The appendix example with mixed kinds, and a small DAG for the exact Nimble checks.
APPENDIX = {
    "nodes": [{"name": str(i), "kind": "memory" if i % 3 == 2 else "compute"} for i in range(1, 14)],
    "edges": [[str(a), str(b)] for a, b in APPENDIX_EDGES],
}
SMALL = {
    "nodes": [{"name": n, "kind": "compute", "cost": c} for n, c in zip("abcdefg", (1, 4, 2, 3, 1, 5, 1))],
    "edges": [["a", "b"], ["a", "c"], ["a", "d"], ["b", "e"], ["c", "e"], ["d", "f"], ["c", "f"], ["e", "g"], ["f", "g"], ["a", "g"]],
}


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "opara_core", *args], capture_output=True, text=True, input=stdin, timeout=300
    )


@pytest.fixture(scope="module")
def dag_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("dags")
    files = {}
    for name, data in (("appendix", APPENDIX), ("small", SMALL)):
        files[name] = folder / f"{name}.json"
        files[name].write_text(json.dumps(data))
    return files


def _check_contract(out: dict, data: dict, policy: str) -> Plan:
    """The output is exactly the contract, and a valid plan of the input DAG."""
    assert list(out) == ["policy", "num_streams", "stream", "order", "waits"]
    names = [n["name"] for n in data["nodes"]]
    assert out["policy"] == policy
    assert isinstance(out["num_streams"], int) and out["num_streams"] >= 1
    assert sorted(out["stream"]) == sorted(names)
    assert sorted(set(out["stream"].values())) == list(range(out["num_streams"]))  # ids 0..k-1, no gaps
    assert sorted(out["order"]) == sorted(names)
    assert all(isinstance(w, list) and len(w) == 2 for w in out["waits"])
    plan = Plan.from_json(out)
    assert violations(Dag.from_json(data), plan) == []  # every edge enforced, no self-wait, topological
    return plan


@pytest.mark.parametrize("policy", policies.names())
def test_dag_file_contract(policy, dag_files):
    for name, data in (("appendix", APPENDIX), ("small", SMALL)):
        result = _run("plan", "--dag", str(dag_files[name]), "--policy", policy)
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("\n") == 1  # one JSON document, one line
        _check_contract(json.loads(result.stdout), data, policy)


@pytest.mark.parametrize("policy", policies.names())
def test_max_streams_bounds_the_streams(policy, dag_files):
    for k in (1, 2):
        result = _run("plan", "--dag", str(dag_files["appendix"]), "--policy", policy, "--max-streams", str(k))
        assert result.returncode == 0, result.stderr
        assert _check_contract(json.loads(result.stdout), APPENDIX, policy).num_streams <= k


def test_opara_gives_five_streams_on_the_appendix_example(dag_files):
    result = _run("plan", "--dag", str(dag_files["appendix"]), "--policy", "opara")
    assert json.loads(result.stdout)["num_streams"] == 5


def test_nimble_meets_its_optimum(dag_files):
    out = json.loads(_run("plan", "--dag", "-", "--policy", "nimble", stdin=json.dumps(SMALL)).stdout)
    dag = Dag.from_json(SMALL)
    # 9 reduction edges (a -> g is implied); a maximum matching has 4, e.g. a-b, b-e, c-f, f-g.
    assert len(dag.reduced_edges) == 9
    assert len(out["waits"]) == min_waits_by_brute_force(dag) == 9 - 4
    for i, u in enumerate(dag.names):  # nodes with no path between them are on different streams
        for j, v in enumerate(dag.names):
            if i < j and not dag.reaches(i, j):
                assert out["stream"][u] != out["stream"][v]


BAD_DAGS = {
    "cycle": ({"nodes": [{"name": "a", "kind": "compute"}, {"name": "b", "kind": "compute"}], "edges": [["a", "b"], ["b", "a"]]}, "cycle"),
    "unknown": ({"nodes": [{"name": "a", "kind": "compute"}], "edges": [["a", "ghost"]]}, "unknown node 'ghost'"),
    "duplicate": ({"nodes": [{"name": "a", "kind": "compute"}, {"name": "a", "kind": "memory"}], "edges": []}, "duplicate node name 'a'"),
}


def _assert_one_line_error(result: subprocess.CompletedProcess, words: str) -> None:
    assert result.returncode != 0
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr


@pytest.mark.parametrize("case", list(BAD_DAGS))
def test_bad_dag_files_get_one_line_errors(case, tmp_path):
    data, words = BAD_DAGS[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    _assert_one_line_error(_run("plan", "--dag", str(path), "--policy", "opara"), words)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--policy", "fastest"], "invalid choice: 'fastest'"),
        (["--policy", "opara", "--max-streams", "0"], "--max-streams: must be at least 1, got 0"),
        (["--policy", "opara", "--max-streams", "-3"], "--max-streams: must be at least 1"),
        (["--policy", "opara", "--max-streams", "many"], "--max-streams: expected an integer"),
    ],
)
def test_bad_arguments_get_one_line_errors(args, words, dag_files):
    result = _run("plan", "--dag", str(dag_files["small"]), *args)
    _assert_one_line_error(result, words)
    assert result.returncode == 2


def test_unreadable_input_gets_one_line_errors(tmp_path):
    _assert_one_line_error(_run("plan", "--dag", str(tmp_path / "missing.json"), "--policy", "opara"), "cannot read")
    (tmp_path / "junk.json").write_text("{nodes: ")
    _assert_one_line_error(_run("plan", "--dag", str(tmp_path / "junk.json"), "--policy", "opara"), "not valid JSON")
    _assert_one_line_error(_run("plan", "--model", "alexnet", "--policy", "opara"), "unknown model 'alexnet'")


def test_model_summary_and_drawing(tmp_path):
    picture = tmp_path / "deepfm.png"
    plan_file = tmp_path / "plan.json"
    args = ("plan", "--model", "deepfm", "--policy", "opara", "--max-streams", "8")
    result = _run(*args, "--draw", str(picture), "--out", str(plan_file))
    assert result.returncode == 0, result.stderr
    for words in ("model           deepfm", "kernels", "free", "streams         8", "waits", "critical path"):
        assert words in result.stdout
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    plan = Plan.from_json(json.loads(plan_file.read_text()))
    assert plan.num_streams == 8 and plan.fingerprint.startswith("sha256:")
