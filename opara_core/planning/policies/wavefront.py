"""Rammer's wavefront policy, as in RAF's stream_schedule_wavefront pass."""

from __future__ import annotations

from opara_core.planning.dag import Dag
from opara_core.planning.policies.lanes import StreamAssignment, check_budget, renumber


def wavefront(dag: Dag, max_streams: int | None = None) -> StreamAssignment:
    """Waves of ready chains; chain j of every wave runs on lane j (j mod max_streams).

    A wave takes every ready node and extends it into a chain through nodes with a
    single input and a single user (on the transitive reduction); the next wave
    starts from what the whole wave made ready. Launch order is wave by wave. The
    barrier between waves is not emitted as waits: only the edges that the lanes do
    not already order get one, like every other policy.
    """
    check_budget(max_streams)
    n = len(dag)
    users = dag.reduced_succs
    pending = [len(p) for p in dag.reduced_preds]
    stream = [0] * n
    order: list[int] = []
    ready = [v for v in range(n) if not pending[v]]
    while ready:
        wave = []
        for head in ready:
            chain = [head]
            if len(users[head]) == 1:
                nxt = users[head][0]
                while len(users[nxt]) == 1 and pending[nxt] == 1:
                    chain.append(nxt)
                    nxt = users[nxt][0]
                if pending[nxt] == 1:
                    chain.append(nxt)
            wave.append(chain)
        ready = []
        for j, chain in enumerate(wave):
            lane = j if max_streams is None else j % max_streams
            for v in chain:
                stream[v] = lane
            order.extend(chain)
            for u in users[chain[-1]]:
                pending[u] -= 1
                if not pending[u]:
                    ready.append(u)
        ready.sort()
    return StreamAssignment(stream=renumber(stream), order=tuple(order), order_name="wavefront")
