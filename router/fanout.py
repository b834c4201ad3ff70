"""Control operations the router sends to every worker: SGLang's cache and weight endpoints.

``POST /flush_cache``, ``/update_weights_from_disk``, ``/release_memory_occupation``,
``/resume_memory_occupation``, ``/load_lora_adapter`` and ``/unload_lora_adapter`` on the router go, with the client's body, to
every registered worker of both roles at once (a weight update must reach the
prefill and the decode side alike, or their KV would differ). The answer names
each worker's result:

    {"success": bool, "workers": [{"url", "role", "status", "success", "body"}]}

200 when every worker succeeded; otherwise 502, with the same body, so that a
caller sees which worker failed and why (its status and answer, or the
connection error with status 0).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import msgspec

from pdserve.router.errors import RouterError
from pdserve.router.http_io import read_capped

# SGLang's LoRA routes: an adapter loaded or unloaded on every worker (the router then loads one
# on a single worker by itself, when a request needs it: router/workers/adapter_sync.py)
LORA_PATHS = ("/load_lora_adapter", "/unload_lora_adapter")
FANOUT_PATHS = ("/flush_cache", "/update_weights_from_disk", "/release_memory_occupation",
                "/resume_memory_occupation", *LORA_PATHS)


@dataclass(frozen=True)
class WorkerResult:
    url: str
    role: str
    status: int  # the worker's HTTP status; 0: no answer
    body: object  # its JSON answer, else its text, else the error

    @property
    def success(self) -> bool:
        return self.status == 200

    def to_json(self) -> dict:
        return {"url": self.url, "role": self.role, "status": self.status, "success": self.success,
                "body": self.body}


def _parse(data: bytes) -> object:
    try:
        return msgspec.json.decode(data) if data else ""
    except msgspec.DecodeError:
        return data.decode(errors="replace")


async def _post_one(session: aiohttp.ClientSession, worker, path: str, body: bytes, headers: dict,
                    max_bytes: int) -> WorkerResult:
    try:
        async with session.post(worker.url + path, data=body, headers=headers) as resp:
            return WorkerResult(worker.url, worker.role, resp.status, _parse(await read_capped(resp, max_bytes)))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return WorkerResult(worker.url, worker.role, 0, f"{type(e).__name__}: {e}")
    except RouterError as e:  # an answer over the cap
        return WorkerResult(worker.url, worker.role, 0, e.message)


async def fan_out(session: aiohttp.ClientSession, workers, path: str, body: bytes,
                  headers: dict, max_bytes: int) -> tuple[int, dict]:
    """POST ``body`` to ``path`` on every worker at once, reading at most ``max_bytes`` of each
    answer (``--max-response-bytes``); returns (status, answer) as above."""
    results = await asyncio.gather(*(_post_one(session, w, path, body, headers, max_bytes) for w in workers))
    ok = bool(results) and all(r.success for r in results)
    return (200 if ok else 502), {"success": ok, "workers": [r.to_json() for r in results]}
