"""Multi-node and migration tests reuse the PD tests' process helpers (``tests/support/pd_stand.py``)."""

from __future__ import annotations
