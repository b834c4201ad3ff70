"""The rank loop builders, by disaggregation mode.

A scheduler rank runs one loop (``add_request``, ``abort``, ``step``, ``has_work``, ``stats``).
The colocated ``SchedulerLoop`` is registered here; the prefill and decode loops live above the
scheduler level (``prefill/``, ``decode/``) and register themselves when their ``loop_builder``
module is imported, which the entry points do (``entrypoints/loops.py``). So this level never
imports the roles built on it.
"""

from __future__ import annotations

from typing import Callable

from pdserve.engine.server_config import ServerConfig

# (config, dp_rank, tp_rank) -> the rank's loop
LoopBuilder = Callable[[ServerConfig, int, int], object]

LOOP_BUILDERS: dict[str, LoopBuilder] = {}


def register_loop_builder(mode: str, build: LoopBuilder) -> None:
    """Make ``build`` the loop of ``mode`` (a ``config.DISAGGREGATION_MODES`` name)."""
    LOOP_BUILDERS[mode] = build


def loop_builder(mode: str) -> LoopBuilder:
    """The builder registered for ``mode``; a KeyError naming the registered modes otherwise."""
    try:
        return LOOP_BUILDERS[mode]
    except KeyError:
        raise KeyError(f"no loop builder registered for disaggregation mode {mode!r} "
                       f"(registered: {sorted(LOOP_BUILDERS)})") from None


def build_null_loop(config: ServerConfig, dp_rank: int, tp_rank: int):
    """The colocated loop: prefill and decode in one scheduler."""
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.engine.sched.scheduler_loop import SchedulerLoop

    return SchedulerLoop(config.engine, dp_rank=dp_rank, runner=ModelRunner(config.engine, config.host_ranks))


register_loop_builder("null", build_null_loop)
