"""``kvtransfer.tp_agreement.agree`` over a real gloo group of two processes: the element-wise minimum of
the rooms' states, a rank whose copy of a room failed elsewhere aborts it with the failing rank's reason,
quarantine closedness and values."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from pdserve.entrypoints.procs import free_port

pytestmark = pytest.mark.timeout(120)


class Room:
    """A sender or receiver as the agreement sees it."""

    def __init__(self, state, closed_here=False, requested_at=0.0, failure_reason=None):
        self.state = state
        self.failure_reason = failure_reason
        self.agreed = None
        self.closed_here = closed_here
        self.agreed_closed = None
        self.requested_at = requested_at
        self.aborted = None

    def abort(self, reason):
        from pdserve.kvtransfer.kv_poll import KVPoll

        self.aborted = reason
        self.state = KVPoll.Failed


def _rank(rank: int, addr: str, out) -> None:
    import torch

    from pdserve.engine.model_executor import parallel
    from pdserve.kvtransfer.kv_poll import KVPoll as P
    from pdserve.kvtransfer.tp_agreement import agree, agree_values

    parallel.init_tp(rank, 2, addr, 30.0, torch.device("cpu"))
    try:
        mine = [[P.Success, P.Transferring, P.Failed, P.WaitingForInput, P.Transferring, P.Failed],
                [P.Success, P.Success, P.Transferring, P.Bootstrapping, P.Failed, P.Transferring]][rank]
        rooms = [Room(s, failure_reason=f"cause on {rank}" if s is P.Failed else None) for s in mine]
        rooms[5].agreed = P.Failed  # agreed Failed a step ago: left alone, no reasons exchanged for it
        # quarantined rooms: closed on both / on one / never requested on one (counts as closed)
        closing = [Room(P.Failed, True), Room(P.Failed, rank == 0), Room(P.Failed, False, None if rank else 0.0)]
        agree(rooms, closing)
        flags = agree_values([3, 5 if rank else 4, -1 if rank else 0])
        out.put((rank, [r.agreed.name for r in rooms], [r.aborted for r in rooms],
                 [r.agreed_closed for r in closing], flags))
    finally:
        parallel.close_tp()


def test_two_ranks_agree_on_the_minimum():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, addr, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((res[0], res[1:]) for res in (out.get(timeout=90) for _ in procs))
    for p in procs:
        p.join(30)
    for rank in (0, 1):
        agreed, aborted, closed, flags = got[rank]
        assert agreed == ["Success", "Transferring", "Failed", "Bootstrapping", "Failed", "Failed"]
        assert closed == [True, False, False]  # closed only where every rank is (or never asked)
        assert flags == [3, 4, -1]
    # a rank whose copy was still Transferring aborts it (telling its peers, freeing its pages), naming
    # the rank where it failed and why; a copy that failed by itself keeps its own reason
    assert got[1][1][:5] == [None, None, "failed on TP rank 0 of this server: cause on 0", None, None]
    assert got[0][1][:5] == [None, None, None, None, "failed on TP rank 1 of this server: cause on 1"]
    # room 5: still Transferring on rank 1 under a Failed agreed a step ago: the plain abort, no exchange
    assert got[1][1][5] == "failed on another TP rank of this server" and got[0][1][5] is None
