"""The pure head-slice mapping between prefill TP p and decode TP d ranks, for every valid combo."""

from __future__ import annotations

import itertools

import pytest

from pdserve.kvtransfer.head_slices import head_slices, kv_head_range, slices_from, slices_into

SIZES = [1, 2, 3, 4]
KV_HEADS = [1, 2, 3, 4, 6]


def _valid(tp: int, kv: int) -> bool:
    return kv % tp == 0 or tp % kv == 0


COMBOS = [(p, d, h) for p, d, h in itertools.product(SIZES, SIZES, KV_HEADS) if _valid(p, h) and _valid(d, h)]


def test_kv_head_range_split_and_replicated():
    assert [kv_head_range(r, 2, 4) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [kv_head_range(r, 4, 2) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [kv_head_range(r, 3, 3) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="tp size 2 cannot split 3 KV heads"):
        kv_head_range(0, 2, 3)


@pytest.mark.parametrize("p,d,kv", COMBOS)
def test_every_decode_head_arrives_once_from_a_rank_that_holds_it(p, d, kv):
    slices = head_slices(p, d, kv)
    for j in range(d):
        dst = kv_head_range(j, d, kv)
        got = []
        for s in slices_into(j, p, d, kv):
            src = kv_head_range(s.src_rank, p, kv)
            heads = range(s.head, s.head + s.num_heads)
            assert heads.start >= src.start and heads.stop <= src.stop, (s, src)
            assert heads.start >= dst.start and heads.stop <= dst.stop, (s, dst)
            assert s.src_head == s.head - src.start and s.dst_head == s.head - dst.start
            got.extend(heads)
        assert got == list(dst), (j, got)
        # exactly one source writes this rank's aux: its first
        auxes = [s for s in slices_into(j, p, d, kv) if s.aux]
        assert len(auxes) == 1 and auxes[0] == slices_into(j, p, d, kv)[0]
    # a replicated head is sent by its lowest replica only: no prefill rank sends a head a lower rank holds
    for s in slices:
        assert all(s.head not in kv_head_range(r, p, kv) for r in range(s.src_rank))
    by_source = [s for i in range(p) for s in slices_from(i, p, d, kv)]
    assert sorted(by_source, key=slices.index) == slices


@pytest.mark.parametrize("p,d,kv", COMBOS)
def test_bytes_cross_once_per_decode_copy(p, d, kv):
    """Total heads moved = what the decode ranks hold together (one copy per decode replica)."""
    moved = sum(s.num_heads for s in head_slices(p, d, kv))
    assert moved == sum(len(kv_head_range(j, d, kv)) for j in range(d))


def test_known_cases():
    # equal sizes, split heads: rank i to its twin, whole pages
    assert [(s.src_rank, s.dst_rank, s.num_heads, s.src_head, s.dst_head) for s in head_slices(2, 2, 4)] == [
        (0, 0, 2, 0, 0), (1, 1, 2, 0, 0)]
    # prefill TP 2 -> decode TP 1: both prefill ranks write half of decode's heads
    assert [(s.src_rank, s.dst_rank, s.head, s.num_heads, s.dst_head, s.aux) for s in head_slices(2, 1, 2)] == [
        (0, 0, 0, 1, 0, True), (1, 0, 1, 1, 1, False)]
    # prefill TP 1 -> decode TP 2: prefill's heads cut in two, one half to each decode rank, aux to both
    assert [(s.src_rank, s.dst_rank, s.src_head, s.num_heads, s.aux) for s in head_slices(1, 2, 2)] == [
        (0, 0, 0, 1, True), (0, 1, 1, 1, True)]
    # replicated on the prefill side (TP 4, 2 heads): ranks 1 and 3 are replicas and send nothing
    assert slices_from(1, 4, 1, 2) == [] and slices_from(3, 4, 1, 2) == []
    assert [s.src_rank for s in head_slices(4, 1, 2)] == [0, 2]
    # replicated on the decode side (TP 4, 1 head): every decode rank gets the head from prefill rank 0
    assert [(s.src_rank, s.dst_rank) for s in head_slices(1, 4, 1)] == [(0, 0), (0, 1), (0, 2), (0, 3)]
