"""The colocated rank loop's builder, and the shape every mode's builder has.

A scheduler rank runs one loop (``add_request``, ``abort``, ``step``, ``has_work``, ``stats``),
built in the rank's process by a ``LoopBuilder``. This one builds the colocated ``SchedulerLoop``;
the prefill and decode builders live beside their loops (``prefill/``, ``decode/``), and the entry
points pick one by disaggregation mode from their table (``entrypoints/loops.py``), so this level
never imports the roles built on it.
"""

from __future__ import annotations

from typing import Callable

from pdserve.engine.server_config import ServerConfig

# (config, dp_rank, tp_rank) -> the rank's loop
LoopBuilder = Callable[[ServerConfig, int, int], object]


def build_null_loop(config: ServerConfig, dp_rank: int, tp_rank: int):
    """The colocated loop: prefill and decode in one scheduler."""
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.engine.sched.scheduler_loop import SchedulerLoop

    return SchedulerLoop(config.engine, dp_rank=dp_rank, runner=ModelRunner(config.engine, config.host_ranks))
