"""``GET /health_generate`` on the router (SGLang's gateway has it): every worker generates a token.

``/health`` says the router runs and ``/readiness`` that a healthy pair is
known from the periodic probes; ``/health_generate`` asks every registered
worker that is not draining for its own ``/health_generate`` now, all at once,
so a 200 means that each prefill and each decode server (every DP rank of
each: the servers probe all their ranks) produced a token within the timeout.
Anything else is a 503 listing each worker's answer.
"""

from __future__ import annotations

import asyncio

import aiohttp

from pdserve.router.workers.worker_registry import ROLES, Worker

# a worker answers within its own limit (30 s, engine/frontend/http_server.py); wait a little longer
HEALTH_GENERATE_TIMEOUT_S = 40.0


async def _probe(session: aiohttp.ClientSession, worker: Worker, headers: dict[str, str]) -> dict:
    out = {"url": worker.url, "role": worker.role}
    try:
        timeout = aiohttp.ClientTimeout(total=HEALTH_GENERATE_TIMEOUT_S)
        async with session.get(worker.url + "/health_generate", headers=headers, timeout=timeout) as resp:
            out["status"] = resp.status
            if resp.status != 200:
                out["error"] = (await resp.text())[:500]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        out["status"] = None
        out["error"] = f"{type(e).__name__}: {e}"
    return out


async def health_generate(session: aiohttp.ClientSession, workers: list[Worker],
                          headers: dict[str, str]) -> tuple[int, dict]:
    """(HTTP status, body) for the router's ``/health_generate`` over ``workers``."""
    serving = [w for w in workers if not w.draining]
    results = list(await asyncio.gather(*(_probe(session, w, headers) for w in serving)))
    missing = [role for role in ROLES if not any(w.role == role for w in serving)]
    failed = [r for r in results if r["status"] != 200]
    if missing or failed:
        parts = [f"no {role} worker" for role in missing]
        parts += [f"{r['role']} {r['url']}: {r['status'] or r['error']}" for r in failed]
        return 503, {"status": "unhealthy", "message": "; ".join(parts), "workers": results}
    return 200, {"status": "ok", "workers": results}
