"""The order in which waiting requests are admitted (SGLang's ``--schedule-policy``).

The policies' names are ``config.SCHEDULE_POLICIES``.

- ``fcfs``: arrival order.
- ``lpm`` (longest prefix match): the requests with the most tokens already in the
  prefix cache first, arrival order among equals. They need the fewest new pages
  and the least compute, and requests sharing a prefix run together while it is
  cached. Past ``LPM_MAX_WAITING`` waiting requests the matching costs more than
  it saves and the order stays fcfs, as in SGLang.

Pure logic over the waiting queue and the prefix cache's ``match_prefix``.
"""

from __future__ import annotations

from collections import deque

LPM_MAX_WAITING = 128  # SGLang's threshold for falling back to fcfs


def order_waiting(policy: str, waiting: deque, cache) -> None:
    """Reorder ``waiting`` (a deque of ``Req``) in place for ``policy``."""
    if policy == "fcfs" or not 1 < len(waiting) <= LPM_MAX_WAITING:
        return
    # a stable sort: equal matches keep their arrival order
    matched = {id(r): len(cache.match_prefix(r.cache_key(r.seq_len))[0]) for r in waiting}
    ordered = sorted(waiting, key=lambda r: -matched[id(r)])
    waiting.clear()
    waiting.extend(ordered)
