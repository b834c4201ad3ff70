"""The names of the expert-parallel all-to-all backends (``--moe-a2a-backend``), apart from
their modules so that the config and the flags name them without importing torch.distributed.

- ``none``: every rank sees every token (TP's replicated hidden state); each rank runs the
  experts it holds and one all-reduce over the group sums their outputs.
- ``gloo``: each rank takes its share of the tokens and sends each (token, expert) pair to the
  rank holding the expert with an all-to-all, and the outputs back with a second one (CPU).
- ``deepep``: DeepEP's dispatch/combine (CUDA; normal mode for prefill, low-latency for decode).
"""

from __future__ import annotations

MOE_A2A_BACKENDS = ("none", "gloo", "deepep")


def check_ep(ep_size: int, moe_a2a_backend: str) -> None:
    """Raise ValueError naming the field when the EP flags are malformed on their own."""
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if moe_a2a_backend not in MOE_A2A_BACKENDS:
        raise ValueError(f"moe_a2a_backend must be one of {MOE_A2A_BACKENDS}, got {moe_a2a_backend!r}")
