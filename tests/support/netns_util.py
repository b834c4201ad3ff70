"""Shared by the tests that put processes in network namespaces joined by veth pairs."""

from __future__ import annotations

import socket
import subprocess

import pytest


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def tx_bytes(ns: str, dev: str) -> int:
    """Bytes sent so far by interface ``dev`` inside namespace ``ns``."""
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
                         check=True, capture_output=True, text=True, timeout=10)
    return int(out.stdout)


def add_netns_or_skip(name: str) -> None:
    """Create namespace ``name``; skip the test, saying why, where this host does not permit it."""
    try:
        ip("netns", "add", name)
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as e:
        pytest.skip(f"`ip netns add` not permitted here: {(getattr(e, 'stderr', '') or str(e)).strip()}")


def del_netns(*names: str) -> None:
    """Delete namespaces (and with them the veth ends inside); missing ones are fine."""
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def outward_address() -> str:
    """This host's address on its default route (no packet is sent); the test skips without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            pytest.skip("this host has no non-loopback IPv4 route")
        addr = s.getsockname()[0]
    if addr.startswith("127."):
        pytest.skip("this host has no non-loopback IPv4 address")
    return addr
