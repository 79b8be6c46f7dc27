"""scripts/generation_bench.py's comparison (which rate counts as sustained) and its configs."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_script

from opara_core.parameters import GENERATION, parse
from opara_core.parameters import get as get_parameter
from opara_core.serving import model_config
from opara_core.serving.launcher import REPO_ROOT

generation_bench = load_script("generation_bench")
best_under_bound = generation_bench.best_under_bound


def row(scheduling: str, req_s: float, tpot: float, ttft: float, errors: int = 0) -> dict:
    return {"scheduling": scheduling, "requests_per_s": req_s, "tpot_p99_ms": tpot, "ttft_p99_ms": ttft, "errors": errors, "norm_latency_p99_ms": 9.0}


def test_an_overloaded_rate_counts_only_without_the_ttft_bound():
    rows = [
        row("iteration", 40.0, 8.0, 300.0),
        row("iteration", 55.0, 9.0, 12_000.0),  # its queue grew all run: TTFT shows it, TPOT does not
        row("iteration", 70.0, 30.0, 500.0),  # over the TPOT bound
        row("iteration", 90.0, 5.0, 100.0, errors=3),  # refused some requests
        row("request", 50.0, 5.0, 100.0),
    ]
    assert best_under_bound(rows, "iteration", 20.0)["requests_per_s"] == 55.0
    assert best_under_bound(rows, "iteration", 20.0, ttft_bound_ms=2000.0)["requests_per_s"] == 40.0
    assert best_under_bound(rows, "iteration", 20.0, ttft_bound_ms=100.0) is None
    assert best_under_bound(rows, "request", 4.0) is None


def precision_of(model_dir: Path) -> str:
    """The `precision` a generation model's config.pbtxt asks for."""
    return parse(GENERATION, model_config.parameters(model_config.read(model_dir / "config.pbtxt")))["precision"]


def test_precision_reaches_both_configs_and_a_bad_one_is_refused(tmp_path, capsys):
    """--precision bf16 (issue 72) in both copies of gpt2, and the configs still parse;
    without --precision they keep their own."""
    parser = generation_bench.argument_parser()
    repository = generation_bench.make_repository(tmp_path / "a", generation_bench.served_parameters(parser.parse_args(["--precision", "bf16"])))
    for name in generation_bench.MODELS.values():
        assert precision_of(repository / name) == "bf16"
    repository = generation_bench.make_repository(tmp_path / "b", generation_bench.served_parameters(parser.parse_args([])))
    assert precision_of(repository / "gpt2") == precision_of(REPO_ROOT / "model_repository" / "gpt2")
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "bf17"])
    error = capsys.readouterr().err
    assert "argument --precision: invalid choice: 'bf17'" in error
    assert all(repr(choice) in error for choice in get_parameter("precision").choices)
