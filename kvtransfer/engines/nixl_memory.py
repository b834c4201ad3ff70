"""Where NIXL memory lives: the memory type and device id of each registered region, chosen from
the device of the tensor that holds it, and the descriptors NIXL takes for it.

NIXL names a region by (address, length, device id) within a memory type: host memory is
``"DRAM"`` with device id 0, a CUDA device's memory is ``"VRAM"`` with the device's index. One
transfer's descriptor list holds one memory type, so a batch whose sources or destinations lie in
both (a prefill's last chunk: KV pages in the GPU's pool, the aux slot in host memory) is split by
place (``split_by_place``). Everything here is a pure function of addresses and device names, so it
is tested on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, order=True)
class MemPlace:
    """A NIXL memory type and the device id within it."""

    mem_type: str  # "DRAM" or "VRAM"
    dev_id: int


DRAM = MemPlace("DRAM", 0)


def place_of(device: str) -> MemPlace:
    """The place of memory on ``device`` (torch's spelling: ``"cpu"``, ``"cuda:N"``; ``"cuda"``
    alone is device 0). ValueError for a device NIXL's UCX backend does not take here."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return DRAM
    if kind == "cuda":
        if index and not index.isdigit():
            raise ValueError(f"device {device!r}: the CUDA device index is not a number")
        return MemPlace("VRAM", int(index or 0))
    raise ValueError(f"device {device!r}: NIXL memory is host memory ('cpu') or a CUDA device ('cuda:N')")


def registration_descs(addr: int, nbytes: int, device: str) -> tuple[list[tuple[int, int, int, str]], str]:
    """``(descs, mem_type)`` for ``nixl_agent.register_memory`` of ``[addr, addr + nbytes)`` on
    ``device``."""
    place = place_of(device)
    return [(addr, nbytes, place.dev_id, "")], place.mem_type


def xfer_descs(addrs: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray, place: MemPlace) -> np.ndarray:
    """``[n, 3]`` (address, length, device id) for ``nixl_agent.get_xfer_descs(descs, place.mem_type)``;
    numpy avoids building n Python tuples."""
    descs = np.zeros((len(addrs), 3), dtype=np.uint64)
    descs[:, 0], descs[:, 1], descs[:, 2] = addrs, lengths, place.dev_id
    return descs


class PlaceMap:
    """The places of a set of registered regions, looked up by address. An address in no region
    is in ``DRAM`` (what a peer that sends no map registered: host memory only)."""

    def __init__(self, regions: Iterable[tuple[int, int, MemPlace]] = ()):
        self.regions = sorted(regions)
        # place 0 is DRAM, the answer for an address outside every region
        self.place_list = [DRAM] + sorted({p for _, _, p in self.regions} - {DRAM})
        self._starts = np.array([r[0] for r in self.regions], dtype=np.uint64)
        self._ends = np.array([r[0] + r[1] for r in self.regions], dtype=np.uint64)
        self._codes = np.array([self.place_list.index(r[2]) for r in self.regions], dtype=np.int64)

    def codes(self, addrs: np.ndarray) -> np.ndarray:
        """The index in ``place_list`` of each address's place (of the region it starts in)."""
        if len(self.place_list) == 1:  # host memory only: no lookup
            return np.zeros(len(addrs), dtype=np.int64)
        idx = np.searchsorted(self._starts, addrs, side="right").astype(np.int64) - 1
        inside = (idx >= 0) & (addrs < self._ends[np.maximum(idx, 0)])
        return np.where(inside, self._codes[np.maximum(idx, 0)], 0)


@dataclass(frozen=True)
class PlaceGroup:
    """The descriptors of a batch that go from one local place to one remote place."""

    local: MemPlace
    remote: MemPlace
    local_descs: np.ndarray  # [n, 3] (address, length, device id)
    remote_descs: np.ndarray  # [n, 3]


def split_by_place(src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
                   local: PlaceMap, remote: PlaceMap) -> list[PlaceGroup]:
    """The batch ``src[i] -> dst[i]`` (``lengths[i]`` bytes) as one group per pair of places (local,
    remote), each in the batch's order, the groups in the order their pair first occurs. An empty
    batch is one empty group in host memory."""
    src_a = np.asarray(src, dtype=np.uint64)
    dst_a = np.asarray(dst, dtype=np.uint64)
    len_a = np.asarray(lengths, dtype=np.uint64)
    n_remote = len(remote.place_list)
    pair = local.codes(src_a) * n_remote + remote.codes(dst_a)
    found, first = np.unique(pair, return_index=True)

    def group(code: int, sel) -> PlaceGroup:
        lp, rp = local.place_list[code // n_remote], remote.place_list[code % n_remote]
        return PlaceGroup(lp, rp, xfer_descs(src_a[sel], len_a[sel], lp), xfer_descs(dst_a[sel], len_a[sel], rp))

    if len(found) <= 1:  # one pair of places (or none): the batch as it is
        return [group(int(found[0]) if len(found) else 0, slice(None))]
    return [group(code, pair == code) for code in found[np.argsort(first)].tolist()]
