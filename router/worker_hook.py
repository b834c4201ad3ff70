"""A worker pod's lifecycle hooks (deploy/k8s): drain it on every router replica before it stops,
take it back after it started.

``python -m pdserve.router.worker_hook drain --router http://pdserve-router-pods:30000
--worker http://pdserve-decode-0.pdserve-decode:30000 --wait-secs 120`` calls ``POST
/workers/drain`` on every address the router's host name resolves to (a headless Service lists
every router pod), all at once, and returns when each answered (drained, or ``--wait-secs``
passed). ``undrain`` calls ``POST /workers/undrain`` the same way. Both are admin routes: the
hook sends ``--admin-api-key`` or ``PDSERVE_ROUTER_ADMIN_API_KEY`` (router/auth.py). A router that does not know
the worker, or does not answer, is reported and skipped: the hook always exits 0, because a
failing postStart hook would kill the container and a failing preStop hook changes nothing.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from pdserve.engine import env

CALL_MARGIN_S = 10.0  # beyond --wait-secs: the router answers once drained or after wait_secs


def router_urls(router: str) -> list[str]:
    """One base URL per address of the router's host (each replica behind a headless Service)."""
    parts = urlsplit(router)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        print(f"worker_hook: cannot resolve {parts.hostname}: {e}", file=sys.stderr)
        return []
    addrs = sorted({info[4][0] for info in infos})
    return [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}" for a in addrs]


def call(base: str, action: str, body: dict, api_key: str | None, timeout: float) -> str:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{base}/workers/{action}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.loads(r.read() or b"{}")
        return f"{base}: draining={answer.get('draining')} drained={answer.get('drained')} " \
               f"in_flight={answer.get('in_flight')}"
    except urllib.error.HTTPError as e:
        return f"{base}: HTTP {e.code} {e.read()[:200].decode(errors='replace')}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{base}: {type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m pdserve.router.worker_hook", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("drain", "undrain"))
    p.add_argument("--router", required=True, help="router base URL; every address of its host is called")
    p.add_argument("--worker", required=True, help="the worker's URL as the router knows it")
    p.add_argument("--wait-secs", type=float, default=0.0, help="drain: how long each router waits "
                                                               "for the worker's in-flight requests")
    p.add_argument("--admin-api-key", default=None,
                   help="the routers' --admin-api-key (default: PDSERVE_ROUTER_ADMIN_API_KEY); a router "
                        "without one takes drains from loopback peers only")
    args = p.parse_args(argv)
    key = args.admin_api_key or env.PDSERVE_ROUTER_ADMIN_API_KEY or None
    body = {"url": args.worker}
    if args.action == "drain":
        body["wait_secs"] = args.wait_secs
    urls = router_urls(args.router)
    with ThreadPoolExecutor(max(1, len(urls))) as pool:
        results = list(pool.map(lambda u: call(u, args.action, body, key,
                                               args.wait_secs + CALL_MARGIN_S), urls))
    for line in results or [f"no router address for {args.router}"]:
        print(f"worker_hook {args.action} {args.worker}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
