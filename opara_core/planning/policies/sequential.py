"""The baseline: every operator on one stream, in topological order."""

from __future__ import annotations

from opara_core.planning.dag import Dag
from opara_core.planning.policies.lanes import StreamAssignment, check_budget


def sequential(dag: Dag, max_streams: int | None = None) -> StreamAssignment:
    """One lane, the node list's order: what a sequential CUDA graph runs."""
    check_budget(max_streams)
    return StreamAssignment(stream=(0,) * len(dag), order=tuple(range(len(dag))))
