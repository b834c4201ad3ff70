"""The router's worker API as the planner's connectors call it: list, add, drain, remove."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request


class RouterApiError(OSError):
    """The router refused a call or did not answer."""


class RouterApi:
    def __init__(self, base: str, api_key: str | None = None, timeout: float = 5.0):
        self.base = base.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise RouterApiError(f"{method} {path}: HTTP {e.code} {e.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise RouterApiError(f"{method} {path}: {type(e).__name__}: {e}") from None

    def workers(self) -> dict:
        return self._call("GET", "/workers")

    def add(self, url: str, role: str, bootstrap_port: int | None = None) -> dict:
        return self._call("POST", "/workers", {"url": url, "role": role, "bootstrap_port": bootstrap_port})

    def drain(self, url: str, wait_secs: float) -> dict:
        """Returns once the worker is drained or ``wait_secs`` passed (``drained`` says which)."""
        return self._call("POST", "/workers/drain", {"url": url, "wait_secs": wait_secs}, timeout=wait_secs + 10)

    def remove(self, url: str) -> dict:
        return self._call("DELETE", "/workers/" + urllib.parse.quote(url, safe=""))
