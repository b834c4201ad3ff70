"""Data-parallel attention (SGLang's ``--enable-dp-attention``): the dense layers over every
attention group, and the forward rounds that keep the groups' collectives in step.

Each attention group (``tp_size / dp_size`` processes, ``parallel.init_dp_attention``) runs
attention on its own batch with its own KV pool, its heads split over its ranks as TP splits
them (MLA's latent KV whole on each); the MLP's weights are split over all the world's ranks like
TP's. Before an MLP a group's rows (the same on each of its ranks) join the other groups'
(``dp_gather``: padded to the largest of the counts its round announced, each of the group's
ranks sending its share, so one rank sends each row), every rank multiplies
all rows by its slice, the partial sums are all-reduced over the world, and each group keeps its
own rows (``dp_scatter``), so a token's MLP is the same sum TP computes.

The groups schedule independently, so a group may run a forward while another has none, or run
more forwards in one iteration. Every forward opens a round (``join_forward``); a group done with
its iteration calls ``finish_iteration``, which answers rounds with an idle forward (zero rows
through every MLP's collectives) until every group is done. A round is one all-gather over the world
of each rank's (running a forward, its kind, rows, sampled rows), so the groups agree on the
collectives' order without agreeing on a schedule, and every MLP of the forward knows each
group's row count without asking (``round_counts``: the step's rows, or the sampled rows past the
last attention).
A group's ranks step in lockstep (its leader broadcasts the inputs), so they announce the same
tuple and run the same forwards, idle ones included; a round in which they differ fails.
The rounds are thus the one sequence of steps common to every rank: what runs collectives of its
own between forwards runs per round, once the round is open (EPLB's balancer steps there in a
target forward and in an idle target forward alike, ``ModelRunner._balance_experts``).

A round also says which model's forward it is (``TARGET``, or ``DRAFT``: NEXTN's MTP layer, whose
MLP is another layer's and so other collectives): every rank of a round must run the same model's
forward, its own or an idle one. When the running groups announce different kinds, the round is
the smallest kind's (the target's first); a group whose kind is not chosen counts no rows in it,
runs the chosen kind's idle forward beside the others and announces its forward again in the next
round (``join_forward``), as a finished group answers a round with the idle forward of the
round's kind (``finish_iteration``). Each group's forwards keep their order, and a draft forward
waits at most for the other groups' target forwards of their iteration; a round's kind depends
only on what was announced, so every rank agrees on it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from pdserve.engine.model_executor.parallel import HeadShard, dp_attention


def enabled() -> bool:
    return dp_attention() is not None


def mlp_shard(attn: HeadShard) -> HeadShard:
    """The slice of the dense layers this process holds: ``attn`` (its attention heads) without DP
    attention; under it, world rank ``r`` of ``tp_size`` (the heads stay its attention group's
    share)."""
    dp = dp_attention()
    if dp is None:
        return attn
    return HeadShard(dp.world_rank, dp.world_size, attn.num_heads, attn.num_kv_heads, attn.q_start, attn.kv_start)


def mlp_reduces() -> bool:
    """Whether a dense layer's row-parallel product all-reduces its partial sums itself: not under
    DP attention, where ``dp_scatter`` sums them over the world."""
    return not enabled()


TARGET = 0  # the target model's forward
DRAFT = 1  # the draft's (NEXTN's MTP layer)

_COUNTS: tuple[list[int], list[int]] = ([], [])  # this round's rows and sampled rows, per group

IdleForward = Callable[[int], None]  # the idle forward of a kind


def round_kind(table: list[list[int]]) -> int | None:
    """The kind of a round, from each group's announced (running, kind, rows, sampled): the smallest
    kind a running group announced; None when no group runs a forward (the iteration is over)."""
    kinds = [kind for running, kind, _, _ in table if running]
    return min(kinds) if kinds else None


def round_rows(table: list[list[int]], kind: int | None) -> tuple[list[int], list[int]]:
    """Each group's rows and sampled rows in a round of ``kind``: a group running another kind's
    forward (or none) has none in it."""
    chosen = [bool(running) and k == kind for running, k, _, _ in table]
    return ([r[2] if c else 0 for r, c in zip(table, chosen)], [r[3] if c else 0 for r, c in zip(table, chosen)])


def _round(active: bool, kind: int = TARGET, rows: int = 0, sampled: int = 0) -> int | None:
    global _COUNTS
    dp = dp_attention()
    parts = [torch.zeros(4, dtype=torch.int64) for _ in range(dp.world_size)]
    dist.all_gather(parts, torch.tensor([int(active), kind, rows, sampled], dtype=torch.int64))
    table = torch.stack(parts).view(dp.size, dp.attn_size, 4)  # [group, attention rank, 4]
    if not bool((table == table[:, :1]).all()):  # a group's ranks must run the same forward
        raise RuntimeError(f"DP attention: the ranks of an attention group disagree on a round: {table.tolist()}")
    leaders = table[:, 0].tolist()
    chosen = round_kind(leaders)
    _COUNTS = round_rows(leaders, chosen)
    return chosen


def join_forward(rows: int, sampled: int, kind: int = TARGET, idle: IdleForward | None = None) -> None:
    """Open a forward round of ``rows`` step rows, ``sampled`` of them sampled, of the model ``kind``:
    the groups not running a forward now run an idle one beside it. While another group's forward
    of another kind takes the round, this group answers it with ``idle(that kind)`` and asks again."""
    if not enabled():
        return
    while (chosen := _round(True, kind, rows, sampled)) != kind:
        if idle is None:
            raise RuntimeError(f"DP attention: a round of kind {chosen} with no idle forward to answer it")
        idle(chosen)


def round_counts(last: bool = False) -> list[int]:
    """Each group's rows at an MLP of this round's forward: the step's, or with ``last`` the
    sampled rows a model keeps past its last attention."""
    return _COUNTS[1 if last else 0]


def finish_iteration(idle_forward: IdleForward) -> int:
    """Answer the other groups' forward rounds with ``idle_forward(kind)`` until every group has
    finished its iteration; returns the idle forwards run."""
    if not enabled():
        return 0
    idle = 0
    while (kind := _round(False)) is not None:
        idle_forward(kind)
        idle += 1
    return idle


def dp_gather(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every group's rows of ``x`` [n, hidden] in group order, given each group's row ``counts``
    (one all-gather over the world). A group's ranks hold the same rows, so each sends only its
    share: the rows padded to the largest count (rounded up to a multiple of the group's ranks),
    attention rank ``a`` sending the ``a``-th slice; a group's slices, in rank order, are its rows."""
    dp = dp_attention()
    mine = counts[dp.rank]
    if x.shape[0] != mine:  # a wrong count would misplace every group's rows: fail instead
        raise RuntimeError(f"DP attention: this group has {x.shape[0]} rows, its round said {mine}")
    if max(counts) == 0:
        return x
    share = -(-max(counts) // dp.attn_size)  # rows each rank sends
    padded = x.new_zeros((share * dp.attn_size,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    start = dp.attn_rank * share
    parts = [torch.empty_like(padded[:share]) for _ in range(dp.world_size)]
    dist.all_gather(parts, padded[start: start + share].contiguous())
    groups = [torch.cat(parts[g * dp.attn_size: (g + 1) * dp.attn_size]) for g in range(dp.size)]
    return torch.cat([rows[:c] for rows, c in zip(groups, counts)])


def dp_scatter(y: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """This group's rows of the gathered ``y`` once its partial sums are all-reduced."""
    rank = dp_attention().rank
    if sum(counts):
        dist.all_reduce(y)
    start = sum(counts[:rank])
    return y[start: start + counts[rank]]


def dense_mlp(mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
              last: bool = False) -> torch.Tensor:
    """``residual + mlp(x)`` with ``mlp`` (this group's slice, unreduced) run over every group's rows
    (``last``: an MLP past the last attention, over the sampled rows: ``round_counts``)."""
    counts = round_counts(last)
    rows = dp_gather(x, counts)
    y = mlp(rows) if sum(counts) else rows
    out = dp_scatter(y, counts)
    return out if residual is None else residual + out
