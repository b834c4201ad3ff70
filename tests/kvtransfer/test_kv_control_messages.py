"""Every control and bootstrap message survives encode/decode; bad frames raise, never crash."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.kvtransfer import messages as m
from pdserve.kvtransfer.head_slices import layout_mismatch

LAYOUT = m.LayoutInfo(30, 16, 3, 64, "bfloat16")

CONTROL = [
    m.RegisterPool(
        decode_id="decode-1", endpoint="127.0.0.1:5000", backend="nixl", peer_info=b"\x00agent-md\xff",
        layout=LAYOUT, num_pages=64, page_bytes=6144, k_addrs=[1 << 40, 2 << 40], v_addrs=[3 << 40, 4 << 40],
        aux_addr=5 << 40, aux_slot_bytes=176, aux_num_slots=256,
    ),
    m.RegisterPool(
        decode_id="decode-2", endpoint="127.0.0.1:5001", backend="local", peer_info=b"",
        layout=m.LayoutInfo(30, 16, 3, 64, "bfloat16", "w8a16"), num_pages=8, page_bytes=6144, k_addrs=[1],
        v_addrs=[2], aux_addr=3, aux_slot_bytes=176, aux_num_slots=4,
    ),
    m.RegisterAck("prefill-1", "127.0.0.1:6000", False, "KV layout mismatch", b"sess"),
    m.RoomRequest(room=(1 << 63) - 1, decode_id="decode-1", dst_pages=[3, 4, 9], aux_slot=7),
    m.RoomStatus(room=5, success=True, notified=True),
    m.RoomStatus(room=5, success=False, reason="KV write failed"),
    m.AbortRoom(room=6, reason="client went away"),
    m.AbortRoom(room=6, reason="client went away", endpoint="127.0.0.1:5000"),
    m.RoomClosed(room=(1 << 63) - 1),
    m.Heartbeat("decode-1", "127.0.0.1:5000", seq=3),
    m.HeartbeatAck("prefill-1", "127.0.0.1:6000", seq=3),
]


@pytest.mark.parametrize("msg", CONTROL, ids=lambda msg: type(msg).__name__)
def test_control_round_trip(msg):
    decoded = m.decode(m.encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


def test_bootstrap_messages_round_trip():
    reg = m.RankRegistration(0, 0, "10.0.0.1:7000", 16, "bfloat16", 30, 3, 64, "mooncake")
    assert msgspec.json.decode(msgspec.json.encode(reg), type=m.RankRegistration) == reg
    topo = m.Topology(1, 1, [reg])
    assert msgspec.json.decode(msgspec.json.encode(topo), type=m.Topology) == topo
    assert reg.layout() == LAYOUT
    quantized = msgspec.structs.replace(reg, quantization="w8a16")
    assert msgspec.json.decode(msgspec.json.encode(quantized), type=m.RankRegistration) == quantized
    assert quantized.layout() == msgspec.structs.replace(LAYOUT, quantization="w8a16")


def test_peers_without_quantization_read_as_unquantized():
    old = {"dp_rank": 0, "tp_rank": 0, "endpoint": "10.0.0.1:7000", "page_size": 16, "kv_dtype": "bfloat16",
           "num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
    assert msgspec.json.decode(msgspec.json.encode(old), type=m.RankRegistration).quantization == "none"
    old_layout = msgspec.msgpack.encode({"num_layers": 30, "page_size": 16, "num_kv_heads": 3, "head_dim": 64,
                                         "dtype": "bfloat16"})
    assert msgspec.msgpack.decode(old_layout, type=m.LayoutInfo) == LAYOUT


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", b"garbage", m.encode(CONTROL[2])[:-3], msgspec.msgpack.encode({"type": "Nope", "room": 1}),
     msgspec.msgpack.encode({"type": "RoomRequest", "room": "x", "decode_id": "d", "dst_pages": [], "aux_slot": 0})],
)
def test_bad_frames_raise_typed_errors(frame):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        m.decode(frame)


def test_layout_mismatch_names_the_fields():
    assert LAYOUT.mismatch(LAYOUT) is None
    other = m.LayoutInfo(30, 32, 3, 64, "float32")
    assert LAYOUT.mismatch(other) == "page_size: 16 vs 32; dtype: bfloat16 vs float32"


def test_pair_mismatch_names_both_sides_quantization():
    w8 = msgspec.structs.replace(LAYOUT, quantization="w8a16")
    assert layout_mismatch(w8, 3, w8, 3) is None
    assert layout_mismatch(w8, 3, LAYOUT, 3) == "weights quantization: prefill w8a16, decode none"
    fp32 = msgspec.structs.replace(LAYOUT, dtype="float32")
    assert layout_mismatch(w8, 3, fp32, 3) == (
        "weights quantization: prefill w8a16, decode none; "
        "KV layout mismatch (prefill vs decode): dtype: bfloat16 vs float32"
    )
