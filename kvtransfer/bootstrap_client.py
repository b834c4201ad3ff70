"""The one client of a prefill server's bootstrap server (``kvtransfer/bootstrap_server.py``).

Blocking calls over ``urllib``: the KV managers and the decode loop run them on worker
threads, never on the scheduler thread. Errors are the ``urllib`` ones (``HTTPError`` carries
the status: 503 while not every prefill rank registered, 404 for an unknown rank, 400 for a
rejected registration) or ``msgspec`` decode errors for a malformed answer.
"""

from __future__ import annotations

import urllib.request

import msgspec

from pdserve.engine.kv_auth import AUTH_HEADER, FrameAuth
from pdserve.kvtransfer.messages import RankRegistration, Topology

TIMEOUT_S = 5.0


def route_url(host: str, port: int) -> str:
    return f"http://{host}:{port}/route"


def register_rank(host: str, port: int, reg: RankRegistration, auth: FrameAuth | None = None) -> None:
    """``PUT /route``: announce a prefill rank (signed with ``auth``, the ``bootstrap`` FrameAuth, if given)."""
    body = msgspec.json.encode(reg)
    req = urllib.request.Request(route_url(host, port), data=body, method="PUT")
    req.add_header("Content-Type", "application/json")
    if auth is not None:
        req.add_header(AUTH_HEADER, auth.http_header("PUT", "/route", body))
    with urllib.request.urlopen(req, timeout=TIMEOUT_S):
        pass


def fetch_rank(host: str, port: int, dp_rank: int, tp_rank: int = 0) -> RankRegistration:
    """``GET /route?dp_rank=&tp_rank=``: one prefill rank's control endpoint and KV layout."""
    url = f"{route_url(host, port)}?dp_rank={dp_rank}&tp_rank={tp_rank}"
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
        return msgspec.json.decode(resp.read(), type=RankRegistration)


def fetch_topology(host: str, port: int) -> Topology:
    """``GET /route``: every rank of the prefill server (its DP and TP sizes)."""
    with urllib.request.urlopen(route_url(host, port), timeout=TIMEOUT_S) as resp:
        return msgspec.json.decode(resp.read(), type=Topology)
