"""Keeping the router's adapter table (router/workers/adapters.py) true: the I/O half.

``refresh`` reads one worker's ``GET /v1/models`` (the health checker calls it after every probe
that passes, so a worker's adapters are known from its registration on and follow what others
load or unload on it). ``ensure`` loads the adapters a request needs on the workers the router
chose for it (``POST /load_lora_adapter`` with the router's control key, SGLang's body), one
load per worker and adapter at a time however many requests wait for it; a failure is a typed
``RouterError`` naming the worker and the adapter, never a retry loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import aiohttp
import msgspec

from pdserve.router.errors import RouterError
from pdserve.router.workers.adapters import AdapterTable, loaded_adapters
from pdserve.router.workers.worker_registry import Worker

log = logging.getLogger("pdserve.router.workers.adapters")
# a load reads safetensors from disk and waits for the worker's loop to be between steps
LOAD_TIMEOUT_S = 300.0


class AdapterSync:
    def __init__(self, table: AdapterTable, session: aiohttp.ClientSession, headers: dict[str, str],
                 control_headers: dict[str, str], timeout_s: float):
        """``headers``: the inference key (for ``/v1/models``); ``control_headers``: the admin key
        (for ``/load_lora_adapter``); ``timeout_s``: of one ``/v1/models`` read."""
        self.table = table
        self.session = session
        self.headers = headers
        self.control_headers = control_headers
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._loading: dict[tuple[str, str], asyncio.Future] = {}  # (worker url, adapter) -> its load
        self.loads = 0  # adapters loaded by the router (a metric, and what tests count)

    async def refresh(self, worker: Worker) -> None:
        """Read the adapters ``worker`` lists; a worker without ``/v1/models`` keeps what was known."""
        try:
            async with self.session.get(worker.url + "/v1/models", headers=self.headers,
                                        timeout=self._timeout) as resp:
                if resp.status != 200:
                    return
                payload = msgspec.json.decode(await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, msgspec.DecodeError):
            return
        self.table.set_models(worker.url, payload)

    async def ensure(self, workers: Iterable[Worker], adapters: frozenset[str]) -> None:
        """Every one of ``adapters`` loaded on each of ``workers`` (those it lacks are loaded now)."""
        if not adapters:
            return
        jobs = []
        seen = set()
        for w in workers:
            if w.url in seen:
                continue
            seen.add(w.url)
            for name, path in self.table.missing(w.url, adapters):
                jobs.append(self._load_once(w, name, path))
        if jobs:
            await asyncio.gather(*jobs)

    async def _load_once(self, worker: Worker, name: str, path: str) -> None:
        key = (worker.url, name)
        pending = self._loading.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._load(worker, name, path))
            self._loading[key] = pending
            pending.add_done_callback(lambda _f: self._loading.pop(key, None))
        await asyncio.shield(pending)

    async def _load(self, worker: Worker, name: str, path: str) -> None:
        body = msgspec.json.encode({"lora_name": name, "lora_path": path})
        try:
            async with self.session.post(worker.url + "/load_lora_adapter", data=body, headers=self.control_headers,
                                         timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S)) as resp:
                data = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise RouterError(502, f"loading LoRA adapter {name!r} on {worker.url}: {type(e).__name__}: {e}",
                              "upstream_error") from None
        try:
            payload = msgspec.json.decode(data)
        except msgspec.DecodeError:
            payload = None
        loaded = loaded_adapters(payload)
        if loaded is not None:
            self.table.set_loaded(worker.url, loaded)
        if status == 200 or name in self.table.held(worker.url):  # loaded now, or by someone else meanwhile
            self.table.add(worker.url, name, path)
            if status == 200:
                self.loads += 1
                log.info("loaded LoRA adapter %r on %s %s", name, worker.role, worker.url)
            return
        reason = payload.get("error_message") if isinstance(payload, dict) else None
        raise RouterError(502, f"loading LoRA adapter {name!r} on {worker.url} failed (HTTP {status}): "
                          f"{reason or data[:300].decode(errors='replace')}", "upstream_error")
