"""The rank channel's admission rules (``RemoteRanks.admit``): what node 0's front end takes from
the ranks of other nodes under DP attention, and what it drops from a peer that may not send it.
Pure logic, no sockets: frames as the ROUTER hands them over, ``[routing id, payload]``."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.engine.frontend.rank_transport import RemoteRanks
from pdserve.engine.kv_auth import AuthError, FrameAuth
from pdserve.engine.messages import RankMetrics, SchedulerError, SchedulerReady, SchedulerStats, TokenOutput

ADDR = "tcp://10.0.0.1:5001"
KEY = b"k" * 32


def ready(dp: int) -> SchedulerReady:
    return SchedulerReady(dp_rank=dp, vocab_size=10, max_context_len=64, eos_token_ids=[2], page_size=1,
                          max_total_num_tokens=64)


def stats(dp: int) -> SchedulerStats:
    return SchedulerStats(dp_rank=dp, num_running=0, num_waiting=0, num_free_pages=1, num_total_pages=1,
                          page_size=1)


def frame(*msgs) -> bytes:
    return msgspec.msgpack.encode(list(msgs))


def channel(auth=None) -> RemoteRanks:
    # --tp-size 4 --dp-size 2 --nnodes 2: group 1 (ranks (1, 0), (1, 1)) on node 1
    return RemoteRanks(ADDR, {(1, 0), (1, 1)}, auth)


def test_a_group_leader_is_whoever_announced_it_first():
    ch = channel()
    out = TokenOutput(rid="r", new_token_ids=[5], prompt_tokens=3, completion_tokens=1)
    assert ch.admit([b"peer", frame(out, stats(1))]) == []  # not a leader yet
    assert ch.admit([b"leader", frame(ready(1), stats(1), out)]) == [ready(1), stats(1), out]
    assert ch.leaders == {1: b"leader"}
    assert ch.admit([b"peer", frame(ready(1))]) == []  # a second announcement takes nothing over
    assert ch.admit([b"leader", frame(stats(0), ready(0))]) == []  # a node-0 group is not its to speak for
    assert ch.admit([b"peer", frame(out)]) == [] and ch.leaders == {1: b"leader"}


def test_metrics_and_deaths_from_ranks_off_node_0_only():
    ch = channel()
    mine, theirs = RankMetrics(dp_rank=1, tp_rank=1, families=[]), RankMetrics(dp_rank=0, tp_rank=0, families=[])
    assert ch.admit([b"follower", frame(mine, theirs)]) == [mine]
    assert ch.admit([b"node1", frame(SchedulerError(dp_rank=7, message="x"))]) == [] and ch.failure is None
    died = SchedulerError(dp_rank=1, message="scheduler process of DP rank 1 TP rank 0 exited with code -9")
    assert ch.admit([b"node1", frame(died)]) == [died]
    assert ch.failure == "DP rank 1 failed: scheduler process of DP rank 1 TP rank 0 exited with code -9"


@pytest.mark.parametrize("parts", [[b"x"], [b"x", b""], [b"x", b"\xc1garbage"], [b"x", msgspec.msgpack.encode([1])],
                                   [b"x", b"a", b"b"]])
def test_garbage_is_refused_by_raising(parts):
    """The receive loop drops what raises here and goes on (``RemoteRanks.recv_loop``)."""
    with pytest.raises(Exception):
        channel().admit(parts)


def test_with_a_key_only_sealed_frames_from_the_named_rank_count():
    auth = FrameAuth(KEY, "ranks")
    ch = channel(FrameAuth(KEY, "ranks"))
    with pytest.raises(AuthError):
        ch.admit([b"stranger", frame(ready(1))])
    with pytest.raises(AuthError):  # sealed with another key
        ch.admit([b"stranger", FrameAuth(b"s" * 32, "ranks").seal(frame(ready(1)), "dp1-tp0", ADDR)])
    # sealed by a key holder, but not by the group's leader: it cannot become the leader
    assert ch.admit([b"follower", auth.seal(frame(ready(1)), "dp1-tp1", ADDR)]) == []
    assert ch.admit([b"leader", auth.seal(frame(ready(1)), "dp1-tp0", ADDR)]) == [ready(1)]
    sealed = auth.seal(frame(stats(1)), "dp1-tp0", ADDR)
    assert ch.admit([b"leader", sealed]) == [stats(1)]
    with pytest.raises(AuthError, match="replayed"):
        ch.admit([b"leader", sealed])
