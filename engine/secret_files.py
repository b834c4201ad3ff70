"""Secrets read from files (never from argv, where ``ps`` shows them): the KV control plane's key
(``engine/kv_auth.py``) and the storage tier's object key (``mem_cache/storage_object.py``)."""

from __future__ import annotations


def read_secret(path: str, min_bytes: int, what: str, known: tuple[bytes, ...] = ()) -> bytes:
    """The secret in ``path``, surrounding whitespace dropped; ValueError naming ``what`` and the
    file when it cannot be read, is one of the publicly ``known`` placeholders, or is shorter than
    ``min_bytes``."""
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror}") from e
    if secret in known:
        raise ValueError(f"{what} {path!r} holds an example placeholder, which is public: generate a key "
                         "(head -c 32 /dev/urandom | base64 > FILE)")
    if len(secret) < min_bytes:
        raise ValueError(f"{what} {path!r} holds {len(secret)} bytes; at least {min_bytes} needed")
    return secret
