"""How long a queued request waits for its pages from the storage tier, by default: a rule from
the tier costs, not a fixed guess.

Waiting for a fetch pays when fetching a page costs less than computing it. Then the request
waits as long as computing the pages it waits for would take, and no longer (past that,
computing them would have been done); when fetching costs as much or more, it does not wait.
An idle server otherwise schedules a request at once, before any page arrives, and a store
shared by servers serves nobody at low load.

Both costs are this server's own, measured as it runs: a fetch per page (the storage worker's
timer) and compute per token (the prefill steps), as running means over recent steps. Until a
first measurement the figures of ``scripts/bench_tier_costs.py`` stand in (results/tier_costs.md:
the default model on CPU, a page of 16 tokens computed in 39 ms, fetched from the ``file`` store
and copied in 0.54 ms). Pure: no clock, no thread.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_FETCH_S_PER_PAGE = 0.54e-3
PRIOR_COMPUTE_S_PER_TOKEN = 39e-3 / 16
SMOOTHING = 0.2  # weight of a new measurement in the running mean


@dataclass
class TierCosts:
    fetch_s_per_page: float = PRIOR_FETCH_S_PER_PAGE
    compute_s_per_token: float = PRIOR_COMPUTE_S_PER_TOKEN

    def observe_fetch(self, seconds: float, pages: int) -> None:
        if pages > 0 and seconds >= 0:
            self.fetch_s_per_page += SMOOTHING * (seconds / pages - self.fetch_s_per_page)

    def observe_compute(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds > 0:
            self.compute_s_per_token += SMOOTHING * (seconds / tokens - self.compute_s_per_token)

    def wait_s(self, pages: int, page_size: int) -> float:
        """Seconds to wait for ``pages`` pages from storage: their compute time when a fetch is
        cheaper than computing a page, else 0."""
        compute_page = self.compute_s_per_token * page_size
        if self.fetch_s_per_page >= compute_page:
            return 0.0
        return pages * compute_page
