"""The engine notification that a prefill TP rank's last write of a room carries (NIXL, ``local``):
the decode side counts a room's KV as landed only once it arrived (``receiver_rooms``). The bytes
are the same on every backend and travel inside the transfer engine, not on the control channel."""

from __future__ import annotations


def room_notification(room: int, tp_rank: int = 0) -> bytes:
    """The notification of prefill TP rank ``tp_rank``'s last write of ``room``."""
    return b"pdserve-room:%d:%d" % (room, tp_rank)


def parse_room_notification(msg: bytes) -> tuple[int, int] | None:
    """(room, prefill tp rank) of a ``room_notification``; None for anything else."""
    prefix, _, rest = msg.partition(b":")
    room, _, tp = rest.partition(b":")
    if prefix != b"pdserve-room" or not room.isdigit() or not tp.isdigit():
        return None
    return int(room), int(tp)
