"""The adapter over the real engines (and the in-process ``local`` one): bytes move, codes become
typed errors, notifications arrive."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kvtransfer import (
    ConnectError,
    RegistrationError,
    TransferEngineError,
    TransferState,
    create_transfer_engine,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", params=["mooncake", "nixl", "local"])
def engines(request):
    a = create_transfer_engine(request.param, "127.0.0.1")
    b = create_transfer_engine(request.param, "127.0.0.1")
    src = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)  # 4 MiB
    dst = torch.zeros_like(src)
    a.register(src.data_ptr(), src.numel())
    b.register(dst.data_ptr(), dst.numel())
    peer = a.connect(b.peer_info())
    yield a, b, peer, src, dst
    a.deregister(src.data_ptr())
    b.deregister(dst.data_ptr())
    a.close()
    b.close()


def test_batch_write_moves_bytes(engines):
    a, b, peer, src, dst = engines
    dst.zero_()
    base_s, base_d = src.data_ptr(), dst.data_ptr()
    # three scattered pieces, one large
    pieces = [(0, 4096, 100), (8192, 0, 4096), (1 << 20, 2 << 20, 1 << 20)]
    handle = a.write_batch(peer, [base_s + s for s, _, _ in pieces], [base_d + d for _, d, _ in pieces],
                           [n for _, _, n in pieces], notify=b"pdserve-room:77")
    assert a.wait(handle, timeout=30) is TransferState.DONE and handle.error is None
    expected = torch.zeros_like(dst)
    for s, d, n in pieces:
        expected[d : d + n] = src[s : s + n]
    assert torch.equal(dst, expected)
    if a.supports_notifications:
        deadline = time.monotonic() + 10
        notes = []
        while b"pdserve-room:77" not in notes and time.monotonic() < deadline:
            notes += b.get_notifications()
        assert b"pdserve-room:77" in notes
    else:
        assert b.get_notifications() == []


def test_many_small_descriptors(engines):
    # more than one TCP lane queue's worth for mooncake: split into sub-batches
    a, b, peer, src, dst = engines
    dst.zero_()
    n, size = 3000, 512
    handle = a.write_batch(peer, [src.data_ptr() + i * size for i in range(n)],
                           [dst.data_ptr() + i * size for i in range(n)], [size] * n)
    assert a.wait(handle, timeout=30) is TransferState.DONE
    assert torch.equal(dst[: n * size], src[: n * size])


def test_empty_batch_is_done(engines):
    a, _, peer, _, _ = engines
    h = a.write_batch(peer, [], [], []) if a.name == "mooncake" else None
    if h is not None:
        assert a.poll(h) is TransferState.DONE


def test_failures_are_typed(engines):
    a, _, peer, src, _ = engines
    if a.name == "mooncake":
        with pytest.raises(ConnectError):
            a.connect(b"not-a-session")
        # nobody listens on port 1: the write fails with the engine's code, as a typed error
        h = a.write_batch("127.0.0.1:1", [src.data_ptr()], [0x1000], [64])
        assert a.wait(h, timeout=30) is TransferState.FAILED
        assert isinstance(h.error, TransferEngineError) and h.error.code == -1
    elif a.name == "local":
        with pytest.raises(ConnectError):
            a.connect(b"garbage metadata")
        # as mooncake: a refused write is a FAILED handle with a typed error
        for bad_peer, dst in (("no-such-peer", 0x1000), (peer, 0x1000)):
            h = a.write_batch(bad_peer, [src.data_ptr()], [dst], [64])
            assert a.wait(h, timeout=1) is TransferState.FAILED and isinstance(h.error, TransferEngineError)
        with pytest.raises(TransferEngineError, match="not registered"):
            a.write(peer, [src.data_ptr() + src.numel() - 8], [0x1000], [64])  # runs past the source region
        with pytest.raises(RegistrationError):
            a.deregister(0xDEAD000)
    else:
        with pytest.raises(ConnectError):
            a.connect(b"garbage metadata")
        with pytest.raises(TransferEngineError):
            a.write_batch("no-such-agent", [src.data_ptr()], [0x1000], [64])
        with pytest.raises(RegistrationError):
            a.deregister(0xDEAD000)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown transfer backend"):
        create_transfer_engine("gloo", "127.0.0.1")


def test_registry_names_and_external_specs():
    from pdserve.engine.transfer_backends import TRANSFER_ENGINES, check_transfer_backend

    assert {"mooncake", "nixl", "local"} <= set(TRANSFER_ENGINES)
    for name in TRANSFER_ENGINES:
        check_transfer_backend(name)
    # an importable "module:attr" factory is a backend too; it is imported to be checked
    check_transfer_backend("pdserve.kvtransfer.engines.local_engine:LocalTransferEngine")
    eng = create_transfer_engine("pdserve.kvtransfer.engines.local_engine:LocalTransferEngine", "127.0.0.1")
    assert eng.name == "local"
    eng.close()
    for bad in ("mooncak", "no_such_module:factory", "pdserve.kvtransfer.engines.local_engine:Nope"):
        with pytest.raises(ValueError):
            check_transfer_backend(bad)
