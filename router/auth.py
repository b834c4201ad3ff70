"""Who may call which route of the router: two keys, compared in constant time, failing closed.

- Inference routes (``/generate``, the OpenAI routes, (de)tokenize, model and server info,
  ``/health_generate``, ``GET /workers``) take ``--api-key`` when one is set; without it they are
  open, as SGLang's router's are.
- Admin routes (everything that changes the router or its workers: ``/workers`` add, remove,
  drain and undrain, and the control routes fanned out to every worker) take ``--admin-api-key``
  when one is set, from any peer; without it they answer only to loopback peers, and a 403 says
  so. The inference key never opens an admin route (nor the admin key an inference route): users
  and operators hold different keys.

Registering a worker makes the router send it users' prompts and fetch its ``/health`` and
``/get_server_info``; closing registration to operators is what keeps a stranger from making the
router fetch hosts of their choice.

Keys come from ``--api-key`` / ``--admin-api-key``, from ``--api-key-file`` /
``--admin-api-key-file`` (the file's content, stripped), or from ``PDSERVE_ROUTER_API_KEY`` /
``PDSERVE_ROUTER_ADMIN_API_KEY`` (engine/env.py), in that order of precedence.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from pdserve.engine import env
from pdserve.engine.net_allowlist import is_loopback_peer
from pdserve.engine.secret_files import read_key
from pdserve.router.errors import RouterError, unauthorized


def keys_from_flags(api_key: str | None, api_key_file: str | None, admin_api_key: str | None,
                    admin_api_key_file: str | None) -> tuple[str | None, str | None]:
    """(api_key, admin_api_key) as the CLI resolves them."""
    return (read_key("api-key", api_key, api_key_file, env.PDSERVE_ROUTER_API_KEY),
            read_key("admin-api-key", admin_api_key, admin_api_key_file, env.PDSERVE_ROUTER_ADMIN_API_KEY))


def _bearer(request: web.Request) -> bytes:
    header = request.headers.get("Authorization", "")
    return header[7:].encode() if header.startswith("Bearer ") else b""


class Access:
    """The two checks; each raises a RouterError (401 or 403) or returns."""

    def __init__(self, api_key: str | None, admin_api_key: str | None):
        self._api = api_key.encode() if api_key else None
        self._admin = admin_api_key.encode() if admin_api_key else None

    def check_inference(self, request: web.Request) -> None:
        if self._api is not None and not hmac.compare_digest(_bearer(request), self._api):
            raise unauthorized()

    def check_admin(self, request: web.Request) -> None:
        if self._admin is not None:
            if not hmac.compare_digest(_bearer(request), self._admin):
                raise RouterError(401, f"{request.method} {request.path} is an admin route: it needs "
                                  "'Authorization: Bearer <--admin-api-key>'", "authentication_error")
            return
        if not is_loopback_peer(request.remote):
            raise RouterError(403, f"{request.method} {request.path} is an admin route and this router has "
                              f"no --admin-api-key: it answers only to loopback peers, not {request.remote}",
                              "permission_denied")
