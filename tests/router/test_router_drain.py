"""Graceful drain. The router as a process (``python -m pdserve.router``) in front of stand-in
workers in the test's loop: on SIGTERM the streams in flight finish, new requests get 503 with
``Retry-After``, ``/readiness`` fails and the router exits 0; past ``--graceful-shutdown-timeout``
a stream ends with an SSE error event. ``POST /workers/drain`` on an in-process router: no new
request reaches the drained worker, its in-flight one finishes, and the answer says when it is
drained; ``/workers/undrain`` puts it back."""

import asyncio
import signal
import subprocess
import sys
import tempfile

import aiohttp
import msgspec
import pytest

from pdserve.entrypoints.procs import free_port, log_tail, spawn, stop_group, wait_healthy
from support.standin_worker import Behavior, StandinWorker

pytestmark = pytest.mark.timeout(60)


def sse_events(text: str) -> list:
    return [b[6:] if b[6:] == "[DONE]" else msgspec.json.decode(b[6:])
            for b in text.split("\n\n") if b.startswith("data: ")]


class RouterProc:
    def __init__(self, prefill: StandinWorker, decode: StandinWorker, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-router-drain-", suffix=".log", delete=False).name
        self.proc = spawn([sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(self.port),
                           "--prefill", prefill.url, "8998", "--decode", decode.url, *flags], self.log)

    async def wait_ready(self):
        await asyncio.to_thread(wait_healthy, self.url, self.proc, 30.0, log=lambda: log_tail(self.log))

    async def exit_code(self, timeout: float) -> int:
        return await asyncio.to_thread(self.proc.wait, timeout)

    def stop(self):
        stop_group(self.proc, grace=2.0)


@pytest.fixture
async def stand():
    workers = []
    procs = []

    async def make(decode_behavior: Behavior, *flags: str, prefill_behavior: Behavior | None = None):
        p, d = StandinWorker("prefill", prefill_behavior), StandinWorker("decode", decode_behavior)
        for w in (p, d):
            await w.start()
            workers.append(w)
        r = RouterProc(p, d, *flags)
        procs.append(r)
        await r.wait_ready()
        return p, d, r

    async with aiohttp.ClientSession() as client:
        yield make, client
    for r in procs:
        r.stop()
    for w in workers:
        await w.close()


async def read_stream(client, url, n_tokens, started: asyncio.Event):
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": n_tokens}}
    async with client.post(url + "/generate", json=body) as r:
        assert r.status == 200
        text = (await r.content.readuntil(b"\n\n")).decode()
        started.set()
        return text + (await r.text())


async def test_sigterm_finishes_streams_refuses_new_requests_and_exits_0(stand):
    make, client = stand
    # 20 tokens, 0.1 s apart: each stream lasts ~2 s
    _, dec, router = await make(Behavior(num_tokens=20, token_delay_s=0.1), "--graceful-shutdown-timeout", "30")
    started = [asyncio.Event() for _ in range(4)]
    streams = [asyncio.ensure_future(read_stream(client, router.url, 20, e)) for e in started]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
    router.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    async with client.post(router.url + "/generate", json={"text": "late"}) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        err = (await r.json())["error"]
        assert err["code"] == 503 and "shutting down" in err["message"]
    async with client.get(router.url + "/readiness") as r:
        assert r.status == 503 and (await r.json())["status"] == "draining"
    async with client.get(router.url + "/liveness") as r:
        assert r.status == 200
    assert router.proc.poll() is None  # still serving the streams
    for text in await asyncio.wait_for(asyncio.gather(*streams), 20):
        events = sse_events(text)
        assert len(events) == 21 and events[-1] == "[DONE]", text[-300:]
        assert all("error" not in e for e in events[:-1])
    assert await router.exit_code(10) == 0, log_tail(router.log)
    assert len(dec.requests) == 4  # the late request never reached a worker
    assert dec.cancelled == []


async def test_streams_past_the_graceful_shutdown_timeout_end_with_a_clear_error(stand):
    make, client = stand
    _, dec, router = await make(Behavior(num_tokens=200, token_delay_s=0.05), "--graceful-shutdown-timeout", "1")
    started = asyncio.Event()
    stream = asyncio.ensure_future(read_stream(client, router.url, 200, started))
    await asyncio.wait_for(started.wait(), 10)
    router.proc.send_signal(signal.SIGTERM)
    text = await asyncio.wait_for(stream, 10)
    events = sse_events(text)
    assert events[-1] == "[DONE]" and "graceful-shutdown-timeout 1 s" in events[-2]["error"]["message"]
    assert 3 < len(events) < 150  # cut off after ~1 s of a 10 s stream
    assert await router.exit_code(10) == 0, log_tail(router.log)
    await asyncio.sleep(0.2)
    assert len(dec.cancelled) == 1  # the decode leg was closed, so the server can free the room


async def test_a_second_signal_cuts_the_drain_short(stand):
    make, client = stand
    _, _, router = await make(Behavior(num_tokens=400, token_delay_s=0.05), "--graceful-shutdown-timeout", "60")
    started = asyncio.Event()
    stream = asyncio.ensure_future(read_stream(client, router.url, 400, started))
    await asyncio.wait_for(started.wait(), 10)
    router.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    assert not stream.done()
    router.proc.send_signal(signal.SIGINT)
    events = sse_events(await asyncio.wait_for(stream, 5))
    assert events[-1] == "[DONE]" and "shut down" in events[-2]["error"]["message"]
    assert await router.exit_code(5) == 0


async def test_a_prefill_leg_still_answering_after_its_stream_finishes_before_exit(stand):
    make, client = stand
    prefill, _, router = await make(Behavior(num_tokens=3), "--graceful-shutdown-timeout", "30",
                                    prefill_behavior=Behavior(delay_s=1.5))
    started = asyncio.Event()
    events = sse_events(await asyncio.wait_for(read_stream(client, router.url, 3, started), 10))
    assert events[-1] == "[DONE]" and prefill.completed == 0  # the prefill leg is still answering
    router.proc.send_signal(signal.SIGTERM)
    assert await router.exit_code(10) == 0, log_tail(router.log)
    assert prefill.completed == 1 and prefill.cancelled == []  # not cut: its room had succeeded


async def test_a_json_request_past_the_timeout_gets_a_503_saying_why(stand):
    make, client = stand
    _, dec, router = await make(Behavior(hang=True), "--graceful-shutdown-timeout", "0.5")
    req = asyncio.ensure_future(client.post(router.url + "/generate", json={"text": "x"}))
    while not dec.requests:
        await asyncio.sleep(0.02)
    router.proc.send_signal(signal.SIGTERM)
    async with await asyncio.wait_for(req, 10) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert "graceful-shutdown-timeout 0.5 s" in (await r.json())["error"]["message"]
    assert await router.exit_code(10) == 0, log_tail(router.log)


# -- POST /workers/drain ---------------------------------------------------------------------

async def test_a_drained_worker_gets_no_new_requests_and_finishes_its_own(cluster):
    await cluster.start(1, 2, policy="round_robin", decode_behavior=Behavior(delay_s=0.6))
    d0, d1 = cluster.decodes
    slow = asyncio.ensure_future(asyncio.gather(*(cluster.post("/generate", {"text": str(i)}) for i in range(2))))
    await asyncio.sleep(0.2)
    assert d0.in_flight == 1 and d1.in_flight == 1
    status, body = await cluster.post("/workers/drain", {"url": d0.url})
    assert status == 200 and body["draining"] and not body["drained"] and body["in_flight"] == 1
    async with cluster.client.get(cluster.url + "/workers") as r:
        listed = {w["url"]: w for w in (await r.json())["decode"]}
    assert listed[d0.url]["draining"] and not listed[d1.url]["draining"]
    d0_before = len(d0.requests)
    results = await asyncio.gather(*(cluster.post("/generate", {"text": f"n{i}"}) for i in range(6)))
    assert [s for s, _ in results] == [200] * 6
    assert len(d0.requests) == d0_before  # nothing new reached the drained worker
    assert [s for s, _ in await slow] == [200, 200]  # its in-flight request finished
    status, body = await cluster.post("/workers/drain", {"url": d0.url, "wait_secs": 5})
    assert status == 200 and body["drained"] and body["in_flight"] == 0
    # the readiness counts it; with the other decode drained too, no pair is left
    status, _ = await cluster.post("/workers/drain", {"url": d1.url})
    async with cluster.client.get(cluster.url + "/readiness") as r:
        body = await r.json()
        assert r.status == 503 and body["missing"] == ["decode"] and body["workers"]["decode"]["draining"] == 2
    status, body = await cluster.post("/workers/undrain", {"url": d0.url})
    assert status == 200 and not body["draining"]
    before = len(d0.requests)
    assert (await cluster.post("/generate", {"text": "back"}))[0] == 200
    assert len(d0.requests) == before + 1


async def test_drain_answers_wait_for_the_in_flight_request(cluster):
    await cluster.start(1, 1, decode_behavior=Behavior(delay_s=0.5))
    dec = cluster.decodes[0]
    req = asyncio.ensure_future(cluster.post("/generate", {"text": "x"}))
    await asyncio.sleep(0.15)
    status, body = await cluster.post("/workers/drain", {"url": dec.url, "wait_secs": 5})
    assert status == 200 and body["drained"] and req.done() and (await req)[0] == 200


async def test_drain_errors_and_auth(cluster):
    await cluster.start(1, 1, admin_api_key="k")
    auth = {"Authorization": "Bearer k"}
    dec = cluster.decodes[0]
    assert (await cluster.post("/workers/drain", {"url": dec.url}))[0] == 401
    assert (await cluster.post("/workers/drain", {"url": "http://nope:1"}, auth))[0] == 404
    assert (await cluster.post("/workers/drain", {"url": dec.url, "wait_secs": -1}, auth))[0] == 400
    assert (await cluster.post("/workers/drain", {"nourl": 1}, auth))[0] == 400
    assert (await cluster.post("/workers/drain", {"url": dec.url}, auth))[0] == 200


def test_router_cli_takes_the_drain_and_readiness_flags():
    from pdserve.router.cli import build_parser, config_from_args

    for flag in ("--graceful-shutdown-timeout", "--shutdown-grace-period-secs"):
        cfg = config_from_args(build_parser().parse_args([flag, "7", "--request-queue-timeout-secs", "2",
                                                          "--worker-startup-timeout-secs", "9"]))
        assert (cfg.graceful_shutdown_timeout, cfg.request_queue_timeout_secs,
                cfg.worker_startup_timeout_secs) == (7.0, 2.0, 9.0)
    out = subprocess.run([sys.executable, "-m", "pdserve.router", "--request-queue-timeout-secs", "-1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "request_queue_timeout_secs must be >= 0" in out.stderr


async def test_worker_hook_drains_and_undrains_on_every_router_address(cluster, capsys):
    from pdserve.router.worker_hook import main as hook

    await cluster.start(1, 1, decode_behavior=Behavior(delay_s=0.4))
    dec = cluster.decodes[0]
    worker = cluster.router.registry.get(dec.url)
    req = asyncio.ensure_future(cluster.post("/generate", {"text": "x"}))
    await asyncio.sleep(0.1)
    assert await asyncio.to_thread(hook, ["drain", "--router", cluster.url, "--worker", dec.url,
                                          "--wait-secs", "5"]) == 0
    assert worker.draining and req.done()  # the answer came once the in-flight request finished
    assert "draining=True drained=True in_flight=0" in capsys.readouterr().out
    assert await asyncio.to_thread(hook, ["undrain", "--router", cluster.url, "--worker", dec.url]) == 0
    assert not worker.draining
    # an unknown worker or an unreachable router is reported, never a failing hook
    assert await asyncio.to_thread(hook, ["drain", "--router", cluster.url, "--worker", "http://nope:1"]) == 0
    assert "HTTP 404" in capsys.readouterr().out
    assert await asyncio.to_thread(hook, ["drain", "--router", "http://127.0.0.1:1", "--worker", dec.url]) == 0
    assert "http://127.0.0.1:1: URLError" in capsys.readouterr().out
