"""The router closed to strangers and bounded in what it reads, against stand-in workers.

- Admin routes (worker registration, drain, removal, control fan-outs) without ``--admin-api-key``
  answer only loopback peers: the router is bound on all addresses and called on this host's
  non-loopback address (a real peer address, no fake), which gets a 403 naming the reason, and a
  stranger's registration makes the router fetch nothing. With the key they answer to it alone;
  the inference key and the admin key open only their own routes.
- Keys from files and from the environment (the CLI's resolution).
- A worker reporting an absurd ``dp_size`` stays out of rotation.
- A 2.5 MiB non-streamed answer passes through whole; one over ``--max-response-bytes`` is a 502
  naming the cap, not retried.
- A body declared over ``--max-payload-size`` is a 413 before the router reads it; a request
  finding no admission slot is a 429 before its body is read.
- A request head sent a byte at a time is closed at ``--http-header-timeout``, a stalled body is a
  408 at ``--http-read-timeout``, and a connection over ``--max-connections`` is a 503 naming the
  flag while the open ones are served on.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pdserve.router.cli import build_parser, config_from_args
from support.netns_util import outward_address
from support.standin_worker import Behavior, StandinWorker

pytestmark = pytest.mark.timeout(60)

GEN = {"text": "hello world", "sampling_params": {"max_new_tokens": 4}}
ADMIN_CALLS = (("POST", "/workers", {"url": "http://127.0.0.1:9", "role": "decode"}),
               ("POST", "/workers/drain", {"url": "http://127.0.0.1:9"}),
               ("POST", "/workers/undrain", {"url": "http://127.0.0.1:9"}),
               ("DELETE", "/workers/http%3A%2F%2F127.0.0.1%3A9", None),
               ("POST", "/flush_cache", {}),
               ("POST", "/update_weights_from_disk", {"model_path": "/elsewhere"}),
               ("POST", "/release_memory_occupation", {}),
               ("POST", "/resume_memory_occupation", {}))


async def call(client, method, url, body=None, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with client.request(method, url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def test_admin_routes_answer_only_loopback_without_an_admin_key(cluster):
    addr = outward_address()
    await cluster.start(host="0.0.0.0")
    port = cluster.url.rsplit(":", 1)[1]
    outside = f"http://{addr}:{port}"
    stranger = StandinWorker("decode")
    await stranger.start()
    try:
        for method, path, body in ADMIN_CALLS:
            status, answer = await call(cluster.client, method, outside + path, body)
            assert status == 403, (path, answer)
            msg = answer["error"]["message"]
            assert "loopback" in msg and "--admin-api-key" in msg and addr in msg, msg
        # a stranger's worker is neither registered nor fetched (no request forgery)
        status, _ = await call(cluster.client, "POST", outside + "/workers", {"url": stranger.url, "role": "decode"})
        assert status == 403
        assert stranger.health_checks == 0 and cluster.router.registry.get(stranger.url) is None
        assert [r.path for w in cluster.prefills + cluster.decodes for r in w.requests] == []
        # inference and the listing stay open (no --api-key), and loopback keeps its admin rights
        status, answer = await call(cluster.client, "POST", outside + "/generate", GEN)
        assert status == 200, answer
        status, listing = await call(cluster.client, "GET", outside + "/workers")
        assert status == 200 and len(listing["decode"]) == 1
        status, answer = await call(cluster.client, "POST", cluster.url + "/workers",
                                    {"url": stranger.url, "role": "decode"})
        assert status == 200 and answer["healthy"] is True
        assert stranger.health_checks >= 1
    finally:
        await stranger.close()


async def test_the_admin_key_opens_admin_routes_and_only_them(cluster):
    addr = outward_address()
    await cluster.start(host="0.0.0.0", api_key="user-key", admin_api_key="operator-key")
    outside = f"http://{addr}:{cluster.url.rsplit(':', 1)[1]}"
    extra = StandinWorker("decode")
    await extra.start()
    try:
        add = {"url": extra.url, "role": "decode"}
        for key in (None, "user-key", "operator-key-but-longer"):
            status, answer = await call(cluster.client, "POST", outside + "/workers", add, key)
            assert status == 401 and "--admin-api-key" in answer["error"]["message"], (key, answer)
            status, _ = await call(cluster.client, "POST", cluster.url + "/flush_cache", {}, key)
            assert status == 401, key  # a key set binds loopback peers too
        assert extra.health_checks == 0
        status, answer = await call(cluster.client, "POST", outside + "/workers", add, "operator-key")
        assert status == 200 and answer["url"] == extra.url
        status, answer = await call(cluster.client, "POST", outside + "/flush_cache", {}, "operator-key")
        assert status == 200 and answer["success"] is True
        # the workers' control routes get the admin key, their inference routes the inference key
        flush = [r for r in cluster.decodes[0].requests if r.path == "/flush_cache"]
        assert flush[0].headers["Authorization"] == "Bearer operator-key"
        # inference: the user's key only
        for key in (None, "operator-key"):
            status, _ = await call(cluster.client, "POST", outside + "/generate", GEN, key)
            assert status == 401, key
        status, answer = await call(cluster.client, "POST", outside + "/generate", GEN, "user-key")
        assert status == 200, answer
        got = [r for r in cluster.decodes[0].requests + extra.requests if r.path == "/generate"]
        assert got[0].headers["Authorization"] == "Bearer user-key"
        status, answer = await call(cluster.client, "DELETE", outside + "/workers/" + extra.url.replace(":", "%3A")
                                    .replace("/", "%2F"), None, "operator-key")
        assert status == 200 and cluster.router.registry.get(extra.url) is None
    finally:
        await extra.close()


def test_keys_come_from_files_and_the_environment(tmp_path, monkeypatch):
    from pdserve.engine import env

    admin = tmp_path / "admin.key"
    admin.write_text("operator-secret\n")
    user = tmp_path / "user.key"
    user.write_text("user-secret")
    parse = build_parser().parse_args
    cfg = config_from_args(parse(["--api-key-file", str(user), "--admin-api-key-file", str(admin)]))
    assert (cfg.api_key, cfg.admin_api_key) == ("user-secret", "operator-secret")
    assert "secret" not in repr(cfg)  # a logged config does not show them
    monkeypatch.setattr(env, "PDSERVE_ROUTER_API_KEY", "env-user")
    monkeypatch.setattr(env, "PDSERVE_ROUTER_ADMIN_API_KEY", "env-admin")
    cfg = config_from_args(parse([]))
    assert (cfg.api_key, cfg.admin_api_key) == ("env-user", "env-admin")
    cfg = config_from_args(parse(["--admin-api-key-file", str(admin)]))  # a file before the environment
    assert cfg.admin_api_key == "operator-secret"
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    for argv, words in ((["--admin-api-key-file", str(empty)], "is empty"),
                        (["--api-key-file", str(tmp_path / "missing")], "--api-key-file"),
                        (["--api-key", "a", "--api-key-file", str(user)], "not both")):
        with pytest.raises(ValueError, match=words):
            config_from_args(parse(argv))


async def test_a_key_from_a_file_guards_a_running_router(cluster, tmp_path):
    path = tmp_path / "admin.key"
    path.write_text("from-a-file\n")
    cfg = config_from_args(build_parser().parse_args(["--admin-api-key-file", str(path)]))
    await cluster.start(admin_api_key=cfg.admin_api_key)
    status, _ = await call(cluster.client, "POST", cluster.url + "/flush_cache", {})
    assert status == 401
    status, answer = await call(cluster.client, "POST", cluster.url + "/flush_cache", {}, "from-a-file")
    assert status == 200 and answer["success"] is True


@pytest.mark.parametrize("dp_size", [10**12, 0, "8", 2.5])
async def test_an_absurd_dp_size_keeps_the_worker_out_of_rotation(cluster, dp_size, caplog):
    await cluster.start(decode_behavior=Behavior(dp_size=dp_size))
    worker = cluster.router.registry.get(cluster.decodes[0].url)
    assert worker.healthy is False and len(worker.endpoints) == 1
    assert "reports dp_size" in caplog.text
    status, answer = await cluster.post("/generate", GEN)
    assert status == 503 and "decode" in answer["error"]["message"]
    # fixed, it joins (the router is alive and probing)
    cluster.decodes[0].behavior.dp_size = 2
    await cluster.router.health.check(worker, first=True)
    assert worker.healthy and worker.dp_size == 2
    status, _ = await cluster.post("/generate", GEN)
    assert status == 200


async def test_a_large_answer_passes_whole_and_one_over_the_cap_is_a_502(cluster):
    await cluster.start(decode_behavior=Behavior(pad_bytes=(5 << 20) // 2), max_response_bytes=3 << 20)
    decode = cluster.decodes[0]
    for path in ("/generate", "/v1/completions"):
        body = GEN if path == "/generate" else {"prompt": "hello", "max_tokens": 4}
        async with cluster.client.post(cluster.url + path, json=body) as r:
            assert r.status == 200
            data = await r.read()
        assert len(data) > 2 << 20 and data == decode.last_answer, path
    assert len([r for r in decode.requests]) == 2  # no retry
    decode.behavior.pad_bytes = 4 << 20
    status, answer = await cluster.post("/generate", GEN)
    assert status == 502 and "--max-response-bytes (3145728 bytes)" in answer["error"]["message"], answer
    assert len(decode.requests) == 3  # not retried: any pair would answer as much
    decode.behavior.pad_bytes = 0
    status, _ = await cluster.post("/generate", GEN)
    assert status == 200


async def _raw_post(port: int, head: str, body: bytes) -> tuple[int, bytes]:
    """Send ``head`` and ``body`` (perhaps less than the head declares) and read the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode() + body)
        await writer.drain()
        status_line = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, v = line.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        data = await reader.readexactly(int(headers["content-length"]))
        return int(status_line.split()[1]), data
    finally:
        writer.close()


async def test_a_body_over_the_limit_is_refused_before_it_is_read(cluster):
    await cluster.start(max_payload_size=1 << 20)
    port = int(cluster.url.rsplit(":", 1)[1])
    # declared 1 GiB, 64 KiB sent: the answer comes without the rest
    head = ("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {1 << 30}\r\n\r\n")
    status, data = await asyncio.wait_for(_raw_post(port, head, b" " * (64 << 10)), 30)
    assert status == 413 and b"--max-payload-size (1048576 bytes)" in data
    # chunked, no length: refused at the limit
    async def chunks():
        for _ in range(40):
            yield b" " * (64 << 10)
    async with cluster.client.post(cluster.url + "/v1/completions", data=chunks()) as r:
        assert r.status == 413 and "--max-payload-size" in (await r.json())["error"]["message"]
    status, _ = await cluster.post("/generate", GEN)
    assert status == 200 and len(cluster.decodes[0].requests) == 1


async def test_the_admission_slot_comes_before_the_body(cluster):
    await cluster.start(max_concurrent_requests=1, queue_size=0, decode_behavior=Behavior(hang=True))
    holder = asyncio.ensure_future(cluster.post("/generate", GEN))
    while not cluster.decodes[0].requests:
        await asyncio.sleep(0.01)
    # a second upload that never finishes its body is refused at once, not read
    port = int(cluster.url.rsplit(":", 1)[1])
    head = ("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {4 << 20}\r\n\r\n")
    status, data = await asyncio.wait_for(_raw_post(port, head, b"{"), 30)
    assert status == 429 and b"queue" in data
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)


async def test_the_drain_hook_and_the_planner_send_the_admin_key(cluster, capsys, monkeypatch):
    from pdserve.engine import env
    from pdserve.entrypoints.planner.router_api import RouterApi, RouterApiError
    from pdserve.router.worker_hook import main as hook

    await cluster.start(admin_api_key="ops")
    dec = cluster.decodes[0]
    worker = cluster.router.registry.get(dec.url)
    await asyncio.to_thread(hook, ["drain", "--router", cluster.url, "--worker", dec.url])
    assert "HTTP 401" in capsys.readouterr().out and not worker.draining
    monkeypatch.setattr(env, "PDSERVE_ROUTER_ADMIN_API_KEY", "ops")  # the hooks' Secret
    await asyncio.to_thread(hook, ["drain", "--router", cluster.url, "--worker", dec.url])
    assert "drained=True" in capsys.readouterr().out and worker.draining
    extra = StandinWorker("decode")
    await extra.start()
    try:
        with pytest.raises(RouterApiError, match="HTTP 401"):
            await asyncio.to_thread(RouterApi(cluster.url, admin_api_key="wrong").add, extra.url, "decode")
        answer = await asyncio.to_thread(RouterApi(cluster.url, admin_api_key="ops").add, extra.url, "decode")
        assert answer["url"] == extra.url and cluster.router.registry.get(extra.url) is not None
    finally:
        await extra.close()


def test_loopback_peers_are_told_apart_from_the_rest():
    from pdserve.engine.net_allowlist import is_loopback_peer as is_loopback

    for remote in ("127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(remote), remote
    for remote in ("192.0.2.2", "10.0.0.1", "::ffff:10.0.0.1", "fd00::2", "", None, "localhost", "unix"):
        assert not is_loopback(remote), remote


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of one HTTP answer; (0, b"") when the connection closed first."""
    status_line = await reader.readline()
    if not status_line:
        return 0, b""
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return int(status_line.split()[1]), await reader.readexactly(int(headers.get("content-length", 0)))


async def test_slow_and_surplus_connections_are_dropped(cluster):
    cap = 3
    await cluster.start(http_header_timeout=2.0, http_read_timeout=1.0, max_connections=cap)
    port = int(cluster.url.rsplit(":", 1)[1])
    # slowloris: a byte every 0.1 s; the router closes the connection before the head is complete
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"GET /liveness HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 300 + b"\r\n\r\n"
    sent, data = 0, None
    for byte in head:
        writer.write(bytes([byte]))
        sent += 1
        try:
            data = await asyncio.wait_for(reader.read(4096), 0.1)
            break
        except asyncio.TimeoutError:
            pass
    writer.close()
    assert data == b"" and sent < len(head), (sent, data)
    # a body that stops arriving: 408 naming the flag
    status, body = await asyncio.wait_for(_raw_post(port, "POST /generate HTTP/1.1\r\nHost: x\r\n"
                                                    "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n",
                                                    b"{"), 30)
    assert status == 408 and b"--http-read-timeout" in body
    # the cap: `cap` keep-alive connections served, the next one refused, the open ones served on
    held = []
    try:
        for _ in range(cap):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append((reader, writer))
            writer.write(b"GET /liveness HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _answer(reader))[0] == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        status, body = await _answer(reader)
        assert await reader.read() == b""  # and closed
        writer.close()
        assert status == 503, body
        err = json.loads(body)["error"]
        assert err["code"] == "too_many_connections" and f"--max-connections ({cap})" in err["message"]
        held[0][1].write(b"GET /liveness HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _answer(held[0][0]))[0] == 200
    finally:
        for _, writer in held:
            writer.close()
    for _ in range(100):  # once the router has seen the closes, a new client is served
        try:
            status, _ = await cluster.post("/generate", GEN)
            if status == 200:
                break
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    else:
        pytest.fail("no request served after the held connections closed")
