"""Shared-secret authentication of the KV control plane (``--disaggregation-auth-key-file``).

Every ZMQ control frame between prefill and decode ranks, and every bootstrap ``PUT /route``,
carries an HMAC-SHA256 tag made with a key derived from the shared secret. A frame whose tag,
timestamp or nonce does not check is refused before it is decoded, so it never reaches a
room's state machine. The tag covers a wall-clock timestamp and a random nonce: a frame older
than ``REPLAY_WINDOW_S`` (or from a clock that far ahead, or not a finite number) is refused,
and so is a nonce seen within the window (a replayed ``RoomRequest`` must not start a second
write). Hosts must keep their clocks within the window of each other (NTP does).

A ZMQ frame's tag also binds its sender's and its receiver's control endpoints: the sender's
travels in the header, the receiver checks that the frame was sealed for its own endpoint (a
frame captured on the way to one rank is refused by every other), and the manager checks that
a message naming a reply endpoint names the sender's own.

Rotation: a second (previous) key may be configured; frames are sealed with the current key
and accepted under either, so servers are moved to a new key one at a time, then the previous
key is dropped. Secrets shorter than ``MIN_SECRET_BYTES``, and the placeholder shipped in old
manifests, are refused.

Why an HMAC and not ZeroMQ's CURVE: one mechanism covers both the ZMQ channel and the
bootstrap server's HTTP ``PUT``; refusals are counted per message here, where CURVE refuses at
the handshake inside a ZAP handler thread; and the cost is small. ``scripts/bench_control_auth.py``
on 2 AMD EPYC Zen 4 cores shared with other jobs (load average 9): sealing and opening a room's two
frames (``RoomRequest`` of 64 or 256 pages, ``RoomStatus``) added 34-43 us per room, and a room
through real prefill and decode managers (``local`` backend, one process) took 0.60-0.68 ms with
auth against 0.56-0.64 ms without (ratio 1.02-1.14, within that machine's noise). What it does not
give is secrecy: frames travel in clear (they hold page indices, addresses and room ids, no KV data).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
import time
from collections import deque
from collections.abc import Callable

from pdserve.engine.secret_files import read_secret

MIN_SECRET_BYTES = 32
# placeholders that appeared in example manifests: publicly known, so never a key
PLACEHOLDER_SECRETS = (b"replace-me-with-a-random-secret",)
REPLAY_WINDOW_S = 30.0
_MAGIC = b"PDA2"
_HEADER = struct.Struct("!4sd16s32s")  # magic, timestamp (s since the epoch), nonce, tag
HEADER_BYTES = _HEADER.size
MAX_ID_BYTES = 255  # a control endpoint (host:port) fits


class AuthError(Exception):
    """A frame or request that failed authentication; the message says why (never the key)."""


def load_secret(path: str) -> bytes:
    """The shared secret in ``path`` (surrounding whitespace dropped); ValueError when unusable."""
    return read_secret(path, MIN_SECRET_BYTES, "auth key file", PLACEHOLDER_SECRETS)


class FrameAuth:
    """Seals and opens frames for one purpose (``control``, ``bootstrap``): keys differ per purpose,
    so a tag made for one channel is refused on the other."""

    def __init__(self, secret: bytes, purpose: str, clock: Callable[[], float] = time.time,
                 window: float = REPLAY_WINDOW_S, previous: bytes | None = None):
        """``previous``: a key still accepted (during rotation); frames are sealed with ``secret``."""
        # keyed once; each tag starts from a copy (thread-safe: copy() only reads the base)
        self._bases = [self._keyed(s, purpose) for s in (secret, previous) if s]
        self.clock = clock
        self.window = window
        # nonces seen within the window, oldest first; ``open`` runs on one thread per instance
        self._seen: set[bytes] = set()
        self._expiry: deque[tuple[float, bytes]] = deque()

    @staticmethod
    def _keyed(secret: bytes, purpose: str):
        key = hmac.new(secret, b"pdserve-kv-auth/" + purpose.encode(), hashlib.sha256).digest()
        return hmac.new(key, digestmod=hashlib.sha256)

    @classmethod
    def from_file(cls, path: str, purpose: str, previous_path: str = "", **kw) -> "FrameAuth":
        return cls(load_secret(path), purpose, previous=load_secret(previous_path) if previous_path else None, **kw)

    @staticmethod
    def _tag(base, ts: float, nonce: bytes, ids: bytes, payload: bytes) -> bytes:
        mac = base.copy()
        mac.update(struct.pack("!d16s", ts, nonce))
        mac.update(ids)
        mac.update(payload)
        return mac.digest()

    @staticmethod
    def _ids(sender: str, receiver: str) -> bytes:
        s, r = sender.encode(), receiver.encode()
        if len(s) > MAX_ID_BYTES or len(r) > MAX_ID_BYTES:
            raise AuthError(f"endpoint id longer than {MAX_ID_BYTES} bytes")
        return bytes([len(s)]) + s + bytes([len(r)]) + r

    def sign(self, payload: bytes, sender: str = "", receiver: str = "") -> bytes:
        """The header that authenticates ``payload`` from ``sender`` to ``receiver`` (thread-safe)."""
        ts, nonce = self.clock(), os.urandom(16)
        return _HEADER.pack(_MAGIC, ts, nonce, self._tag(self._bases[0], ts, nonce, self._ids(sender, receiver),
                                                        payload))

    def verify(self, header: bytes, payload: bytes, sender: str = "", receiver: str = "") -> None:
        """Raise ``AuthError`` unless ``header`` authenticates ``payload`` from ``sender`` to
        ``receiver`` under the current or the previous key, and was not seen before."""
        if len(header) != HEADER_BYTES:
            raise AuthError(f"no authentication header ({len(header)} bytes)")
        magic, ts, nonce, tag = _HEADER.unpack(header)
        if magic != _MAGIC:
            raise AuthError("no authentication header")
        if not math.isfinite(ts):
            raise AuthError(f"timestamp {ts} is not a finite number")
        ids = self._ids(sender, receiver)
        if not any(hmac.compare_digest(tag, self._tag(b, ts, nonce, ids, payload)) for b in self._bases):
            raise AuthError("bad authentication tag (wrong key, altered frame, or sealed for another receiver)")
        now = self.clock()
        if abs(now - ts) > self.window:
            raise AuthError(f"timestamp {now - ts:+.1f}s off, outside the {self.window:.0f}s replay window")
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(self._expiry.popleft()[1])
        if nonce in self._seen:
            raise AuthError("replayed frame (nonce already seen)")
        self._seen.add(nonce)
        self._expiry.append((ts + 2 * self.window, nonce))

    # ZMQ form: header | len(sender) | sender | payload; the receiver is implied (who reads it)
    def seal(self, payload: bytes, sender: str = "", receiver: str = "") -> bytes:
        s = sender.encode()
        return self.sign(payload, sender, receiver) + bytes([len(s)]) + s + payload

    def open_from(self, frame: bytes, receiver: str = "") -> tuple[str, bytes]:
        """(sender, payload) of a ``frame`` sealed for ``receiver``; ``AuthError`` when it does not
        authenticate."""
        if len(frame) < HEADER_BYTES + 1:
            raise AuthError(f"no authentication header ({len(frame)} bytes)")
        n = frame[HEADER_BYTES]
        start = HEADER_BYTES + 1 + n
        try:
            sender = frame[HEADER_BYTES + 1 : start].decode()
        except UnicodeDecodeError:
            raise AuthError("malformed sender id") from None
        self.verify(frame[:HEADER_BYTES], frame[start:], sender, receiver)
        return sender, frame[start:]

    def open(self, frame: bytes, receiver: str = "") -> bytes:
        """The payload of a sealed ``frame``; ``AuthError`` when it does not authenticate."""
        return self.open_from(frame, receiver)[1]

    # HTTP form: the header travels hex-encoded in AUTH_HEADER, over "METHOD PATH\n" + body
    def http_header(self, method: str, path: str, body: bytes) -> str:
        return self.sign(f"{method} {path}\n".encode() + body).hex()

    def verify_http(self, value: str | None, method: str, path: str, body: bytes) -> None:
        if not value:
            raise AuthError(f"no {AUTH_HEADER} header")
        try:
            header = bytes.fromhex(value)
        except ValueError:
            raise AuthError(f"malformed {AUTH_HEADER} header") from None
        self.verify(header, f"{method} {path}\n".encode() + body)


AUTH_HEADER = "X-PDServe-KV-Auth"
