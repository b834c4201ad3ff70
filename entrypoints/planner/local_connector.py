"""The ``local`` connector: servers of a ``pdserve launch`` cluster on this machine.

The servers the router lists when the planner starts are the cluster's own (``external``): they
count as capacity and are never stopped. Above them the connector starts servers of its own
(``pdserve serve`` with the role's mode, on free ports, each in its own process group, logging to
``log_dir``), registers each with the router (``POST /workers``) once it answers ``/health``,
and on scale-down drains it (``POST /workers/drain``: no new requests, the ones in flight finish;
it is stopped only once drained, however long that takes), removes it from the router and stops
it. A server that exits or does not become healthy within
``startup_timeout`` is counted as a start failure, never as capacity, and retried after a backoff
(5 s doubling to 2 min). The servers are started without a parent-death signal: a planner that
crashes leaves them serving, registered, as they were; a planner that exits cleanly drains and
stops them (unless ``leave_servers``).

Every method returns quickly: starts are non-blocking, drains run in threads, and ``poll`` (called
every second by the planner) moves servers from starting to ready and retries failed starts.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from pdserve.entrypoints.event_ports import with_own_event_ports
from pdserve.entrypoints.planner.connector import Connector
from pdserve.entrypoints.planner.router_api import RouterApi, RouterApiError
from pdserve.entrypoints.planner.scaling import Counts

log = logging.getLogger("pdserve.planner.local")
ROLES = ("prefill", "decode")
BACKOFF_S, BACKOFF_MAX_S = 5.0, 120.0


class _Server:
    __slots__ = ("role", "url", "bootstrap_port", "proc", "state", "started", "log_path")

    def __init__(self, role, url, bootstrap_port, proc, log_path):
        self.role, self.url, self.bootstrap_port, self.proc, self.log_path = role, url, bootstrap_port, proc, log_path
        self.state = "starting"  # -> ready -> draining -> stopped; or failed
        self.started = time.monotonic()


def pdserve_server_argv(role: str, host: str, port: int, bootstrap_port: int | None, transfer_backend: str,
                        serve_args: tuple[str, ...]) -> list[str]:
    argv = [sys.executable, "-m", "pdserve.engine", "--host", host, "--port", str(port),
            "--disaggregation-mode", role, "--disaggregation-transfer-backend", transfer_backend]
    if bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return argv + with_own_event_ports(serve_args, host)  # KV event ports of its own (event_ports.py)


class LocalConnector(Connector):
    def __init__(self, router: RouterApi, server_argv: Callable[[str, str, int, int | None], list[str]],
                 host: str = "127.0.0.1", log_dir: str | None = None, startup_timeout: float = 600.0,
                 drain_timeout: float = 300.0, leave_servers: bool = False, metrics=None):
        """``server_argv(role, host, port, bootstrap_port)``: the command of a new server."""
        self.router, self.server_argv, self.host = router, server_argv, host
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="pdserve-planner-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.startup_timeout, self.drain_timeout, self.leave_servers = startup_timeout, drain_timeout, leave_servers
        self.metrics = metrics
        self.lock = threading.Lock()
        self.servers: list[_Server] = []
        self.failures = {r: 0 for r in ROLES}  # consecutive start failures
        self.next_start = {r: 0.0 for r in ROLES}
        self.drains: list[threading.Thread] = []
        listing = router.workers()
        self.external = {r: sum(1 for w in listing.get(r) or [] if not w.get("draining")) for r in ROLES}
        self.target = Counts(self.external["prefill"], self.external["decode"])
        self.seq = 0

    @classmethod
    def from_config(cls, config, metrics) -> "LocalConnector":
        def argv(role, host, port, bootstrap):
            return pdserve_server_argv(role, host, port, bootstrap, config.transfer_backend, config.serve_args)

        return cls(RouterApi(config.router, config.api_key, config.scrape_timeout, config.admin_api_key), argv,
                   log_dir=config.log_dir, startup_timeout=config.startup_timeout,
                   drain_timeout=config.drain_timeout, leave_servers=config.leave_servers, metrics=metrics)

    # --- counts -----------------------------------------------------------------------------------
    def _mine(self, role: str, *states: str) -> list[_Server]:
        return [s for s in self.servers if s.role == role and s.state in states]

    def current(self) -> Counts:
        with self.lock:
            n = {r: self.external[r] + len(self._mine(r, "starting", "ready")) for r in ROLES}
        return Counts(n["prefill"], n["decode"])

    def status(self) -> dict:
        with self.lock:
            return {r: {"external": self.external[r], **{st: len(self._mine(r, st))
                                                          for st in ("starting", "ready", "draining")}}
                    for r in ROLES}

    def apply(self, target: Counts) -> None:
        self.target = target
        self._reconcile()

    def poll(self) -> None:
        for s in list(self.servers):
            if s.state == "starting":
                self._check_start(s)
        self._reconcile()

    # --- starting -----------------------------------------------------------------------------------
    def _reconcile(self) -> None:
        for role, want in (("prefill", self.target.prefill), ("decode", self.target.decode)):
            have = self.current().prefill if role == "prefill" else self.current().decode
            if want > have and time.monotonic() >= self.next_start[role]:
                for _ in range(want - have):
                    self._start(role)
            elif want < have:
                self._scale_down(role, have - want)

    def _start(self, role: str) -> None:
        from pdserve.entrypoints.procs import free_port, spawn

        port = free_port(self.host)
        bootstrap = free_port(self.host) if role == "prefill" else None
        self.seq += 1
        log_path = os.path.join(self.log_dir, f"planner-{role}-{self.seq}.log")
        # no die_with_parent: a planner crash leaves the cluster as it was
        proc = spawn(self.server_argv(role, self.host, port, bootstrap), log_path)
        with self.lock:
            self.servers.append(_Server(role, f"http://{self.host}:{port}", bootstrap, proc, log_path))
        log.info("starting a %s server at http://%s:%d (log %s)", role, self.host, port, log_path)

    def _check_start(self, s: _Server) -> None:
        from pdserve.entrypoints.procs import get_json, log_tail, stop_group

        failed = None
        if s.proc.poll() is not None:
            failed = f"exited with {s.proc.returncode}"
        elif get_json(s.url + "/health", timeout=1.0) is not None:
            try:
                self.router.add(s.url, s.role, s.bootstrap_port)
            except RouterApiError as e:
                log.warning("registering %s with the router: %s (retried)", s.url, e)
                return
            with self.lock:
                s.state = "ready"
            self.failures[s.role] = 0
            log.info("%s server %s ready and registered (%.1f s)", s.role, s.url, time.monotonic() - s.started)
            return
        elif time.monotonic() - s.started > self.startup_timeout:
            failed = f"not healthy within {self.startup_timeout:g} s"
            stop_group(s.proc)
        if failed:
            with self.lock:
                s.state = "failed"
            self.failures[s.role] += 1
            backoff = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (self.failures[s.role] - 1))
            self.next_start[s.role] = time.monotonic() + backoff
            if self.metrics is not None:
                self.metrics.start_failures.labels(s.role).inc()
            log.error("%s server %s failed to start (%s); retry in %.0f s; last lines of %s:\n%s", s.role, s.url,
                      failed, backoff, s.log_path, log_tail(s.log_path, 10))

    # --- stopping -----------------------------------------------------------------------------------
    def _scale_down(self, role: str, n: int) -> None:
        from pdserve.entrypoints.procs import stop_group

        with self.lock:
            order = self._mine(role, "starting") + sorted(self._mine(role, "ready"), key=lambda s: -s.started)
            chosen = order[:n]
            for s in chosen:
                s.state = "draining" if s.state == "ready" else "stopped"
        if len(chosen) < n:
            log.info("%s: %d fewer wanted, but the rest are the cluster's own servers: kept", role, n - len(chosen))
        for s in chosen:
            if s.state == "stopped":  # never registered: nothing to drain
                stop_group(s.proc)
                continue
            t = threading.Thread(target=self._drain_and_stop, args=(s,), name=f"drain {s.url}", daemon=True)
            self.drains.append(t)
            t.start()

    def _drain_and_stop(self, s: _Server) -> None:
        """Scale-down always drains: no new requests, the ones in flight finish, then it stops. A
        server is stopped only once drained (or when its process ended by itself): a drain that
        outlasts ``drain_timeout`` is logged and waited for again."""
        from pdserve.entrypoints.procs import stop_group

        t0 = time.monotonic()
        while s.proc.poll() is None:
            try:
                answer = self.router.drain(s.url, self.drain_timeout)
            except RouterApiError as e:
                log.warning("draining %s: %s (retried)", s.url, e)
                time.sleep(1.0)
                continue
            if answer.get("drained"):
                break
            log.warning("%s still has %s request(s) after %.0f s of drain: waiting on", s.url,
                        answer.get("in_flight"), time.monotonic() - t0)
        for attempt in range(5):
            try:
                self.router.remove(s.url)
                break
            except RouterApiError as e:
                log.warning("removing %s from the router: %s%s", s.url, e, " (retried)" if attempt < 4 else "")
                time.sleep(1.0)
        stop_group(s.proc)
        with self.lock:
            s.state = "stopped"
        log.info("%s server %s drained and stopped (%.1f s)", s.role, s.url, time.monotonic() - t0)

    def close(self) -> None:
        if not self.leave_servers:
            self.target = Counts(self.external["prefill"], self.external["decode"])
            for role in ROLES:
                extra = len(self._mine(role, "starting", "ready"))
                if extra:
                    self._scale_down(role, extra)
        for t in self.drains:
            t.join()
