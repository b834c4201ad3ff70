"""Which DP rank of a worker a request goes to (``--dp-rank-policy``).

A worker that reports ``dp_size`` > 1 (DP attention: each rank its own scheduler, KV pool and
batch) is one endpoint per rank. The role's policy still chooses the worker; this rule first
narrows each worker's ranks to the one it offers, so the policy sees one candidate per worker and
records (cache-aware trees) the endpoint that really runs the request:

- ``least_tokens`` (default): the rank with the fewest tokens in flight that the router sent it
  (``Endpoint.tokens``: prompts, plus on a decode rank the most each may generate), then the
  fewest requests; ties go round, so an idle worker's ranks take turns. Request counts alone let
  a few long requests pile on one rank while the others idle.
- ``round_robin``: each worker's ranks in turn, whatever their load (the baseline).

A client that names a rank keeps it (``routed_dp_rank`` or SGLang's older ``data_parallel_rank``
for the decode leg, ``disagg_prefill_dp_rank`` for the prefill leg): only that rank of each
worker is offered. A policy that weighs every rank itself (``Policy.scores_dp_ranks``: kv_aware,
by the blocks each rank holds) is offered them all. Pure logic over endpoints.
"""

from __future__ import annotations

from itertools import groupby
from typing import Sequence

from pdserve.router.config import DP_RANK_POLICIES
from pdserve.router.errors import bad_request
from pdserve.router.workers.worker_registry import Endpoint

# the fields a client names its DP ranks with, per leg (the first one given wins)
RANK_FIELDS = {"decode": ("routed_dp_rank", "data_parallel_rank"), "prefill": ("disagg_prefill_dp_rank",)}


class DpRankChoice:
    """One per router: narrows each worker's ranks to the one offered to the policy."""

    def __init__(self, policy: str = "least_tokens"):
        if policy not in DP_RANK_POLICIES:
            raise ValueError(f"dp_rank_policy must be one of {DP_RANK_POLICIES}, got {policy!r}")
        self.policy = policy
        self._turn: dict[str, int] = {}  # worker URL -> the rank offered first on a tie (or next, round robin)

    def offer(self, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """``endpoints`` (each worker's ranks next to each other, as the registry lists them)
        with one rank per worker."""
        out = []
        for _, group in groupby(endpoints, key=lambda e: e.worker):
            ranks = list(group)
            out.append(ranks[0] if len(ranks) == 1 else self._pick(ranks))
        return out

    def chosen(self, endpoint: Endpoint | None) -> None:
        """The policy sent a request to ``endpoint``: its worker's next turn starts after it."""
        if endpoint is not None and endpoint.dp_rank is not None:
            self._turn[endpoint.worker.url] = endpoint.dp_rank + 1

    def _pick(self, ranks: list[Endpoint]) -> Endpoint:
        start = self._turn.get(ranks[0].worker.url, 0)
        order = sorted(ranks, key=lambda e: ((e.dp_rank or 0) - start) % len(ranks))
        if self.policy == "round_robin":
            return order[0]
        return min(order, key=lambda e: (e.tokens, e.load))  # min keeps the first of equals


def named_rank(endpoints: Sequence[Endpoint], body: dict, leg: str) -> list[Endpoint] | None:
    """The ``endpoints`` of the DP rank the client named for ``leg`` ("prefill" or "decode");
    None when it named none or the role's workers have no DP ranks (the field is then replaced,
    as before DP ranks). A value that is not a rank, or a rank no healthy worker of the role has,
    is a 400 naming the field."""
    if not any(e.dp_rank is not None for e in endpoints):
        return None
    for name in RANK_FIELDS[leg]:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad_request(f"{name} must be a DP rank (an integer >= 0), got {value!r}", name)
        named = [e for e in endpoints if e.dp_rank == value]
        if not named:
            top = max(e.dp_rank for e in endpoints if e.dp_rank is not None)
            raise bad_request(f"{name} {value} is not a DP rank of any healthy {leg} worker (ranks 0..{top})",
                              name)
        return named
    return None
