"""``pdserve launch --hicache-storage-backend mooncake`` runs Mooncake Store itself: every server is
told where its master is, and the store's processes start before and stop after the servers."""

from __future__ import annotations

import json
import socket

from pdserve.entrypoints.flags import build_serve_parser
from pdserve.entrypoints.cluster import Cluster, wants_managed_store
from pdserve.entrypoints.launch_flags import parse_launch_args
from pdserve.entrypoints.procs import group_pids


def test_launch_manages_the_store_the_servers_name(tmp_path):
    config = parse_launch_args(["--log-dir", str(tmp_path), "--port", "0", "--enable-hierarchical-cache",
                                "--hicache-storage-backend=mooncake"], build_serve_parser)
    cluster = Cluster(config)
    servers = [s for s in cluster.specs if s.name != "router"]
    for s in servers:
        extra = json.loads(s.argv[s.argv.index("--hicache-storage-backend-extra-config") + 1])
        assert extra == cluster.store.extra_config()
    assert "--hicache-storage-backend-extra-config" not in cluster.specs[-1].argv  # not the router's
    cluster.store.start()
    try:
        host, port = extra["master_server_address"].split(":")
        socket.create_connection((host, int(port)), timeout=2).close()
        pids = [cluster.store.master.pid, cluster.store.client.pid]
    finally:
        cluster.stop()
    assert not any(group_pids(p) for p in pids)


def test_a_store_named_by_the_user_is_not_managed():
    assert not wants_managed_store(("--hicache-storage-backend", "mooncake",
                                    "--hicache-storage-backend-extra-config", '{"master_server_address": "h:1"}'))
    assert not wants_managed_store(("--hicache-storage-backend", "file"))
    assert wants_managed_store(("--hicache-storage-backend", "mooncake"))
