"""The scheduling policy: the order of the waiting queue and the choice of whom to preempt.

One class per policy, registered by name in `REQUEST_QUEUES` (vLLM's `v1/core/sched/
request_queue.py`); `SchedulerConfig.scheduling_policy` names one. The scheduler asks its
queue for the next sequence to admit, where a preempted sequence goes back, which running
sequence gives up its blocks, and whether the waiting head may preempt running ones; it never
branches on the policy's name.

Adding a policy is one subclass of `RequestQueue` and one line:
`REQUEST_QUEUES["lcfs"] = LcfsQueue`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence as SequenceList
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpaged.core.sequence import Sequence


class RequestQueue:
    """The waiting sequences, in the order they are admitted (first: next).

    The base class keeps them in a deque and leaves the order to `add` and `add_preempted`;
    subclasses decide both, and the two preemption choices. `reads_priority`: whether the
    order depends on a request's `priority` (requests with a priority other than 0 are refused
    by a policy that ignores it).
    """

    reads_priority = False

    def __init__(self):
        self._seqs: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence."""
        raise NotImplementedError

    def add_preempted(self, seq: Sequence) -> None:
        """Queues a sequence preempted from running (its blocks freed, to be recomputed)."""
        raise NotImplementedError

    def peek(self) -> Sequence:
        """The next sequence to admit. Raises IndexError when empty."""
        return self._seqs[0]

    def pop(self) -> Sequence:
        """Removes and returns the next sequence to admit. Raises IndexError when empty."""
        return self._seqs.popleft()

    def remove(self, seq: Sequence) -> None:
        """Removes `seq` (an abort or a finish while waiting). Raises ValueError if absent."""
        self._seqs.remove(seq)

    def block_victim(self, running: SequenceList[Sequence],
                     scheduled: SequenceList[Sequence]) -> Sequence:
        """The running sequence preempted when one needs a block and none is free.

        Args:
          running: the running sequences, in admission order (the one asking among them).
          scheduled: those already in the step being built (never chosen unless the policy
            says so).
        """
        raise NotImplementedError

    def admission_victim(self, running: SequenceList[Sequence]) -> Sequence | None:
        """A running sequence the waiting head may preempt when it finds no seat or no blocks,
        or None (the head waits). Called with a non-empty queue and `running`."""
        return None

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __contains__(self, seq) -> bool:
        return seq in self._seqs


class FcfsQueue(RequestQueue):
    """First come, first served: arrival order; a preempted sequence goes first again, and the
    most recently admitted running sequence is the one preempted for blocks."""

    def add(self, seq: Sequence) -> None:
        self._seqs.append(seq)

    def add_preempted(self, seq: Sequence) -> None:
        self._seqs.appendleft(seq)

    def block_victim(self, running, scheduled) -> Sequence:
        return running[-1]


def priority_key(seq: Sequence) -> tuple[int, int]:
    """(priority, arrival): lower goes first."""
    return seq.priority, seq.arrival


class PriorityQueue(RequestQueue):
    """vLLM's priority policy: by a request's `priority` (lower first), then arrival. A waiting
    head that finds no seat or no blocks preempts the running sequence of lowest priority
    (latest arrival among equals) while that one comes after it; a running sequence that needs
    a block preempts the lowest-priority one not yet in the step."""

    reads_priority = True

    def add(self, seq: Sequence) -> None:
        """Inserts `seq` after every sequence that goes first (a lower key)."""
        key = priority_key(seq)
        i = next((i for i, s in enumerate(self._seqs) if priority_key(s) > key),
                 len(self._seqs))
        self._seqs.insert(i, seq)

    add_preempted = add

    def block_victim(self, running, scheduled) -> Sequence:
        in_step = {id(s) for s in scheduled}
        return max((s for s in running if id(s) not in in_step), key=priority_key)

    def admission_victim(self, running) -> Sequence | None:
        victim = max(running, key=priority_key)
        return victim if priority_key(victim) > priority_key(self.peek()) else None


# Policy name (`SchedulerConfig.scheduling_policy`) -> its queue class.
REQUEST_QUEUES: dict[str, type[RequestQueue]] = {"fcfs": FcfsQueue, "priority": PriorityQueue}


def make_request_queue(policy: str) -> RequestQueue:
    """A new, empty queue of `policy`. Raises ValueError naming an unknown policy."""
    if policy not in REQUEST_QUEUES:
        raise ValueError(f"scheduling_policy must be one of {sorted(REQUEST_QUEUES)}, "
                         f"got {policy!r}")
    return REQUEST_QUEUES[policy]()
