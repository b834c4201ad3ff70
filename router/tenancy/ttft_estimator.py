"""The fleet's prefill rate, learned from finished requests, and a TTFT estimate from it.

A request admitted at ``t`` with ``W`` prompt tokens not yet at their first byte (its own and those
of every request admitted before it and still prefilling) has its first byte at ``t + W / r``
where ``r`` is the fleet's prefill rate in tokens per second: each first byte gives a sample
``r = W / ttft`` and the estimate is their moving average. A newcomer's TTFT is then the prompt
tokens ahead of it (queued before it, plus those prefilling now) and its own, over ``r``.
The clock is passed in; nothing here sleeps or reads the time.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the newest sample in the moving average


@dataclass
class PrefillTicket:
    tokens: int
    work: int  # prompt tokens prefilling when admitted, its own included
    admitted_at: float
    done: bool = False


class PrefillRateEstimator:
    def __init__(self):
        self.rate: float | None = None  # tokens/s; None until the first sample
        self.prefilling = 0  # prompt tokens admitted and not yet at their first byte

    def admitted(self, tokens: int, now: float) -> PrefillTicket:
        self.prefilling += tokens
        return PrefillTicket(tokens, self.prefilling, now)

    def first_byte(self, ticket: PrefillTicket, now: float) -> None:
        """The request's first byte: a sample of the rate, and its tokens stop prefilling."""
        if ticket.done:
            return
        self._finish(ticket)
        elapsed = now - ticket.admitted_at
        if elapsed <= 0 or ticket.work <= 0:
            return
        sample = ticket.work / elapsed
        self.rate = sample if self.rate is None else (1 - SMOOTHING) * self.rate + SMOOTHING * sample

    def abandoned(self, ticket: PrefillTicket) -> None:
        """The request ended without a first byte (an error, the client left): no sample."""
        if not ticket.done:
            self._finish(ticket)

    def _finish(self, ticket: PrefillTicket) -> None:
        ticket.done = True
        self.prefilling -= ticket.tokens

    def estimate_s(self, queued_ahead: float, own: int) -> float | None:
        """Seconds to the first byte of a request with ``own`` prompt tokens and ``queued_ahead``
        tokens queued before it; None while no rate is known."""
        if self.rate is None:
            return None
        return (queued_ahead + self.prefilling + own) / self.rate
