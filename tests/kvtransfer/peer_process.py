"""Test-side handle on a ``kv_peer.py`` process (optionally inside a network namespace)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

PEER_SCRIPT = Path(__file__).with_name("kv_peer.py")


class PeerProcess:
    def __init__(self, netns: str | None = None, env: dict[str, str] | None = None):
        cmd = [sys.executable, str(PEER_SCRIPT)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        # UCX_NET_DEVICES only when asked: an in-process NIXL engine of an earlier test set it in this
        # process for its own host (lo), which would bind a child in a network namespace to lo
        inherited = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
        full_env = {**inherited, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env
        )
        self._lines: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self._stderr.append), daemon=True).start()

    @staticmethod
    def _pump(stream, sink):
        for line in stream:
            sink(line)

    def call(self, op: str, timeout: float = 60.0, **kw):
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"peer did not answer {op} in {timeout}s; stderr tail:\n{self.stderr_tail()}") from None
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"peer {op} failed: {reply['error']}\n{reply.get('tb', '')}")
        return reply["result"]

    def stderr_tail(self, n: int = 30) -> str:
        return "".join(self._stderr[-n:])

    def sigkill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close", timeout=15)
                self.proc.wait(10)
            except Exception:  # noqa: BLE001 - kill what we started, whatever state it is in
                self.proc.kill()
                self.proc.wait(10)
