"""Conditional disaggregation: does a request skip the prefill pool? Pure logic over numbers.

Two reasons send a single (non-batch) request to a decode worker alone, which
prefills it itself in its running batch (and a third any request: the worker is a colocated
server, ``colocated``, which serves everything alone):

- ``short``: the part of the prompt that the chosen decode worker must compute
  (``uncached_tokens``: the prompt less the leading blocks that worker's own KV
  events say it holds; the whole prompt when it publishes none) is at most
  ``--local-prefill-max-tokens``. The decode worker's cache is the one that
  counts because it is the one that does the work: a prompt mostly cached on a
  *prefill* worker but not on the decode worker costs the decode worker its
  whole length, so it goes remote, where that cache is used. A prompt that is
  short on the decode side is sent there even when a prefill worker also holds
  it: the local work is at most N tokens either way, and the local path saves
  the disaggregation toll (a second hop, a bootstrap handshake and the KV
  transfer) and the prefill queue.
- ``queue``: every prefill endpoint has more than ``--prefill-queue-threshold``
  requests in flight (the router's own count of prefill legs not yet answered,
  that is, queued or running there) while the decode endpoint has fewer than
  that many local prefills in flight, so its running batch has room for one
  more. Such a request waits less in the decode worker's batch than behind a
  full prefill queue. A prompt longer than the decode server's
  ``--max-local-prefill-tokens`` is refused there (400) and retried through a
  prefill worker, as is any refused local prefill.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class LocalReason(enum.Enum):
    SHORT = "short"  # its uncached part is within --local-prefill-max-tokens
    QUEUE = "queue"  # every prefill queue is above --prefill-queue-threshold
    COLOCATED = "colocated"  # the decode worker is a colocated server: it serves every request alone


def local_prefill_reason(uncached_tokens: int | None, max_tokens: int, prefill_loads: Sequence[int],
                         queue_threshold: int, decode_local_load: int) -> LocalReason | None:
    """Why a request goes local, or None for the prefill/decode path.

    ``uncached_tokens``: the prompt tokens the decode endpoint would compute (None: unknown,
    the prompt could not be tokenized). ``max_tokens``: ``--local-prefill-max-tokens`` (0: off).
    ``prefill_loads``: requests in flight on each healthy prefill endpoint.
    ``queue_threshold``: ``--prefill-queue-threshold`` (0: off). ``decode_local_load``: local
    prefills in flight on the decode endpoint.
    """
    if max_tokens and uncached_tokens is not None and uncached_tokens <= max_tokens:
        return LocalReason.SHORT
    if (queue_threshold and prefill_loads and min(prefill_loads) > queue_threshold
            and decode_local_load < queue_threshold):
        return LocalReason.QUEUE
    return None
