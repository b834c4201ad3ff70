"""Which hosts a decode server may fetch a bootstrap route from (``--disaggregation-bootstrap-allowlist``).

A request's ``bootstrap_host`` names the prefill server whose bootstrap server the decode asks
for the route. The router sets it; a client calling a decode server directly could name any
host, making the decode fetch from it (server-side request forgery). With an allowlist (hosts
or CIDRs, comma-separated) a decode server refuses any other ``bootstrap_host`` with a 400 that
names the field, before any lookup.
"""

from __future__ import annotations

import ipaddress
import socket

Allowlist = tuple[frozenset[str], tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]]


def parse_allowlist(text: str) -> Allowlist:
    """(host names, networks) from ``text``; ValueError naming a bad entry."""
    names, nets = set(), []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            if "/" in entry or " " in entry:
                raise ValueError(f"bootstrap_allowlist entry {entry!r} is not a host or a CIDR") from None
            names.add(entry.lower())
    return frozenset(names), tuple(nets)


def host_allowed(allow: Allowlist, host: str) -> bool:
    """Whether ``host`` (a name or an address) is on the list; an empty list allows every host."""
    names, nets = allow
    if not names and not nets:
        return True
    if host.lower() in names:
        return True
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False  # a name not listed: never resolved here, so DNS cannot widen the list
    return any(addr in n for n in nets)


def is_loopback(host: str) -> bool:
    """True for loopback addresses and ``localhost``; a wildcard or any other address is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def is_loopback_peer(remote: str | None) -> bool:
    """True when a connection's peer address (an IP, never a name) is a loopback address, a
    dual-stack socket's ``::ffff:127.0.0.1`` included. Nothing is resolved: a peer is what it is."""
    if not remote:
        return False
    try:
        addr = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback
