"""Wire compatibility: sglang-router (PD mode) and the pdserve router, fronting the same
stand-in workers, send them the same bodies and give the client the same answers.

This also shows that the stand-ins behave like SGLang servers to sglang-router
(health, server/model info, both legs), so they are a fair bench for both routers.
"""

import asyncio
import importlib.util
import os
import sys

import aiohttp
import pytest

from pdserve.entrypoints.procs import free_port, spawn, stop_group
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.server import start_router
from support.standin_worker import StandinWorker

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                 reason="sglang-router is not installed")]

REQUESTS = [
    ("/generate", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3}}),
    ("/generate", {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/completions", {"model": "standin-model", "prompt": "Once upon", "max_tokens": 3}),
    ("/v1/chat/completions", {"model": "standin-model", "max_tokens": 2, "stream": True,
                              "messages": [{"role": "user", "content": "Hi"}]}),
]
ROOM_FREE = ("bootstrap_room",)
# sglang-router re-serialises chat requests with OpenAI's newer name for the limit
RENAMED = {"max_tokens": "max_completion_tokens"}


def normalise(answer: str) -> str:
    # ids carry the room, which differs between the routers
    import re
    return re.sub(r"standin-\d+", "standin-ROOM", answer)


async def test_same_bodies_and_answers_as_sglang_router():
    prefill, decode = StandinWorker("prefill"), StandinWorker("decode")
    await prefill.start()
    await decode.start()
    port = free_port()
    proc = spawn(
        [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
         "--prefill", prefill.url, "8998", "--decode", decode.url, "--host", "127.0.0.1",
         "--port", str(port), "--policy", "round_robin", "--log-level", "error",
         "--prometheus-port", str(free_port()), "--health-check-interval-secs", "3600"],
        os.devnull)
    cfg = RouterConfig(prefill=(WorkerSpec(prefill.url, "prefill", 8998),),
                       decode=(WorkerSpec(decode.url, "decode"),), host="127.0.0.1", port=0,
                       policy="round_robin")
    router, runner, our_port = await start_router(cfg)
    theirs, ours = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{our_port}"
    try:
        async with aiohttp.ClientSession() as client:
            for _ in range(300):  # sglang-router registers its workers in the background
                try:
                    async with client.post(theirs + "/generate", json={"text": "x"}) as r:
                        await r.read()
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert proc.poll() is None, "sglang-router exited"
                await asyncio.sleep(0.1)
            else:
                pytest.fail("sglang-router did not become ready")
            for path, body in REQUESTS:
                answers, bodies = [], []
                for url in (theirs, ours):
                    n_p, n_d = len(prefill.requests), len(decode.requests)
                    async with client.post(url + path, json=body) as r:
                        assert r.status == 200, (url, path, await r.text())
                        answers.append(normalise(await r.text()))
                    assert len(prefill.requests) == n_p + 1 and len(decode.requests) == n_d + 1
                    p, d = prefill.requests[-1].body, decode.requests[-1].body
                    assert p["bootstrap_room"] == d["bootstrap_room"] < 2**63
                    bodies.append((p, d))
                (their_p, their_d), (our_p, our_d) = bodies
                assert answers[0] == answers[1], path
                for theirs_body, ours_body in ((their_p, our_p), (their_d, our_d)):
                    # sglang-router adds SGLang's optional fields; every field we send, it sends too,
                    # with the same value (the room aside)
                    for k, v in ours_body.items():
                        their_k = k if k in theirs_body else RENAMED.get(k)
                        assert their_k in theirs_body, (path, k)
                        if k not in ROOM_FREE:
                            assert theirs_body[their_k] == v, (path, k, theirs_body[their_k], v)
    finally:
        stop_group(proc)
        await runner.cleanup()
        await prefill.close()
        await decode.close()
