"""What the storage tier stores per page: a header that proves the object is the page asked for.

A store is shared (a Mooncake Store's master is open to every pod; a file folder to whoever can
write it), so a fetched object is checked before its bytes enter the host tier:

    object = MAGIC (4) | block_hash (8, the page's chained token hash) | tag (32) | payload

``tag`` is BLAKE2b-256 over the object's key (namespace and hash), the block hash and the payload.
On read the hash must be the one the reader computed from its own prompt tokens and the tag must
check; anything else (a torn or truncated write, flipped bits, an object copied under another
key, one left by an incompatible writer) is a bad object: the worker deletes it, counts it
(``corrupt``) and the pages from there on are recomputed.

Without a store key the tag is a plain checksum: it catches corruption and misplaced objects,
but whoever can write the store and knows a prompt's tokens and the namespace can compute a
valid object. With a key (extra config ``key_file``, a secret of at least ``MIN_KEY_BYTES``
shared by the servers of the store) the tag is keyed, and an object planted by anyone without
the key is refused like a corrupt one.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from pdserve.engine.secret_files import read_secret

MAGIC = b"PDK1"
_HEADER = struct.Struct("!4sQ32s")
HEADER_BYTES = _HEADER.size
MIN_KEY_BYTES = 32


def load_store_key(path: str) -> bytes:
    """The store key in ``path``; ValueError naming the extra-config key."""
    return read_secret(path, MIN_KEY_BYTES, "hicache storage key_file")


class ObjectCodec:
    """Seals pages into objects and opens them, checking block hash and tag."""

    def __init__(self, key: bytes | None = None):
        # BLAKE2b takes a key of at most 64 bytes: derive one of 32 from any secret
        self._key = hashlib.sha256(b"pdserve-hicache-store/" + key).digest() if key else b""

    @property
    def keyed(self) -> bool:
        return bool(self._key)

    def _tag(self, key: str, block_hash: int, payload: bytes) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=32)
        h.update(key.encode())
        h.update(struct.pack("!Q", block_hash))
        h.update(payload)
        return h.digest()

    def seal(self, key: str, block_hash: int, payload: bytes) -> bytes:
        return _HEADER.pack(MAGIC, block_hash, self._tag(key, block_hash, payload)) + payload

    def open(self, key: str, block_hash: int, obj: bytes, payload_bytes: int) -> bytes | str:
        """The payload of ``obj``, or a string saying why it is bad."""
        if len(obj) != HEADER_BYTES + payload_bytes:
            return f"{len(obj)} bytes, expected {HEADER_BYTES + payload_bytes}"
        magic, stored_hash, tag = _HEADER.unpack_from(obj)
        if magic != MAGIC:
            return "no object header"
        if stored_hash != block_hash:
            return f"token hash {stored_hash:016x}, expected {block_hash:016x}"
        payload = obj[HEADER_BYTES:]
        if not hmac.compare_digest(tag, self._tag(key, block_hash, payload)):
            return "checksum mismatch" + (" (or written without the store key)" if self.keyed else "")
        return payload
