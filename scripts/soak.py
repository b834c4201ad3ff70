#!/usr/bin/env python
"""Soak and faults under load for pdserve PD serving, with full accounting.

Starts N prefill + M decode servers and the router on this machine (or drives an existing router
with ``--router URL``), sends streamed ``/generate`` requests of mixed lengths at a fixed
concurrency for ``--duration`` seconds, each with a deadline, while the chosen fault scenarios fire
in turn. It prints a running table, and ends with ONE JSON line::

    {"sent": .., "completed": .., "failed_with_error": .., "disconnected": .., "hung": 0,
     "pages_leaked": 0, "metrics_agree": true, ...}

``hung`` (no answer within the deadline) and ``pages_leaked`` (pages not free after the load,
summed over every rank of every live server) must be 0; the exit status is 1 otherwise.

Scenarios (``--faults``, comma separated; ``none`` for a plain soak):
  kill_prefill   SIGKILL one prefill (needs 2), restart it, add it back through the router API
  kill_decode    SIGKILL one decode (needs 2), restart it, add it back
  stop_prefill   SIGSTOP one prefill past the heartbeat window, then SIGCONT
  churn          remove a decode through the router API during load, then add it back
  disconnect     (always on with --disconnect-frac) clients that close their stream at random points

Example: ``python scripts/soak.py --prefills 2 --decodes 2 --duration 300 --faults kill_prefill,stop_prefill``

``--rolling-restart`` (instead of the faults): each pool in turn is restarted server by server under
the load (``rolling_restart``: drained, SIGTERM, exit 0, started again, taken back by the router),
then the same load runs as long with no restart; the JSON line gives requests per second and p50/p99
TTFT of both runs per pool, ``failed`` (target 0), ``mismatched_outputs`` (greedy outputs of a prompt
that differ between runs) and ``pages_leaked``.

``--hostile`` (instead of the faults): the plain load alone and the plain load beside a hostile mix
(``benchlib/hostile.py``: slow clients, oversized bodies, grammar bombs, huge stop lists, ``n`` too
large, worker registrations without the admin key) alternate in blocks of ``--block`` seconds until
each arm has run ``--duration`` seconds, so that load drift on the machine hits both arms alike. The
JSON line gives p50/p99 TTFT of the plain requests in each arm and their ratio, ``lost`` (plain
requests not completed, target 0), ``pages_leaked`` (target 0) and the hostile answers by kind and
status (``hostile_wrong``: answers outside each kind's allowed 4xx/200 set, 5xx or hung; target 0).
Example: ``python scripts/soak.py --hostile --prefills 1 --decodes 1 --duration 600 --block 60``

The load functions (``run_load``, ``scrape``, ``pages_free``) are imported by tests/reliability.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package

from benchlib.hostile import HostileRequest, hostile_requests, is_allowed, send_hostile  # noqa: E402

from pdserve.entrypoints.procs import free_port, signal_group, spawn, stop_group, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUTCOMES = ("completed", "error", "disconnected", "hung")


# --------------------------------------------------------------------------------------- load
@dataclass
class Outcome:
    kind: str  # one of OUTCOMES
    tokens: int = 0  # output tokens the client saw
    expected: int = 0
    status: int = 0
    message: str = ""
    output_ids: list[int] = field(default_factory=list)  # the last event's (cumulative) output ids
    ttft: float | None = None  # seconds from sending to the first event with tokens


@dataclass
class LoadStats:
    sent: int = 0
    counts: dict = field(default_factory=lambda: {k: 0 for k in OUTCOMES})
    tokens_completed: int = 0
    bad_token_counts: int = 0  # completed with the wrong number of tokens (a bug)
    errors: dict = field(default_factory=dict)  # message prefix -> count
    ttfts: list = field(default_factory=list)  # of the completed requests, seconds
    # (prompt ids, max_new) -> output ids of the completed requests; a greedy request that
    # completed twice with different outputs is counted in ``mismatched``
    outputs: dict = field(default_factory=dict)
    mismatched: int = 0

    def add(self, o: Outcome, key: tuple | None = None) -> None:
        self.counts[o.kind] += 1
        if o.kind == "completed":
            self.tokens_completed += o.tokens
            if o.tokens != o.expected:
                self.bad_token_counts += 1
            if o.ttft is not None:
                self.ttfts.append(o.ttft)
            if key is not None:
                if self.outputs.setdefault(key, o.output_ids) != o.output_ids:
                    self.mismatched += 1
        elif o.kind == "error":
            key = f"{o.status} {o.message[:70]}"
            self.errors[key] = self.errors.get(key, 0) + 1


async def one_request(session: aiohttp.ClientSession, url: str, ids: list[int], max_new: int, deadline: float,
                      disconnect_after: int | None = None, headers: dict | None = None) -> Outcome:
    """One streamed /generate; ends completed (all tokens), error (JSON error), disconnected or hung."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    out = Outcome("hung", expected=max_new)
    t0 = time.monotonic()

    async def go():
        async with session.post(url + "/generate", json=body, headers=headers) as resp:
            out.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    msg = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    out.kind, out.message = "error", f"non-JSON error body: {text[:100]}"
                    return
                out.kind, out.message = "error", str(msg)
                return
            events = 0
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while (nl := buf.find(b"\n")) >= 0:
                    line, buf = buf[:nl].strip(), buf[nl + 1:]
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        out.kind = "completed" if out.kind == "hung" else out.kind
                        return
                    obj = json.loads(payload)
                    if "error" in obj:
                        err = obj["error"]
                        out.kind, out.message = "error", str(err.get("message") if isinstance(err, dict) else err)
                        continue
                    meta = obj.get("meta_info") or {}
                    out.output_ids = obj.get("output_ids") or []
                    out.tokens = meta.get("completion_tokens", len(out.output_ids))
                    if out.ttft is None and out.tokens:
                        out.ttft = time.monotonic() - t0
                    events += 1
                    if disconnect_after is not None and events >= disconnect_after:
                        out.kind = "disconnected"
                        resp.close()
                        return
            if out.kind == "hung":  # the stream ended without [DONE]
                out.kind, out.message = "error", "stream ended without [DONE]"

    try:
        await asyncio.wait_for(go(), deadline)
    except asyncio.TimeoutError:
        out.kind = "hung"
    except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError) as e:
        out.kind, out.message = "error", f"transport: {type(e).__name__}: {e}"
    return out


async def run_load(url: str, *, n: int | None = None, duration: float | None = None, concurrency: int = 16,
                   deadline: float = 60.0, seed: int = 0, prompt_lens=(1, 300), max_new=(1, 12),
                   disconnect_frac: float = 0.0, headers: dict | None = None, on_tick=None,
                   stats: LoadStats | None = None, pool: int | None = None,
                   stop_when: Callable[[], bool] | None = None) -> LoadStats:
    """Send ``n`` requests (or for ``duration`` s, or until ``stop_when()``) at ``concurrency``;
    every one is accounted for. ``pool``: the requests cycle through that many prompts drawn from
    ``seed`` (the same ones in every run), so two runs' outputs can be compared (``stats.outputs``)."""
    rng = random.Random(seed)
    stats = stats or LoadStats()
    end = None if duration is None else time.monotonic() + duration
    fixed = [_draw(rng, prompt_lens, max_new) for _ in range(pool)] if pool else None
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker(wid: int):
            while True:
                if n is not None and stats.sent >= n:
                    return
                if end is not None and time.monotonic() >= end:
                    return
                if stop_when is not None and stop_when():
                    return
                ids, mn = fixed[stats.sent % len(fixed)] if fixed else _draw(rng, prompt_lens, max_new)
                stats.sent += 1
                disc = rng.randint(1, mn) if rng.random() < disconnect_frac else None
                stats.add(await one_request(session, url, ids, mn, deadline, disc, headers), (tuple(ids), mn))
                if on_tick is not None:
                    on_tick(stats)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return stats


def _draw(rng: random.Random, prompt_lens, max_new) -> tuple[list[int], int]:
    """One request's prompt ids and max_new_tokens."""
    return [rng.randrange(100, 40000) for _ in range(rng.randint(*prompt_lens))], rng.randint(*max_new)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# ---------------------------------------------------------------------------------- accounting
def scrape(url: str, headers: dict | None = None) -> dict[str, float]:
    """Prometheus text of ``url/metrics`` as {``name{labels}``: value}."""
    import urllib.request

    req = urllib.request.Request(url + "/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, v in samples.items():
        if key == name or key.startswith(name + "{"):
            if all(f'{k}="{val}"' in key for k, val in labels.items()):
                total += v
    return total


def pages_free(url: str, headers: dict | None = None, timeout: float = 30.0) -> tuple[int, int, list]:
    """Flush the prefix cache until every rank is idle with every page free (or ``timeout``):
    (free, total, states) summed over ranks."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", data=b"{}",
                                                          headers={**(headers or {}), "Content-Type": "application/json"}),
                                   timeout=10).read()
        except OSError:
            pass
        req = urllib.request.Request(url + "/get_server_info", headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as r:
            states = json.loads(r.read())["internal_states"]
        free = sum(s["num_free_pages"] for s in states)
        total = sum(s["num_total_pages"] for s in states)
        idle = all(s["inflight"] == 0 and s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0 for s in states)
        if (free == total and idle) or time.monotonic() > deadline:
            return free, total, states
        time.sleep(0.3)


# ------------------------------------------------------------------------------------- cluster
class Proc:
    def __init__(self, name: str, cmd: list[str], logdir: Path):
        self.name, self.cmd = name, cmd
        self.log_path = logdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PDSERVE_NUM_THREADS": "1"}
        self.proc = spawn(self.cmd, self.log_path, env=env, cwd=REPO)

    def send(self, sig) -> None:
        if self.alive:
            signal_group(self.proc, sig)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=15.0)  # under load a server takes longer to drain

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Cluster:
    """N prefill + M decode servers and a router, all on 127.0.0.1."""

    def __init__(self, prefills: int, decodes: int, logdir: Path, server_args: list[str], router_args: list[str]):
        py = sys.executable
        common = ["--dtype", "float32", "--num-threads", "1", "--log-level", "warning", "--chunked-prefill-size",
                  "128", "--max-total-tokens", "2048", "--disaggregation-heartbeat-interval", "1.0",
                  "--disaggregation-heartbeat-max-failures", "3", "--disaggregation-bootstrap-timeout", "60",
                  "--disaggregation-waiting-timeout", "60", *server_args]
        self.prefills, self.decodes = [], []
        for i in range(prefills):
            port, bport = free_port(), free_port()
            p = Proc(f"prefill{i}", [py, "-m", "pdserve.engine", "--port", str(port), "--disaggregation-mode",
                                     "prefill", "--disaggregation-bootstrap-port", str(bport), *common], logdir)
            p.url, p.bootstrap_port = f"http://127.0.0.1:{port}", bport
            self.prefills.append(p)
        for i in range(decodes):
            port = free_port()
            d = Proc(f"decode{i}", [py, "-m", "pdserve.engine", "--port", str(port), "--disaggregation-mode",
                                    "decode", *common], logdir)
            d.url = f"http://127.0.0.1:{port}"
            self.decodes.append(d)
        rport = free_port()
        cmd = [py, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(rport), "--log-level", "warning",
               "--health-check-interval-secs", "1", *router_args]
        for p in self.prefills:
            cmd += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in self.decodes:
            cmd += ["--decode", d.url]
        self.router = Proc("router", cmd, logdir)
        self.router.url = f"http://127.0.0.1:{rport}"

    @property
    def servers(self) -> list[Proc]:
        return self.prefills + self.decodes

    def start(self, timeout: float = 300.0) -> None:
        for s in self.servers:
            s.start()
        for s in self.servers:
            wait_health(s, timeout)
        self.router.start()
        wait_health(self.router, 30)

    def stop(self) -> None:
        for s in [self.router, *self.servers]:
            s.stop()


def wait_health(p: Proc, timeout: float) -> None:
    wait_healthy(p.url, p.proc, timeout, name=p.name, log=lambda: f"see {p.log_path}")


def router_call(router_url: str, method: str, path: str, body: dict | None = None) -> int:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(router_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# ------------------------------------------------------------------------------------ faults
async def fault_kill(cluster: Cluster, role: str, log) -> None:
    """SIGKILL the last server of ``role``; restart it once the router saw it fail, re-add it."""
    victims = cluster.prefills if role == "prefill" else cluster.decodes
    if len(victims) < 2:
        log(f"kill_{role}: needs 2 {role} servers, skipped")
        return
    v = victims[-1]
    log(f"kill_{role}: SIGKILL {v.name}")
    v.send(signal.SIGKILL)
    v.proc.wait(10)
    await asyncio.sleep(5)
    log(f"kill_{role}: restarting {v.name}")
    v.start()
    await asyncio.to_thread(wait_health, v, 300)
    log(f"kill_{role}: {v.name} back")


async def fault_stop(cluster: Cluster, window: float, log) -> None:
    v = cluster.prefills[-1]
    log(f"stop_prefill: SIGSTOP {v.name} for {window:.1f}s")
    v.send(signal.SIGSTOP)
    await asyncio.sleep(window)
    v.send(signal.SIGCONT)
    log(f"stop_prefill: SIGCONT {v.name}")


async def fault_churn(cluster: Cluster, log) -> None:
    d = cluster.decodes[-1]
    status = await asyncio.to_thread(router_call, cluster.router.url, "DELETE", "/workers/" + d.url.replace("/", "%2F"))
    log(f"churn: removed {d.name} from the router ({status})")
    await asyncio.sleep(4)
    status = await asyncio.to_thread(router_call, cluster.router.url, "POST", "/workers",
                                     {"url": d.url, "role": "decode"})
    log(f"churn: added {d.name} back ({status})")


# ---------------------------------------------------------------------------- rolling restart
RESTART_EXIT_TIMEOUT_S = 120.0  # a draining server finishes its streams first


def router_worker(router_url: str, url: str) -> dict | None:
    """The router's ``/workers`` entry of the worker at ``url``."""
    import urllib.request

    with urllib.request.urlopen(router_url + "/workers", timeout=10) as r:
        listing = json.loads(r.read())
    return next((w for ws in listing.values() for w in ws if w["url"] == url), None)


def busy(url: str) -> int:
    """Requests a server has in flight, summed over its ranks (0 when it does not answer)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/get_server_info", timeout=10) as r:
            states = json.loads(r.read())["internal_states"]
    except OSError:
        return 0
    return sum(s["inflight"] + s["num_running_reqs"] + s["num_waiting_reqs"] for s in states)


def restart_worker(router_url: str, server, *, router_drain: bool, log=print, busy_wait: float = 20.0) -> dict:
    """One step of a rolling restart of ``server`` (a process with ``url``, ``proc``, ``start()`` and
    ``send(sig)``, restarted on the same ports), once it has requests in flight.

    ``router_drain``: as Kubernetes does it (deploy/k8s): ``POST /workers/drain`` on the router,
    then SIGTERM to the server's main process only. Otherwise as systemd or ``pdserve launch`` do
    it: SIGTERM to the whole process group, with no word to the router, which learns it from the
    draining server's 503 answers and failing ``/health``. Either way the server drains and exits
    0, is started again, and the router takes it back (``/workers/undrain``, or its fast probing).
    Returns {"name", "busy_at_sigterm", "exit_code", "down_s"}.
    """
    deadline = time.monotonic() + busy_wait
    while busy(server.url) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if router_drain:
        router_call(router_url, "POST", "/workers/drain", {"url": server.url, "wait_secs": 0})
    n_busy = busy(server.url)
    t0 = time.monotonic()
    if router_drain:
        server.proc.send_signal(signal.SIGTERM)
    else:
        server.send(signal.SIGTERM)
    log(f"restart: SIGTERM to {server.name} ({'main process, after /workers/drain' if router_drain else 'process group'}"
        f", {n_busy} requests in flight)")
    code = server.proc.wait(RESTART_EXIT_TIMEOUT_S)
    log(f"restart: {server.name} exited {code} after {time.monotonic() - t0:.1f}s; starting it again")
    server.start()
    wait_healthy(server.url, server.proc, 300, name=server.name)
    if router_drain:
        router_call(router_url, "POST", "/workers/undrain", {"url": server.url})
    deadline = time.monotonic() + 60
    while True:
        w = router_worker(router_url, server.url)
        if w is not None and w["healthy"] and not w["draining"]:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router did not take {server.name} back: {w}")
        time.sleep(0.1)
    down = time.monotonic() - t0
    log(f"restart: {server.name} back in the router after {down:.1f}s")
    return {"name": server.name, "busy_at_sigterm": n_busy, "exit_code": code, "down_s": round(down, 1)}


def rolling_restart(router_url: str, servers: list, log=print) -> list[dict]:
    """Restart ``servers`` one after the other, alternating the Kubernetes way (router drain,
    SIGTERM to the main process) and the systemd way (SIGTERM to the process group)."""
    return [restart_worker(router_url, s, router_drain=(i % 2 == 0), log=log) for i, s in enumerate(servers)]


def run_summary(stats: LoadStats, seconds: float) -> dict:
    """Requests per second, p50/p99 TTFT (ms) and failures of one load run."""
    c = stats.counts
    p50, p99 = percentile(stats.ttfts, 0.50), percentile(stats.ttfts, 0.99)
    return {"seconds": round(seconds, 1), "sent": stats.sent, "completed": c["completed"],
            "failed": stats.sent - c["completed"], "req_per_s": round(c["completed"] / seconds, 2),
            "ttft_p50_ms": None if p50 is None else round(p50 * 1000),
            "ttft_p99_ms": None if p99 is None else round(p99 * 1000),
            "errors": dict(sorted(stats.errors.items(), key=lambda kv: -kv[1])[:5])}


def rolling_main(args, cluster: Cluster, log) -> dict:
    """For each pool: a run under load while that pool is restarted server by server, then the
    same load for as long with no restart. Outputs of the same prompt are compared across all runs."""
    load = dict(concurrency=args.concurrency, deadline=args.deadline, seed=args.seed,
                prompt_lens=(1, args.max_prompt), max_new=(1, args.max_new), pool=args.prompt_pool)
    seen = LoadStats()  # every completed output of every run, to count mismatches
    report: dict = {}
    for pool in ("decode", "prefill"):
        done = asyncio.Event()

        async def restarts(servers=cluster.decodes if pool == "decode" else cluster.prefills, done=done):
            try:
                return await asyncio.to_thread(rolling_restart, cluster.router.url, servers, log)
            finally:
                done.set()

        async def under_restart(done=done):
            return await asyncio.gather(run_load(cluster.router.url, stop_when=done.is_set, **load), restarts())

        t0 = time.monotonic()
        restart_stats, steps = asyncio.run(under_restart())
        took = time.monotonic() - t0
        log(f"{pool} pool restarted in {took:.1f}s; the same load with no restart for as long")
        t1 = time.monotonic()
        base_stats = asyncio.run(run_load(cluster.router.url, duration=took, **load))
        report[pool] = {"restart": run_summary(restart_stats, took), "no_restart": run_summary(base_stats, time.monotonic() - t1),
                        "steps": steps}
        for st in (restart_stats, base_stats):
            for key, out in st.outputs.items():
                if seen.outputs.setdefault(key, out) != out:
                    seen.mismatched += 1
        log(f"{pool}: {json.dumps(report[pool])}")
    report["failed"] = sum(report[p][r]["failed"] for p in ("decode", "prefill") for r in ("restart", "no_restart"))
    report["mismatched_outputs"] = seen.mismatched
    return report


# -------------------------------------------------------------------------------------- main
class RunLog:
    """A run's log folder and its progress lines, each stamped with the seconds since the start."""

    def __init__(self, logdir: str):
        self.dir = Path(logdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds of load (default 120; with --hostile, each arm's, default 600)")
    ap.add_argument("--prefills", type=int, default=2)
    ap.add_argument("--decodes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--deadline", type=float, default=90.0, help="per-request deadline, seconds")
    ap.add_argument("--faults", default="kill_prefill,kill_decode,stop_prefill,churn")
    ap.add_argument("--disconnect-frac", type=float, default=0.05)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logdir", default="/tmp/pdserve-soak")
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for every server (repeatable)")
    ap.add_argument("--rolling-restart", action="store_true",
                    help="instead of --faults: restart each pool server by server under load (drain, SIGTERM, "
                         "start again), then the same load with no restart; reports req/s and p99 TTFT of both")
    ap.add_argument("--prompt-pool", type=int, default=64,
                    help="--rolling-restart: requests cycle through this many prompts, so outputs are compared")
    ap.add_argument("--drain-timeout", type=float, default=120.0,
                    help="--rolling-restart: the servers' --graceful-shutdown-timeout")
    ap.add_argument("--hostile", action="store_true",
                    help="instead of --faults: alternate blocks of the plain load alone and beside a hostile mix; "
                         "--duration is each arm's total; reports both arms' p99 TTFT and their ratio")
    ap.add_argument("--block", type=float, default=60.0, help="--hostile: seconds of one block of one arm")
    ap.add_argument("--hostile-concurrency", type=int, default=4, help="--hostile: hostile clients at once")
    ap.add_argument("--warmup", type=int, default=32,
                    help="--hostile: plain requests sent first and not measured (0: none)")
    args = ap.parse_args(argv)
    if args.duration is None:
        args.duration = 600.0 if args.hostile else 120.0
    if args.rolling_restart:
        return rolling_cli(args)
    if args.hostile:
        return hostile_cli(args)
    faults = [f for f in args.faults.split(",") if f and f != "none"]
    log = RunLog(args.logdir)
    logdir, t0 = log.dir, log.t0

    cluster = Cluster(args.prefills, args.decodes, logdir, args.server_arg, [])
    log(f"starting {args.prefills}P{args.decodes}D + router (logs in {logdir})")
    cluster.start()
    before = {s.name: scrape(s.url) for s in cluster.servers}
    start_free = {s.name: pages_free(s.url)[:2] for s in cluster.servers}
    stats = LoadStats()
    last_print = [0.0]
    print(f"{'time':>8} {'sent':>6} {'done':>6} {'error':>6} {'disc':>6} {'hung':>5}", flush=True)

    def tick(st: LoadStats) -> None:
        now = time.monotonic()
        if now - last_print[0] >= 5:
            last_print[0] = now
            c = st.counts
            print(f"{now - t0:8.1f} {st.sent:6d} {c['completed']:6d} {c['error']:6d} {c['disconnected']:6d} "
                  f"{c['hung']:5d}", flush=True)

    async def faults_task():
        if not faults:
            return
        gap = args.duration / (len(faults) + 1)
        for f in faults:
            await asyncio.sleep(gap * 0.5)
            if f == "kill_prefill":
                await fault_kill(cluster, "prefill", log)
            elif f == "kill_decode":
                await fault_kill(cluster, "decode", log)
            elif f == "stop_prefill":
                await fault_stop(cluster, 3.0 * 1.0 + 2.0, log)  # past the 3 s heartbeat window
            elif f == "churn":
                await fault_churn(cluster, log)
            else:
                log(f"unknown fault {f!r}, skipped")
            await asyncio.sleep(gap * 0.5)

    async def run():
        await asyncio.gather(
            run_load(cluster.router.url, duration=args.duration, concurrency=args.concurrency,
                     deadline=args.deadline, seed=args.seed, prompt_lens=(1, args.max_prompt),
                     max_new=(1, args.max_new), disconnect_frac=args.disconnect_frac, on_tick=tick, stats=stats),
            faults_task())

    result: dict = {}
    try:
        asyncio.run(run())
        tick_final = stats.counts
        leaked, per_server = 0, {}
        for s in cluster.servers:
            if not s.alive:
                per_server[s.name] = "dead"
                continue
            free, total, _ = pages_free(s.url)
            leaked += total - free
            per_server[s.name] = f"{free}/{total}"
        # metrics agreement holds only without restarts (a restarted server's counters start again)
        agree = None
        if not any(f.startswith("kill") for f in faults):
            after = {s.name: scrape(s.url) for s in cluster.servers}
            dec = sum(metric_sum(after[d.name], "pdserve_generation_tokens_total")
                      - metric_sum(before[d.name], "pdserve_generation_tokens_total") for d in cluster.decodes)
            agree = dec >= stats.tokens_completed
        result = {
            "sent": stats.sent, "completed": tick_final["completed"], "failed_with_error": tick_final["error"],
            "disconnected": tick_final["disconnected"], "hung": tick_final["hung"], "pages_leaked": leaked,
            "bad_token_counts": stats.bad_token_counts, "metrics_agree": agree, "pages": per_server,
            "start_pages": {k: f"{f}/{t}" for k, (f, t) in start_free.items()}, "faults": faults,
            "errors": dict(sorted(stats.errors.items(), key=lambda kv: -kv[1])[:8]),
            "duration_s": round(time.monotonic() - t0, 1),
        }
    finally:
        cluster.stop()
    print(json.dumps(result), flush=True)
    ok = result.get("hung") == 0 and result.get("pages_leaked") == 0 and result.get("bad_token_counts") == 0
    return 0 if ok else 1


def rolling_cli(args) -> int:
    log = RunLog(args.logdir)
    logdir = log.dir

    cluster = Cluster(args.prefills, args.decodes, logdir,
                      ["--graceful-shutdown-timeout", str(args.drain_timeout), *args.server_arg],
                      ["--request-queue-timeout-secs", str(args.deadline)])
    log(f"starting {args.prefills}P{args.decodes}D + router (logs in {logdir})")
    cluster.start()
    report: dict = {}
    try:
        report = rolling_main(args, cluster, log)
        report["pages_leaked"] = sum(t - f for f, t, _ in (pages_free(s.url) for s in cluster.servers))
    finally:
        cluster.stop()
    print(json.dumps(report), flush=True)
    ok = report.get("failed") == 0 and report.get("mismatched_outputs") == 0 and report.get("pages_leaked") == 0
    return 0 if ok else 1


# ------------------------------------------------------------------------------------- hostile
@dataclass
class HostileStats:
    sent: int = 0
    outcomes: dict = field(default_factory=dict)  # kind -> {outcome: count}
    seconds: dict = field(default_factory=dict)  # kind -> the longest time to its answer (or hang)
    wrong: int = 0  # answers outside the kind's allowed set (5xx, hung, closed, a wrong 4xx)

    def add(self, req: HostileRequest, outcome: str, took: float) -> None:
        by = self.outcomes.setdefault(req.kind, {})
        by[outcome] = by.get(outcome, 0) + 1
        self.seconds[req.kind] = max(self.seconds.get(req.kind, 0.0), round(took, 1))
        self.wrong += not is_allowed(req, outcome)


async def run_hostile(url: str, kinds: list[HostileRequest], *, until: float, concurrency: int, seed: int,
                      stats: HostileStats, deadline: float) -> HostileStats:
    """``concurrency`` clients send the hostile kinds in a shuffled cycle until ``until`` (monotonic)."""
    rng = random.Random(seed)

    async def client():
        order: list[HostileRequest] = []
        while time.monotonic() < until:
            if not order:
                order = rng.sample(kinds, len(kinds))
            req = order.pop()
            stats.sent += 1
            t0 = time.monotonic()
            outcome = await send_hostile(url, req, deadline)
            stats.add(req, outcome, time.monotonic() - t0)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return stats


def hostile_main(args, cluster: Cluster, admin_headers: dict, log) -> dict:
    """Alternate blocks (plain, hostile, plain, ...) until each arm ran ``args.duration`` seconds."""
    load = dict(concurrency=args.concurrency, deadline=args.deadline, prompt_lens=(1, args.max_prompt),
                max_new=(1, args.max_new))
    kinds = hostile_requests(cluster.decodes[0].url)
    workers_before = router_listing(cluster.router.url, admin_headers)
    if args.warmup:  # unmeasured, so that the first (plain) block does not carry the servers' warm-up
        warm = asyncio.run(run_load(cluster.router.url, n=args.warmup, seed=args.seed - 1, **load))
        log(f"warm-up: {warm.counts['completed']}/{warm.sent} completed")
    arms = {"plain": LoadStats(), "hostile": LoadStats()}
    ran = {"plain": 0.0, "hostile": 0.0}
    hostile = HostileStats()
    blocks = []
    i = seen_out = 0
    while min(ran.values()) < args.duration:
        arm = "plain" if i % 2 == 0 else "hostile"
        block = min(args.block, args.duration - ran[arm])
        t0 = time.monotonic()
        mine = LoadStats()

        async def one_block(block=block, arm=arm, mine=mine, seed=args.seed + i):
            tasks = [run_load(cluster.router.url, duration=block, seed=seed, stats=mine, **load)]
            if arm == "hostile":
                tasks.append(run_hostile(cluster.router.url, kinds, until=time.monotonic() + block,
                                         concurrency=args.hostile_concurrency, seed=seed, stats=hostile,
                                         deadline=args.deadline))
            await asyncio.gather(*tasks)

        asyncio.run(one_block())
        took = time.monotonic() - t0
        ran[arm] += block
        _merge(arms[arm], mine)
        summary = run_summary(mine, took)
        outs = _log_count(cluster.router.log_path, "out of rotation")
        blocks.append({"arm": arm, "sent": mine.sent, "completed": summary["completed"],
                       "ttft_p99_ms": summary["ttft_p99_ms"], "seconds": round(took, 1),
                       "workers_out_of_rotation": outs - seen_out})
        seen_out = outs
        log(f"block {i} {arm}: {json.dumps(blocks[-1])}; hostile so far: sent {hostile.sent}, wrong {hostile.wrong}")
        i += 1
    plain, hot = (run_summary(arms[a], ran[a]) for a in ("plain", "hostile"))
    ratio = None
    if plain["ttft_p99_ms"] and hot["ttft_p99_ms"] is not None:
        ratio = round(hot["ttft_p99_ms"] / plain["ttft_p99_ms"], 2)
    return {"plain": plain, "hostile": hot, "ttft_p99_ratio": ratio, "lost": plain["failed"] + hot["failed"],
            "hostile_sent": hostile.sent, "hostile_wrong": hostile.wrong,
            "hostile_outcomes": {k: dict(sorted(v.items())) for k, v in sorted(hostile.outcomes.items())},
            "hostile_max_seconds": dict(sorted(hostile.seconds.items())),
            "workers_out_of_rotation": {a: sum(b["workers_out_of_rotation"] for b in blocks if b["arm"] == a)
                                        for a in ("plain", "hostile")},
            "workers_unchanged": router_listing(cluster.router.url, admin_headers) == workers_before,
            "blocks": blocks}


def _log_count(path: Path, text: str) -> int:
    """How many lines of the log at ``path`` hold ``text`` (the router's health transitions)."""
    try:
        return sum(text in line for line in path.read_text(errors="replace").splitlines())
    except OSError:
        return 0


def _merge(into: LoadStats, part: LoadStats) -> None:
    into.sent += part.sent
    for k, v in part.counts.items():
        into.counts[k] += v
    into.ttfts += part.ttfts
    into.tokens_completed += part.tokens_completed
    into.bad_token_counts += part.bad_token_counts
    for k, v in part.errors.items():
        into.errors[k] = into.errors.get(k, 0) + v


def router_listing(router_url: str, headers: dict) -> dict:
    """The router's workers as {role: sorted urls}."""
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(router_url + "/workers", headers=headers), timeout=10) as r:
        listing = json.loads(r.read())
    return {role: sorted(w["url"] for w in ws) for role, ws in listing.items()}


def hostile_cli(args) -> int:
    log = RunLog(args.logdir)
    logdir = log.dir

    key_file = logdir / "router-admin-key"
    key = os.urandom(24).hex()
    key_file.write_text(key)
    key_file.chmod(0o600)
    # an admin key, so that a stranger on loopback (the hostile clients) is refused the admin routes
    cluster = Cluster(args.prefills, args.decodes, logdir, args.server_arg,
                      ["--admin-api-key-file", str(key_file), "--request-queue-timeout-secs", str(args.deadline)])
    log(f"starting {args.prefills}P{args.decodes}D + router (logs in {logdir})")
    cluster.start()
    report: dict = {}
    try:
        report = hostile_main(args, cluster, {"Authorization": f"Bearer {key}"}, log)
        pages = {s.name: pages_free(s.url)[:2] if s.alive else None for s in cluster.servers}
        report["servers_alive"] = all(p is not None for p in pages.values()) and cluster.router.alive
        report["pages"] = {k: None if v is None else f"{v[0]}/{v[1]}" for k, v in pages.items()}
        report["pages_leaked"] = sum(t - f for f, t in (v for v in pages.values() if v is not None))
    finally:
        cluster.stop()
    print(json.dumps(report), flush=True)
    ok = (report.get("lost") == 0 and report.get("pages_leaked") == 0 and report.get("hostile_wrong") == 0
          and report.get("servers_alive") and report.get("workers_unchanged"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
