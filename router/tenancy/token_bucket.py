"""A token bucket (requests or tokens per second) with the clock passed in, so it is tested
without sleeping."""

from __future__ import annotations


class TokenBucket:
    """``rate`` units per second refill a bucket holding at most ``capacity``; it starts full."""

    def __init__(self, rate: float, capacity: float, now: float):
        if rate <= 0 or capacity <= 0:
            raise ValueError(f"a token bucket needs rate > 0 and capacity > 0, got {rate}, {capacity}")
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
            self._at = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds ``amount`` (0.0: it does now); takes nothing."""
        self._refill(now)
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give_back(self, amount: float) -> None:
        """Return what a request took when a later check refused it (it was never served)."""
        self.level = min(self.capacity, self.level + amount)
