"""The decode rank's loop: a ``DecodeLoop`` over its model and a started ``DecodeKVManager``
(the entry points' table of loop builders, ``entrypoints/loops.py``, names this builder)."""

from __future__ import annotations

from pdserve.engine.sched.rank_affinity import unpinned
from pdserve.engine.server_config import ServerConfig


def build_decode_loop(config: ServerConfig, dp_rank: int, tp_rank: int):
    from pdserve.decode.decode_loop import DecodeLoop
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.engine.speculative.nextn_handoff import aux_hidden_bytes, mtp_kv_layers
    from pdserve.kvtransfer.decode_kv_manager import DecodeKVManager
    from pdserve.kvtransfer.head_slices import TPPlace

    # NEXTN: the pool holds the MTP layer's KV of the prompt as one layer more, sent as any layer's
    runner = ModelRunner(config.engine, config.host_ranks,
                         extra_kv_layers=mtp_kv_layers(config.engine.speculative_algorithm))
    # this TP rank's place for its KV manager: its pool holds its share of the model's KV heads
    tp = TPPlace(tp_rank, config.attn_tp_size, runner.arch.num_kv_heads)  # the heads of this DP rank's group
    hidden = aux_hidden_bytes(config.engine.speculative_algorithm, runner)  # NEXTN: drafts from it
    with unpinned():
        kv = DecodeKVManager(config.kv_transfer_config(), runner.page_pool, tp=tp, aux_hidden_bytes=hidden).start()
    return DecodeLoop(config.engine, kv, dp_rank=dp_rank, runner=runner,
                      max_local_prefill_tokens=config.max_local_prefill_tokens)

