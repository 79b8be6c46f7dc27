"""scripts/generation_bench.py's comparison: which rate counts as sustained."""

from __future__ import annotations

from conftest import load_script

best_under_bound = load_script("generation_bench").best_under_bound


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
