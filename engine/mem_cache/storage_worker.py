"""The one thread that talks to the storage backend, so the scheduler never blocks on it.

The cache submits puts (a page's bytes, copied out of the host tier) and
fetches (a request's chain of page keys past what the tree holds); the worker
runs them, fetches first, and the cache drains finished fetches between steps.

Faults: a backend error (master killed or unreachable, setup refused) opens a
circuit breaker: the backend is dropped, and for a backoff (1 s doubling to
30 s) fetches finish empty at once and puts are skipped; then the worker
connects again. Objects are sealed here (``storage_object.py``: the page's token
hash and a checksum, keyed when the store has a key) and checked on fetch: a bad
object (wrong length, wrong token hash, checksum mismatch) is deleted from the
store, counted (``corrupt``), and ends the chain there (the rest is recomputed,
and written again). Every failure is counted; none reaches a request.

Shutdown: ``close`` sends the puts still queued, for up to ``CLOSE_FLUSH_S``
seconds (the thread is a daemon: without it, pages queued at exit would never
reach the store), then drops the rest, counted and logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.mem_cache.storage_backend import StorageBackend
from pdserve.engine.mem_cache.storage_object import ObjectCodec

logger = logging.getLogger(__name__)

BACKOFF_S = (1.0, 30.0)
MAX_PENDING_PUTS = 4096  # beyond this, new puts are dropped (the store is behind; L1/L2 still serve)
CLOSE_FLUSH_S = 10.0  # close() waits this long for the queued puts (4096 pages: ~1 s to a local store)


@dataclass
class FetchResult:
    rid: str
    start: int  # page index of values[0] in the request's prompt
    values: list[bytes] = field(default_factory=list)  # the leading pages found, in order
    seconds: float = 0.0  # the backend calls' time


@dataclass
class StorageStats:
    put_pages: int = 0
    put_bytes: int = 0
    put_s: float = 0.0
    get_pages: int = 0
    get_bytes: int = 0
    get_s: float = 0.0
    errors: int = 0  # backend calls that failed (unreachable, refused)
    corrupt: int = 0  # bad objects fetched (length, token hash, checksum), deleted from the store
    dropped_puts: int = 0  # skipped while the breaker was open or the queue full
    prefetch_done: int = 0
    prefetch_empty: int = 0


class StorageWorker:
    def __init__(self, connect: Callable[[], StorageBackend], object_bytes: int, codec: ObjectCodec | None = None):
        """``object_bytes``: a page's payload; ``codec``: seals and checks objects (default: unkeyed)."""
        self._connect = connect
        self.object_bytes = object_bytes
        self.codec = codec or ObjectCodec()
        self.stats = StorageStats()
        self._backend: StorageBackend | None = None
        self._backoff = BACKOFF_S[0]
        self._down_until = 0.0
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # work for the thread
        self._fetched = threading.Condition(lock)  # a fetch finished (``wait_fetched``)
        self._puts: deque[tuple[str, int, bytes]] = deque()
        self._fetches: deque[tuple[str, int, list[str], list[int]]] = deque()
        self._cancelled: set[str] = set()
        self._done: deque[FetchResult] = deque()
        self._closed = False
        self._working = False  # the thread is inside a put or a fetch (``idle`` waits for it too)
        self._thread = threading.Thread(target=self._run, name="hicache-storage", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the cache's side
    def submit_put(self, key: str, block_hash: int, value: bytes) -> None:
        """Store page ``value`` (its chained token hash ``block_hash``) under ``key``."""
        with self._cond:
            if len(self._puts) >= MAX_PENDING_PUTS or time.monotonic() < self._down_until:
                self.stats.dropped_puts += 1
                return
            self._puts.append((key, block_hash, value))
            self._cond.notify()

    def submit_fetch(self, rid: str, start: int, keys: list[str], hashes: list[int]) -> None:
        """Fetch the chain ``keys`` (their pages' token hashes ``hashes``) for request ``rid``."""
        with self._cond:
            self._cancelled.discard(rid)
            self._fetches.append((rid, start, keys, hashes))
            self._cond.notify()

    def cancel(self, rid: str) -> None:
        with self._cond:
            self._cancelled.add(rid)

    def wait_fetched(self, timeout: float) -> bool:
        """Block until a finished fetch waits to be drained, or ``timeout`` seconds; True if one does."""
        with self._fetched:
            if not self._done:
                self._fetched.wait(timeout)
            return bool(self._done)

    def drain(self) -> list[FetchResult]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    @property
    def available(self) -> bool:
        """False while the breaker is open (the last call failed and the backoff runs)."""
        return time.monotonic() >= self._down_until

    def idle(self) -> bool:
        """Nothing queued and nothing being written or fetched."""
        with self._cond:
            return not self._puts and not self._fetches and not self._working

    def close(self, timeout: float = CLOSE_FLUSH_S) -> None:
        """Send the puts still queued, for up to ``timeout`` seconds (a breaker open drops them at
        once), then disconnect. Puts left after the timeout are dropped and counted."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():  # inside a slow put: drop the queue; it returns after that put
            with self._cond:
                left, self._puts = len(self._puts), deque()
            self.stats.dropped_puts += left
            logger.warning("hicache storage: %d queued puts dropped at close (not sent within %g s)", left, timeout)
            return
        if self._backend is not None:
            self._backend.close()

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                self._working = False
                while not (self._closed or self._puts or self._fetches):
                    self._cond.wait()
                if self._closed:
                    self._fetches.clear()  # nobody waits for them; the puts still go (flush on close)
                    if not self._puts:
                        return
                fetch = self._fetches.popleft() if self._fetches else None
                put = None if fetch else self._puts.popleft()
                self._working = True
            if fetch is not None:
                self._fetch(*fetch)
            else:
                self._put(*put)

    def _ready(self) -> StorageBackend | None:
        if time.monotonic() < self._down_until:
            return None
        if self._backend is None:
            try:
                self._backend = self._connect()
            except Exception as e:  # noqa: BLE001 - any failure to connect opens the breaker
                self._fail(e)
                return None
        return self._backend

    def _fail(self, e: Exception) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self._backoff
        logger.warning("hicache storage failed (%s); retrying in %.0f s, serving from the pool and host "
                       "memory meanwhile", e, self._backoff)
        self._backoff = min(self._backoff * 2, BACKOFF_S[1])
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.close()
            except Exception:  # noqa: BLE001 - closing a broken client may fail too
                pass

    def _put(self, key: str, block_hash: int, value: bytes) -> None:
        backend = self._ready()
        if backend is None:
            self.stats.dropped_puts += 1
            return
        t0 = time.perf_counter()
        try:
            backend.put(key, self.codec.seal(key, block_hash, value))
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            return
        self._backoff = BACKOFF_S[0]
        self.stats.put_s += time.perf_counter() - t0
        self.stats.put_pages += 1
        self.stats.put_bytes += len(value)

    def _bad_object(self, backend: StorageBackend, key: str, why: str) -> None:
        """Count a bad object and delete it, so that the recomputed page is written in its place."""
        self.stats.corrupt += 1
        logger.warning("hicache storage: bad object %s (%s): deleted, the page is recomputed", key, why)
        try:
            backend.delete(key)
        except Exception as e:  # noqa: BLE001 - a store that cannot delete still serves; the object stays refused
            logger.warning("hicache storage: delete %s failed: %s", key, e)

    def _fetch(self, rid: str, start: int, keys: list[str], hashes: list[int]) -> None:
        result = FetchResult(rid, start)
        backend = None if rid in self._cancelled else self._ready()
        t0 = time.perf_counter()
        for key, block_hash in zip(keys, hashes) if backend is not None else ():
            if rid in self._cancelled:
                break
            try:
                value = backend.get(key)
            except Exception as e:  # noqa: BLE001
                self._fail(e)
                break
            if value is None:
                break
            payload = self.codec.open(key, block_hash, value, self.object_bytes)
            if isinstance(payload, str):
                self._bad_object(backend, key, payload)
                break
            result.values.append(payload)
        result.seconds = time.perf_counter() - t0
        self.stats.get_s += result.seconds
        self.stats.get_pages += len(result.values)
        self.stats.get_bytes += sum(map(len, result.values))
        self.stats.prefetch_done += 1
        self.stats.prefetch_empty += not result.values
        with self._cond:
            self._cancelled.discard(rid)
            self._done.append(result)
            self._fetched.notify_all()
