"""Which running requests to preempt for a waiting one of higher priority (SGLang's rule).

With ``enable_priority_scheduling``, a waiting request that cannot be admitted for lack of KV pages
or of a running slot may take them from running requests of strictly lower priority: the lowest
priority first, then the latest arrival among equals (it has the least work to redo), until the
pages it is short of are covered. Nothing is preempted unless the victims cover the whole shortfall:
a preemption that still leaves the request waiting would only waste the victims' work.

Pure logic over requests: the scheduler retracts the victims (their KV goes to the prefix cache,
and from there to the host tier when one is configured, else it is freed) and they re-queue keeping
their output, to resume by a prefill of prompt plus output so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pdserve.engine.sched.priority_order import priority_rank


class Ranked(Protocol):
    priority: int
    arrival: int


def outranks(a: int, b: int, low_values_first: bool) -> bool:
    """Whether priority ``a`` goes strictly before priority ``b``."""
    return priority_rank(a, low_values_first) < priority_rank(b, low_values_first)


def preemption_order(running: Sequence[Ranked], low_values_first: bool) -> list:
    """``running`` in the order victims are taken: lowest priority first, latest arrival first among equals."""
    return sorted(running, key=lambda r: (-priority_rank(r.priority, low_values_first), -r.arrival))


def pick_victims(candidate: Ranked, running: Sequence[Ranked], short_pages: int, need_slot: bool,
                 gain: Callable[[Ranked], int], low_values_first: bool) -> list:
    """The running requests to preempt so that ``candidate`` fits: enough of them that the pages each
    gives back (``gain``) cover ``short_pages``, and at least one when ``need_slot`` (every running
    slot is taken). Only requests ``candidate`` outranks are taken; [] when they cannot cover it."""
    if short_pages <= 0 and not need_slot:
        return []
    victims: list = []
    for r in preemption_order(running, low_values_first):
        if not outranks(candidate.priority, r.priority, low_values_first):
            break
        victims.append(r)
        short_pages -= gain(r)
        if short_pages <= 0:
            return victims
    return []
