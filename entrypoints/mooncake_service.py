"""Mooncake Store as managed processes: the master and the memory that holds the objects.

``mooncake_master`` keeps the objects' metadata (and, with
``--enable_http_metadata_server``, the transfer engine's metadata too, so no
etcd is needed); the bytes live in segments mounted by clients. A standalone
``mooncake_client`` mounts ``segment_size`` bytes, so objects outlive the
servers that wrote them (a restarted server finds its old prefixes). Servers
then contribute no memory themselves (``global_segment_size`` 0). Both binaries
ship in the mooncake-transfer-engine wheel, beside this Python.

``extra_config()`` is the ``--hicache-storage-backend-extra-config`` a server
needs to reach this store.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from pdserve.entrypoints.procs import free_port, spawn, stop_groups


def binary(name: str) -> str:
    """``mooncake_master`` or ``mooncake_client``: beside this interpreter, else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    found = here if os.path.exists(here) else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found beside {sys.executable} nor on PATH "
                                "(it ships in the mooncake-transfer-engine wheel)")
    return found


def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{proc.args[0]} did not listen on {host}:{port} within {timeout} s")


@dataclass
class MooncakeService:
    log_dir: str
    host: str = "127.0.0.1"
    segment_size: str = "1GB"  # the standalone client's memory for objects
    rpc_port: int = 0  # 0: a free port
    http_port: int = 0
    master: subprocess.Popen | None = None
    client: subprocess.Popen | None = None

    def __post_init__(self):
        self.rpc_port = self.rpc_port or free_port(self.host)
        self.http_port = self.http_port or free_port(self.host)

    def extra_config(self) -> dict:
        return {
            "master_server_address": f"{self.host}:{self.rpc_port}",
            "metadata_server": f"http://{self.host}:{self.http_port}/metadata",
            "local_hostname": self.host,
            "protocol": "tcp",
        }

    def start_master(self, timeout: float = 30.0) -> None:
        self.master = spawn([
            binary("mooncake_master"), f"--rpc_port={self.rpc_port}", "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}", f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={free_port(self.host)}", "--eviction_high_watermark_ratio=0.9",
        ], os.path.join(self.log_dir, "mooncake_master.log"), die_with_parent=True)
        _wait_port(self.host, self.rpc_port, self.master, timeout)
        _wait_port(self.host, self.http_port, self.master, timeout)

    def start_client(self, timeout: float = 30.0) -> None:
        port = free_port(self.host)
        self.client = spawn([
            binary("mooncake_client"), f"--host={self.host}", f"--port={port}",
            f"--master_server_address={self.host}:{self.rpc_port}",
            f"--metadata_server=http://{self.host}:{self.http_port}/metadata",
            f"--global_segment_size={self.segment_size}", "--protocol=tcp",
        ], os.path.join(self.log_dir, "mooncake_client.log"), die_with_parent=True)
        _wait_port(self.host, port, self.client, timeout)

    def start(self) -> "MooncakeService":
        self.start_master()
        self.start_client()
        return self

    def stop(self) -> None:
        stop_groups([p for p in (self.client, self.master) if p is not None], grace=5.0)
        self.client = self.master = None
