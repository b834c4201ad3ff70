"""Tensor parallelism: the process group of one DP rank's TP processes, and the few collectives
the sharded model and the scheduler need.

Each DP rank is its own ``torch.distributed`` world of ``tp_size`` processes (so the default
group IS the TP group; there is no other group), except under DP attention (below). The one
state of our own is the expert-parallel layout (``init_ep``): how the group's ranks split the MoE
layers' experts, set once per process before the model is built, so that every ``FusedMoE`` of
any model reads the same layout.
Gloo on CPU; on CUDA one group with two backends, NCCL for CUDA tensors and gloo for the
scheduler's CPU-side broadcast of each step's inputs. Every collective waits at most the
group's timeout, so a rank whose peer died raises instead of hanging.

With TP 1 nothing is initialised and every helper returns its input: zero collectives.

Data-parallel attention (``init_dp_attention``, SGLang's ``--enable-dp-attention``): the world is
the server's ``tp_size`` processes, ``dp_size`` attention groups of ``tp_size / dp_size`` ranks
each (consecutive world ranks). The TP helpers below then work inside this process's attention
group (its own process group; with groups of one rank they see a TP group of one), and the dense
layers' collectives over the world live in ``dp_attention.py``. The expert-parallel all-to-all
(``all_to_all_rows``, ``exchange_counts``, ``all_gather_rows``) always spans the default group:
the TP group, or under DP attention the world.

Head split (as SGLang's): rank ``r`` of ``tp`` holds query heads ``[r * H/tp, (r + 1) * H/tp)``;
KV heads are split the same way when ``kv_heads % tp == 0``, and replicated when ``tp % kv_heads
== 0`` (each rank then holds the one KV head its query heads read: ``r // (tp / kv_heads)``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.engine.model_executor.ep_names import check_ep
from pdserve.engine.model_executor.model_config import check_tp_heads


@dataclass(frozen=True)
class HeadShard:
    """The heads TP rank ``rank`` of ``size`` holds: ``[q_start, q_start + num_heads)`` query heads and
    ``[kv_start, kv_start + num_kv_heads)`` KV heads."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_shard(tp_rank: int, tp_size: int, num_heads: int, num_kv_heads: int) -> HeadShard:
    check_tp_heads(tp_size, num_heads, num_kv_heads)
    local_heads = num_heads // tp_size
    if num_kv_heads % tp_size == 0:
        local_kv = num_kv_heads // tp_size
        kv_start = tp_rank * local_kv
    else:  # replicated: tp_size / num_kv_heads consecutive ranks share one KV head
        local_kv = 1
        kv_start = tp_rank // (tp_size // num_kv_heads)
    return HeadShard(tp_rank, tp_size, local_heads, local_kv, tp_rank * local_heads, kv_start)


def init_tp(tp_rank: int, tp_size: int, init_addr: str, timeout_s: float, device: torch.device) -> None:
    """Join this DP rank's TP group at ``init_addr`` (``host:port``; rank 0 listens there). No-op at TP 1."""
    if tp_size == 1:
        return
    _join_world(tp_rank, tp_size, init_addr, timeout_s, device)


def _join_world(rank: int, size: int, init_addr: str, timeout_s: float, device: torch.device) -> None:
    """The process group of ``size`` processes meeting at ``init_addr`` (gloo, and NCCL beside it on CUDA)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{init_addr}", rank=rank,
        world_size=size, timeout=datetime.timedelta(seconds=timeout_s),
    )


@dataclass(frozen=True)
class DpAttention:
    """This process's place under data-parallel attention: attention group ``rank`` of ``size``, and
    rank ``attn_rank`` of that group's ``attn_size`` (its attention tensor-parallel rank). Groups
    hold consecutive world ranks: this process is world rank ``rank * attn_size + attn_rank``."""

    rank: int
    size: int
    attn_rank: int = 0
    attn_size: int = 1

    @property
    def world_rank(self) -> int:
        return self.rank * self.attn_size + self.attn_rank

    @property
    def world_size(self) -> int:
        return self.size * self.attn_size


_DP_ATTENTION: DpAttention | None = None
_ATTN_GROUP = None  # under DP attention with groups of > 1 rank: this process's attention group


def init_dp_attention(dp_rank: int, dp_size: int, init_addr: str, timeout_s: float, device: torch.device,
                      attn_rank: int = 0, attn_size: int = 1) -> None:
    """Join the world of the server's ``dp_size`` attention groups of ``attn_size`` ranks each at
    ``init_addr`` (world rank 0 listens there), as rank ``attn_rank`` of group ``dp_rank``; from now
    on the TP helpers answer for this process's attention group. Every process creates every
    group's process group, in group order (``new_group`` is a collective of the whole world)."""
    global _DP_ATTENTION, _ATTN_GROUP
    dp = DpAttention(dp_rank, dp_size, attn_rank, attn_size)
    _join_world(dp.world_rank, dp.world_size, init_addr, timeout_s, device)
    if attn_size > 1:
        groups = [dist.new_group(list(range(g * attn_size, (g + 1) * attn_size)),
                                 timeout=datetime.timedelta(seconds=timeout_s)) for g in range(dp_size)]
        _ATTN_GROUP = groups[dp_rank]
    _DP_ATTENTION = dp


def dp_attention() -> DpAttention | None:
    """This process's attention group under data-parallel attention; None without it."""
    return _DP_ATTENTION


@dataclass(frozen=True)
class MoeParallel:
    """How TP rank ``rank`` of ``size`` runs the MoE layers: expert-parallel rank ``ep_rank`` of
    ``ep_size`` (it holds that share of the experts, whole or split again over ``moe_tp_size``
    ranks on the intermediate dimension, its slice ``moe_tp_rank``), tokens exchanged by
    ``a2a_backend`` (``ep_names.py``)."""

    ep_size: int = 1
    ep_rank: int = 0
    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    a2a_backend: str = "none"


_MOE = MoeParallel()


def moe_parallel_for(rank: int, size: int, ep_size: int, a2a_backend: str) -> MoeParallel:
    """SGLang's rule: ``ep_size`` divides the group's ``size``; consecutive ranks share an EP rank
    (``size / ep_size`` of them split its experts' intermediate rows). An all-to-all backend moves
    whole experts' tokens: it needs ``ep_size == size`` (at EP 1 it has nothing to move)."""
    check_ep(ep_size, a2a_backend)
    if size % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide tp_size {size}")
    if a2a_backend != "none" and ep_size not in (1, size):
        raise ValueError(f"moe_a2a_backend {a2a_backend!r} needs ep_size equal to tp_size, got ep_size {ep_size}, "
                         f"tp_size {size}")
    moe_tp = size // ep_size
    return MoeParallel(ep_size, rank // moe_tp, moe_tp, rank % moe_tp, a2a_backend if ep_size > 1 else "none")


def init_ep(ep_size: int, a2a_backend: str) -> MoeParallel:
    """Fix this process's expert-parallel layout over its TP group, or under DP attention over the
    whole world of every attention group's ranks (before the model is built)."""
    global _MOE
    dp = _DP_ATTENTION
    _MOE = moe_parallel_for(dp.world_rank if dp else tp_rank(), dp.world_size if dp else tp_size(), ep_size,
                            a2a_backend)
    return _MOE


def moe_parallel() -> MoeParallel:
    """The layout ``init_ep`` fixed (EP 1: every rank holds every expert's TP slice)."""
    return _MOE


def close_tp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    """This process's rank in its TP group (under DP attention: in its attention group)."""
    if _DP_ATTENTION is not None:
        return _DP_ATTENTION.attn_rank
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    """The ranks of this process's TP group (under DP attention: of its attention group)."""
    if _DP_ATTENTION is not None:
        return _DP_ATTENTION.attn_size
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks in place (every rank gets the same bits); returns it."""
    if tp_size() > 1:
        dist.all_reduce(x, group=_ATTN_GROUP)
    return x


def all_reduce_world(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` in place over every rank of the server's world: the ranks the MoE layers span (the
    TP group, or under DP attention every attention group, where ``all_reduce`` sums over one
    group); returns it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., tp * n], rank 0's columns first."""
    size = tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=_ATTN_GROUP)
    return torch.cat(parts, dim=-1)


def all_reduce_min(value: int) -> int:
    """The smallest ``value`` over the TP ranks (so that every rank sizes its page pool the same)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_ATTN_GROUP)
    return int(t.item())


def all_reduce_min_list(values: list[int]) -> list[int]:
    """Element-wise smallest of ``values`` over the TP ranks (every rank passes as many, in the same order)."""
    if tp_size() == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_ATTN_GROUP)
    return t.tolist()


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every TP rank's ``data``, in rank order (CPU tensors, over gloo: the scheduler's side channel)."""
    size = tp_size()
    if size == 1:
        return [data]
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=_ATTN_GROUP)
    width = max(1, max(int(n) for n in lengths))
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=_ATTN_GROUP)
    return [part[: int(n)].numpy().tobytes() for part, n in zip(parts, lengths)]


def broadcast_objects(objs: list | None) -> list:
    """TP rank 0's picklable ``objs`` on every rank (CPU, over gloo). Others pass None."""
    if tp_size() == 1:
        return objs or []
    box = [objs]
    dist.broadcast_object_list(box, group=_ATTN_GROUP, group_src=0, device=torch.device("cpu"))
    return box[0]


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Rows ``x[sum(send_counts[:r]) : ...]`` go to rank ``r``; returns the rows every rank sent
    here, in rank order ([sum(recv_counts), ...])."""
    out = torch.empty((sum(recv_counts),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts)
    return out


def exchange_counts(send_counts: torch.Tensor) -> torch.Tensor:
    """[size] int64 of rows this rank sends each rank -> [size] rows each rank sends this one."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous())
    return recv


def all_gather_rows(x: torch.Tensor, counts: list[int], tp_group: bool = False) -> torch.Tensor:
    """Rank r's ``counts[r]`` rows of ``x``, concatenated in rank order on every rank of the default
    group (with ``tp_group``: of this process's TP group, under DP attention its attention group)."""
    width = max(counts)
    padded = torch.zeros((width,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=_ATTN_GROUP if tp_group else None)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])
