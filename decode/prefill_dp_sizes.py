"""How many DP ranks a prefill server has, asked once per bootstrap server.

A decode request that does not name its prefill DP rank (SGLang's router
without DP awareness) is served by rank ``bootstrap_room % prefill_dp_size``,
as on the prefill side. The size comes from the bootstrap server's topology,
fetched on a worker thread so the scheduler loop never blocks on the network.
"""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.kvtransfer.bootstrap_client import fetch_topology

_RETRY_S = 0.2


class PrefillDPSizes:
    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout  # give up on a bootstrap server after this long
        self.clock = clock
        self._sizes: dict[tuple[str, int], int] = {}
        self._pending: dict[tuple[str, int], tuple[Future, float]] = {}  # future, first asked
        self._retry_at: dict[tuple[str, int], float] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prefill-dp-size")

    def get(self, host: str, port: int) -> int | str | None:
        """The dp size; None while unknown (asked in the background); a message once given up."""
        key = (host, port)
        if key in self._sizes:
            return self._sizes[key]
        now = self.clock()
        fut, since = self._pending.get(key, (None, now))
        if fut is None:
            if time.monotonic() < self._retry_at.get(key, 0.0):  # retry pacing: real time
                return None
            fut = self._pool.submit(self._fetch, host, port)
            self._pending[key] = (fut, since)
        if not fut.done():
            return None
        try:
            self._sizes[key] = fut.result()
            del self._pending[key]
            return self._sizes[key]
        except Exception as e:  # noqa: BLE001 - any failure: retry until the timeout
            if now - since > self.timeout:
                del self._pending[key]
                return f"bootstrap server {host}:{port} not reachable within {self.timeout}s: {e}"
            self._pending[key] = (None, since)
            self._retry_at[key] = time.monotonic() + _RETRY_S
            return None

    @staticmethod
    def _fetch(host: str, port: int) -> int:
        try:
            return fetch_topology(host, port).dp_size
        except urllib.error.HTTPError as e:
            # the answer says why (503: which prefill ranks have not registered): keep it, the
            # client's error is all an operator may see of it
            detail = e.read().decode(errors="replace").strip()[:300]
            raise OSError(f"HTTP {e.code}: {detail or e.reason}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
