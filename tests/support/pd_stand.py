"""Helpers of the PD tests: real pdserve servers (colocated, prefill, decode) and routers as subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from pdserve.engine.net_allowlist import is_loopback
from pdserve.entrypoints.procs import free_port, signal_group, spawn, stop_group, wait_healthy
from pdserve.router.config import RouterConfig
from pdserve.router.server import start_router

REPO = Path(__file__).resolve().parents[2]
# exactness is asserted: fp32; small pools and chunks so chunking and exhaustion are exercised cheaply
COMMON = ["--dtype", "float32", "--chunked-prefill-size", "64", "--num-threads", "1", "--log-level", "warning"]
FAST_KV = ["--disaggregation-heartbeat-interval", "1.0", "--disaggregation-heartbeat-max-failures", "3",
           "--disaggregation-bootstrap-timeout", "4", "--disaggregation-waiting-timeout", "20",
           # a failed room's pages come back within the tests' unleaked waits when its prefill was killed
           "--disaggregation-quarantine-timeout", "5"]


class Proc:
    """A subprocess with its log in /tmp; ``cmd_prefix`` runs it elsewhere (``ip netns exec NS``)."""

    def __init__(self, name: str, cmd: list[str], env: dict | None = None, cmd_prefix: list[str] | None = None):
        self.name = name
        self.cmd = cmd
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PDSERVE_NUM_THREADS": "1", **(env or {})}
        self.cmd_prefix = cmd_prefix or []
        self.log_path = Path(f"/tmp/pdserve-pd-{name}-{os.getpid()}.log")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = spawn(self.cmd_prefix + self.cmd, self.log_path, env=self.env, cwd=REPO)

    def log(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def send(self, sig) -> None:
        """Signal the whole process group (the server and its scheduler ranks), without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc, sig)

    def kill(self, sig=signal.SIGKILL) -> None:
        """Signal the whole process group and wait until none of it is left (SIGKILL after 10 s)."""
        if self.proc is not None:
            stop_group(self.proc, grace=10.0, sig=sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


# The control routes' key of servers on a non-loopback host (without one they answer loopback peers only)
STAND_ADMIN_KEY = "pd-stand-admin-key"
ADMIN_HEADERS = {"Authorization": f"Bearer {STAND_ADMIN_KEY}"}


class Server(Proc):
    """``pdserve serve`` with a mode; ``host`` is where it listens (and where its KV manager is reached).
    Off loopback it takes ``STAND_ADMIN_KEY`` for its control routes."""

    def __init__(self, name: str, mode: str = "null", *extra: str, host: str = "127.0.0.1",
                 backend: str = "mooncake", cmd_prefix: list[str] | None = None, env: dict | None = None):
        self.host = host
        self.port = free_port()
        self.bootstrap_port = free_port() if mode == "prefill" else None
        self.mode = mode
        cmd = [sys.executable, "-m", "pdserve.engine", "--host", host, "--port", str(self.port),
               "--disaggregation-mode", mode, *COMMON]
        if mode != "null":
            cmd += ["--disaggregation-transfer-backend", backend, *FAST_KV]
            if not is_loopback(host) and "--disaggregation-auth-key-file" not in extra:
                # the test network is private: say so, as a PD server on such a host requires
                cmd += ["--disaggregation-allow-unauthenticated"]
        if self.bootstrap_port:
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        cmd += extra  # last: overrides the defaults above
        if not is_loopback(host):
            env = {"PDSERVE_ADMIN_API_KEY": STAND_ADMIN_KEY, **(env or {})}
        super().__init__(name, cmd, env=env, cmd_prefix=cmd_prefix)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> "Server":
        wait_healthy(self.url, self.proc, timeout, name=self.name, log=self.log)
        return self

    def post(self, path: str, body: dict, timeout: float = 120, **kw) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout, **kw)

    def states(self) -> list[dict]:
        return requests.get(self.url + "/get_server_info", timeout=10).json()["internal_states"]

    def wait_unleaked(self, timeout: float = 20.0) -> None:
        """Every rank idle and, after a cache flush, every page free; the server still healthy.

        (A rank whose idle integrity check fails dies, which turns /health to 503.)
        """
        deadline = time.monotonic() + timeout
        states: list[dict] = []
        while time.monotonic() < deadline:
            requests.post(self.url + "/flush_cache", json={}, headers=ADMIN_HEADERS, timeout=10)
            states = self.states()
            if all(s["inflight"] == 0 and s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0
                   and s["num_free_pages"] == s["num_total_pages"] for s in states):
                assert requests.get(self.url + "/health", timeout=5).status_code == 200, self.log()
                return
            time.sleep(0.2)
        raise AssertionError(f"{self.name}: pages in use or requests left: {states}\n{self.log()}")


def new_room() -> int:
    return random.getrandbits(63)


def pd_post(prefill: Server, decode: Server, path: str, body: dict, prefill_dp_rank: int | None = None,
            decode_dp_rank: int | None = None, room: int | None = None, timeout: float = 120):
    """Send one request to a prefill and a decode server at once, as a router pairs it: (prefill, decode) answers."""
    room = new_room() if room is None else room
    common = dict(body, bootstrap_host=prefill.host, bootstrap_port=prefill.bootstrap_port, bootstrap_room=room)
    if prefill_dp_rank is not None:
        common["disagg_prefill_dp_rank"] = prefill_dp_rank
    p_body, d_body = dict(common), dict(common)
    if decode_dp_rank is not None:
        d_body["routed_dp_rank"] = decode_dp_rank
    out: dict = {}

    def leg():
        try:
            out["p"] = prefill.post(path, p_body, timeout=timeout)
        except requests.RequestException as e:
            out["p"] = e

    t = threading.Thread(target=leg)
    t.start()
    try:
        d = decode.post(path, d_body, timeout=timeout)
    except requests.RequestException as e:
        d = e
    t.join(timeout)
    return out.get("p"), d


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def greedy_body(ids: list[int], max_new: int) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}


# the prompts a model's PD test compares: a repeated pattern, a short one, one of several pages
PD_CHECK_PROMPTS = ([5, 17, 99, 200, 311, 7] * 9, [3, 40, 41, 42], list(range(100, 230)))


def assert_pd_equals_colocated(colocated: Server, prefill: Server, decode: Server, max_new: int) -> None:
    """Greedy output through ``prefill`` -> ``decode`` equals ``colocated``'s for each of
    ``PD_CHECK_PROMPTS``, and both PD servers end with no page leaked."""
    for n, ids in enumerate(PD_CHECK_PROMPTS):
        body = greedy_body(ids, max_new)
        ref = colocated.post("/generate", body)
        assert ref.status_code == 200, ref.text
        pr, dr = pd_post(prefill, decode, "/generate", body)
        assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text)
        assert dr.json()["output_ids"] == ref.json()["output_ids"], n
    prefill.wait_unleaked()
    decode.wait_unleaked()


def events_flag() -> str:
    return (f'{{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{free_port()}",'
            f' "replay_endpoint": "tcp://127.0.0.1:{free_port()}", "topic": "kv"}}')


def wait_for(cond, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class InProcessRouter:
    """The router on an event loop of its own thread, so the test can read its policy's index."""

    def __init__(self, config: RouterConfig):
        self.port = free_port()
        started = threading.Event()

        async def main():
            self.loop = asyncio.get_running_loop()
            self.stopped = asyncio.Event()
            self.router, runner, _ = await start_router(config, "127.0.0.1", self.port)
            started.set()
            await self.stopped.wait()
            await runner.cleanup()

        self.thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self.thread.start()
        assert started.wait(60)

    def wait_ready(self, timeout: float = 120.0) -> "InProcessRouter":
        """Until ``/readiness`` answers 200: a worker that did not answer the router's first probe
        (a loaded machine) is healthy only after a later one."""
        deadline = time.monotonic() + timeout
        while True:
            r = requests.get(f"http://127.0.0.1:{self.port}/readiness", timeout=10)
            if r.status_code == 200:
                return self
            assert time.monotonic() < deadline, f"router not ready: {r.text}"
            time.sleep(0.2)

    def post(self, body: dict) -> requests.Response:
        return requests.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body, timeout=120)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stopped.set)
        self.thread.join(30)


@contextlib.contextmanager
def serving(servers: dict[str, Server], while_starting=None):
    """A stand's servers (already spawned) ready, and every one stopped at the end, whatever failed.
    ``while_starting()``: work done while they load (another fixture's stand)."""
    try:
        if while_starting is not None:
            while_starting()
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@contextlib.contextmanager
def sglang_router(name: str, prefill: Server, decode: Server):
    """SGLang's own router (``sglang_router.launch_router --pd-disaggregation``) in front of one
    prefill and one decode server; yields its URL and stops it at the end."""
    port = free_port()
    router = Proc(name, [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill.url,
        str(prefill.bootstrap_port), "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port),
        "--policy", "round_robin", "--log-level", "error", "--prometheus-port", str(free_port()),
        "--health-check-interval-secs", "3600"])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, router.proc, 90, name="sglang-router", log=router.log)
        yield url
    finally:
        router.stop()

