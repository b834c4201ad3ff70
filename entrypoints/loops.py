"""The rank loop of a disaggregation mode, with the PD roles registered.

Importing ``prefill/loop_builder.py`` and ``decode/loop_builder.py`` registers their loops in
``sched/loop_builders.py``; the entry points (the server, the offline Engine) know the mode and
take its builder from here. The builders are module-level functions, so a spawned scheduler
process receives one by name and imports its module itself.
"""

from __future__ import annotations

import pdserve.decode.loop_builder  # noqa: F401  registers "decode"
import pdserve.prefill.loop_builder  # noqa: F401  registers "prefill"
from pdserve.engine.sched.loop_builders import LoopBuilder, loop_builder


def rank_loop_builder(mode: str) -> LoopBuilder:
    """The builder of one (DP, TP) rank's loop in ``mode``."""
    return loop_builder(mode)
