"""Health checks: probe every worker each interval; out of rotation after
``health_failure_threshold`` failures in a row, back after
``health_success_threshold`` passes. A worker's DP size comes from
``/get_server_info`` (``/server_info`` on newer SGLang) the first time it passes; one that
reports a DP size that is not an integer in 1..``MAX_DP_SIZE`` stays unhealthy (the router
would otherwise make an endpoint per rank it claims).

A worker that was never healthy (starting up, or just added through ``/workers``)
is not left to the interval: ``watch`` probes it every ``STARTUP_PROBE_S``
(0.5 s, fixed) until it is healthy or ``--worker-startup-timeout-secs`` have
passed (then the interval takes over again). So a router started together with
its workers is ready within 0.5 s of the moment they answer, however long they
took to load. A worker that was healthy and went out of rotation is probed from
0.5 s on, doubling the wait up to ``--health-check-interval-secs`` (a worker
that keeps failing is not hammered).

The log line that takes a worker in or out of rotation names the kind of probe
that saw it (``PROBE_KINDS``), so an operator, or a test, can tell which
mechanism made a worker ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

import aiohttp

from pdserve.router.config import RouterConfig
from pdserve.router.workers.worker_registry import MAX_DP_SIZE, Worker, WorkerRegistry

log = logging.getLogger("pdserve.router.workers.health")
PROBE_INITIAL_S = 0.5
STARTUP_PROBE_S = 0.5  # the fixed wait between probes of a worker that was never healthy
# which probe saw a worker: the one when it is added (router start, ``/workers``), the interval's,
# the watching probe of a worker never healthy, the watching probe of one that failed
PROBE_KINDS = ("added", "interval", "startup", "backoff")


def probe_delays(cap: float) -> Iterator[float]:
    """Waits between the probes of a watched worker: 0.5 s, doubling, at most ``cap``."""
    delay = PROBE_INITIAL_S
    while True:
        yield min(delay, cap)
        delay *= 2


def startup_probe_delays() -> Iterator[float]:
    """Waits between the probes of a worker that was never healthy: ``STARTUP_PROBE_S``, fixed."""
    while True:
        yield STARTUP_PROBE_S


class HealthChecker:
    def __init__(self, registry: WorkerRegistry, session: aiohttp.ClientSession,
                 config: RouterConfig, headers: dict[str, str],
                 after_pass: Callable[[Worker], Awaitable[None]] | None = None):
        """``after_pass(worker)``: awaited after each probe the worker passes (the router reads
        its LoRA adapters then: router/workers/adapter_sync.py)."""
        self.registry = registry
        self.after_pass = after_pass
        self.session = session
        self.config = config
        self.headers = headers
        self._timeout = aiohttp.ClientTimeout(total=config.health_check_timeout_secs)
        self._watched: dict[str, asyncio.Task] = {}  # worker url -> its probe task

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_secs)
            await self.check_all()

    async def check_all(self) -> None:
        """One probe of every worker that is not being watched (those are probed more often)."""
        workers = [w for w in self.registry.workers() if w.url not in self._watched]
        if workers:
            await asyncio.gather(*(self.check(w, probe="interval") for w in workers))

    def watch(self, worker: Worker, first: bool = False) -> None:
        """Probe ``worker`` often until it is healthy (no-op when it is already watched)."""
        if worker.url not in self._watched:
            self._watched[worker.url] = asyncio.ensure_future(self._probe_until_healthy(worker, first))

    @property
    def watched(self) -> list[str]:
        return list(self._watched)

    def close(self) -> None:
        for task in self._watched.values():
            task.cancel()
        self._watched.clear()

    async def _probe_until_healthy(self, worker: Worker, first: bool) -> None:
        timeout = self.config.worker_startup_timeout_secs
        deadline = time.monotonic() + timeout
        try:
            kind = "backoff" if worker.ever_healthy else "startup"
            delays = (probe_delays(self.config.health_check_interval_secs) if worker.ever_healthy
                      else startup_probe_delays())
            for delay in delays:
                if self.registry.get(worker.url) is not worker:
                    return  # removed (or replaced) meanwhile
                await self.check(worker, first, probe=kind)
                if worker.healthy:
                    return
                if time.monotonic() + delay > deadline:
                    log.error("%s worker %s did not become healthy within "
                              "--worker-startup-timeout-secs (%g s); probing it every %g s from now on",
                              worker.role, worker.url, timeout, self.config.health_check_interval_secs)
                    return
                await asyncio.sleep(delay)
        finally:
            if self._watched.get(worker.url) is asyncio.current_task():
                del self._watched[worker.url]

    async def check(self, worker: Worker, first: bool = False, probe: str = "added") -> bool:
        """Probe one worker and record the result; ``first``: a worker just added counts as
        healthy after one pass, so a router starts serving as soon as its workers answer.
        ``probe``: which of ``PROBE_KINDS`` this is, named in the log line of a change."""
        ok = await self._get_ok(worker.url + "/health")
        if ok and not worker.info_known:
            ok = await self._fetch_info(worker)
        if ok and self.after_pass is not None:
            await self.after_pass(worker)
        cfg = self.config
        changed = self.registry.record_health(worker, ok, cfg.health_failure_threshold,
                                              1 if first else cfg.health_success_threshold)
        if changed:
            (log.info if first else log.warning)("%s worker %s is %s (%s probe)", worker.role, worker.url,
                        "back in rotation" if worker.healthy else "out of rotation", probe)
            if not worker.healthy:
                self.watch(worker)
        return ok

    async def _get_ok(self, url: str) -> bool:
        try:
            async with self.session.get(url, headers=self.headers, timeout=self._timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def _local_prefill_limit(self, worker: Worker, limit) -> None:
        """Record a decode worker's local-prefill limit; say so when conditional disaggregation is
        on and the worker would refuse what the router sends it."""
        worker.max_local_prefill_tokens = limit if isinstance(limit, int) and limit > 0 else 0
        want = self.config.local_prefill_max_tokens
        if not want:
            return
        if not worker.max_local_prefill_tokens:
            log.warning("decode worker %s does not accept local prefills (start it with --max-local-prefill-tokens "
                        "%d): every prompt goes to it through a prefill server, --local-prefill-max-tokens %d "
                        "notwithstanding", worker.url, want, want)
        elif worker.max_local_prefill_tokens < want:
            log.warning("decode worker %s accepts local prefills of at most %d tokens (its "
                        "--max-local-prefill-tokens), fewer than --local-prefill-max-tokens %d: it gets those "
                        "only", worker.url, worker.max_local_prefill_tokens, want)

    async def _fetch_info(self, worker: Worker) -> bool:
        for path in ("/get_server_info", "/server_info"):
            try:
                async with self.session.get(worker.url + path, headers=self.headers,
                                            timeout=self._timeout) as resp:
                    if resp.status != 200:
                        continue
                    info = await resp.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                continue
            if isinstance(info, dict):
                model = info.get("model_path") or info.get("served_model_name")
                worker.stream_deltas = bool(info.get("incremental_streaming_output"))
                worker.model_path = info.get("tokenizer_path") or info.get("model_path")
                limits = [info.get(k) for k in ("max_context_len", "max_total_num_tokens")]
                worker.token_room = min(limits) if all(type(v) is int for v in limits) else None
                dp_size = info.get("dp_size", 1)
                if type(dp_size) is not int or not 1 <= dp_size <= MAX_DP_SIZE:
                    log.error("%s worker %s reports dp_size %.40r, not an integer in 1..%d: it stays "
                              "out of rotation", worker.role, worker.url, dp_size, MAX_DP_SIZE)
                    return False
                colocated = worker.role == "decode" and info.get("disaggregation_mode") == "null"
                if worker.role == "decode":
                    self._local_prefill_limit(worker, info.get("max_local_prefill_tokens"))
                self.registry.set_server_info(worker, dp_size, model, colocated)
                return True
        log.warning("%s answers /health but neither /get_server_info nor /server_info", worker.url)
        # a server without server info still serves: assume one DP rank
        self.registry.set_server_info(worker, 1)
        return True
