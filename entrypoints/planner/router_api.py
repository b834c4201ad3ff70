"""The router's worker API as the planner's connectors call it: list, add, drain, remove."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from pdserve.engine import env


class RouterApiError(OSError):
    """The router refused a call or did not answer."""


def _headers(key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


class RouterApi:
    def __init__(self, base: str, api_key: str | None = None, timeout: float = 5.0,
                 admin_api_key: str | None = None):
        """``api_key`` reads the listing; ``admin_api_key`` (default: PDSERVE_ROUTER_ADMIN_API_KEY)
        adds, drains and removes workers. A router without an admin key takes those calls from
        loopback peers only (router/auth.py)."""
        self.base = base.rstrip("/")
        self.headers = _headers(api_key)
        self.admin_headers = _headers(admin_api_key or env.PDSERVE_ROUTER_ADMIN_API_KEY or None)
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None,
              admin: bool = True) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = self.admin_headers if admin else self.headers
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise RouterApiError(f"{method} {path}: HTTP {e.code} {e.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise RouterApiError(f"{method} {path}: {type(e).__name__}: {e}") from None

    def workers(self) -> dict:
        return self._call("GET", "/workers", admin=False)

    def add(self, url: str, role: str, bootstrap_port: int | None = None) -> dict:
        return self._call("POST", "/workers", {"url": url, "role": role, "bootstrap_port": bootstrap_port})

    def drain(self, url: str, wait_secs: float) -> dict:
        """Returns once the worker is drained or ``wait_secs`` passed (``drained`` says which)."""
        return self._call("POST", "/workers/drain", {"url": url, "wait_secs": wait_secs}, timeout=wait_secs + 10)

    def remove(self, url: str) -> dict:
        return self._call("DELETE", "/workers/" + urllib.parse.quote(url, safe=""))
