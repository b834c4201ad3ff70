"""The prefill and decode workers the router knows, their health and their load.

Pure bookkeeping: no sockets. The health checker and the ``/workers`` API call
into it; the request path reads ``healthy_endpoints(role)``, a list rebuilt only
when membership, health, draining or DP size change, so choosing a worker is
cheap. A draining worker (``POST /workers/drain``) stays registered and probed
but gets no new requests; listeners added with ``on_change`` hear of every
rebuild (the readiness gate wakes the requests waiting for a pair).
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from pdserve.router.config import WorkerSpec

ROLES = ("prefill", "decode")
# the most DP ranks a worker may report: an endpoint is made per rank, so a reported size is bounded
MAX_DP_SIZE = 1024


class Endpoint:
    """One schedulable target: a worker, or one DP rank of a DP-aware worker.

    Policies choose among endpoints; ``load`` is the number of requests in
    flight on it and ``tokens`` the tokens they hold there (a prefill leg its
    prompt; a decode leg its prompt plus the most it may generate), both counted
    by the router from what it dispatched (``begin`` / ``end``). The DP rank of
    a worker is chosen by ``tokens`` (``dp_rank_choice.py``).
    """

    __slots__ = ("worker", "dp_rank", "key", "load", "tokens")

    def __init__(self, worker: "Worker", dp_rank: int | None):
        self.worker = worker
        self.dp_rank = dp_rank
        self.key = worker.url if dp_rank is None else f"{worker.url}@{dp_rank}"
        self.load = 0
        self.tokens = 0

    def begin(self, tokens: int = 0) -> None:
        """A leg of ``tokens`` tokens starts on this endpoint."""
        self.load += 1
        self.tokens += tokens

    def end(self, tokens: int = 0) -> None:
        """The leg ``begin`` counted ended (answered, failed or cancelled)."""
        self.load -= 1
        self.tokens -= tokens

    def __repr__(self) -> str:
        return f"Endpoint({self.key}, load={self.load}, tokens={self.tokens})"


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.url = spec.url.rstrip("/")
        self.role = spec.role
        self.bootstrap_port = spec.bootstrap_port
        # SGLang's router sends the host part of the prefill URL (no brackets for IPv6)
        self.bootstrap_host = urlsplit(self.url).hostname or ""
        self.dp_size = 1
        self.model_id: str | None = None
        self.healthy = False
        self.ever_healthy = False  # healthy at least once (a worker still starting is probed more often)
        self.info_known = False  # /get_server_info answered at least once
        # its /generate streams carry deltas (--incremental-streaming-output), not whole outputs
        self.stream_deltas = False
        self.model_path: str | None = None  # its /server_info tokenizer_path or model_path (None: default model)
        # a decode worker's --max-local-prefill-tokens from its /server_info: 0 when it does not
        # take local prefills (SGLang's decode servers, pdserve's without the flag)
        self.max_local_prefill_tokens = 0
        # the most tokens (prompt + answer) one request may hold there: min(max_context_len,
        # max_total_num_tokens) of its /server_info (None: not told); a migrated chat without
        # max_tokens continues with what is left of it (router/migration/openai_migration.py)
        self.token_room: int | None = None
        # a colocated server (its /server_info disaggregation_mode "null") given as a decode
        # worker: it prefills and decodes every request itself, no prefill leg
        self.colocated = False
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        self.draining = False
        self.endpoints: list[Endpoint] = [Endpoint(self, None)]

    @property
    def load(self) -> int:
        return sum(e.load for e in self.endpoints)

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "bootstrap_port": self.bootstrap_port,
            "healthy": self.healthy,
            "draining": self.draining,
            # drained: draining and nothing of it is in flight any more (safe to stop)
            "drained": self.draining and self.load == 0,
            "dp_size": self.dp_size,
            "model_id": self.model_id,
            "max_local_prefill_tokens": self.max_local_prefill_tokens if self.role == "decode" else None,
            "colocated": self.colocated,
            "in_flight": self.load,
            "endpoints": {e.key: e.load for e in self.endpoints},
            "endpoint_tokens": {e.key: e.tokens for e in self.endpoints},
        }


class WorkerRegistry:
    def __init__(self, dp_aware: bool = False):
        self.dp_aware = dp_aware
        self._workers: dict[str, Worker] = {}
        self._healthy: dict[str, list[Endpoint]] = {role: [] for role in ROLES}
        self._serves_alone = False  # a healthy colocated worker is among them (_rebuild)
        self._listeners: list[Callable[[], None]] = []

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change of the healthy endpoints."""
        self._listeners.append(listener)

    # membership --------------------------------------------------------
    def add(self, spec: WorkerSpec, healthy: bool = False) -> Worker:
        url = spec.url.rstrip("/")
        if url in self._workers:
            raise ValueError(f"worker {url} is already registered")
        worker = Worker(spec)
        worker.healthy = worker.ever_healthy = healthy
        self._workers[url] = worker
        self._rebuild()
        return worker

    def remove(self, url: str) -> Worker | None:
        """Take a worker out; requests already on it finish, new ones go elsewhere."""
        worker = self._workers.pop(url.rstrip("/"), None)
        if worker is not None:
            self._rebuild()
        return worker

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url.rstrip("/"))

    def workers(self, role: str | None = None) -> list[Worker]:
        return [w for w in self._workers.values() if role is None or w.role == role]

    def healthy_endpoints(self, role: str) -> list[Endpoint]:
        return self._healthy[role]

    @property
    def serves_alone(self) -> bool:
        """A healthy colocated worker takes requests: no prefill worker is needed for them."""
        return self._serves_alone

    # state changes -----------------------------------------------------
    def set_server_info(self, worker: Worker, dp_size: int, model_id: str | None = None,
                        colocated: bool = False) -> None:
        """What the worker's ``/server_info`` says; ``colocated``: a decode worker that is a
        colocated server (it serves requests alone)."""
        worker.info_known = True
        changed = worker.colocated != colocated
        worker.colocated = colocated
        if model_id:
            worker.model_id = model_id
        if not 1 <= dp_size <= MAX_DP_SIZE:
            raise ValueError(f"dp_size must be in 1..{MAX_DP_SIZE}, got {dp_size}")
        worker.dp_size = dp_size
        ranks = list(range(dp_size)) if (self.dp_aware or dp_size > 1) else [None]
        if [e.dp_rank for e in worker.endpoints] != ranks:
            old = {e.dp_rank: e for e in worker.endpoints}  # keep load counts of kept ranks
            worker.endpoints = [old.get(r) or Endpoint(worker, r) for r in ranks]
            changed = True
        if changed:
            self._rebuild()

    def set_draining(self, worker: Worker, draining: bool) -> None:
        """Take a worker out of rotation without removing it (or put it back)."""
        if worker.draining != draining:
            worker.draining = draining
            self._rebuild()

    def record_health(self, worker: Worker, ok: bool, failure_threshold: int,
                      success_threshold: int) -> bool:
        """Count one health probe; returns True when the worker's healthy flag changed."""
        if ok:
            worker.consecutive_failures = 0
            worker.consecutive_successes += 1
            flip = not worker.healthy and worker.consecutive_successes >= success_threshold
        else:
            worker.consecutive_successes = 0
            worker.consecutive_failures += 1
            flip = worker.healthy and worker.consecutive_failures >= failure_threshold
        if flip:
            worker.healthy = not worker.healthy
            worker.ever_healthy = worker.ever_healthy or worker.healthy
            if worker.url in self._workers:
                self._rebuild()
        return flip

    def _rebuild(self) -> None:
        healthy: dict[str, list[Endpoint]] = {role: [] for role in ROLES}
        for w in self._workers.values():
            if w.healthy and not w.draining:
                healthy[w.role].extend(w.endpoints)
        self._healthy = healthy
        self._serves_alone = any(e.worker.colocated for e in healthy["decode"])
        for listener in self._listeners:
            listener()
