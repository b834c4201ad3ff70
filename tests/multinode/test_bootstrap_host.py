"""Where a multi-node prefill server's ranks register: node 0's bootstrap server, on every node."""

from __future__ import annotations

import pytest

from pdserve.entrypoints.flags import parse_serve_args
from pdserve.entrypoints.serve import _check_bootstrap_host


def config(*args: str):
    return parse_serve_args(["--disaggregation-mode", "prefill", "--disaggregation-allow-unauthenticated", *args])


def test_every_node_registers_at_node_0():
    two = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:5000"]
    assert config("--host", "10.0.0.2", "--node-rank", "1", *two).bootstrap_host == "10.0.0.1"
    assert config("--host", "10.0.0.1", "--node-rank", "0", *two).bootstrap_host == "10.0.0.1"
    lws = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "pdserve-prefill-0.pdserve-prefill:5000"]
    assert config("--host", "10.0.0.9", "--node-rank", "1", *lws).bootstrap_host == "pdserve-prefill-0.pdserve-prefill"
    assert config("--host", "10.0.0.2").bootstrap_host == "10.0.0.2"  # one node: its own


def test_node_0_must_listen_where_the_ranks_register():
    two = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:5000"]
    with pytest.raises(ValueError, match="register with the bootstrap server at --dist-init-addr's host 10.0.0.1"):
        _check_bootstrap_host(config("--host", "10.0.0.3", *two))
    _check_bootstrap_host(config("--host", "0.0.0.0", *two))
    _check_bootstrap_host(config("--host", "10.0.0.1", *two))
    _check_bootstrap_host(config("--host", "10.0.0.3", "--tp-size", "2", "--nnodes", "2",
                                 "--dist-init-addr", "leader.example:5000"))  # a name: not checked
