"""Measures a server for a profile (``pdserve profile``): prefill TTFT against input length and
decode ITL against batch size and context length, over HTTP against ``/generate``.

- Prefill: one request at a time of ``n`` random token ids (fresh ones each time, so the prefix
  cache never helps) and one new token; the TTFT is the time to its answer, the median of
  ``repeats``.
- Decode: ``b`` streaming requests of ``c`` random ids each at once, ``tokens`` new tokens each
  (``ignore_eos``); the ITL is the mean gap between consecutive tokens while all ``b`` are
  decoding (after the last one's first token, before the first one's last), so neither the
  prefills nor a shrinking batch count.

The server is described by its own ``/get_server_info`` (``describe``), so a profile names the
configuration it was measured on.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import aiohttp
import msgspec

from pdserve.entrypoints.planner.profile import DecodePoint, PrefillPoint, ServerDescription

TOKEN_ID_RANGE = (1000, 20000)  # ordinary word pieces in every supported vocabulary


class ProfilePlan(msgspec.Struct, frozen=True, kw_only=True):
    input_lens: tuple[int, ...]
    repeats: int
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    tokens: int  # new tokens per decode request


SHORT = ProfilePlan(input_lens=(32, 256, 1024, 2048), repeats=2, contexts=(128, 1024), batches=(1, 4, 12),
                    tokens=20)
FULL = ProfilePlan(input_lens=(32, 128, 256, 512, 1024, 2048, 4096), repeats=3, contexts=(128, 512, 1024, 2048),
                   batches=(1, 2, 4, 8, 16, 32), tokens=48)


def describe(info: dict) -> ServerDescription:
    """The ServerDescription of a server from its ``/get_server_info`` answer."""
    return ServerDescription(
        model=info.get("served_model_name") or info.get("model_path") or "default",
        dtype=info.get("dtype") or "auto", quantization=info.get("quantization") or "none",
        tp_size=int(info.get("tp_size") or 1), page_size=int(info.get("page_size") or 16),
        chunked_prefill_size=int(info.get("chunked_prefill_size") or 0),
        num_threads=int(info.get("num_threads") or 0),
        max_total_tokens=int(info.get("max_total_num_tokens") or info.get("max_total_tokens") or 0))


async def server_info(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/get_server_info") as r:
        r.raise_for_status()
        return await r.json()


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)]


def _body(ids: list[int], tokens: int, stream: bool) -> dict:
    return {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}


async def measure_ttft(session: aiohttp.ClientSession, url: str, n: int, rng: random.Random) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/generate", json=_body(_ids(rng, n), 1, False)) as r:
        body = await r.read()
        if r.status != 200:
            raise RuntimeError(f"/generate answered {r.status}: {body[:300]!r}")
    return time.perf_counter() - t0


async def stream_times(session: aiohttp.ClientSession, url: str, ids: list[int], tokens: int) -> list[float]:
    """The arrival time (``time.perf_counter``) of each token of one streaming ``/generate`` of
    ``ids`` and ``tokens`` new tokens (``ignore_eos``); RuntimeError on a refusal or an error event."""
    times = []
    async with session.post(url + "/generate", json=_body(ids, tokens, True)) as r:
        if r.status != 200:
            raise RuntimeError(f"/generate answered {r.status}: {(await r.read())[:300]!r}")
        seen = 0
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"/generate stream ended with an error: {event['error']}")
            n = event["meta_info"]["completion_tokens"]
            times += [now] * (n - seen)  # a chunk of several tokens: they arrived together
            seen = n
    return times


async def measure_itl(session: aiohttp.ClientSession, url: str, batch: int, context: int, tokens: int,
                      rng: random.Random) -> float:
    runs = await asyncio.gather(*(stream_times(session, url, _ids(rng, context), tokens) for _ in range(batch)))
    start = max(t[0] for t in runs)  # every sequence decoding from here ...
    end = min(t[-1] for t in runs)  # ... to here
    gaps = [b - a for t in runs for a, b in zip(t, t[1:]) if a >= start and b <= end]
    if not gaps:  # the prefills overlapped the whole decode: take every gap after the first token
        gaps = [b - a for t in runs for a, b in zip(t, t[1:])]
    # chunks of several tokens show as zero gaps followed by a long one: the mean is still right
    return sum(gaps) / len(gaps)


async def measure(url: str, plan: ProfilePlan, seed: int = 0, log=print) -> tuple[ServerDescription, list, list]:
    """(description, prefill points, decode points) of the server at ``url``."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        server = describe(await server_info(session, url))
        await measure_ttft(session, url, 16, rng)  # warm-up
        prefill = []
        for n in plan.input_lens:
            ttft = statistics.median([await measure_ttft(session, url, n, rng) for _ in range(plan.repeats)])
            prefill.append(PrefillPoint(n, ttft))
            log(f"[profile] prefill {n:5d} tokens: TTFT {ttft * 1000:8.1f} ms")
        decode = []
        for c in plan.contexts:
            for b in plan.batches:
                itl = await measure_itl(session, url, b, c, plan.tokens, rng)
                decode.append(DecodePoint(b, c, itl))
                log(f"[profile] decode batch {b:3d} context {c:5d}: ITL {itl * 1000:8.1f} ms")
    return server, prefill, decode
