"""The transfer engines listen on ``--host`` where the backend allows it.

NIXL (UCX): listeners only on the interface of ``host`` (``UCX_NET_DEVICES``), checked from the
process's own listening sockets. Mooncake: its handshake RPC port and TCP transport listen on every
interface whatever ``host`` says (this build has no knob that changes it; README, security), which
this test records so that a Mooncake that learns to bind shows up here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.kvtransfer.engines.netdev import interface_of

pytestmark = pytest.mark.timeout(120)

# in a child: the engine's environment (UCX_NET_DEVICES) must not leak into this test process
_LISTENERS = r'''
import ctypes, os, socket, struct, sys
from pdserve.kvtransfer.engines.transfer_engine import create_transfer_engine
engine = create_transfer_engine(sys.argv[1], "127.0.0.1")
buf = ctypes.create_string_buffer(1 << 16)
engine.register(ctypes.addressof(buf), 1 << 16)
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        inodes.add(link[8:-1])
for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:  # LISTEN
            addr = f[1].split(":")[0]
            if len(addr) == 8:
                print("LISTEN", socket.inet_ntoa(struct.pack("<I", int(addr, 16))))
            else:
                print("LISTEN", "v6:" + addr)
sys.stdout.flush()
os._exit(0)  # the engines' own atexit teardown is not what this checks (NIXL's can crash at exit)
'''


def _listeners(backend: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    out = subprocess.run([sys.executable, "-c", _LISTENERS, backend], capture_output=True, text=True, env=env,
                         timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return [line.split()[1] for line in out.stdout.splitlines() if line.startswith("LISTEN ")]


def test_nixl_listens_on_the_host_interface_only():
    pytest.importorskip("nixl")
    assert interface_of("127.0.0.1") == "lo"
    addrs = _listeners("nixl")
    assert addrs and set(addrs) == {"127.0.0.1"}, addrs


def test_mooncake_listens_on_every_interface():
    pytest.importorskip("mooncake")
    addrs = _listeners("mooncake")
    assert "0.0.0.0" in addrs, addrs  # the handshake RPC port: Mooncake gives no way to bind it
