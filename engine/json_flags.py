"""Flags whose value is a JSON object (``--kv-events-config``,
``--hicache-storage-backend-extra-config``): one parser, errors naming the flag."""

from __future__ import annotations

import json


def json_object(text: str | None, name: str) -> dict:
    """``text`` as a JSON object ({} for None or empty); ValueError names ``name``."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object")
    return value
