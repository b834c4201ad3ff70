"""The decode's quarantine of failed rooms' pages: held until the prefill closes the room or the timeout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.decode.quarantine import Quarantine
from pdserve.kvtransfer import KVTransferConfig


def test_pages_held_until_closed_or_timeout():
    held: set[int] = set()
    q = Quarantine(timeout=10.0, pages=held)
    a, b = SimpleNamespace(peer_closed=False), SimpleNamespace(peer_closed=False)
    q.hold(a, [3, 4], 7, now=0.0)
    q.hold(b, [5], None, now=1.0)
    assert held == {3, 4, 5} and len(q) == 2 and q.aux_slots == 1
    assert q.pop_released(5.0) == []
    a.peer_closed = True
    assert q.pop_released(5.0) == [([3, 4], 7, False)]
    assert held == {5} and q.aux_slots == 0
    assert q.pop_released(10.9) == []
    assert q.pop_released(11.0) == [([5], None, True)]  # the prefill never answered
    assert held == set() and len(q) == 0


def test_quarantine_timeout_is_validated():
    assert KVTransferConfig(quarantine_timeout=0.5).quarantine_timeout == 0.5
    with pytest.raises(ValueError, match="quarantine_timeout"):
        KVTransferConfig(quarantine_timeout=0)
