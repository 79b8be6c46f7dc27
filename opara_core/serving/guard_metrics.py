"""The Prometheus text an HTTP guard serves at `GET /metrics` on the public
HTTP port: the requests it answered itself, by reason, and the launcher's
restarts of tritonserver, by reason (the Python guard and nginx alike)."""

from __future__ import annotations

from collections.abc import Mapping


def metrics_text(refused: Mapping[str, int], restarts: Mapping[str, int]) -> str:
    lines = [
        "# HELP opara_guard_refused_total Requests the HTTP guard answered itself, by reason.",
        "# TYPE opara_guard_refused_total counter",
        *(f'opara_guard_refused_total{{reason="{r}"}} {n}' for r, n in sorted(refused.items())),
        "# HELP opara_server_restarts_total Restarts of tritonserver by the launcher, by reason.",
        "# TYPE opara_server_restarts_total counter",
        *(f'opara_server_restarts_total{{reason="{r}"}} {n}' for r, n in sorted(restarts.items())),
    ]
    return "\n".join(lines) + "\n"
