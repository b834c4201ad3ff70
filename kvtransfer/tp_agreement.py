"""The TP ranks of one DP rank agree on their rooms before acting on them (SGLang's ``poll_and_all_reduce``).

Every TP rank runs its own KV manager, so a room can land (or fail) on one rank a step before
another. Acting on a rank's own view would let the ranks' scheduling diverge (one rank moves a
request into the decode batch, or frees its pages, while another does not), and the next
collective of the model would mix different batches. So each step, before the loops read any
room, the ranks take the element-wise minimum of their rooms' states (``KVPoll`` is ordered
Failed < Bootstrapping < ... < Success): a room is Success only when it is on every rank, and
Failed as soon as it is on any; a rank whose own copy of a room the others failed aborts it
here, which tells its peers and frees (or quarantines) its pages like any failure. The ranks then
share why the room failed where it did (one more collective, only at a step where some room
newly failed), so the client's error and the peer's abort name the cause, not only "another rank". A decode
room's pages leave quarantine only once every rank's source closed it. The loops read the agreed
state through ``poll()`` until the next agreement.

At TP 1 no collective runs and ``poll()`` stays the rank's own live view.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdserve.engine.model_executor.parallel import all_gather_bytes, all_reduce_min_list, tp_size
from pdserve.kvtransfer.errors import failed_on_rank
from pdserve.kvtransfer.kv_poll import KVPoll

FAILED_ELSEWHERE = "failed on another TP rank of this server"


def agree(rooms: Sequence, closing: Sequence = ()) -> None:
    """Agree on ``rooms`` (senders or receivers: their ``agreed`` state) and on whether each receiver of
    ``closing`` is closed by its prefill (``agreed_closed``). Every TP rank passes the same rooms in the
    same order."""
    if tp_size() == 1:
        return
    # a receiver whose destination never left this rank has nothing in flight here
    closed = [r.closed_here or r.requested_at is None for r in closing]
    vec = [int(r.state) for r in rooms] + [int(c) for c in closed]
    out = all_reduce_min_list(vec)
    n = len(rooms)
    states = [KVPoll(s) for s in out[:n]]
    # the previous agreement is the same on every rank, so every rank takes this branch alike
    newly = [r for r, s in zip(rooms, states) if s is KVPoll.Failed and r.agreed is not KVPoll.Failed]
    causes = _causes(newly) if newly else {}
    for room, state in zip(rooms, states):
        if state is KVPoll.Failed and not room.state.done:
            room.abort(causes.get(id(room), FAILED_ELSEWHERE))
        room.agreed = state
    for room, closed in zip(closing, out[n:]):
        room.agreed_closed = bool(closed)


def _causes(rooms: Sequence) -> dict[int, str]:
    """For each of ``rooms`` (failed on some rank, in the same order on every rank), the reason of the
    lowest TP rank whose own copy failed, as this rank's abort reason: {id(room): reason}."""
    mine = [r.failure_reason if r.state is KVPoll.Failed else None for r in rooms]
    per_rank = [msgspec.json.decode(b) for b in all_gather_bytes(msgspec.json.encode(mine))]
    out = {}
    for i, room in enumerate(rooms):
        origin = next(((rank, why[i]) for rank, why in enumerate(per_rank) if why[i] is not None), None)
        if origin is not None:
            out[id(room)] = failed_on_rank(*origin)
    return out


def agree_values(values: Sequence[int]) -> list[int]:
    """The element-wise minimum of ``values`` over the TP ranks (each rank passes as many, in order)."""
    return all_reduce_min_list(list(values))


def hold_new(room) -> None:
    """A room opened mid-step reads Bootstrapping on every TP rank until the next agreement."""
    if tp_size() > 1:
        room.agreed = KVPoll.Bootstrapping


def may_be_written(receiver) -> bool:
    """Whether a failed decode room's pages must wait in quarantine for its prefill to close it: when its
    destination left. Under TP every rank decides alike (the pages went to ``init`` on every rank); a rank
    whose destination never left counts as closed in the agreement, so nothing waits for it."""
    if tp_size() == 1:
        return receiver.requested_at is not None
    return receiver.dst_pages is not None


def agreed_clock(now: float) -> float:
    """The earliest of the TP ranks' clocks: timeouts the loops decide (quarantine) fire on every rank at
    the same step. Microsecond resolution."""
    if tp_size() == 1:
        return now
    return all_reduce_min_list([int(now * 1e6)])[0] / 1e6
