"""The prefill rank's loop: a ``PrefillLoop`` over its model and a started ``PrefillKVManager``
(the entry points' table of loop builders, ``entrypoints/loops.py``, names this builder)."""

from __future__ import annotations

from pdserve.engine.sched.rank_affinity import unpinned
from pdserve.engine.server_config import ServerConfig


def build_prefill_loop(config: ServerConfig, dp_rank: int, tp_rank: int):
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.engine.speculative.nextn_handoff import aux_hidden_bytes, mtp_kv_layers
    from pdserve.kvtransfer.head_slices import TPPlace
    from pdserve.kvtransfer.prefill_kv_manager import PrefillKVManager
    from pdserve.prefill.prefill_loop import PrefillLoop

    # NEXTN: the pool holds the MTP layer's KV of the prompt as one layer more, sent as any layer's
    runner = ModelRunner(config.engine, config.host_ranks,
                         extra_kv_layers=mtp_kv_layers(config.engine.speculative_algorithm))
    # this TP rank's place for its KV manager: its pool holds its share of the model's KV heads
    tp = TPPlace(tp_rank, config.attn_tp_size, runner.arch.num_kv_heads)  # the heads of this DP rank's group
    hidden = aux_hidden_bytes(config.engine.speculative_algorithm, runner)  # NEXTN: sent with the first token
    with unpinned():
        kv = PrefillKVManager(
            config.kv_transfer_config(), runner.page_pool, dp_rank=dp_rank, tp=tp,
            bootstrap_host=config.bootstrap_host, aux_hidden_bytes=hidden,
        ).start()
    return PrefillLoop(config.engine, kv, dp_rank=dp_rank, runner=runner)

