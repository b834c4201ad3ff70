"""NIXL memory places: a region is registered and named in the memory it lives in (``"VRAM"`` with
the CUDA device's index, ``"DRAM"`` with 0), chosen from the tensor's device; a peer learns where
each of its regions lives from its peer info; a batch spanning places becomes one transfer per pair
of places, the notification after all of them.

The descriptor builders are pure functions of (address, length, device), so the CUDA case is
checked here on CPU by the descriptors they build. The real NIXL engine then moves bytes between
two places on CPU: host memory under a second device id stands in for a GPU this machine lacks."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.kvtransfer import TransferState, create_transfer_engine
from pdserve.kvtransfer.engines import nixl_engine
from pdserve.kvtransfer.engines.nixl_engine import decode_peer_info, encode_peer_info
from pdserve.kvtransfer.engines.nixl_memory import (
    DRAM,
    MemPlace,
    PlaceMap,
    place_of,
    registration_descs,
    split_by_place,
    xfer_descs,
)

pytestmark = pytest.mark.timeout(60)


def test_the_place_comes_from_the_device():
    assert place_of("cpu") == DRAM == MemPlace("DRAM", 0)
    assert place_of("cuda:3") == MemPlace("VRAM", 3)
    assert place_of("cuda") == MemPlace("VRAM", 0)
    assert place_of(str(torch.zeros(1).device)) == DRAM  # a CPU tensor's own spelling
    for bad in ("mps:0", "cuda:x"):
        with pytest.raises(ValueError, match=bad.split(":")[0]):
            place_of(bad)


def test_registration_descriptors_name_the_memory_type_and_device():
    t = torch.zeros(64, dtype=torch.uint8)
    assert registration_descs(t.data_ptr(), 64, str(t.device)) == ([(t.data_ptr(), 64, 0, "")], "DRAM")
    # a CUDA tensor on device 2, described by its address, size and device
    assert registration_descs(0x7F0000000000, 1 << 20, "cuda:2") == ([(0x7F0000000000, 1 << 20, 2, "")], "VRAM")


def test_the_pool_reports_where_its_tensors_live():
    infos = PagePool(4, 2, 1, 1, 8, torch.float32).buffer_infos()
    assert [b.device for b in infos] == ["cpu", "cpu"]  # K and V of one layer: what the KV manager registers
    assert place_of(infos[0].device) == DRAM


def test_transfer_descriptors_carry_the_device_id():
    d = xfer_descs([0x1000, 0x3000], [16, 32], MemPlace("VRAM", 5))
    assert d.dtype == np.uint64 and d.tolist() == [[0x1000, 16, 5], [0x3000, 32, 5]]
    assert xfer_descs([0x1000], [16], DRAM).tolist() == [[0x1000, 16, 0]]


def test_a_batch_over_gpu_pages_and_a_host_aux_slot_splits_by_place():
    # local: the KV pool on cuda:0, the aux staging slot in host memory; remote: KV on cuda:1, aux in host
    local = PlaceMap([(0x10000, 0x1000, MemPlace("VRAM", 0)), (0x90000, 0x100, DRAM)])
    remote = PlaceMap([(0x20000, 0x1000, MemPlace("VRAM", 1)), (0xA0000, 0x100, DRAM)])
    src, dst, lengths = [0x10000, 0x10800, 0x90000], [0x20400, 0x20000, 0xA0040], [256, 256, 64]
    kv, aux = split_by_place(src, dst, lengths, local, remote)
    assert (kv.local, kv.remote) == (MemPlace("VRAM", 0), MemPlace("VRAM", 1))
    assert kv.local_descs.tolist() == [[0x10000, 256, 0], [0x10800, 256, 0]]
    assert kv.remote_descs.tolist() == [[0x20400, 256, 1], [0x20000, 256, 1]]
    assert (aux.local, aux.remote) == (DRAM, DRAM)
    assert aux.local_descs.tolist() == [[0x90000, 64, 0]] and aux.remote_descs.tolist() == [[0xA0040, 64, 0]]


def test_host_memory_only_is_one_group_in_order():
    (only,) = split_by_place([3, 1, 2], [30, 10, 20], [1, 1, 1], PlaceMap([(1, 8, DRAM)]), PlaceMap())
    assert (only.local, only.remote) == (DRAM, DRAM)
    assert only.local_descs[:, 0].tolist() == [3, 1, 2] and only.remote_descs[:, 0].tolist() == [30, 10, 20]
    (empty,) = split_by_place([], [], [], PlaceMap(), PlaceMap())
    assert empty.local_descs.shape == (0, 3)


def test_peer_info_carries_the_places_and_a_bare_metadata_is_host_memory():
    info = encode_peer_info(b"agent-md", [(0x20000, 0x1000, MemPlace("VRAM", 1)), (0xA0000, 0x100, DRAM)])
    metadata, places = decode_peer_info(info)
    assert metadata == b"agent-md"
    assert places.regions == [(0x20000, 0x1000, MemPlace("VRAM", 1)), (0xA0000, 0x100, DRAM)]
    metadata, places = decode_peer_info(b"agent-md")  # a peer that sends its metadata alone
    assert metadata == b"agent-md" and places.regions == []


def test_nixl_moves_a_batch_spanning_two_places_and_notifies_after_both(monkeypatch):
    # host memory under device id 1 stands in for a second device: NIXL matches each descriptor
    # to a registration by its device id, so a descriptor naming the wrong one would fail
    second = MemPlace("DRAM", 1)
    monkeypatch.setattr(nixl_engine, "place_of", lambda device: second if device == "second:1" else place_of(device))
    a = create_transfer_engine("nixl", "127.0.0.1")
    b = create_transfer_engine("nixl", "127.0.0.1")
    kv_src, aux_src = torch.arange(4096).to(torch.uint8), torch.arange(256).to(torch.uint8).flip(0).contiguous()
    kv_dst, aux_dst = torch.zeros(4096, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    regs = [(a, kv_src, "second:1"), (a, aux_src, "cpu"), (b, kv_dst, "second:1"), (b, aux_dst, "cpu")]
    try:
        for engine, t, device in regs:
            engine.register(t.data_ptr(), t.numel(), device)
        peer = a.connect(b.peer_info())
        handle = a.write_batch(peer, [kv_src.data_ptr(), aux_src.data_ptr(), kv_src.data_ptr() + 1024],
                               [kv_dst.data_ptr() + 2048, aux_dst.data_ptr(), kv_dst.data_ptr()],
                               [1024, 256, 512], notify=b"room-5")
        assert handle.raw.held is not None  # the last group waits, with the notification, for the first
        assert a.wait(handle, timeout=30) is TransferState.DONE and handle.error is None
        assert torch.equal(kv_dst[2048:3072], kv_src[:1024]) and torch.equal(kv_dst[:512], kv_src[1024:1536])
        assert torch.equal(aux_dst, aux_src)
        notes: list[bytes] = []
        while b"room-5" not in notes:  # bounded by the test's timeout
            notes += b.get_notifications()
            time.sleep(0.001)
    finally:
        for engine, t, _ in regs:
            engine.deregister(t.data_ptr())
        a.close()
        b.close()
