"""The prefill rank's peer directory: the decode ranks that registered their KV pool here.

Life cycle of a decode peer: a decode TP rank sends ``RegisterPool`` once per pair (SGLang's
``decode_kv_args_table`` entry); ``check_pool`` validates its layout, backend, head share, buffer
count, page bytes and aux slots against this rank's pool, and ``add`` records it, accepted (with
its transfer-engine peer) or rejected (with the reason every room from it then fails with). A
later ``RegisterPool`` of the same decode id replaces it. Rooms name their decode peer by id
(``RoomRequest.decode_id``); ``check_request`` validates a room's destination against the pool.

Owns the ``DecodePeer`` records and the rules a decode pool and a destination must meet. Pure:
no socket, no engine call; the manager connects the engine and answers ``RegisterAck``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pdserve.kvtransfer.messages as m
from pdserve.kvtransfer.head_slices import kv_head_range, layout_mismatch


@dataclass
class DecodePeer:
    """A decode rank's registered pool, as validated here."""

    reg: m.RegisterPool
    engine_peer: str | None  # None when rejected
    reject_reason: str | None
    dst_bases: list[int]  # all layers' K then V, head 0's page-0 addresses

    @property
    def plane_bytes(self) -> int:
        """One head's pages in the decode pool: the stride between its heads (head-major, page_pool)."""
        return self.reg.page_bytes // self.reg.layout.num_kv_heads * self.reg.num_pages


class DecodePeers:
    def __init__(self, layout: m.LayoutInfo, kv_heads: int, backend: str, page_bytes: int, head_page_bytes: int,
                 aux_slot_bytes: int, aux_hidden_bytes: int = 0):
        """This rank's side of every check: its pool's ``layout`` (its own share of the heads),
        ``kv_heads`` of the whole model, its engine's ``backend`` name, its ``page_bytes`` (every one of
        its heads) and ``head_page_bytes`` (one head), and the ``aux_slot_bytes`` it writes, of which
        ``aux_hidden_bytes`` are the hidden state it sends a NEXTN decode (``aux_pool``)."""
        self.layout = layout
        self.kv_heads = kv_heads
        self.backend = backend
        self.page_bytes = page_bytes
        self.head_page_bytes = head_page_bytes
        self.aux_slot_bytes = aux_slot_bytes
        self.aux_hidden_bytes = aux_hidden_bytes
        self.peers: dict[str, DecodePeer] = {}  # decode id -> its pool

    def get(self, decode_id: str) -> DecodePeer | None:
        return self.peers.get(decode_id)

    def check_pool(self, reg: m.RegisterPool) -> str | None:
        """Why this rank cannot write into ``reg``'s pool; None when it can."""
        their_heads = reg.kv_heads or reg.layout.num_kv_heads
        diff = layout_mismatch(self.layout, self.kv_heads, reg.layout, their_heads)
        if diff:
            return diff
        if reg.backend != self.backend:
            return f"transfer backend mismatch: prefill {self.backend} vs decode {reg.backend}"
        try:
            share = len(kv_head_range(reg.tp_rank, reg.tp_size, their_heads))
        except ValueError as e:
            return f"decode TP rank {reg.tp_rank} of {reg.tp_size}: {e}"
        if share != reg.layout.num_kv_heads:
            return f"decode TP rank {reg.tp_rank} of {reg.tp_size} holds {reg.layout.num_kv_heads} KV heads, not {share}"
        v_buffers = 0 if self.layout.kind == m.LATENT else self.layout.num_layers
        if len(reg.k_addrs) != self.layout.num_layers or len(reg.v_addrs) != v_buffers:
            return f"decode registered {len(reg.k_addrs)}/{len(reg.v_addrs)} K/V buffers for {self.layout.num_layers} layers"
        if reg.page_bytes != self.head_page_bytes * share:
            return f"page bytes mismatch: prefill {self.page_bytes} for {self.layout.num_kv_heads} heads vs decode {reg.page_bytes} for {share}"
        base = self.aux_slot_bytes - self.aux_hidden_bytes  # the slot before its hidden state, as this rank writes it
        if (reg.num_pages < 2 or reg.aux_num_slots < 1 or reg.aux_hidden_bytes < 0
                or reg.aux_slot_bytes - reg.aux_hidden_bytes != base):
            return f"bad decode pool: {reg.num_pages} pages, {reg.aux_num_slots} aux slots of {reg.aux_slot_bytes} bytes"
        return self._check_hidden(reg.aux_hidden_bytes)

    def _check_hidden(self, wanted: int) -> str | None:
        """Aux slots with no hidden state, or the one this rank sends; a decode wanting one from a
        prefill that sends none is accepted (its rooms then fail there, naming the missing state)."""
        if wanted == 0 or wanted == self.aux_hidden_bytes or self.aux_hidden_bytes == 0:
            return None
        return (f"NEXTN hidden state mismatch: the decode's aux slots hold {wanted} bytes of it, this prefill "
                f"sends {self.aux_hidden_bytes} (a different model or dtype)")

    def add(self, reg: m.RegisterPool, engine_peer: str | None, reason: str | None) -> DecodePeer:
        """Record ``reg``'s pool: accepted (``engine_peer``) or rejected (``reason``)."""
        peer = DecodePeer(reg, engine_peer, reason, list(reg.k_addrs) + list(reg.v_addrs))
        self.peers[reg.decode_id] = peer
        return peer

    def remove(self, decode_id: str) -> DecodePeer | None:
        """Forget a decode rank (it stopped heartbeating); a new ``RegisterPool`` brings it back."""
        return self.peers.pop(decode_id, None)

    def check_request(self, req: m.RoomRequest) -> tuple[DecodePeer | None, str | None]:
        """(the room's decode peer, why its destination cannot be written). Peer None: the decode rank
        never registered here (the request is dropped)."""
        peer = self.peers.get(req.decode_id)
        if peer is None:
            return None, None
        if peer.reject_reason is not None:
            return peer, peer.reject_reason
        bad = [p for p in req.dst_pages if not 0 < p < peer.reg.num_pages]
        if bad:
            return peer, f"destination pages {bad[:4]} outside decode pool [1, {peer.reg.num_pages})"
        if not 0 <= req.aux_slot < peer.reg.aux_num_slots:
            return peer, f"aux slot {req.aux_slot} outside [0, {peer.reg.aux_num_slots})"
        return peer, None
