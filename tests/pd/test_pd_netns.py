"""1P1D with prefill, decode and the router in three network namespaces joined by a bridge.

The KV crosses veth interfaces between distinct addresses (198.51.100.0/24, RFC 5737);
the bootstrap host is the prefill namespace's address. Needs root (``ip netns``);
skipped with the reason where that is not permitted. The namespaces are removed
whatever happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from support.netns_util import add_netns_or_skip, del_netns, ip, tx_bytes
from support.pd_stand import Proc, Server, greedy_body, prompt_ids

pytestmark = pytest.mark.timeout(400)

NET = "198.51.100"
ADDRS = {"p": f"{NET}.11", "d": f"{NET}.12", "r": f"{NET}.13"}


@pytest.fixture(scope="module")
def netns():
    tag = f"{os.getpid() % 100000}"
    hub = f"pdpd-hub{tag}"
    names = {k: f"pdpd-{k}{tag}" for k in ADDRS}
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
            ip("-n", ns, "addr", "add", f"{ADDRS[k]}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        del_netns(*names.values(), hub)


def ns_request(ns: str, method: str, url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    """An HTTP request made from inside a namespace (the test process itself sits outside them)."""
    code = (
        "import json, sys, requests\n"
        f"r = requests.request({method!r}, {url!r}, json={body!r}, timeout={timeout})\n"
        "sys.stdout.write(json.dumps([r.status_code, r.text]))\n"
    )
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout + 30)
    if out.returncode != 0:
        return 0, out.stderr[-2000:]
    status, text = json.loads(out.stdout)
    return status, text


def wait_up(ns: str, url: str, proc: Proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, proc.log()
        if ns_request(ns, "GET", url, timeout=2)[0] == 200:
            return
        time.sleep(1.0)
    raise TimeoutError(f"{url} not up in {ns}:\n{proc.log()}")


def test_1p1d_router_across_three_namespaces(netns, reference, request):
    request.getfixturevalue("colocated")
    prefix = lambda k: ["ip", "netns", "exec", netns[k]]  # noqa: E731
    P = Server("netns-P", "prefill", "--max-total-tokens", "2048", host=ADDRS["p"], cmd_prefix=prefix("p"))
    D = Server("netns-D", "decode", "--max-total-tokens", "2048", host=ADDRS["d"], cmd_prefix=prefix("d"))
    router = None
    try:
        wait_up(netns["p"], P.url + "/health", P)
        wait_up(netns["d"], D.url + "/health", D)
        router_url = f"http://{ADDRS['r']}:30000"
        router = Proc("netns-router", [sys.executable, "-m", "pdserve.router", "--prefill", P.url,
                                       str(P.bootstrap_port), "--decode", D.url, "--host", ADDRS["r"],
                                       "--port", "30000"], cmd_prefix=prefix("r"))
        wait_up(netns["r"], router_url + "/health", router, timeout=60)
        before = tx_bytes(netns["p"], "ethp")
        ids = prompt_ids(150, seed=77)
        status, text = ns_request(netns["r"], "POST", router_url + "/generate", greedy_body(ids, 6))
        assert status == 200, text
        assert json.loads(text)["output_ids"] == reference(ids, 6)
        # 150 tokens of KV: 30 layers x K/V x 3 heads x 64 dims x fp32 left the prefill namespace
        kv_bytes = 150 * 30 * 2 * 3 * 64 * 4
        assert tx_bytes(netns["p"], "ethp") - before >= kv_bytes
    finally:
        if router is not None:
            router.stop()
        P.stop()
        D.stop()
