"""A real prefill or decode process for the two-process tests and the benchmark.

Reads one JSON command per line on stdin, answers one JSON line on its private
copy of stdout (fd 1 itself goes to stderr, where the engines log). Holds named
KV managers over real page pools of the default model's KV shape.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.kvtransfer import (
    AuxData,
    BootstrapServer,
    DecodeKVManager,
    KVTransferConfig,
    PrefillKVManager,
)

# SmolLM2-135M's KV: 30 layers, 3 KV heads, head dim 64 (bf16)
NUM_LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def fill_random(pool: PagePool, seed: int) -> None:
    """Deterministic content, so the other process can regenerate the expected bytes."""
    gen = torch.Generator().manual_seed(seed)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))


def make_pool(num_pages: int, page_size: int = 16, num_layers: int = NUM_LAYERS) -> PagePool:
    return PagePool(num_pages, page_size, num_layers, KV_HEADS, HEAD_DIM, torch.bfloat16)


class Peer:
    def __init__(self):
        self.mgrs: dict[str, PrefillKVManager | DecodeKVManager] = {}
        self.servers: dict[str, BootstrapServer] = {}
        self.rooms: dict[int, object] = {}

    def init(self, name, role, num_pages, page_size=16, seed=None, cfg=None, dp_size=1):
        config = KVTransferConfig(**(cfg or {}))
        pool = make_pool(num_pages, page_size)
        if seed is not None:
            fill_random(pool, seed)
        if role == "prefill":
            server = BootstrapServer(config.host, 0, dp_size=dp_size).start_in_thread()
            self.servers[name] = server
            mgr = PrefillKVManager(config, pool, server.port).start()
            mgr.registered.wait(30)
            if mgr.registration_error:
                raise RuntimeError(mgr.registration_error)
            self.mgrs[name] = mgr
            return {"bootstrap_port": server.port, "endpoint": mgr.endpoint}
        mgr = DecodeKVManager(config, pool).start()
        self.mgrs[name] = mgr
        return {"endpoint": mgr.endpoint}

    def create_sender(self, mgr, room):
        self.rooms[room] = self.mgrs[mgr].create_sender(room)
        return {}

    def create_receiver(self, mgr, room, host, port, dp_rank=0):
        self.rooms[room] = self.mgrs[mgr].create_receiver(room, host, port, dp_rank)
        return {}

    def poll(self, room):
        obj = self.rooms[room]
        return {"state": obj.poll().name, "reason": obj.failure_reason}

    def wait(self, room, states, timeout=20.0):
        obj = self.rooms[room]
        deadline = time.monotonic() + timeout
        while obj.poll().name not in states and time.monotonic() < deadline:
            time.sleep(0.0005)
        return {"state": obj.poll().name, "reason": obj.failure_reason, "t": time.monotonic()}

    def wait_closed(self, room, timeout=10.0):
        """Until the prefill said this (failed) room has no write queued or in flight (RoomClosed)."""
        obj = self.rooms[room]
        deadline = time.monotonic() + timeout
        while not obj.peer_closed and time.monotonic() < deadline:
            time.sleep(0.001)
        return {"closed": obj.peer_closed}

    def send(self, room, pages, is_last, aux=None):
        self.rooms[room].send(pages, is_last, AuxData(**aux) if aux else None)
        return {}

    def recv_init(self, mgr, room, pages, aux_slot=None):
        if aux_slot is None:
            aux_slot = self.mgrs[mgr].aux_pool.alloc()
        self.rooms[room].init(pages, aux_slot)
        return {"aux_slot": aux_slot}

    def aux(self, room):
        aux = self.rooms[room].aux()
        if aux is None:
            return None
        out = dict(aux.__dict__)
        if not out.pop("hidden"):  # JSON has no bytes: hex, only where one was sent
            return out
        return {**out, "hidden": aux.hidden.hex()}

    def abort(self, mgr, room, reason):
        self.mgrs[mgr].abort(room, reason)
        return {}

    def verify(self, mgr, pairs, untouched, src_seed, src_num_pages):
        """Compare dst pages with the source pool's pages regenerated from its seed."""
        pool = self.mgrs[mgr].pool
        src = make_pool(src_num_pages, pool.page_size)
        fill_random(src, src_seed)
        bad = []
        for dst_page, src_page in pairs:
            for i, (d, s) in enumerate(zip((*pool.k, *pool.v), (*src.k, *src.v))):
                if not torch.equal(d[:, dst_page], s[:, src_page]):  # head-major: pages are dim 1
                    bad.append([dst_page, src_page, i])
                    break
        dirty = [p for p in untouched if any(bool(t[:, p].any()) for t in (*pool.k, *pool.v))]
        return {"bad": bad, "dirty": dirty}

    def clear(self, mgr):
        for t in (*self.mgrs[mgr].pool.k, *self.mgrs[mgr].pool.v):
            t.zero_()
        return {}

    def close(self):
        for mgr in self.mgrs.values():
            mgr.close()
        for server in self.servers.values():
            server.stop_thread()
        return {}


def main() -> None:
    torch.set_num_threads(1)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # engine chatter on stdout would corrupt the protocol
    peer = Peer()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            result = {"ok": True, "result": getattr(peer, op)(**cmd)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
        out.write(json.dumps(result) + "\n")
        if op == "close":
            out.flush()
            # managers are closed; skip interpreter teardown, where UCX can linger for seconds
            # over endpoints to peers that died (the SIGKILL test)
            os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
