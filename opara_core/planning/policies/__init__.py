"""Stream policies: pure functions from a DAG (and its costs) to a lane per operator.

Each policy is `policy(dag, max_streams=None) -> StreamAssignment`; the waits are
derived generically from the assignment and a launch order (see `opara_core.planning.plan`).
"""

from __future__ import annotations

from collections.abc import Callable

from opara_core.planning.dag import Dag
from opara_core.planning.policies.asap import asap
from opara_core.planning.policies.lanes import StreamAssignment
from opara_core.planning.policies.nimble import nimble
from opara_core.planning.policies.opara import opara
from opara_core.planning.policies.sequential import sequential
from opara_core.planning.policies.side import side
from opara_core.planning.policies.wavefront import wavefront

Policy = Callable[[Dag, "int | None"], StreamAssignment]

POLICIES: dict[str, Policy] = {
    "sequential": sequential,
    "opara": opara,
    "nimble": nimble,
    "asap": asap,
    "wavefront": wavefront,
    "side": side,
}


def names() -> list[str]:
    """Policy names, in a stable order."""
    return list(POLICIES)


def get(name: str) -> Policy:
    """The policy called `name`; a ValueError lists the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "StreamAssignment", "asap", "get", "names", "nimble", "opara", "sequential", "side", "wavefront"]
