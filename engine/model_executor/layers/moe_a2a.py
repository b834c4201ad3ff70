"""How a ``FusedMoE`` layer's tokens reach the experts that the ranks of its group hold, and come
back (``ep_names.py`` names the backends).

``experts(x, topk_weights, local_ids, step)`` is the layer's method over this rank's experts: the
weighted sum of the experts each row names by local index (an id < 0 adds nothing: the kernel
skips experts held elsewhere). An exchange returns every row's full sum over the group.

- ``ReplicatedExchange`` (``none``, and EP 1): every rank has every token; ids of remote experts
  become -1, and one all-reduce sums the ranks' partial outputs (TP's MLP pattern).
- ``AllToAllExchange`` (``gloo``): with TP attention every rank holds the same tokens, so rank r
  takes the r-th share of them, sends each (token, slot) to the rank holding that slot's expert
  (all-to-all), runs what it received, sends the weighted outputs back (all-to-all) and sums
  them per token; an all-gather of the shares gives every rank the whole step again. A rank
  with no tokens still joins each collective with empty buffers, so no rank waits on another.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.model_executor.layers.kernel_plan import Step
from pdserve.engine.model_executor.parallel import (all_gather_rows, all_reduce, all_to_all_rows, exchange_counts,
                                                    tp_size)

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Step], torch.Tensor]


@dataclass
class ExchangeStats:
    """Bytes this rank sent through the all-to-all and seconds spent in it, since start."""

    bytes_sent: int = 0
    seconds: float = 0.0
    calls: int = 0


class ReplicatedExchange:
    """Every rank runs its experts on every token; one all-reduce (when the group has > 1 rank),
    unless ``reduce`` is False: the caller sums the ranks' parts (DP attention's ``dense_mlp``)."""

    def __init__(self, local_of: torch.Tensor, reduce: bool = True):
        self.local_of = local_of  # [E] int64: local index, or -1 where held elsewhere
        self.reduce = reduce
        self.stats = ExchangeStats()

    def run(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, step: Step,
            experts: Experts) -> torch.Tensor:
        y = experts(x, topk_weights, self.local_of[topk_ids], step)  # [T, K]: this rank's experts' part
        return all_reduce(y) if self.reduce and tp_size() > 1 else y


def row_share(total: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s [start, end) of ``total`` rows split as evenly as can be (lower ranks first)."""
    base, extra = divmod(total, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class AllToAllExchange:
    """Tokens to their experts' ranks and back over ``torch.distributed``'s all-to-all (gloo on CPU)."""

    def __init__(self, owner: torch.Tensor, local_of: torch.Tensor, rank: int, size: int):
        self.owner = owner  # [E] int64: the EP rank holding each expert
        self.local_of = local_of  # [E] int64: its index there
        self.rank, self.size = rank, size
        self.stats = ExchangeStats()

    def run(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, step: Step,
            experts: Experts) -> torch.Tensor:
        T, K = topk_ids.shape
        start, end = row_share(T, self.size, self.rank)
        mine = self.exchange(x[start:end], topk_weights[start:end], topk_ids[start:end], step, experts)
        counts = [b - a for a, b in (row_share(T, self.size, r) for r in range(self.size))]
        return all_gather_rows(mine, counts)  # [T, H], every rank

    def exchange(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, step: Step,
                 experts: Experts) -> torch.Tensor:
        """This rank's own rows x [t, H] through the group's experts -> [t, H] in x's dtype."""
        t0 = time.perf_counter()
        t, K = topk_ids.shape
        flat = topk_ids.reshape(-1)  # [t K]; slot s is token s // K's
        dest = self.owner[flat]
        order = torch.argsort(dest, stable=True)  # slots grouped by destination rank
        send_counts = torch.bincount(dest, minlength=self.size)
        recv_counts = exchange_counts(send_counts).tolist()
        send_counts = send_counts.tolist()
        tok = order // K
        meta = torch.stack([self.local_of[flat[order]].to(torch.float32),
                            topk_weights.reshape(-1)[order].to(torch.float32)], dim=1)  # [n, 2]
        recv_x = all_to_all_rows(x[tok], send_counts, recv_counts)  # [m, H]
        recv_meta = all_to_all_rows(meta, send_counts, recv_counts)  # [m, 2]
        ids = recv_meta[:, :1].to(torch.int64)  # [m, 1] local expert
        t1 = time.perf_counter()
        y = experts(recv_x, recv_meta[:, 1:], ids, Step(recv_x.shape[0], step.decode))  # [m, H], weighted
        t0 += time.perf_counter() - t1  # the experts' own time is not the exchange's
        back = all_to_all_rows(y, recv_counts, send_counts)  # [n, H], in ``order``
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, back.float())
        self.stats.bytes_sent += (x[tok].numel() + y.numel()) * x.element_size() + meta.numel() * 4
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        return out.to(x.dtype)
