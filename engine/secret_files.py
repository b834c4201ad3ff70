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


def read_key(flag: str, value: str | None, path: str | None, env_value: str) -> str | None:
    """An HTTP key from ``--FLAG``, ``--FLAG-file`` (its content, stripped) or an environment
    variable, in that order; ValueError naming the flag when both forms are given or the file is
    unreadable or empty."""
    if value is not None and path is not None:
        raise ValueError(f"give --{flag} or --{flag}-file, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
        except OSError as e:
            raise ValueError(f"--{flag}-file {path}: {e.strerror or e}") from None
        if not value:
            raise ValueError(f"--{flag}-file {path} is empty")
    if value is None:
        value = env_value or None
    return value
