"""Which generation requests run in the next decoding step (no torch).

Orca's iteration-level scheduling: after every step, finished requests leave
and waiting ones join, so a short request never waits for a long one. The
baseline, request-level batching, admits a batch only when the previous one
has ended entirely (nobody joins a running batch), as a server that batches
whole requests does.

Admission is first come, first served and reserves each request's whole KV
cache up front (prompt plus every token it may generate), so a running request
never runs out of cache (as in Orca). Everything here is plain bookkeeping over
ids and counts: the serving adapter owns the tensors and the responses, and a
test can drive the scheduler with any fake step.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

ITERATION, REQUEST = "iteration", "request"
MODES = (ITERATION, REQUEST)


class Rejected(ValueError):
    """A request the scheduler will not take: the queue is full, or it could
    never fit. The message is for the client."""


@dataclass(frozen=True)
class Limits:
    """max_active: requests in one decoding step (KV-cache slots);
    kv_tokens: cache positions that admitted requests may reserve in total;
    max_context: positions one request may use (the model's window and a slot's length);
    max_queue: requests that may wait for a free slot; one more is rejected."""

    max_active: int
    kv_tokens: int
    max_context: int
    max_queue: int

    def __post_init__(self) -> None:
        for name in ("max_active", "kv_tokens", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")


@dataclass
class Sequence:
    """One generation request: its prompt length, its stop conditions and what it has generated."""

    key: int
    prompt_len: int
    max_tokens: int
    end_id: int | None = None
    generated: list[int] = field(default_factory=list)
    slot: int | None = None
    cancelled: bool = False

    @property
    def reservation(self) -> int:
        """Cache positions it needs: the prompt and every generated token but
        the last, which is returned and never fed back."""
        return self.prompt_len + self.max_tokens - 1

    @property
    def length(self) -> int:
        """Positions already in its cache once the last generated token is fed."""
        return self.prompt_len + len(self.generated)

    @property
    def done(self) -> bool:
        if self.cancelled or len(self.generated) >= self.max_tokens:
            return True
        return bool(self.generated) and self.end_id is not None and self.generated[-1] == self.end_id


class Scheduler:
    """The queue, the active set and the free cache slots of one model instance.

    The serving loop calls, per iteration: `admit()` (prefill the returned
    requests), then `step_batch()` (one batched decoding step for them), then
    `record(key, token)` for every token, then `retire()`.

    `admit_every`: while requests are generating, waiting ones join at most
    every that many iterations (the first waiter is held at most
    admit_every - 1 iterations), so that one prefill forward takes several
    arrivals instead of one each; with nothing generating they join at once.
    """

    def __init__(self, limits: Limits, mode: str = ITERATION, admit_every: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(f"scheduling must be one of {MODES}, got {mode!r}")
        if admit_every < 1:
            raise ValueError(f"admit_every must be >= 1, got {admit_every}")
        self.limits = limits
        self.mode = mode
        self.admit_every = admit_every
        self._held = 0  # iterations the first waiting request has been held back
        self.waiting: deque[Sequence] = deque()
        self.active: dict[int, Sequence] = {}
        # a heap: the lowest free slot first, so the active slots stay low and a decoding step's rows few
        self.free_slots = list(range(limits.max_active))
        self.reserved = 0

    def submit(self, sequence: Sequence) -> None:
        """Queue a request, or raise Rejected naming the problem."""
        self.check(sequence)
        limits = self.limits
        # the queue holds those that the next admit() cannot take (free slots admit the rest)
        room = len(self.free_slots) if self.mode == ITERATION or not self.active else 0
        if len(self.waiting) >= limits.max_queue + room:
            raise Rejected(
                f"overloaded: {len(self.active)} requests generating and {len(self.waiting) - room} waiting "
                f"(queue limit {limits.max_queue}); retry later"
            )
        self.waiting.append(sequence)

    def check(self, sequence: Sequence) -> None:
        """Raise Rejected for a request that could never run, whatever the load.
        Reads only the limits, so any thread may call it."""
        limits = self.limits
        if sequence.prompt_len < 1:
            raise Rejected("input_ids is empty: give at least one prompt token")
        if sequence.max_tokens < 1:
            raise Rejected(f"max_tokens must be >= 1, got {sequence.max_tokens}")
        if sequence.reservation > limits.max_context:
            raise Rejected(
                f"prompt of {sequence.prompt_len} tokens plus max_tokens {sequence.max_tokens} needs "
                f"{sequence.reservation} positions; this model allows {limits.max_context}"
            )
        if sequence.reservation > limits.kv_tokens:
            raise Rejected(f"the request needs {sequence.reservation} KV-cache positions; the budget is {limits.kv_tokens}")

    def admit(self) -> list[Sequence]:
        """Requests to prefill now, each given a slot; first come, first served.

        Iteration level: as many as fit beside the running ones. Request level:
        a new batch only once the previous one has ended entirely (a request
        that finishes early still leaves at once and gets its final response;
        only joining waits, so the baseline is kinder than padding every row
        of the batch to its longest request).
        """
        if self.mode == REQUEST and self.active:
            return []
        if self.active and self.waiting and self._held + 1 < self.admit_every:
            self._held += 1
            return []
        self._held = 0
        admitted = []
        while self.waiting and self.free_slots:
            head = self.waiting[0]
            if self.reserved + head.reservation > self.limits.kv_tokens:
                break
            self.waiting.popleft()
            head.slot = heapq.heappop(self.free_slots)
            self.reserved += head.reservation
            self.active[head.key] = head
            admitted.append(head)
        return admitted

    def step_batch(self) -> list[Sequence]:
        """The active requests that need one more decoding step, in slot order."""
        return sorted((s for s in self.active.values() if not s.done), key=lambda s: s.slot)

    def record(self, key: int, token: int) -> None:
        self.active[key].generated.append(token)

    def cancel(self, key: int) -> None:
        """Mark a request whose client went away; the next retire() drops it.
        A waiting request is dropped at once."""
        if key in self.active:
            self.active[key].cancelled = True
            return
        for sequence in self.waiting:
            if sequence.key == key:
                sequence.cancelled = True
                self.waiting.remove(sequence)
                return

    def retire(self) -> list[Sequence]:
        """Finished requests leave now, and their slots and reservations are freed."""
        finished = [s for s in self.active.values() if s.done]
        for sequence in finished:
            del self.active[sequence.key]
            heapq.heappush(self.free_slots, sequence.slot)
            self.reserved -= sequence.reservation
        return finished

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting
