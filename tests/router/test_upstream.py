"""The legs' HTTP/1.1 client against raw asyncio servers: reuse, stale connections, bodies
ended by EOF, timeouts, malformed answers, and cancellation closing the connection."""

import asyncio

import pytest

from pdserve.router.upstream import UpstreamError, UpstreamPool

pytestmark = pytest.mark.timeout(20)


class RawServer:
    """Answers each request with ``reply`` (bytes, or a callable of the request count)."""

    def __init__(self, reply, close_after=False, hang=False):
        self.reply, self.close_after, self.hang = reply, close_after, hang
        self.connections = 0
        self.requests = []
        self.closed_by_client = asyncio.Event()

    async def start(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if self.hang:
                    if await reader.read(1) == b"":
                        self.closed_by_client.set()
                    return
                reply = self.reply(len(self.requests)) if callable(self.reply) else self.reply
                writer.write(reply)
                await writer.drain()
                if self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()

    async def close(self):
        self.server.close()


def ok(body: bytes = b'{"ok":true}') -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


async def test_keep_alive_connections_are_reused_and_headers_sent():
    srv = await RawServer(ok()).start()
    pool = UpstreamPool(5, extra_headers={"Authorization": "Bearer k"})
    for _ in range(5):
        resp = await pool.post(srv.url, "/generate", b'{"a":1}')
        assert resp.status == 200 and resp.content_type == "application/json"
        assert await resp.read() == b'{"ok":true}'
    assert srv.connections == 1
    head, body = srv.requests[0]
    assert head.startswith(b"POST /generate HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in head
    assert body == b'{"a":1}'
    pool.close()
    await srv.close()


async def test_server_closing_after_each_answer_is_not_an_error():
    # the server closes its side after answering: the next request must open a new connection
    srv = await RawServer(ok(), close_after=True).start()
    pool = UpstreamPool(5)
    for i in range(6):
        resp = await pool.post(srv.url, "/x", b"{}")
        assert await resp.read() == b'{"ok":true}'
        if i % 2:  # half the time the close has arrived, half the time it races the next request
            await asyncio.sleep(0.02)
    assert srv.connections == 6
    pool.close()
    await srv.close()


async def test_chunked_stream_and_eof_delimited_body():
    chunked = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"6\r\ndata: \r\n3\r\n1\n\n\r\n0\r\n\r\n")
    srv = await RawServer(chunked).start()
    pool = UpstreamPool(5)
    resp = await pool.post(srv.url, "/s", b"{}")
    got = b""
    while chunk := await resp.readany():
        got += chunk
    resp.close()
    assert got == b"data: 1\n\n" and resp.content_type == "text/event-stream"
    await srv.close()
    eof = await RawServer(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-eof", close_after=True).start()
    resp = await pool.post(eof.url, "/e", b"{}")
    assert await resp.read() == b"until-eof"
    pool.close()
    await eof.close()


async def test_timeout_and_broken_answers_are_upstream_errors():
    hang = await RawServer(b"", hang=True).start()
    pool = UpstreamPool(0.2)
    with pytest.raises(UpstreamError, match="within 0.2s"):
        await pool.post(hang.url, "/h", b"{}")
    await asyncio.wait_for(hang.closed_by_client.wait(), 2)
    garbage = await RawServer(b"NOT HTTP AT ALL\r\n\r\n").start()
    with pytest.raises(UpstreamError, match="malformed"):
        await pool.post(garbage.url, "/g", b"{}")
    cut = await RawServer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", close_after=True).start()
    resp = await pool.post(cut.url, "/c", b"{}")
    with pytest.raises(UpstreamError, match="mid-answer"):
        await resp.read()
    with pytest.raises(UpstreamError, match="cannot connect"):
        await pool.post("http://127.0.0.1:1", "/x", b"{}")
    pool.close()
    for s in (hang, garbage, cut):
        await s.close()


async def test_cancelling_a_request_closes_its_connection():
    srv = await RawServer(b"", hang=True).start()
    pool = UpstreamPool(30)
    task = asyncio.ensure_future(pool.post(srv.url, "/h", b"{}"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(srv.closed_by_client.wait(), 2)
    pool.close()
    await srv.close()


async def test_a_cancel_while_connecting_is_never_swallowed():
    """A leg cancelled while its connection is being made ends cancelled, at every point of the
    connect. (Python 3.11's ``asyncio.wait_for`` returned the connection when the cancel met its
    completion, swallowing the cancel: the router's prefill leg then went on, sent the request and
    held a room nobody waited for until prefill's bootstrap timeout.)"""
    srv = await RawServer(b"", hang=True).start()
    pool = UpstreamPool(30)
    for ticks in range(40):  # cancel after 0..39 turns of the event loop
        task = asyncio.ensure_future(pool.post(srv.url, "/h", b"{}"))
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done and task.cancelled(), f"cancelled after {ticks} loop turns: the leg went on"
    pool.close()
    await srv.close()
