"""Plain data the room-state and peer-directory unit tests share: a small layout, a decode pool's
registration and a prefill rank's bootstrap entry, and a clock the tests move."""

from __future__ import annotations

import pdserve.kvtransfer.messages as m

LAYERS, PAGE, HEADS, DIM = 2, 4, 2, 8
HEAD_PAGE_BYTES = PAGE * DIM * 4  # float32
LAYOUT = m.LayoutInfo(LAYERS, PAGE, HEADS, DIM, "float32")
AUX_SLOT_BYTES = 64


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def register_pool(decode_id: str = "d0", endpoint: str = "decode:1", *, heads: int = HEADS, tp_rank: int = 0,
                  tp_size: int = 1, kv_heads: int = 0, backend: str = "local", num_pages: int = 16,
                  layers: int = LAYERS, page_bytes: int | None = None, aux_slots: int = 4,
                  aux_slot_bytes: int = AUX_SLOT_BYTES, aux_hidden_bytes: int = 0) -> m.RegisterPool:
    layout = m.LayoutInfo(LAYERS, PAGE, heads, DIM, "float32")
    return m.RegisterPool(
        decode_id=decode_id, endpoint=endpoint, backend=backend, peer_info=b"decode-engine", layout=layout,
        num_pages=num_pages, page_bytes=HEAD_PAGE_BYTES * heads if page_bytes is None else page_bytes,
        k_addrs=[0x10000 * (i + 1) for i in range(layers)], v_addrs=[0x100000 * (i + 1) for i in range(layers)],
        aux_addr=0x9000000, aux_slot_bytes=aux_slot_bytes, aux_num_slots=aux_slots, tp_rank=tp_rank,
        tp_size=tp_size, kv_heads=kv_heads, aux_hidden_bytes=aux_hidden_bytes)


def rank(tp_rank: int = 0, tp_size: int = 1, *, dp_rank: int = 0, heads: int = HEADS, kv_heads: int = 0,
         backend: str = "local", endpoint: str | None = None, page_size: int = PAGE) -> m.RankRegistration:
    return m.RankRegistration(dp_rank=dp_rank, tp_rank=tp_rank, endpoint=endpoint or f"prefill:{tp_rank}",
                              page_size=page_size, kv_dtype="float32", num_layers=LAYERS, num_kv_heads=heads,
                              head_dim=DIM, backend=backend, tp_size=tp_size, kv_heads=kv_heads)
