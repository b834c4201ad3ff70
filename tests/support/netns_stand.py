"""Namespaces joined by one bridge, and HTTP requests made from inside one of them.

Each name in ``ADDRS`` gets a namespace with one veth end (``eth<name>``) at its
address (198.51.100.0/24, RFC 5737) on a bridge in a hub namespace. The test
process stays outside them, so it reaches the servers through ``ns_request``.
Everything is deleted at the end, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

from support.netns_util import add_netns_or_skip, del_netns, ip
from support.pd_stand import ADMIN_HEADERS

NET = "198.51.100"


@contextlib.contextmanager
def namespaces(addrs: dict[str, str]):
    """Yields name -> namespace; ``addrs``: name -> address (its interface is ``eth<name>``; the
    bridge's end of it, in the hub namespace, is cut by ``cut_link(names, name)``)."""
    tag = f"{os.getpid() % 100000}"
    hub = f"pdmn-hub{tag}"
    names = {k: f"pdmn-{k}{tag}" for k in addrs}
    add_netns_or_skip(hub)
    try:
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        for k, ns in names.items():
            ip("netns", "add", ns)
            inner, outer = f"eth{k}", f"veth{k}{tag}"
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "netns", hub)
            ip("-n", hub, "link", "set", outer, "master", "br0")
            ip("-n", hub, "link", "set", outer, "up")
            ip("-n", ns, "addr", "add", f"{addrs[k]}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        del_netns(*names.values(), hub)


def cut_link(names: dict[str, str], key: str) -> None:
    """Take namespace ``key``'s link to the bridge down (its veth end in the hub): its packets
    are dropped from now on, with no reset sent to either side."""
    tag = names[key][len(f"pdmn-{key}"):]
    ip("-n", f"pdmn-hub{tag}", "link", "set", f"veth{key}{tag}", "down")


def ns_request(ns: str, method: str, url: str, body: dict | None = None, timeout: float = 120,
               headers: dict | None = None) -> tuple[int, str]:
    """An HTTP request made from inside namespace ``ns``: (status, text); status 0 if it could not be made."""
    code = (
        "import json, sys, requests\n"
        f"r = requests.request({method!r}, {url!r}, json={body!r}, headers={headers!r}, timeout={timeout})\n"
        "sys.stdout.write(json.dumps([r.status_code, r.text]))\n"
    )
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout + 30)
    if out.returncode != 0:
        return 0, out.stderr[-2000:]
    status, text = json.loads(out.stdout)
    return status, text


def ns_requests_started(ns: str, url: str, bodies: list[dict], delays: list[float], timeout: float = 120
                        ) -> subprocess.Popen:
    """POST each of ``bodies`` to ``url`` from inside namespace ``ns``, body i ``delays[i]`` s after the
    first; returns once they are on their way. ``ns_requests_results`` gives [status, text, seconds]
    per body (seconds from its own send)."""
    code = (
        "import json, sys, threading, time, requests\n"
        f"bodies, delays, out = {bodies!r}, {delays!r}, [None] * {len(bodies)}\n"
        "def one(i):\n"
        "    time.sleep(delays[i])\n"
        "    t0 = time.monotonic()\n"
        "    try:\n"
        f"        r = requests.post({url!r}, json=bodies[i], timeout={timeout})\n"
        "        out[i] = [r.status_code, r.text, time.monotonic() - t0]\n"
        "    except Exception as e:\n"
        "        out[i] = [0, repr(e), time.monotonic() - t0]\n"
        "ts = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]\n"
        "[t.start() for t in ts]\n"
        "print('started', flush=True)\n"
        "[t.join() for t in ts]\n"
        "print(json.dumps(out), flush=True)\n"
    )
    p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "started", p.stderr.read()
    return p


def ns_requests_results(p: subprocess.Popen, timeout: float) -> list[list]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def wait_up(ns: str, url: str, procs, timeout: float = 300) -> None:
    """Until ``url`` answers 200 from inside ``ns``; fails at once if one of ``procs`` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.proc.poll() is None, f"{p.name} died:\n{p.log()}"
        if ns_request(ns, "GET", url, timeout=2)[0] == 200:
            return
        time.sleep(1.0)
    raise TimeoutError(f"{url} not up in {ns}:\n" + "\n".join(p.log() for p in procs))


def wait_unleaked(ns: str, url: str, timeout: float = 30.0) -> None:
    """Every rank of the server at ``url`` idle and, after a cache flush, every page free."""
    deadline = time.monotonic() + timeout
    states = None
    while time.monotonic() < deadline:
        ns_request(ns, "POST", url + "/flush_cache", {}, timeout=10, headers=ADMIN_HEADERS)
        status, text = ns_request(ns, "GET", url + "/get_server_info", timeout=10)
        if status == 200:
            states = json.loads(text)["internal_states"]
            if all(s["inflight"] == 0 and s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0
                   and s["num_free_pages"] == s["num_total_pages"] for s in states):
                return
        time.sleep(0.5)
    raise AssertionError(f"{url}: pages in use or requests left: {states}")
