"""Helpers of the server tests: the real engine server as a subprocess on a free port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from pdserve.entrypoints.procs import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
TEST_MAX_TOTAL_TOKENS = 16384  # keep the KV pools small: several servers run side by side in CI
# One torch thread per rank: on a shared 2-core machine several OpenMP threads per process stall on each
# other's barriers (10x slower decode measured under load); the reference engine uses one as well.
TEST_NUM_THREADS = 1


def children_of(pid: int) -> list[int]:
    """Direct children of a process (from /proc)."""
    out = []
    task_dir = Path(f"/proc/{pid}/task")
    for task in task_dir.iterdir() if task_dir.exists() else []:
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def rank_pids(server_pid: int) -> dict[str, int]:
    """A server's scheduler processes (its children) by their process name (pdserve-dp0-tp1, ...)."""
    out = {}
    for pid in children_of(server_pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("pdserve-dp"):
            out[name] = pid
    return out


def is_running(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, admin_key: str | None = None):
        """``admin_key``: the control routes' key, given to the server in a file."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.admin_key = admin_key
        cmd = [sys.executable, "-m", "pdserve.engine", "--port", str(self.port),
               "--max-total-tokens", str(TEST_MAX_TOTAL_TOKENS), "--num-threads", str(TEST_NUM_THREADS),
               "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        if admin_key:
            key_file = Path(f"/tmp/pdserve-test-server-{self.port}.admin-key")
            key_file.write_text(admin_key + "\n")
            key_file.chmod(0o600)
            cmd += ["--admin-api-key-file", str(key_file)]
        self.log_path = Path(f"/tmp/pdserve-test-server-{self.port}.log")
        self._log = open(self.log_path, "wb")
        # not procs.spawn / stop_group: the server is signalled alone, because these tests check
        # that the server itself stops its scheduler ranks (a group stop would hide a leak)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def admin_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def control(self, path: str, json=None, **kw) -> requests.Response:
        """POST a control route (JSON, the admin key when the server has one)."""
        return requests.post(self.url + path, json={} if json is None else json, headers=self.admin_headers,
                             timeout=120, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 240.0) -> "ServerProcess":
        try:
            wait_healthy(self.url, self.proc, timeout, name="server", log=self.log)
        except TimeoutError:
            self.stop()
            raise
        return self

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, headers=self.headers, timeout=60, **kw)

    def post(self, path: str, json=None, **kw) -> requests.Response:
        return requests.post(self.url + path, json=json, headers=self.headers, timeout=120, **kw)

    def server_info(self) -> dict:
        r = self.get("/get_server_info")
        r.raise_for_status()
        return r.json()

    def wait_idle_and_unleaked(self, timeout: float = 15.0) -> dict:
        """Wait until no request runs and, after a cache flush, every page is free."""
        deadline = time.monotonic() + timeout
        states = []
        while time.monotonic() < deadline:
            self.control("/flush_cache")
            states = self.server_info()["internal_states"]
            if all(
                s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0 and s["inflight"] == 0
                and s["num_free_pages"] == s["num_total_pages"]
                for s in states
            ):
                return states
            time.sleep(0.2)
        raise AssertionError(f"pages still in use or requests running: {states}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def post_to_groups(server: "ServerProcess", prompts: list[list[int]], sampling: dict) -> list:
    """Each prompt posted to ``/generate`` at once from its own thread, prompt i to DP-attention
    group ``i % 2`` (``routed_dp_rank``), so both groups run together; the responses in order."""
    results: list = [None] * len(prompts)

    def ask(i: int) -> None:
        results[i] = server.post("/generate", {"input_ids": prompts[i], "sampling_params": sampling,
                                               "routed_dp_rank": i % 2})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def greedy_ref(engine, input_ids: list[int], max_new_tokens: int) -> dict:
    return engine.generate(input_ids=input_ids, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def kill_tree_quietly(pid: int) -> None:
    for c in children_of(pid):
        try:
            os.kill(c, signal.SIGKILL)
        except ProcessLookupError:
            pass
