"""The aux slot's hidden state (NEXTN through PD): its bytes round-trip, a slot tells "none sent"
from "sent", the prefill writes it only into decode slots made for it, and a decode pool whose
slots want another size is refused by name."""

from __future__ import annotations

import pytest
import torch
from rooms_fixtures import HEAD_PAGE_BYTES, HEADS, LAYOUT, register_pool

from pdserve.engine.speculative.nextn_handoff import handoff_bytes, hidden_row, last_prompt_rows
from pdserve.kvtransfer.aux_pool import AuxData, AuxPool, base_slot_bytes
from pdserve.kvtransfer.decode_peers import DecodePeers

HIDDEN = 6


def test_hidden_state_round_trips_through_a_slot_and_none_reads_as_empty():
    nbytes = handoff_bytes(HIDDEN, torch.bfloat16)
    pool = AuxPool(2, max_top_logprobs=2, hidden_bytes=nbytes)
    assert pool.slot_bytes == base_slot_bytes(2) + nbytes == pool.base_bytes + 12
    h = torch.linspace(-2, 2, HIDDEN, dtype=torch.bfloat16)
    raw = h.view(torch.uint8).numpy().tobytes()
    aux = AuxData(7, -0.25, [7, 9], [-0.25, -3.0], 5, raw)
    pool.write(0, aux)
    assert pool.read(0) == aux
    assert torch.equal(hidden_row(pool.read(0).hidden, HIDDEN, torch.bfloat16, torch.device("cpu"))[0], h)
    pool.write(1, AuxData(7))  # a prefill that sends none
    assert pool.read(1).hidden == b""
    # a decode whose slots have no room for it reads the rest alike (the prefill wrote its base part)
    plain = AuxPool(1, max_top_logprobs=2)
    assert plain.unpack(pool.pack(aux)[: plain.slot_bytes]) == AuxData(7, -0.25, [7, 9], [-0.25, -3.0], 5)
    with pytest.raises(ValueError, match="hidden state of 3 bytes"):
        pool.write(0, AuxData(7, hidden=b"abc"))
    with pytest.raises(ValueError, match="expected 6 values"):
        hidden_row(b"abc", HIDDEN, torch.bfloat16, torch.device("cpu"))


def test_last_prompt_rows_takes_each_finished_prefill_s_last_row():
    class R:
        def __init__(self, rid):
            self.rid = rid

    hidden = torch.arange(12, dtype=torch.float32).view(6, 2)  # rows: a a a | b b | c
    rows = last_prompt_rows([R("a"), R("b"), R("c")], [3, 2, 1], [True, False, True], hidden)
    assert set(rows) == {"a", "c"}
    assert torch.frombuffer(bytearray(rows["a"]), dtype=torch.float32).tolist() == [4.0, 5.0]
    assert torch.frombuffer(bytearray(rows["c"]), dtype=torch.float32).tolist() == [10.0, 11.0]


def test_decode_pools_are_checked_against_the_hidden_state_sent():
    base = base_slot_bytes(4)

    def peers(sent: int) -> DecodePeers:
        return DecodePeers(LAYOUT, HEADS, "local", HEAD_PAGE_BYTES * HEADS, HEAD_PAGE_BYTES, base + sent, sent)

    # a NEXTN prefill serves NEXTN decodes and plain ones; a plain prefill serves both too (a NEXTN
    # decode's rooms then fail there, naming the missing state)
    def reg(wanted: int, slot: int | None = None):
        return register_pool(aux_slot_bytes=base + wanted if slot is None else slot, aux_hidden_bytes=wanted)

    for sent, wanted in ((24, 24), (24, 0), (0, 24), (0, 0)):
        assert peers(sent).check_pool(reg(wanted)) is None, (sent, wanted)
    assert "hidden state mismatch: the decode's aux slots hold 48 bytes of it, this prefill sends 24" in \
        peers(24).check_pool(reg(48))
    # slots laid out otherwise before the hidden state (another top-logprobs count) are refused
    for sent in (0, 24):
        for bad in (reg(0, base - 4), reg(0, base + 8), reg(24, base + 8)):
            assert peers(sent).check_pool(bad).startswith("bad decode pool"), (sent, bad.aux_slot_bytes)
