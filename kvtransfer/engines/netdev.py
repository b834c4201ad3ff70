"""Which network interface holds an address (Linux, IPv4): to bind a transfer engine to ``--host``."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_of(host: str) -> str | None:
    """The name of the interface whose IPv4 address is ``host`` (``lo`` for 127.0.0.1); None for a
    wildcard, a name, an IPv6 address or an address no interface holds."""
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        return None
    if addr.is_unspecified:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == str(addr):
                return name
    return None
