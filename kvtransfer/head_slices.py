"""Which KV heads go from which prefill TP rank to which decode TP rank (pure; no torch).

Each TP rank's page pool holds its KV heads only (``[local_kv_heads, pages, page_size,
head_dim]``). Rank ``r`` of ``tp`` holds KV heads ``kv_head_range(r, tp, kv_heads)``: a split of
``kv_heads / tp`` heads when ``tp`` divides them, else (``kv_heads`` divides ``tp``) the one head
shared by ``tp / kv_heads`` consecutive ranks (SGLang's replication).

A room's KV moves as slices: decode rank ``j`` needs every head it holds, each from exactly one
prefill rank. A head replicated on several prefill ranks is sent by the lowest of them (the others
hold the same bits: every replica computed it from the same inputs), so no byte crosses twice.
A head replicated on several decode ranks is written into each of them (each has its own pool).
When the sizes are equal each prefill rank writes its whole page runs into its twin; when they
differ, the side with more ranks holds fewer heads per rank and the page runs are cut by head range.

A latent pool (MLA, ``LayoutInfo.kind`` "latent") holds one vector per token per layer, the same on
every TP rank of both sides: its place counts one KV head (``place_for``), which every rank holds, so
every decode rank takes the whole latent page runs from exactly one prefill rank (the lowest, as for
any replicated head) and no page crosses the wire twice into one decode rank; there is no head slicing.

The aux data (first token, logprobs) goes to every decode rank from its first source, so every
decode TP rank reads the first token from its own aux slot (all prefill ranks sample the same
token: the logits are the full vocabulary on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TPPlace:
    """Where a KV manager's pool sits: TP rank ``rank`` of ``size``, of a model with ``kv_heads`` KV heads."""

    rank: int = 0
    size: int = 1
    kv_heads: int = 0  # the model's KV heads; 0: unknown, taken as the pool's own (TP 1)

    def total_heads(self, local_heads: int) -> int:
        return self.kv_heads or local_heads


def place_for(tp: TPPlace, kind: str) -> TPPlace:
    """A rank's place as the transfer sees it: a latent pool's one vector per token is one KV head that
    every TP rank holds, whatever the model's attention heads."""
    from pdserve.kvtransfer.messages import LATENT

    return replace(tp, kv_heads=1) if kind == LATENT else tp


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[head, head + num_heads)`` (global numbering) of prefill rank ``src_rank`` go to decode rank
    ``dst_rank``; they sit at local head ``src_head`` of the source pool and ``dst_head`` of the destination."""

    src_rank: int
    dst_rank: int
    head: int
    num_heads: int
    src_head: int
    dst_head: int
    aux: bool  # the source writes the room's aux data to this destination


def kv_head_range(rank: int, tp: int, kv_heads: int) -> range:
    """The global KV heads TP rank ``rank`` of ``tp`` holds."""
    if not 0 <= rank < tp:
        raise ValueError(f"tp rank {rank} outside [0, {tp})")
    if kv_heads % tp == 0:
        n = kv_heads // tp
        return range(rank * n, (rank + 1) * n)
    if tp % kv_heads == 0:
        head = rank // (tp // kv_heads)
        return range(head, head + 1)
    raise ValueError(f"tp size {tp} cannot split {kv_heads} KV heads (neither divides the other)")


def _sender_of(head: int, tp: int, kv_heads: int) -> int:
    """The lowest prefill rank holding ``head``: the one replica that sends it."""
    if kv_heads % tp == 0:
        return head // (kv_heads // tp)
    return head * (tp // kv_heads)


def head_slices(prefill_tp: int, decode_tp: int, kv_heads: int) -> list[HeadSlice]:
    """Every slice of a room, ordered by (decode rank, head)."""
    out = []
    for j in range(decode_tp):
        dst = kv_head_range(j, decode_tp, kv_heads)
        first = True
        h = dst.start
        while h < dst.stop:
            i = _sender_of(h, prefill_tp, kv_heads)
            src = kv_head_range(i, prefill_tp, kv_heads)
            end = min(src.stop, dst.stop)
            out.append(HeadSlice(i, j, h, end - h, h - src.start, h - dst.start, first))
            first = False
            h = end
    return out


def slices_from(prefill_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int) -> list[HeadSlice]:
    """What prefill rank ``prefill_rank`` writes for each room (empty for a replica that sends nothing)."""
    return [s for s in head_slices(prefill_tp, decode_tp, kv_heads) if s.src_rank == prefill_rank]


def slices_into(decode_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int) -> list[HeadSlice]:
    """What decode rank ``decode_rank`` receives for each room: one or more slices, its sources."""
    return [s for s in head_slices(prefill_tp, decode_tp, kv_heads) if s.dst_rank == decode_rank]


def layout_mismatch(prefill, prefill_heads: int, decode, decode_heads: int) -> str | None:
    """Why a prefill rank's pool and a decode rank's cannot pair (``None``: they can): the model's
    identity (both names), the weights' quantization, then ``LayoutInfo.mismatch`` comparing the model's KV heads rather than each rank's
    share (which differs when the two sides' TP sizes do)."""
    import msgspec

    reasons = []
    if prefill.kind != decode.kind:
        reasons.append(f"KV layout kind mismatch: prefill {prefill.describe()}, decode {decode.describe()}")
    if prefill.model != decode.model:
        reasons.append(f"model mismatch: prefill {prefill.model or 'unknown'}, decode {decode.model or 'unknown'}")
    if prefill.quantization != decode.quantization:
        reasons.append(f"weights quantization: prefill {prefill.quantization}, decode {decode.quantization}")
    if prefill.num_layers != decode.num_layers:
        # a NEXTN rank's pool holds the MTP layer's KV as one layer past the model's
        reasons.append(f"layer count mismatch: prefill {prefill.num_layers} layers, decode {decode.num_layers} "
                       f"(a --speculative-algorithm NEXTN server's pool has its MTP layer as one more: start "
                       f"both servers with it, or neither)")
    diff = msgspec.structs.replace(prefill, num_kv_heads=prefill_heads, quantization=decode.quantization,
                                   model=decode.model).mismatch(
        msgspec.structs.replace(decode, num_kv_heads=decode_heads)
    )
    if diff:
        reasons.append(f"KV layout mismatch (prefill vs decode): {diff}")
    return "; ".join(reasons) or None
