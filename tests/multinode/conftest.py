"""Multi-node and migration tests reuse the PD tests' process helpers (``tests/pd/pd_stand.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pd"))
