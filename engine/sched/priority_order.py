"""The waiting queue's order by the requests' ``priority`` (SGLang's ``--enable-priority-scheduling``).

Applied after ``schedule_policy.order_waiting``, as a stable sort: requests of one priority keep the
order the schedule policy gave them (arrival, or longest prefix match), and a retracted request,
put back at the head, stays ahead of the others of its priority. Larger values go first, or
smaller ones with ``schedule_low_priority_values_first``. Pure logic over the queue.
"""

from __future__ import annotations

from collections import deque


def priority_rank(priority: int, low_values_first: bool) -> int:
    """A sort key of ``priority``: the smaller goes first (larger values first, or smaller ones with
    ``low_values_first``). The preallocation queue and preemption order by it too."""
    return priority if low_values_first else -priority


def order_by_priority(waiting: deque, low_values_first: bool) -> None:
    """Reorder ``waiting`` (a deque of ``Req``) in place by priority, keeping the order within one."""
    if len(waiting) < 2:
        return
    ordered = sorted(waiting, key=lambda r: priority_rank(r.priority, low_values_first))
    waiting.clear()
    waiting.extend(ordered)
