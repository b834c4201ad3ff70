"""Shared by the tests that put processes in network namespaces joined by veth pairs."""

from __future__ import annotations

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
