"""Helpers of the reliability tests: a router process, listening sockets of a process group, page counts."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

from support.pd_stand import Proc, Server

from pdserve.entrypoints.procs import free_port, group_pids, wait_healthy


def load_soak():
    """``scripts/soak.py`` as the module ``soak`` (its dataclasses look their module up by name)."""
    spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[2] / "scripts" / "soak.py")
    soak = sys.modules.setdefault("soak", importlib.util.module_from_spec(spec))
    if not hasattr(soak, "run_load"):
        spec.loader.exec_module(soak)
    return soak


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


@contextlib.contextmanager
def pd22(prefix: str, server_args: list[str], router_args: list[str], before_stop=None):
    """2 prefill + 2 decode servers and a router in front; yields ``(prefills, decodes, router)`` and
    stops them all at the end (``before_stop(process)`` first, e.g. a SIGCONT to a stopped one)."""
    ps = [Server(f"{prefix}-P{i}", "prefill", *server_args) for i in range(2)]
    ds = [Server(f"{prefix}-D{i}", "decode", *server_args) for i in range(2)]
    r = None
    try:
        for s in ps + ds:
            s.wait_ready()
        r = Router(f"{prefix}-router", ps, ds, *router_args).wait_ready()
        yield ps, ds, r
    finally:
        for s in [r, *ps, *ds]:
            if s is not None:
                if before_stop is not None:
                    before_stop(s)
                s.stop()

