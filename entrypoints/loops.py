"""The rank loop of each disaggregation mode: one plain table.

The entry points (the server, the offline Engine) know the mode and take its builder from here.
The builders are module-level functions, so a spawned scheduler process receives one by name and
imports its module itself.
"""

from __future__ import annotations

from pdserve.decode.loop_builder import build_decode_loop
from pdserve.engine.sched.loop_builder import LoopBuilder, build_null_loop
from pdserve.prefill.loop_builder import build_prefill_loop

# disaggregation mode (config.DISAGGREGATION_MODES) -> the builder of one (DP, TP) rank's loop
LOOP_BUILDERS: dict[str, LoopBuilder] = {
    "null": build_null_loop,
    "prefill": build_prefill_loop,
    "decode": build_decode_loop,
}


def rank_loop_builder(mode: str) -> LoopBuilder:
    """The builder of one (DP, TP) rank's loop in ``mode``; a KeyError naming the modes otherwise."""
    try:
        return LOOP_BUILDERS[mode]
    except KeyError:
        raise KeyError(f"no loop builder for disaggregation mode {mode!r} "
                       f"(known: {sorted(LOOP_BUILDERS)})") from None
