"""Prefill and decode in two network namespaces joined by a veth pair: the bytes cross an interface."""

from __future__ import annotations

import os
import random
import subprocess

import pytest

from support.netns_util import add_netns_or_skip, del_netns, ip, tx_bytes
from test_two_process_transfer import NUM_PAGES, Pair

pytestmark = pytest.mark.timeout(150)

P_ADDR, D_ADDR = "198.51.100.1", "198.51.100.2"  # documentation range (RFC 5737)


@pytest.fixture(scope="module")
def netns():
    tag = f"{os.getpid() % 100000}"
    ns_p, ns_d, dev_p, dev_d = f"pdkv-p{tag}", f"pdkv-d{tag}", f"pdkvp{tag}", f"pdkvd{tag}"
    add_netns_or_skip(ns_p)
    try:
        ip("netns", "add", ns_d)
        ip("link", "add", dev_p, "type", "veth", "peer", "name", dev_d)
        for ns, dev, addr in ((ns_p, dev_p, P_ADDR), (ns_d, dev_d, D_ADDR)):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield ns_p, ns_d, dev_p
    finally:
        # deleting a namespace deletes the veth end inside it, and with it the pair
        del_netns(ns_p, ns_d)
        subprocess.run(["ip", "link", "del", dev_p], capture_output=True, timeout=10)


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_transfer_across_veth(netns, backend):
    ns_p, ns_d, dev_p = netns
    # within one host UCX would pick shared memory; force TCP so the bytes use the veth
    pair = Pair(backend, p_netns=ns_p, d_netns=ns_d, env={"UCX_TLS": "tcp"})
    try:
        pair.start(p_host=P_ADDR, d_host=D_ADDR)
        before = tx_bytes(ns_p, dev_p)
        rng = random.Random(7)
        src = rng.sample(range(1, NUM_PAGES), 30)
        dst = rng.sample(range(1, NUM_PAGES), 30)
        aux = {"token_id": 17, "logprob": -0.125, "top_ids": [17], "top_logprobs": [-0.125], "cached_tokens": 32}
        room = pair.transfer(src, dst, chunks=2, aux=aux)
        assert pair.D.call("aux", room=room) == aux
        kv_bytes = 30 * 2 * 30 * 16 * 3 * 64 * 2  # pages x K/V x layers x page tokens x heads x dim x bf16
        assert tx_bytes(ns_p, dev_p) - before >= kv_bytes
    finally:
        pair.close()
