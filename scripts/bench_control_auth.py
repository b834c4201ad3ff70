"""Per-room cost of KV control-plane authentication (``--disaggregation-auth-key-file``), same run.

1. Micro: the frames of one room (decode -> prefill ``RoomRequest`` with the destination pages of a
   ``--tokens`` prompt, prefill -> decode ``RoomStatus``), encoded and sealed, then opened and
   decoded, against encoding and decoding alone. Median of ``--iters`` x 1000 rooms.
2. Rooms: real prefill and decode KV managers in this process over the ``local`` backend, each room
   from ``create_sender``/``create_receiver`` to both sides seeing Success; auth on against auth
   off, alternating which goes first. Median per-room latency over ``--rooms`` rooms.

Ends with one JSON line.

    python scripts/bench_control_auth.py [--tokens 4096] [--rooms 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import pdserve.kvtransfer.messages as m
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.kvtransfer import BootstrapServer, DecodeKVManager, KVPoll, KVTransferConfig, PrefillKVManager
from pdserve.engine.kv_auth import FrameAuth

PAGE_SIZE = 16


def micro(tokens: int, iters: int) -> dict:
    pages = list(range(1, tokens // PAGE_SIZE + 1))
    msgs = [m.RoomRequest(12345678901234, "decode-127.0.0.1:5555-abcdef01", pages, 7), m.RoomStatus(12345678901234, True)]
    # one instance seals and opens (its nonce cache grows as a receiver's does)
    auth = FrameAuth(os.urandom(32), "control")

    def plain() -> None:
        for msg in msgs:
            m.decode(m.encode(msg))

    def sealed() -> None:
        for msg in msgs:
            m.decode(auth.open(auth.seal(m.encode(msg))))

    out = {}
    for name, fn in (("plain", plain), ("sealed", sealed)):
        runs = []
        for _ in range(iters):
            t = time.perf_counter()
            for _ in range(1000):
                fn()
            runs.append((time.perf_counter() - t) / 1000 * 1e6)
        out[name] = statistics.median(runs)
    out["auth_us_per_room"] = out["sealed"] - out["plain"]
    return out


def rooms(key_file: str, n: int, tokens: int) -> float:
    """Median seconds per room over ``n`` rooms, auth on when ``key_file``."""
    boot = BootstrapServer("127.0.0.1", 0, auth=FrameAuth.from_file(key_file, "bootstrap") if key_file else None)
    boot.start_in_thread()
    cfg = KVTransferConfig(backend="local", bootstrap_port=boot.port, auth_key_file=key_file, num_transfer_threads=1)
    npages = tokens // PAGE_SIZE + 2
    pools = [PagePool(npages, PAGE_SIZE, 2, 1, 8, torch.float32) for _ in range(2)]
    p = PrefillKVManager(cfg, pools[0]).start()
    d = DecodeKVManager(cfg, pools[1]).start()
    p.registered.wait(10)
    pages = list(range(1, npages - 1))
    times = []
    try:
        for room in range(1, n + 1):
            t = time.perf_counter()
            s = p.create_sender(room)
            r = d.create_receiver(room, "127.0.0.1", boot.port, 0)
            while r.poll() is KVPoll.Bootstrapping:
                time.sleep(0)
            r.init(pages, d.aux_pool.alloc())
            while s.poll() is KVPoll.Bootstrapping:
                time.sleep(0)
            s.send(pages, True, None)
            while not (s.poll().done and r.poll().done):
                time.sleep(0)
            assert r.poll() is KVPoll.Success, r.failure_reason
            d.aux_pool.free(r.aux_slot)
            times.append(time.perf_counter() - t)
    finally:
        p.close()
        d.close()
        boot.stop_thread()
    return statistics.median(times[5:])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--rooms", type=int, default=200)
    args = ap.parse_args()
    mic = micro(args.tokens, args.iters)
    print(f"micro, per room ({args.tokens} tokens): plain {mic['plain']:.1f} us, sealed {mic['sealed']:.1f} us, "
          f"auth {mic['auth_us_per_room']:.1f} us")
    with tempfile.NamedTemporaryFile("wb", suffix=".key") as f:
        f.write(os.urandom(32).hex().encode())
        f.flush()
        on, off = [], []
        for i in range(2):  # alternate which goes first
            for key, acc in ((f.name, on), ("", off)) if i % 2 == 0 else (("", off), (f.name, on)):
                acc.append(rooms(key, args.rooms, args.tokens))
    on_s, off_s = min(on), min(off)
    print(f"rooms over local managers: auth off {off_s * 1e3:.3f} ms, auth on {on_s * 1e3:.3f} ms per room")
    print(json.dumps({"tokens": args.tokens, "micro_plain_us": round(mic["plain"], 2),
                      "micro_sealed_us": round(mic["sealed"], 2), "micro_auth_us": round(mic["auth_us_per_room"], 2),
                      "room_off_ms": round(off_s * 1e3, 3), "room_on_ms": round(on_s * 1e3, 3),
                      "room_ratio": round(on_s / off_s, 3)}))


if __name__ == "__main__":
    main()
