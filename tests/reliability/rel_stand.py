"""Helpers of the reliability tests: a router process, listening sockets of a process group, page counts."""

from __future__ import annotations

import os
import sys

from pd_stand import Proc, Server

from pdserve.engine.procs import free_port, group_pids, wait_healthy

class Router(Proc):
    """``python -m pdserve.router`` in front of prefill (with bootstrap port) and decode servers."""

    def __init__(self, name: str, prefills: list[Server], decodes: list[Server], *extra: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning"]
        for p in prefills:
            cmd += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in decodes:
            cmd += ["--decode", d.url]
        super().__init__(name, cmd + list(extra))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> "Router":
        wait_healthy(self.url, self.proc, timeout, name=self.name, log=self.log, period=0.2)
        return self


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        pass
    return inodes


def _hex_ip4(h: str) -> str:
    b = bytes.fromhex(h)
    return ".".join(str(x) for x in b[::-1])


def listening(pgid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by the process group (v4 and v6)."""
    found: set[tuple[str, int]] = set()
    for pid in group_pids(pgid):
        inodes = _socket_inodes(pid)
        for table, v6 in (("tcp", False), ("tcp6", True)):
            try:
                lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state != "0A" or inode not in inodes:  # 0A = LISTEN
                    continue
                addr_hex, port_hex = local.split(":")
                addr = ("::" if set(addr_hex) == {"0"} else addr_hex) if v6 else _hex_ip4(addr_hex)
                found.add((addr, int(port_hex, 16)))
    return sorted(found)


def pages(server: Server) -> list[tuple[int, int]]:
    """(free, total) pages of each rank."""
    return [(s["num_free_pages"], s["num_total_pages"]) for s in server.states()]
