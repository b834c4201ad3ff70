"""How many DP ranks a prefill server has, asked once per bootstrap server.

A decode request that does not name its prefill DP rank (SGLang's router
without DP awareness) is served by rank ``bootstrap_room % prefill_dp_size``,
as on the prefill side. The size comes from the bootstrap server's topology,
fetched on a worker thread so the scheduler loop never blocks on the network.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor

_RETRY_S = 0.2


class PrefillDPSizes:
    def __init__(self, timeout: float):
        self.timeout = timeout  # give up on a bootstrap server after this long
        self._sizes: dict[tuple[str, int], int] = {}
        self._pending: dict[tuple[str, int], tuple[Future, float]] = {}  # future, first asked
        self._retry_at: dict[tuple[str, int], float] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prefill-dp-size")

    def get(self, host: str, port: int) -> int | str | None:
        """The dp size; None while unknown (asked in the background); a message once given up."""
        key = (host, port)
        if key in self._sizes:
            return self._sizes[key]
        now = time.monotonic()
        fut, since = self._pending.get(key, (None, now))
        if fut is None:
            if now < self._retry_at.get(key, 0.0):
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
            self._retry_at[key] = now + _RETRY_S
            return None

    def forget(self, host: str, port: int) -> None:
        """Drop a cached size (the prefill server may have restarted with another one)."""
        self._sizes.pop((host, port), None)

    @staticmethod
    def _fetch(host: str, port: int) -> int:
        with urllib.request.urlopen(f"http://{host}:{port}/route", timeout=5) as resp:
            return int(json.loads(resp.read())["dp_size"])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
