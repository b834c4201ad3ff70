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
The load functions (``run_load``, ``scrape``, ``pages_free``) are imported by tests/reliability.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdserve.engine.procs import free_port, signal_group, spawn, stop_group, wait_healthy

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


@dataclass
class LoadStats:
    sent: int = 0
    counts: dict = field(default_factory=lambda: {k: 0 for k in OUTCOMES})
    tokens_completed: int = 0
    bad_token_counts: int = 0  # completed with the wrong number of tokens (a bug)
    errors: dict = field(default_factory=dict)  # message prefix -> count

    def add(self, o: Outcome) -> None:
        self.counts[o.kind] += 1
        if o.kind == "completed":
            self.tokens_completed += o.tokens
            if o.tokens != o.expected:
                self.bad_token_counts += 1
        elif o.kind == "error":
            key = f"{o.status} {o.message[:70]}"
            self.errors[key] = self.errors.get(key, 0) + 1


async def one_request(session: aiohttp.ClientSession, url: str, ids: list[int], max_new: int, deadline: float,
                      disconnect_after: int | None = None, headers: dict | None = None) -> Outcome:
    """One streamed /generate; ends completed (all tokens), error (JSON error), disconnected or hung."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    out = Outcome("hung", expected=max_new)

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
                    out.tokens = meta.get("completion_tokens", len(obj.get("output_ids") or []))
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
                   stats: LoadStats | None = None) -> LoadStats:
    """Send ``n`` requests (or for ``duration`` s) at ``concurrency``; every one is accounted for."""
    rng = random.Random(seed)
    stats = stats or LoadStats()
    end = None if duration is None else time.monotonic() + duration
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker(wid: int):
            while True:
                if n is not None and stats.sent >= n:
                    return
                if end is not None and time.monotonic() >= end:
                    return
                stats.sent += 1
                ids = [rng.randrange(100, 40000) for _ in range(rng.randint(*prompt_lens))]
                mn = rng.randint(*max_new)
                disc = rng.randint(1, mn) if rng.random() < disconnect_frac else None
                stats.add(await one_request(session, url, ids, mn, deadline, disc, headers))
                if on_tick is not None:
                    on_tick(stats)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return stats


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
            urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", data=b"", headers=headers or {}),
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


# -------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
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
    args = ap.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f and f != "none"]
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)

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


if __name__ == "__main__":
    sys.exit(main())
