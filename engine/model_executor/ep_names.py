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


def check_placement_flags(ep_size: int, moe_a2a_backend: str, num_redundant: int, init_expert_location: str,
                          enable_eplb: bool, rebalance_every: int) -> None:
    """Raise ValueError naming the field when the expert-placement flags are malformed or need
    what the EP flags do not give (a placement other than the contiguous one needs EP > 1 and an
    exchange that routes by the placement: ``none`` or ``gloo``)."""
    if num_redundant < 0:
        raise ValueError(f"ep_num_redundant_experts must be >= 0, got {num_redundant}")
    if rebalance_every < 1:
        raise ValueError(f"eplb_rebalance_num_iterations must be >= 1, got {rebalance_every}")
    if not init_expert_location:
        raise ValueError("init_expert_location must be 'trivial' or a JSON file, got ''")
    used = [name for name, on in (("ep_num_redundant_experts", num_redundant > 0), ("enable_eplb", enable_eplb),
                                  ("init_expert_location", init_expert_location != "trivial")) if on]
    if used and ep_size < 2:
        raise ValueError(f"{used[0]} needs expert parallelism (ep_size >= 2), got ep_size {ep_size}")
    if used and moe_a2a_backend == "deepep":
        raise ValueError(f"{used[0]} is not supported with moe_a2a_backend 'deepep' (contiguous placement only)")
